"""Deferring the critical W passes: never slower, always fitting, and faster where a W sets the path."""

from __future__ import annotations

import pytest

from optpipe.core.errors import OptpipeError
from optpipe.core.schedule import OpKind
from optpipe.core.simulate import simulate, try_simulate
from optpipe.solvers import registry
from optpipe.solvers.wdefer import ROUNDS, defer_critical_w, deferred

from conftest import uniform_problem


def _grid(index, *shape):
    from benchmarks.problem_grid import generated

    return generated(index, *shape, seed=0)


def _small(index):
    from benchmarks.problem_grid import small

    return small(index + 1)[index]


# grid204 (p = 4, v = 3, m = 4, k = 3, uneven costs): GIS-H runs each W right after its B, and on
# the devices that take turns being the bottleneck those Ws sit on the critical path
UNEVEN = _small(4)


def _fitting(problem, name):
    schedule = registry.generate(name, problem)
    timeline = simulate(problem, schedule)
    problem = problem.with_budget(max(problem.memory.budget, timeline.peak))
    return problem, schedule, simulate(problem, schedule)


def test_deferring_gis_h_s_critical_ws_is_faster_and_keeps_every_op():
    problem, schedule, timeline = _fitting(UNEVEN, "GIS-H")
    faster, judged = defer_critical_w(problem, schedule, timeline)
    assert judged.fits
    assert judged.makespan < timeline.makespan - 1.0  # 646.0 ms to 632.4 when this was written
    assert judged == simulate(problem, faster)
    assert [sorted(ops, key=repr) for ops in faster.devices] == [sorted(ops, key=repr) for ops in schedule.devices]
    # only Ws moved, each later in its list (so still after its B); the other ops keep their order
    for before, after in zip(schedule.devices, faster.devices):
        assert [op for op in before if op.kind is not OpKind.W] == [op for op in after if op.kind is not OpKind.W]
        for op in before:
            if op.kind is OpKind.W:
                ahead = lambda ops: sum(o.kind is not OpKind.W for o in ops[:ops.index(op)])  # noqa: E731
                assert ahead(after) >= ahead(before)


@pytest.mark.parametrize("name", ["GIS", "GIS-H", "PO-H", "ZB-H1", "1F1B", "1F1B-I", "ZB-I"])
@pytest.mark.parametrize("problem", [UNEVEN, _grid(201, 3, 2, 6, 0.3, 1.6),
                                     uniform_problem(4, 8, v=2, act=100, keep=50, budget=10**6, name="uniform")],
                         ids=lambda p: p.name)
def test_never_slower_and_always_fitting(problem, name):
    try:
        problem, schedule, timeline = _fitting(problem, name)
    except OptpipeError:
        pytest.skip(f"{name} does not apply")
    faster, judged = defer_critical_w(problem, schedule, timeline)
    assert judged.fits and judged.makespan <= timeline.makespan
    assert judged == simulate(problem, faster)


def test_every_round_gives_a_schedule_the_simulator_accepts():
    problem, schedule, timeline = _fitting(UNEVEN, "PO-H")
    for rule in ROUNDS:
        candidate = deferred(problem, schedule, timeline, rule)
        assert candidate is None or try_simulate(problem, candidate) is not None


def test_a_schedule_that_overflows_is_returned_as_it_is():
    schedule = registry.generate("GIS", UNEVEN)
    timeline = simulate(UNEVEN, schedule)
    assert not timeline.fits
    assert defer_critical_w(UNEVEN, schedule, timeline) == (schedule, timeline)


def test_a_passed_deadline_changes_nothing():
    problem, schedule, timeline = _fitting(UNEVEN, "GIS-H")
    assert defer_critical_w(problem, schedule, timeline, deadline=0.0) == (schedule, timeline)


def test_the_last_w_of_the_final_stretch_moves_to_its_device_s_end():
    # grid214 (p = 2, m = 2, k = 1): GIS's path ends on a stretch whose W the device could run
    # after the last backward; the device ends at the makespan, so the "tail" rule finds no room
    problem, schedule, timeline = _fitting(_small(14), "GIS")
    final = next(rule for rule in ROUNDS if rule.stretches == "final")
    assert all(deferred(problem, schedule, timeline, rule) is None or
               simulate(problem, deferred(problem, schedule, timeline, rule)).makespan >= timeline.makespan - 1e-9
               for rule in ROUNDS if rule is not final)
    moved = deferred(problem, schedule, timeline, final)
    judged = simulate(problem, moved)
    assert judged.fits and judged.makespan < timeline.makespan - 5.0  # 141.2 to 132.3 ms when this was written
    changed = [d for d, (a, b) in enumerate(zip(schedule.devices, moved.devices)) if a != b]
    assert len(changed) == 1
    w = moved.devices[changed[0]][-1]
    assert w.kind is OpKind.W and schedule.devices[changed[0]][-1] != w
    assert defer_critical_w(problem, schedule, timeline)[1].makespan <= judged.makespan
