"""Shared host links (issue 14): [offload] link_groups, one D2H and one H2D channel per group."""

from __future__ import annotations

from dataclasses import replace

import pytest

from optpipe.core.errors import ProblemError
from optpipe.core.problem import Offload
from optpipe.core.problem_file import dumps_problem, loads_problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import simulate

from conftest import uniform_problem

F, B, W, BW, OFF, REL = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD

_BASE = """
name = "links"
[pipeline]
devices = 4
microbatches = 4
[costs]
forward = 1
backward_input = 1
backward_weight = 1
[memory]
activation = 100
weight_activation = 50
budget = 1000
"""


def _load(offload: str):
    return loads_problem(_BASE + "[offload]\n" + offload)


def test_link_groups_load_and_round_trip():
    problem = _load('d2h_bandwidth = "1MB/s"\nh2d_bandwidth = "1MB/s"\nlink_groups = [[1, 0], [2, 3]]\n')
    assert problem.offload.link_groups == ((0, 1), (2, 3))
    assert [problem.offload.link_of(d) for d in range(4)] == [0, 0, 2, 2]
    assert loads_problem(dumps_problem(problem)) == problem


@pytest.mark.parametrize("groups, message", [
    ("[[0, 4]]", "devices run 0..3"),
    ("[[0, 1], [1, 2]]", "device 1 is already in group 0"),
    ("[[0]]", "at least two devices"),
    ("[0, 1]", "list of lists"),
    ('[["a", 1]]', "is not a device"),
    (f"[[0, {'9' * 300}]]", "an integer of .* bits is not a device"),  # a huge number is named, not printed
])
def test_bad_link_groups_say_what_is_wrong(groups, message):
    with pytest.raises(ProblemError, match=message):
        _load(f'd2h_bandwidth = "1MB/s"\nh2d_bandwidth = "1MB/s"\nlink_groups = {groups}\n')


def test_link_groups_need_offload():
    with pytest.raises(ProblemError, match="offload is not enabled"):
        _load("enabled = false\nlink_groups = [[0, 1]]\n")


def _pair(groups):
    offload = Offload(True, d2h_bandwidth=100_000.0, h2d_bandwidth=100_000.0, host_budget=10**9,
                      link_groups=groups)  # 1 ms per 100 B
    problem = uniform_problem(2, 1, act=100, keep=50, offload=offload, f=1, b=1, w=1)
    schedule = Schedule.of("hand", [
        [Op(F, 0, 0), Op(OFF, 0, 0), Op(REL, 0, 0), Op(BW, 0, 0)],
        [Op(F, 1, 0), Op(OFF, 1, 0), Op(REL, 1, 0), Op(BW, 1, 0)],
    ])
    return problem, schedule


def test_shared_link_carries_one_transfer_at_a_time():
    alone = simulate(*_pair(())).by_op
    shared = simulate(*_pair(((0, 1),))).by_op
    # Own links: OFF0 runs 1..2, OFF1 runs 2..3 (F1 ends at 2): they do not overlap anyway.
    assert alone[Op(OFF, 0, 0)].start == pytest.approx(1.0)
    # Shared: REL0 (ready at 2) takes H2D 2..3; REL1 is ready at 3 (after OFF1) and runs 3..4.
    assert shared[Op(REL, 0, 0)].start == pytest.approx(2.0)
    assert shared[Op(OFF, 1, 0)].start == pytest.approx(2.0)
    for kind in (OFF, REL):
        a, b = sorted((shared[Op(kind, 0, 0)], shared[Op(kind, 1, 0)]), key=lambda t: t.start)
        assert a.end <= b.start + 1e-9


def test_shared_channel_is_fifo_by_ready_time():
    offload = Offload(True, d2h_bandwidth=50_000.0, h2d_bandwidth=1e9, host_budget=10**9, link_groups=((0, 1),))
    problem = uniform_problem(2, 2, act=100, keep=50, offload=offload, f=1, b=1, w=1)  # offload 2 ms
    # OFF0:0 takes the link 1..3; OFF1:0 is ready at 2 (after F1:0) and OFF0:1 at 3 (after its
    # device's previous offload): the one ready first goes first.
    schedule = Schedule.of("hand", [
        [Op(F, 0, 0), Op(OFF, 0, 0), Op(F, 0, 1), Op(OFF, 0, 1), Op(REL, 0, 0), Op(REL, 0, 1), Op(BW, 0, 0), Op(BW, 0, 1)],
        [Op(F, 1, 0), Op(OFF, 1, 0), Op(REL, 1, 0), Op(BW, 1, 0), Op(F, 1, 1), Op(BW, 1, 1)],
    ])
    first = simulate(problem, schedule)
    by = first.by_op
    assert by[Op(OFF, 0, 0)].start == pytest.approx(1.0)  # 1..3
    assert by[Op(OFF, 1, 0)].start == pytest.approx(3.0)
    assert by[Op(OFF, 0, 1)].start == pytest.approx(5.0)
    assert simulate(problem, schedule) == first  # deterministic


# ------------------------------------------------------------------ solvers


