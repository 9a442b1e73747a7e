"""Solve the CP-SAT model (cpsat_model.py), read the schedule back and check it.

Skeleton (OR-Tools samples): data -> variables -> constraints -> objective (cpsat_model.py) ->
solve -> read back -> check (here), with an explicit time limit, workers and seed, every solver
status handled.

On an exact grid (timegrid.py) the simulator reproduces the model's times to the last digit. On
a rounded one the simulator runs no op later than the model and none earlier by more than the
grid's slack, and a transfer's release is held that much longer in the cumulative: the
simulated makespan is at most the objective and the simulated peak at most the model's
(timegrid.py proves both). That margin makes the solver's bound unsafe, so it is reported only
for exact grids. ``check_solution`` re-simulates every answer and raises ``InternalError`` if
the two ever disagree.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from ortools.sat.python import cp_model

from optpipe.core.errors import InternalError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, Schedule
from optpipe.core.semantics import TOLERANCE_MS, duration_ms
from optpipe.core.simulate import Timeline, simulate

from .bounds import makespan_lower_bound
from .cpsat_model import Model, model_values
from .cpsat_vars import COMPUTE, RC, TRANSFERS, Scope, full_scope
from .decode import schedule_from_starts
from .result import Progress, SolveResult, SolveStatus
from .timegrid import Grid, choose_grid

__all__ = ["Scope", "Model", "solve_cpsat", "solve_model", "check_solution", "model_values", "full_scope"]


# --------------------------------------------------------------------------- solve


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(self, grid: Grid, began: float, on_progress, floor_ms: float, proves: bool):
        super().__init__()
        self.grid, self.began, self.on_progress = grid, began, on_progress
        self.floor, self.proves = floor_ms, proves
        self.last: float | None = None  # when the latest solution came (monotonic s)

    def on_solution_callback(self) -> None:
        self.last = time.monotonic()
        if self.on_progress is None:
            return
        bound = self.floor
        if self.proves:
            bound = max(bound, self.grid.ms(self.best_objective_bound))
        self.on_progress(Progress(time.monotonic() - self.began, self.grid.ms(self.objective_value), bound,
                                  "cp-sat: new incumbent"))


def solve_model(model: Model, *, time_limit_s: float, seed: int, workers: int | None,
                callback: _Progress | None = None, light_presolve: bool = False,
                deterministic_s: float | None = None, stall_s: float | None = None,
                for_bound: bool = False, interleave: bool = False,
                linear_relaxation: bool = True) -> tuple[cp_model.CpSolver, int]:
    """Solve; ``light_presolve`` skips probing, which on window models costs seconds and buys nothing.

    Without ``linear_relaxation`` CP-SAT keeps no LP of the model (``linearization_level`` 0): on
    window models (lns.py) its propagation alone finds and proves their answers sooner. The
    window models of a 60 s compile, solved again one at a time (one worker, their own limits):
    seed 1's grid06 (p = 6, v = 3, 53 models) took 41.8 s against 90.3 with the LP, 49 proved
    optimal against 43, a better answer in 6 and a worse one in 1; grid08 (p = 8, v = 1, 199
    models) 59.7 s against 69.0, 165 proved against 161, 6 better and none worse.

    ``for_bound``: only the proven bound is wanted (floor_relax.py), so CP-SAT searches its
    objective's lower bound by tree search: on two tight problems of 144 ops it proved 501.3 and
    582.1 ms where the default proved nothing above the analytic 473.2 and 572.7 (30 s, 15 s),
    and it proves the small ones as fast.

    ``deterministic_s`` also stops the search after that much of CP-SAT's deterministic time:
    with one worker and a fixed seed the answer is then the same on any machine, loaded or not.
    ``stall_s`` stops it once that long has passed since the latest solution (needs ``callback``).
    ``interleave``: one worker takes turns between the full search and CP-SAT's own LNS helpers,
    as a second worker would run them (lns.py uses it on its deep warm-up windows).
    """
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    if deterministic_s is not None:
        solver.parameters.max_deterministic_time = deterministic_s
    solver.parameters.num_workers = workers or os.cpu_count() or 1
    solver.parameters.random_seed = seed
    if light_presolve:
        solver.parameters.cp_model_probing_level = 0
    if for_bound:
        solver.parameters.optimize_with_lb_tree_search = True
    if interleave:
        solver.parameters.interleave_search = True
    if not linear_relaxation:
        solver.parameters.linearization_level = 0
    done = threading.Event()
    if stall_s is not None and callback is not None:
        threading.Thread(target=_stop_when_stalled, args=(solver, callback, stall_s, done), daemon=True).start()
    try:
        code = solver.solve(model.cp, callback)
    finally:
        done.set()
    if code == cp_model.MODEL_INVALID:
        raise InternalError(f"the CP-SAT model is invalid ({model.cp.validate()})")
    return solver, code


def _stop_when_stalled(solver: cp_model.CpSolver, callback: _Progress, stall_s: float, done: threading.Event) -> None:
    """Stop ``solver`` when no new solution has come for ``stall_s`` since the first one."""
    while not done.wait(min(0.05, stall_s / 4)):
        if callback.last is not None and time.monotonic() - callback.last > stall_s:
            solver.stop_search()
            return


def solve_cpsat(problem: Problem, *, time_limit_s: float = 60.0, hint: Schedule | None = None,
                seed: int = 0, workers: int | None = None, resolution_ms: float | None = None,
                on_progress: Callable[[Progress], None] | None = None, stall_s: float | None = None,
                mixes_only: bool = False, stall_from_start: bool = False, floor_ms: float = 0.0) -> SolveResult:
    """Minimise the makespan over the whole problem; returns what the simulator says of the result.

    A fitting hint (the best fitting heuristic, usually) is given to CP-SAT complete and bounds
    the horizon, so the search only looks at schedules at least as fast. ``stall_s`` ends the
    search early once that long passes without a better solution; with ``stall_from_start`` the
    clock runs from the start, so a search that finds no first solution (not even the hint's)
    in that time ends too. ``mixes_only`` searches only schedules that both offload and
    recompute (Model.require_both); its bound proves nothing about the others, so none is
    reported. ``floor_ms``: a bound proved elsewhere (device_relax.py), used like the analytic one.
    """
    began = time.monotonic()
    # data
    grid = choose_grid(problem, resolution_ms)
    analytic = max(makespan_lower_bound(problem).value, floor_ms)
    hinted = simulate(problem, hint) if hint is not None else None
    values = model_values(problem, grid, hint) if hinted is not None and hinted.fits else None
    horizon = _safe_horizon(problem, grid)
    if values is not None:
        starts, _ = values
        horizon = max(t + grid.up(duration_ms(problem, op)) for op, t in starts.items()) + 1
    lower = grid.up(analytic) if grid.exact else 0
    # variables, constraints, objective
    model = Model(problem, grid, full_scope(problem), horizon, lower)
    if values is not None:
        model.hint(*values)
    if mixes_only:
        model.require_both()
    proves = grid.exact and model.memory_exact and not mixes_only
    # solve
    callback = _Progress(grid, began, on_progress, analytic, proves)
    if stall_from_start:
        callback.last = time.monotonic()
    # Probing pays for proofs; a rounded grid proves nothing, and its long horizons make probing
    # take seconds before the first solution (even a complete hint's).
    solver, code = solve_model(model, time_limit_s=time_limit_s - (time.monotonic() - began), seed=seed,
                               workers=workers, callback=callback, light_presolve=not proves, stall_s=stall_s)
    elapsed = time.monotonic() - began
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        proven_empty = code == cp_model.INFEASIBLE and hinted is None and proves
        status = SolveStatus.INFEASIBLE if proven_empty else SolveStatus.NO_IMPROVEMENT
        return SolveResult("cpsat", status, None, None, None, analytic, elapsed, grid.resolution_ms)
    return _read_back(problem, grid, model, solver, code, analytic, proves, elapsed)


def _read_back(problem: Problem, grid: Grid, model: Model, solver: cp_model.CpSolver, code: int,
               analytic: float, proves: bool, elapsed: float) -> SolveResult:
    """The solution as a schedule, judged by the simulator and checked against the model."""
    # read back
    starts = {op: grid.ms(t) for op, t in model.values(solver).items()}
    schedule = schedule_from_starts(problem, "cpsat", starts, lambda op: grid.ms(model.d(op)))
    timeline = simulate(problem, schedule)
    objective = grid.ms(solver.objective_value)
    # check
    if problem.offload.enabled and problem.offload.link_groups and not grid.exact:
        # The model orders a shared channel FIFO by ready time (cpsat_links.py) in its own
        # units; on a rounded grid two ready times the simulator tells apart may round together,
        # so there the simulator is the judge: its bound stands, its times are re-simulated.
        if not timeline.fits:
            return SolveResult("cpsat", SolveStatus.NO_IMPROVEMENT, None, None, None, analytic, elapsed,
                               grid.resolution_ms)
        objective = timeline.makespan
        code = cp_model.FEASIBLE if timeline.makespan > grid.ms(solver.best_objective_bound) + TOLERANCE_MS else code
    else:
        check_solution(problem, grid, timeline, objective)
    bound = max(analytic, grid.ms(solver.best_objective_bound)) if proves else analytic
    status = SolveStatus.OPTIMAL if code == cp_model.OPTIMAL and proves else SolveStatus.FEASIBLE
    return SolveResult("cpsat", status, schedule, timeline, objective, min(bound, timeline.makespan),
                       elapsed, grid.resolution_ms)


def check_solution(problem: Problem, grid: Grid, timeline: Timeline, objective_ms: float) -> None:
    """The simulator must agree with the model (timegrid.py): the same makespan on an exact grid,
    no more than the objective on a rounded one, and within both budgets."""
    tolerance = TOLERANCE_MS * max(1.0, objective_ms)
    over = timeline.makespan - objective_ms
    if over > tolerance or (grid.exact and -over > tolerance):
        raise InternalError(f"the CP-SAT schedule re-simulates to {timeline.makespan:.9f} ms, not the "
                            f"model's {objective_ms:.9f} ms ({grid.describe()})")
    if not timeline.fits:
        raise InternalError(f"the CP-SAT schedule re-simulates over the memory budget (peak {timeline.peak} "
                            f"bytes, budget {problem.memory.budget}; host peak {max(timeline.host_peak)}); "
                            f"{grid.describe()}")


def _safe_horizon(problem: Problem, grid: Grid) -> int:
    """Everything one after another, in the model's units: no schedule needs longer."""
    kinds = COMPUTE + (TRANSFERS if problem.offload.enabled else ()) + ((RC,) if problem.recompute.enabled else ())
    total = sum(grid.up(duration_ms(problem, Op(kind, s, 0))) for kind in kinds for s in range(problem.stages))
    return problem.microbatches * (total + 2 * problem.stages * grid.up(problem.costs.p2p)) + 1
