"""Issuing the reloads the critical path waits for earlier (solvers/reload_advance.py)."""

from __future__ import annotations

from optpipe.core.problem import Offload
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import simulate
from optpipe.solvers import registry
from optpipe.solvers.critical import critical_path
from optpipe.solvers.offload_slots import add_offloads
from optpipe.solvers.reload_advance import advanced_reloads
from optpipe.solvers.wdefer import defer_critical_w

from conftest import uniform_problem

_REL = OpKind.RELOAD


def _late_reload():
    """1F1B on two devices with stage 0's activations offloaded over a slow link, and the last
    reload listed right before its backward, so that the backward waits for it."""
    offload = Offload(True, d2h_bandwidth=50_000.0, h2d_bandwidth=50_000.0, host_budget=10**9)  # 2 ms per 100 B
    problem = uniform_problem(2, 4, act=100, keep=50, offload=offload, f=1, b=1, w=1)
    plain = registry.generate("1F1B", problem)
    placed = add_offloads(problem, plain, [(0, i) for i in range(4)])
    row = [op for op in placed.devices[0] if op != Op(_REL, 0, 3)]
    backward = next(op for op in row if op.kind in (OpKind.B, OpKind.BW) and op.stage == 0 and op.microbatch == 3)
    row.insert(row.index(backward), Op(_REL, 0, 3))
    late = Schedule(placed.name, (tuple(row), placed.devices[1]))
    return problem, placed, late


def test_a_reload_the_path_waits_for_is_issued_early_enough_again():
    problem, placed, late = _late_reload()
    timeline = simulate(problem, late)
    path = critical_path(problem, timeline)
    assert any(t.op == Op(_REL, 0, 3) for t in path)  # the backward waited for it
    advanced = advanced_reloads(problem, late, timeline, path)
    assert advanced is not None
    faster = simulate(problem, advanced)
    assert faster.makespan < timeline.makespan
    assert faster.makespan <= simulate(problem, placed).makespan + 1e-9
    assert sorted(map(str, advanced.devices[0])) == sorted(map(str, late.devices[0]))  # the same ops, reordered


def test_nothing_moves_where_no_backward_waits_for_a_reload():
    problem, placed, _ = _late_reload()
    plain = registry.generate("1F1B", problem)  # nothing offloaded
    timeline = simulate(problem, plain)
    assert advanced_reloads(problem, plain, timeline, critical_path(problem, timeline)) is None


def test_a_move_keeps_the_channel_order_and_the_schedule_valid():
    """Where the link is too slow for a round trip, the reloads sit on the path even as placed:
    whatever the move, the lists stay a schedule, each reload after its offload and in order."""
    problem, placed, _ = _late_reload()
    timeline = simulate(problem, placed)
    advanced = advanced_reloads(problem, placed, timeline, critical_path(problem, timeline))
    assert advanced is not None
    simulate(problem, advanced)  # raises on a broken schedule
    row = advanced.devices[0]
    reloads = [op.microbatch for op in row if op.kind is _REL]
    assert reloads == sorted(reloads)
    for i in reloads:
        assert row.index(Op(OpKind.OFFLOAD, 0, i)) < row.index(Op(_REL, 0, i))


def test_the_deferral_pass_runs_it_and_stays_within_the_budget():
    problem, _, late = _late_reload()
    timeline = simulate(problem, late)
    problem = problem.with_budget(timeline.peak)  # exactly the late schedule's peak: any extra reload overflows
    timeline = simulate(problem, late)
    schedule, found = defer_critical_w(problem, late, timeline)
    assert found.fits and found.makespan <= timeline.makespan
