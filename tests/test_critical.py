"""The critical path: a chain of ops, each starting when the one before it on the path ends."""

from __future__ import annotations

import dataclasses

import pytest

from optpipe.core.problem import Costs, Offload
from optpipe.core.schedule import COMPUTE_KINDS
from optpipe.core.semantics import lag_ms
from optpipe.solvers.compare import compare
from optpipe.solvers.critical import critical_gaps, critical_path
from optpipe.solvers.warmstart import warm_starts

from conftest import uniform_problem

OFFLOAD = uniform_problem(4, 8, act=100, keep=50, budget=300, offload=Offload(True, 1e5, 1e5, 10**9),
                          name="critical-offload")
PLAIN = uniform_problem(4, 8, act=100, keep=50, budget=400, name="critical-plain")
# a round trip of 2 ms against 1 ms ops, p2p lags, and two pairs of devices on one host link each:
# backwards wait for reloads, and transfers for their channel or their issue point
SLOW_LINK = uniform_problem(4, 8, v=2, act=100, keep=50, budget=500, p2p=0.1, name="critical-slow-link",
                            offload=Offload(True, 1e5, 1e5, 10**9, link_groups=((0, 1), (2, 3))))


def _timelines(problem):
    return [e.judged.timeline for e in compare(problem) if e.fits]


def _offloading_timelines(problem):
    """Every fitting warm start (warmstart.py): each heuristic as it is and, so that reloads and
    shared channels are on the path, its offloaded variants."""
    return [j.timeline for j in warm_starts(problem, compare(problem)) if j.fits]


@pytest.mark.parametrize("problem", [OFFLOAD, PLAIN, SLOW_LINK], ids=lambda p: p.name)
def test_the_path_ends_at_the_makespan_and_every_step_is_tight(problem):
    for timeline in _offloading_timelines(problem):
        path = critical_path(problem, timeline)
        assert path[0].end == pytest.approx(timeline.makespan)
        for later, earlier in zip(path, path[1:]):
            data = earlier.device != later.device and {earlier.op.kind, later.op.kind} <= COMPUTE_KINDS
            lag = lag_ms(problem, earlier.op.stage, later.op.stage) if data else 0.0
            assert earlier.end + lag == pytest.approx(later.start, abs=1e-6), timeline.schedule_name


@pytest.mark.parametrize("problem", [OFFLOAD, PLAIN, SLOW_LINK], ids=lambda p: p.name)
def test_the_path_reaches_back_to_the_first_start(problem):
    """Nothing waits for memory (the simulator starts every op as soon as its data, its device
    or channel, and its issue point allow), so some reason is always tight and the walk only
    stops at an op that starts with the schedule, through reloads and shared channels too."""
    through_transfers = 0
    for timeline in _offloading_timelines(problem):
        path = critical_path(problem, timeline)
        assert path[-1].start == pytest.approx(0.0, abs=1e-9), timeline.schedule_name
        through_transfers += any(t.op.kind not in COMPUTE_KINDS for t in path)
    assert through_transfers or not problem.offload.enabled


@pytest.mark.parametrize("problem", [OFFLOAD, PLAIN], ids=lambda p: p.name)
def test_gaps_are_idle_just_before_an_op_of_the_path(problem):
    for timeline in _timelines(problem):
        on_path = {t.op for t in critical_path(problem, timeline)}
        compute = [t for t in timeline.timings if t.op.kind in COMPUTE_KINDS]
        for gap in critical_gaps(problem, timeline):
            assert gap.op in on_path and gap.length > 0
            row = [t for t in compute if t.device == gap.device]
            k = next(j for j, t in enumerate(row) if t.op == gap.op)
            assert k > 0 and row[k].start - row[k - 1].end == pytest.approx(gap.length)


def test_an_unbalanced_pipeline_is_held_by_its_busiest_device():
    """With the last stage three times as slow, the path spends its steady state there; with
    memory to spare every start is set by data or the device, so the path reaches back to 0."""
    even = uniform_problem(4, 8, act=100, keep=50, budget=10**6, p2p=0.1, name="critical-unbalanced")
    slow = (1.0, 1.0, 1.0, 3.0)
    problem = dataclasses.replace(even, costs=Costs(slow, slow, slow, 0.1))
    for timeline in _timelines(problem):
        path = critical_path(problem, timeline)
        assert path[-1].start == 0.0
        assert len([t for t in path if t.device == 3]) >= 2 * problem.microbatches, timeline.schedule_name
