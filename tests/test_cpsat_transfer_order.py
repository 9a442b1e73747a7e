"""A channel may carry a later microbatch's transfer of a stage first, and both models must allow it.

The exact models keep each stage's F, B and W in microbatch order (symmetry breaking, proved
for compute in docs/design.md), but transfers are not compute: a reload of microbatch 3 may be
issued before the one of microbatch 2 because its issue point comes first. On this p = 4, m = 6
case with slow round trips (3 ms each way, forwards 1.5 to 2 ms) and room for two and a half
activations, the schedule below does that on stage 0; CP-SAT, when its tightness rule left
such orders out, proved 50.75 ms "optimal" (a bound above a real schedule) where 48.3 ms exists.
"""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import simulate, try_simulate
from optpipe.solvers import milp_model as mm
from optpipe.solvers.cpsat import solve_cpsat
from optpipe.solvers.cpsat_model import Model, model_values
from optpipe.solvers.cpsat_vars import full_scope
from optpipe.solvers.heuristics.one_f_one_b import one_f_one_b
from optpipe.solvers.milp import _valid_start
from optpipe.solvers.offload_slots import add_offloads
from optpipe.solvers.timegrid import choose_grid

PROBLEM = Problem(
    "transfer-order",
    Pipeline(4, 1, Placement.INTERLEAVED, 6),
    Costs((1.5, 2.0, 1.5, 2.0), (1.8, 2.0, 1.5, 2.0), (1.05, 1.4, 1.05, 1.4), 0.0),
    Memory((30, 30, 30, 30), (18, 27, 27, 27), 75),
    Offload(True, 10_000.0, 10_000.0, 10**9),  # 30 bytes in 3 ms each way
)

SCHEDULE = Schedule.from_text("reloads out of order", """
d0: F0:0 OFF0:0 F0:1 REL0:0 B0:0 W0:0 F0:2 OFF0:2 B0:1 W0:1 F0:3 OFF0:3 F0:4 OFF0:4 REL0:3 REL0:2 B0:2 W0:2 F0:5 B0:3 W0:3 REL0:4 B0:4 W0:4 B0:5 W0:5
d1: F1:0 OFF1:0 F1:1 OFF1:1 REL1:0 REL1:1 B1:0 W1:0 B1:1 F1:2 W1:1 F1:3 OFF1:3 B1:2 W1:2 REL1:3 F1:4 OFF1:4 B1:3 F1:5 W1:3 REL1:4 B1:4 B1:5 W1:4 W1:5
d2: F2:0 F2:1 OFF2:1 REL2:1 B2:0 B2:1 W2:0 F2:2 W2:1 F2:3 B2:2 W2:2 B2:3 F2:4 W2:3 F2:5 B2:4 B2:5 W2:4 W2:5
d3: F3:0 B3:0 F3:1 B3:1 W3:0 W3:1 F3:2 B3:2 F3:3 W3:2 B3:3 W3:3 F3:4 B3:4 F3:5 B3:5 W3:4 W3:5
""")

_OFF, _REL = OpKind.OFFLOAD, OpKind.RELOAD


def _admits(problem: Problem, schedule: Schedule) -> bool:
    """Whether the whole CP-SAT model has a solution with every start and offload of ``schedule``."""
    grid = choose_grid(problem, None)
    starts, offloaded = model_values(problem, grid, schedule)
    model = Model(problem, grid, full_scope(problem), max(starts.values()) + 10**6)
    for op, var in model.start.items():
        if op in starts:
            model.cp.add(var == starts[op])
    for pair, literal in model.offloaded.items():
        model.cp.add(literal == (pair in offloaded))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 10
    return solver.solve(model.cp) in (cp_model.OPTIMAL, cp_model.FEASIBLE)


def test_the_schedule_fits_with_its_reloads_out_of_microbatch_order():
    timeline = simulate(PROBLEM, SCHEDULE)
    assert timeline.fits and abs(timeline.makespan - 48.7) < 1e-6
    starts = {t.op: t.start for t in timeline.timings}
    assert starts[Op(_REL, 0, 3)] < starts[Op(_REL, 0, 2)]  # one channel, microbatch 3 first


def test_the_schedule_is_a_solution_of_the_cpsat_model():
    assert choose_grid(PROBLEM, None).exact
    assert _admits(PROBLEM, SCHEDULE)


def test_the_schedule_is_a_solution_of_both_milp_models():
    timeline = simulate(PROBLEM, SCHEDULE)
    data = mm.prepare(PROBLEM, mm.choose_milp_grid(PROBLEM))
    for asap in (False, True):
        model = mm.build_model(data, mm.serial_horizon(data), asap=asap)
        values = _valid_start(model, SCHEDULE, timeline)
        assert values is not None, f"the schedule breaks the {'exact' if asap else 'relaxed'} MILP"


def test_cpsat_never_proves_a_bound_above_it():
    result = solve_cpsat(PROBLEM, time_limit_s=5, hint=SCHEDULE, workers=1, seed=0)
    assert result.makespan_ms <= 48.7 + 1e-6
    assert result.lower_bound_ms <= result.makespan_ms + 1e-6


# --------------------------------------------------------------------------- every fitting order


def _random_case(draw):
    """A small offloading problem and a fitting schedule with its transfers listed anywhere their
    data allows: reloads moved earlier, offloads later, in any order on the channel."""
    p, m = draw(st.integers(2, 3)), draw(st.integers(3, 4))
    f = tuple(draw(st.sampled_from((1.0, 1.5, 2.0))) for _ in range(p))
    keep = tuple(draw(st.sampled_from((18, 27))) for _ in range(p))
    link = draw(st.sampled_from((20_000.0, 10_000.0, 7_500.0)))  # 1.5, 3 or 4 ms a transfer
    problem = Problem("orders", Pipeline(p, 1, Placement.INTERLEAVED, m), Costs(f, f, tuple(x / 2 for x in f), 0.0),
                      Memory((30,) * p, keep, draw(st.sampled_from((60, 75, 90, 120)))),
                      Offload(True, link, link, 10**9))
    pairs = draw(st.sets(st.tuples(st.integers(0, p - 2), st.integers(0, m - 1)), min_size=1, max_size=2 * m))
    rows = [list(row) for row in add_offloads(problem, one_f_one_b(problem), pairs).devices]
    for _ in range(draw(st.integers(1, 6))):
        row = rows[draw(st.integers(0, p - 2))]
        transfers = [k for k, op in enumerate(row) if op.kind in (_OFF, _REL)]
        if not transfers:
            continue
        op = row.pop(draw(st.sampled_from(transfers)))
        row.insert(draw(st.integers(0, len(row))), op)
    return problem, Schedule("moved", tuple(tuple(row) for row in rows))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.data())
def test_every_fitting_schedule_is_a_solution_of_both_models(data):
    """What the simulator accepts and fits, with F, B and W in microbatch order, the models admit:
    else a proven optimum could lie above a real schedule (the case above)."""
    problem, schedule = _random_case(data.draw)
    timeline = try_simulate(problem, schedule)
    assume(timeline is not None and timeline.fits)
    assume(choose_grid(problem, None).exact)
    assert _admits(problem, schedule), schedule.to_text()
    prepared = mm.prepare(problem, mm.choose_milp_grid(problem))
    for asap in (False, True):
        milp = mm.build_model(prepared, mm.serial_horizon(prepared), asap=asap)
        assert _valid_start(milp, schedule, timeline) is not None, schedule.to_text()
