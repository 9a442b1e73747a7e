"""The memory-capped offloading list schedule: what comes out fits, and it pays far below PO-H's peak."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optpipe.core.problem import Offload
from optpipe.core.problem_file import default_problem
from optpipe.core.schedule import Op, OpKind
from optpipe.core.simulate import simulate
from optpipe.solvers.capped_offload import Policy, capped_offload, capped_offload_starts
from optpipe.solvers.compare import compare

from conftest import uniform_problem


def _slow_link(p: int, m: int, v: int, budget: int, ms_each_way: float, p2p: float = 0.0):
    bandwidth = 100 / ms_each_way * 1e3
    return uniform_problem(p, m, v=v, act=100, keep=50, budget=budget, p2p=p2p,
                           offload=Offload(True, bandwidth, bandwidth, 10**9))


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 4), v=st.integers(1, 2), m=st.integers(1, 8), slots=st.integers(1, 6),
       ms=st.sampled_from([0.5, 1.0, 2.5]), p2p=st.sampled_from([0.0, 0.3]), cap=st.integers(1, 8),
       policy=st.sampled_from(list(Policy)))
def test_what_comes_out_simulates_and_fits(p, v, m, slots, ms, p2p, cap, policy):
    """Every allocation is checked against the device's memory from its start on, and the times are
    the simulator's: a schedule the pass returns fits, whatever the cap and the policy (None: it
    deadlocked)."""
    problem = _slow_link(p, m, v, budget=100 * max(slots, v) + 60, ms_each_way=ms, p2p=p2p)
    schedule = capped_offload(problem, cap, policy)
    if schedule is not None:
        timeline = simulate(problem, schedule)
        assert timeline.fits, (timeline.peak, problem.memory.budget)  # and it is complete: simulate checks
        _reloads_follow_offloads(schedule)


def _reloads_follow_offloads(schedule) -> None:
    for ops in schedule.devices:  # passes that edit lists (the window search's splice) rely on it
        where = {op: k for k, op in enumerate(ops)}
        assert all(where[op] > where[Op(OpKind.OFFLOAD, op.stage, op.microbatch)]
                   for op in ops if op.kind is OpKind.RELOAD)


def test_reloads_follow_their_offloads_on_the_built_in_problem():
    """The built-in problem once got reloads listed before their offloads (device 6): the simulator
    accepts that, but a window search from it built a cycle and compile failed."""
    problem = default_problem()
    for cap in (7, 8, 12):
        _reloads_follow_offloads(capped_offload(problem, cap))


def test_far_below_po_h_it_beats_the_capped_fallback():
    # p = 4, v = 2, m = 16, a round trip of 2 x 3 ms against F + B = 2 ms (k = 3), three activations.
    problem = _slow_link(4, 16, 2, budget=300, ms_each_way=3.0)
    capped = compare(problem, ["1F1B-capped"])[0].judged
    [start] = capped_offload_starts(problem)
    assert start.timeline.fits and start.schedule.offloaded
    assert start.makespan_ms < capped.makespan_ms


def test_nothing_without_offload():
    assert capped_offload_starts(uniform_problem(4, 8, budget=300)) == []


@pytest.mark.parametrize("cap", [1, 3])
def test_a_small_cap_holds_few_microbatches(cap):
    problem = _slow_link(4, 8, 1, budget=10_000, ms_each_way=1.0)
    schedule = capped_offload(problem, cap)
    order = [op for op in schedule.devices[0] if op.kind.name in ("F", "B")]
    in_flight = most = 0
    for op in order:
        in_flight += 1 if op.kind.name == "F" else -1
        most = max(most, in_flight)
    assert most == cap


def test_link_free_offloads_only_what_the_idle_link_can_take_back_in_time():
    # p = 4, m = 8, F = B = W = 1 ms, transfers of 1.5 ms each way: stage 0's round trip (6 ms)
    # outlasts an offload and a reload, the last stage's (0 ms) does not.
    problem = _slow_link(4, 8, 1, budget=300, ms_each_way=1.5)
    schedule = capped_offload(problem, 4, Policy.LINK_FREE)
    assert "link free" in schedule.name
    offloaded = schedule.offloaded
    assert offloaded and all(stage < 3 for stage, _ in offloaded)
    assert simulate(problem, schedule).fits


@pytest.mark.parametrize("policy", list(Policy))
def test_no_policy_offloads_an_activation_whose_backward_would_wait_for_it(policy):
    # p = 4, v = 1, F = B = W = 1 ms, transfers of 1.5 ms each way: from F(s) to B(s) a microbatch
    # passes 2 x (3 - s) ms of the later stages, so only stages 0 (6 ms) and 1 (4 ms) hold a 3 ms
    # round trip; the first chunk is every stage here, and stage 2's reload would make B(2) wait.
    problem = _slow_link(4, 8, 1, budget=300, ms_each_way=1.5)
    stages = set()
    for cap in range(1, 8):
        schedule = capped_offload(problem, cap, policy)
        if schedule is not None:
            stages |= {stage for stage, _ in schedule.offloaded}
    assert 0 in stages and stages <= {0, 1}


def test_the_starts_keep_the_faster_policy():
    problem = _slow_link(4, 16, 2, budget=300, ms_each_way=3.0)
    [start] = capped_offload_starts(problem)
    for policy in Policy:
        for cap in range(1, 13):
            schedule = capped_offload(problem, cap, policy)
            if schedule is not None and (timeline := simulate(problem, schedule)).fits:
                assert start.makespan_ms <= timeline.makespan + 1e-9
