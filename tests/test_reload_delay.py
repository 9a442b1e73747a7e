"""Issuing later the reloads that hold memory where a device overflows (solvers/reload_delay.py)."""

from __future__ import annotations

from optpipe.core.problem import Offload
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import simulate
from optpipe.solvers import registry
from optpipe.solvers.offload_slots import add_offloads
from optpipe.solvers.reload_delay import delayed_reloads
from optpipe.solvers.wdefer import _round

from conftest import uniform_problem

_REL, _OFF = OpKind.RELOAD, OpKind.OFFLOAD


def _early_reloads():
    """1F1B on four devices with stage 0's activations offloaded (each reload placed to end just
    before its backward), the budget at that schedule's peak, and the same schedule with every
    reload issued right after its own offload: it brings each activation back at once and
    overflows device 0."""
    offload = Offload(True, d2h_bandwidth=50_000.0, h2d_bandwidth=50_000.0, host_budget=10**9)  # 2 ms per 100 B
    problem = uniform_problem(4, 8, act=100, keep=50, offload=offload, f=4, b=4, w=4)
    placed = add_offloads(problem, registry.generate("1F1B", problem), [(0, i) for i in range(8)])
    problem = problem.with_budget(simulate(problem, placed).peak)
    row = [op for op in placed.devices[0] if op.kind is not _REL]
    for i in range(8):
        row.insert(row.index(Op(_OFF, 0, i)) + 1, Op(_REL, 0, i))
    early = Schedule(placed.name, (tuple(row),) + placed.devices[1:])
    return problem, placed, early


def _backward(row, reload):
    return next(k for k, op in enumerate(row) if op.kind in (OpKind.B, OpKind.BW)
                and (op.stage, op.microbatch) == (reload.stage, reload.microbatch))


def test_reloads_held_through_an_overflow_are_issued_later_and_the_schedule_fits():
    problem, placed, early = _early_reloads()
    timeline = simulate(problem, early)
    assert not timeline.fits and max(timeline.peak_memory[1:]) <= problem.memory.budget  # device 0 alone overflows
    later = delayed_reloads(problem, early, timeline, frozenset({0}))
    assert later is not None
    fixed = simulate(problem, later)
    assert fixed.fits
    assert fixed.makespan <= timeline.makespan + 1e-9  # each still ends by its backward's start
    row = later.devices[0]
    assert sorted(map(str, row)) == sorted(map(str, early.devices[0]))  # the same ops, reordered
    assert later.devices[1:] == early.devices[1:]
    for op in row:
        if op.kind is _REL:
            assert row.index(Op(_OFF, 0, op.microbatch)) < row.index(op) < _backward(row, op)


def test_nothing_moves_on_devices_that_fit():
    problem, placed, early = _early_reloads()
    timeline = simulate(problem, early)
    assert delayed_reloads(problem, early, timeline, frozenset({1})) is None  # device 1 fits
    fitting = simulate(problem, placed)
    assert delayed_reloads(problem, placed, fitting, frozenset({0, 1})) is None


def test_a_faster_round_that_overflows_is_kept_once_its_reloads_make_room():
    """W deferral's rounds (wdefer._round): a candidate faster than the schedule in hand that
    overflows only through early reloads comes back fitting, rather than dropped."""
    problem, placed, early = _early_reloads()
    row = list(placed.devices[0])
    late = Op(_REL, 0, 1)
    row.remove(late)
    row.insert(_backward(row, late), late)  # issued only when its backward is next: the backward waits
    slow = Schedule("slow", (tuple(row),) + placed.devices[1:])
    slow_timeline = simulate(problem, slow)
    assert slow_timeline.fits and slow_timeline.makespan > simulate(problem, early).makespan
    found = _round(problem, slow_timeline, lambda skip: early)
    assert found is not None
    schedule, timeline = found
    assert timeline.fits and timeline.makespan < slow_timeline.makespan
