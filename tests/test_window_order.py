"""A window model holds the schedule it improves even where W deferral ran W passes out of order."""

from __future__ import annotations

import dataclasses

from ortools.sat.python import cp_model

from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import simulate
from optpipe.solvers.compare import compare
from optpipe.solvers.cpsat import Model, solve_model
from optpipe.solvers.timegrid import choose_grid
from optpipe.solvers.window import splice, unordered_chains, window_scope

from conftest import uniform_problem

PLAIN = uniform_problem(4, 8, act=100, keep=50, budget=500, name="window-order")
_W = OpKind.W


def _w_deferred_past_the_next() -> Schedule:
    """ZB-H1 with device 0's W(0, 0) listed right after W(0, 1), as W deferral may list it."""
    start = next(e.judged for e in compare(PLAIN, ["ZB-H1"]))
    rows = [list(ops) for ops in start.schedule.devices]
    first, second = Op(_W, 0, 0), Op(_W, 0, 1)
    rows[0].remove(first)
    rows[0].insert(rows[0].index(second) + 1, first)
    return Schedule.of("ZB-H1, W(0, 0) deferred", rows)


def _solve(scope, inside, grid, timeline):
    model = Model(PLAIN, grid, scope, grid.up(timeline.makespan) + 1)
    model.hint(inside, scope.offloaded)
    solver, code = solve_model(model, time_limit_s=20.0, seed=0, workers=1, light_presolve=True)
    return model, solver, code


def test_a_window_over_w_passes_out_of_order_has_a_solution():
    schedule = _w_deferred_past_the_next()
    timeline = simulate(PLAIN, schedule)
    assert timeline.fits
    assert unordered_chains(timeline) == {(_W, 0)}
    by_op = {t.op: t for t in timeline.timings}
    grid = choose_grid(PLAIN)
    # the window frees W(0, 1); W(0, 0), after it, is re-timed in list order with the rest
    at = by_op[Op(_W, 0, 1)].start
    scope, inside = window_scope(PLAIN, timeline, grid, at - 2.0, at + 0.5, float("inf"))
    assert Op(_W, 0, 1) in scope.compute and Op(_W, 0, 0) in scope.following
    model, solver, code = _solve(scope, inside, grid, timeline)
    assert code in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    candidate = splice(PLAIN, timeline, scope, frozenset(model.start), model.values(solver), grid,
                       timeline.makespan + 1.0)
    judged = simulate(PLAIN, candidate)
    assert judged.fits and judged.makespan <= timeline.makespan + 1e-9
    # with the model's microbatch order on every W, the same window has no solution at all
    ordered = dataclasses.replace(scope, unordered=frozenset())
    assert _solve(ordered, inside, grid, timeline)[2] == cp_model.INFEASIBLE


def test_schedules_in_microbatch_order_leave_nothing_unordered():
    for entry in compare(PLAIN):
        if entry.judged is not None:
            assert unordered_chains(entry.judged.timeline) == frozenset(), entry.name