def _shared_problem(k: float = 1.0):
    """WITH_OFFLOAD of test_cpsat with devices 0-1 and 2-3 on shared links (1 ms a transfer at k = 1)."""
    bandwidth = 1e5 / k
    return uniform_problem(4, 6, act=100, keep=50, budget=250, name="shared",
                           offload=Offload(True, bandwidth, bandwidth, 10**9, link_groups=((0, 1), (2, 3))))


def _check_shared_channels(timeline):
    problem = timeline.problem
    for group in problem.offload.link_groups:
        for kind in (OFF, REL):
            spans = sorted((t.start, t.end) for t in timeline.timings if t.op.kind is kind and t.device in group)
            for (_, end), (start, _) in zip(spans, spans[1:]):
                assert end <= start + 1e-9


def test_cpsat_and_milp_respect_shared_links():
    from optpipe.solvers.compare import compare
    from optpipe.solvers.cpsat import solve_cpsat
    from optpipe.solvers.milp import solve_milp
    from optpipe.solvers.bounds import makespan_lower_bound
    from optpipe.solvers.warmstart import best_candidate, warm_starts

    problem = _shared_problem()
    hint = best_candidate(warm_starts(problem, compare(problem))).schedule
    heuristic = simulate(problem, hint)
    assert heuristic.fits
    bound = makespan_lower_bound(problem).value
    cpsat = solve_cpsat(problem, time_limit_s=10, hint=hint, workers=1, seed=1)
    assert cpsat.schedule is not None  # it serves the shared link exactly, so it beats the heuristic here
    for result in (cpsat, solve_milp(problem, backend="highs", time_limit_s=2, hint=hint)):  # runs to its limit
        if result.schedule is None:  # the MILP found nothing faster than the hint in 2 s
            continue
        timeline = simulate(problem, result.schedule)
        assert timeline.fits and timeline.makespan == pytest.approx(result.makespan_ms)
        assert bound - 1e-9 <= result.lower_bound_ms <= timeline.makespan + 1e-9
        _check_shared_channels(timeline)
        assert timeline.makespan <= heuristic.makespan + 1e-9


def test_po_h_keeps_its_compute_timeline_on_shared_links():
    from optpipe.solvers.heuristics.gis import gis_h
    from optpipe.solvers.heuristics.pipeoffload import po_h

    problem = uniform_problem(4, 8, v=2, act=100, keep=50, budget=10**6, name="shared-poh",
                              offload=Offload(True, 1e5 / 0.9, 1e5 / 0.9, 10**9, link_groups=((0, 1), (2, 3))))
    timeline = simulate(problem, po_h(problem))
    assert timeline.makespan == pytest.approx(simulate(problem, gis_h(problem)).makespan)
    _check_shared_channels(timeline)


def test_cpsat_orders_a_shared_channel_as_the_simulator_does():
    """The full model serves a shared channel FIFO by ready time (semantics.py): its objective is
    the simulated makespan. Ordering the channel freely instead found only schedules that
    re-simulate over the budget here. Its optimum is no proof on shared links (it misses fitting
    schedules: tests/test_bound_proofs.py), so only the analytic bound is reported."""
    from optpipe.core.semantics import TOLERANCE_MS
    from optpipe.solvers.bounds import makespan_lower_bound
    from optpipe.solvers.cpsat import solve_cpsat
    from optpipe.solvers.result import SolveStatus

    problem = uniform_problem(4, 4, act=100, keep=50, budget=250, name="fifo",
                              offload=Offload(True, 2e5, 2e5, 10**9, link_groups=((0, 1), (2, 3))))  # k = 0.5
    result = solve_cpsat(problem, time_limit_s=20, workers=1, seed=0)
    assert result.status is SolveStatus.FEASIBLE and result.schedule.offloaded
    timeline = simulate(problem, result.schedule)
    assert timeline.fits and abs(timeline.makespan - result.objective_ms) <= TOLERANCE_MS
    assert result.lower_bound_ms == pytest.approx(makespan_lower_bound(problem).value)
    _check_shared_channels(timeline)


def test_cpsat_with_recompute_on_shared_links_is_the_simulators_schedule():
    """Keep, offload and recompute decided together over shared links: the model's makespan is the
    simulated one, to the last digit (exact grid), and its peak within the budget."""
    from optpipe.core.problem import Recompute
    from optpipe.core.semantics import TOLERANCE_MS
    from optpipe.solvers.cpsat import solve_cpsat
    from optpipe.solvers.registry import generate

    problem = replace(uniform_problem(4, 4, act=100, keep=50, budget=150, name="fifo-rc",
                                      offload=Offload(True, 2e5, 2e5, 10**9, link_groups=((0, 1), (2, 3)))),
                      recompute=Recompute(True, (1.0,) * 4, (10,) * 4))
    hint = generate("1F1B-capped-RC", problem)
    result = solve_cpsat(problem, time_limit_s=10, workers=1, seed=0, hint=hint)
    timeline = simulate(problem, result.schedule)
    assert timeline.fits and abs(timeline.makespan - result.objective_ms) <= TOLERANCE_MS
    assert timeline.makespan <= simulate(problem, hint).makespan
    assert result.lower_bound_ms <= timeline.makespan + TOLERANCE_MS
    _check_shared_channels(timeline)
