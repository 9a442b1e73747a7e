"""A makespan bound from the whole CP-SAT model on a floor grid, where the exact grid is too fine.

On an exact grid (timegrid.py) CP-SAT's bound on the whole model is a proof. Transfers of odd
byte counts make the exact unit about 1e-7 ms, so most problems with offload get a rounded grid,
whose durations are rounded up: safe for schedules, but it proves nothing. A 2-device,
2-microbatch problem then reported a 9.6% gap after 30 s, with the model solved in 0.1 s.

The same unit with every duration and lag rounded down, an op "tight" when it starts within
``cpsat_tight.GIVE`` units of the end of what it waits for (not at it), and no ready-order rule
on shared channels, is a relaxation. Take any fitting schedule, its times t in units (real
numbers), and floor them:

- a wait t_j >= t_i + d_i + lag gives floor(t_j) >= floor(t_i) + floor(d_i) + floor(lag),
  since floor(a + b) >= floor(a) + floor(b); one op at a time per device and channel, and a
  transfer's issue point, are waits of the same form;
- an op the simulator starts right at t_i + d_i + lag starts, floored, at most two units after
  floor(t_i) + floor(d_i) + floor(lag) (three fractional parts sum to less than 3): tight here.
  Without this rule the relaxation may delay a forward until memory frees, which no schedule
  can, and on the case below it proved 137.2 ms instead of 142.6;
- a hold on [t_a, t_e) (semantics.holds: it begins at a start, ends at an end) becomes
  [floor(t_a), E) with E <= floor(t_e). Every hold the floored schedule has at unit u began
  before u + 1 and ends at u + 1 or later in the real one, so all are held together just before
  u + 1, where the real schedule fits: so does the floored one;
- its makespan is at most floor(T / unit).

So the relaxed optimum, and any bound CP-SAT proves on it, times the unit is at most T for every
fitting schedule the model's other rules admit. Those are the whole model's (cpsat_model.py):
each stage's F, B and W in microbatch order, proven to lose nothing without offload and checked
against brute force with it (tests/test_bound_proofs.py); this bound claims what an exact grid's
would. Memory is counted exactly or not at all: byte counts rounded for int64 would not be a
relaxation.
"""

from __future__ import annotations

import time

from ortools.sat.python import cp_model

from optpipe.core.problem import Problem

from .bounds import Bound
from .cpsat import solve_model
from .cpsat_model import Model, model_values
from .cpsat_vars import full_scope
from .result import Judged
from .timegrid import choose_grid

__all__ = ["floor_relaxation_applies", "floor_relaxation_bound"]

# Compute ops of the whole problem up to which the relaxation is worth compile's time: it proved
# p = 3, m = 6 (54) optimal in 0.5 s, and lifted p = 5, v = 2, m = 5 (150) from 368.7 to 372.9 ms
# in 5 s (nothing in 1 s); at 384 (grid08) and 768 (p = 16, m = 16) it proved nothing in 5 s,
# and building the model alone took a second at 768: time the window search then lacks.
_MAX_OPS = 160


def floor_relaxation_applies(problem: Problem, resolution_ms: float | None = None) -> bool:
    """Small enough for the whole model to prove in seconds, on a grid that is not exact (an
    exact one proves already); recompute is not modelled here."""
    return (problem.compute_ops <= _MAX_OPS and not problem.recompute.enabled
            and not choose_grid(problem, resolution_ms).exact)


def floor_relaxation_bound(problem: Problem, *, upper: Judged, floor: Bound,
                           time_limit_s: float, workers: int | None = None, seed: int = 0,
                           resolution_ms: float | None = None) -> Bound:
    """The larger of ``floor`` and what CP-SAT proves on the floor-grid relaxation within the time.

    ``upper``: a fitting schedule, the hint, whose makespan ends the horizon: a faster schedule,
    the only kind that matters, ends within it. ``resolution_ms`` forces a unit (tests).
    """
    began = time.monotonic()  # building the model counts: the devices' relaxation runs after it
    grid = choose_grid(problem, resolution_ms).floored()
    horizon = grid.up(upper.makespan_ms) + 1
    model = Model(problem, grid, full_scope(problem), horizon, min(grid.down(floor.value), horizon))
    if not model.memory_exact:
        return floor
    model.hint(*model_values(problem, grid, upper.schedule))
    left = time_limit_s - (time.monotonic() - began)
    solver, code = solve_model(model, time_limit_s=left, seed=seed, workers=workers, for_bound=True)
    if code == cp_model.OPTIMAL:
        units = solver.objective_value
    elif code == cp_model.FEASIBLE:
        units = solver.best_objective_bound
    else:  # nothing proved in time (an empty relaxation would contradict the fitting ``upper``)
        return floor
    value = grid.ms(units)
    if value <= floor.value:
        return floor
    return Bound(value, f"the whole CP-SAT model with every duration rounded down to {grid.resolution_ms:g} ms "
                        f"(a relaxation) needs at least {value:,.1f} ms")
