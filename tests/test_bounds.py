"""Lower bounds: exact on closed-form cases, and never above any schedule the simulator accepts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optpipe.compiler.problem import Offload, Placement
from optpipe.solvers.bounds import (data_paths, device_lower_bound, makespan_lower_bound, memory_area_bound,
                                    memory_lower_bound)
from optpipe.solvers.compare import compare

from conftest import uniform_problem


def test_fill_and_drain_of_the_last_device():
    # F = B = W = 1, p2p = 0: the last device starts after p-1 forwards and then works 3m;
    # ZB-H2 reaches this (m(F+B+W) + (p-1)F, Qi et al. section 3.2).
    problem = uniform_problem(4, 8)
    bound = makespan_lower_bound(problem)
    assert bound.value == 27.0
    assert "device 3" in bound.reason


def test_p2p_counts_on_every_hop():
    problem = uniform_problem(4, 8, p2p=0.5)
    assert makespan_lower_bound(problem).value == 27.0 + 3 * 0.5


def test_slow_neighbour_stage_delays_releases():
    # Stage 0's forward takes 3: the j-th forward of stage 1 waits for j+1 of them, so device 1
    # cannot finish before 3m + (its own B and W after the last forward).
    problem = uniform_problem(2, 4)
    costs = problem.costs
    slow = type(costs)((3.0, 1.0), costs.backward_input, costs.backward_weight, 0.0)
    problem = type(problem)(problem.name, problem.pipeline, slow, problem.memory, problem.offload)
    # Last forward of stage 1 starts at 12 at the earliest, then F, B, W of that microbatch.
    assert device_lower_bound(problem, 1) >= 12 + 3


def test_budget_forces_a_longer_makespan():
    # p = 2, budget of one activation, no offload: each activation lives from F(0) through
    # F(1), B(1), B(0) (4 ms) at 100 bytes plus W(0) at 50: 450 byte-ms per microbatch, four
    # microbatches, 100 bytes of budget -> at least 18 ms, more than the 13 of fill and drain.
    problem = uniform_problem(2, 4, act=100, keep=50, budget=100)
    area = memory_area_bound(problem)
    assert area.value == pytest.approx(18.0)
    assert makespan_lower_bound(problem).value == pytest.approx(18.0)
    assert "budget" in makespan_lower_bound(problem).reason


def test_offload_shortens_what_the_budget_forces():
    slow = uniform_problem(2, 4, act=100, keep=50, budget=100)
    cheap = uniform_problem(2, 4, act=100, keep=50, budget=100, offload=Offload(True, 1e6, 1e6, 10**9))
    # offloaded, an activation is held for F + offload + reload + B = 2.0002 ms instead of 4
    assert memory_area_bound(cheap).value < memory_area_bound(slow).value


def test_memory_lower_bound_counts_every_chunk_without_offload():
    problem = uniform_problem(4, 4, v=2, act=100, keep=50, budget=1000)
    assert memory_lower_bound(problem).value == 200
    with_offload = uniform_problem(4, 4, v=2, act=100, keep=50, budget=1000, offload=Offload(True, 1e9, 1e9, 10**9))
    assert memory_lower_bound(with_offload).value == 100


def test_data_paths_of_one_microbatch():
    paths = data_paths(uniform_problem(3, 2, p2p=0.5))
    from optpipe.compiler.schedule import OpKind

    assert paths.head[(OpKind.F, 2)] == 3.0  # two forwards and two hops
    assert paths.head[(OpKind.B, 0)] == 3.0 + 1 + 2 * 1.5  # the last forward, then back
    # after F(0): two hops forward, B(2), two hops back, W(0)
    assert paths.tail[(OpKind.F, 0)] == 1.5 + 1.5 + 1 + 1.5 + 1.5 + 1
    assert paths.gap[2] == 0.0  # the last stage's B may follow its F at once


def test_never_above_a_heuristic_on_the_instances(instance):
    bound = makespan_lower_bound(instance).value
    for entry in compare(instance):
        if entry.fits:
            assert entry.timeline.makespan >= bound - 1e-6, entry.name


@settings(max_examples=25, deadline=None)
@given(p=st.integers(2, 4), v=st.integers(1, 2), m=st.integers(1, 6),
       f=st.sampled_from([1.0, 2.0, 3.5]), b=st.sampled_from([1.0, 2.5]), w=st.sampled_from([0.5, 1.0]),
       p2p=st.sampled_from([0.0, 0.5]), budget=st.sampled_from([1, 2, 4, 100]), vshape=st.booleans())
def test_never_above_any_fitting_schedule(p, v, m, f, b, w, p2p, budget, vshape):
    placement = Placement.VSHAPE if vshape and v == 2 else Placement.INTERLEAVED
    problem = uniform_problem(p, m, v=v, f=f, b=b, w=w, p2p=p2p, act=100, keep=40, budget=100 * budget,
                              placement=placement)
    bound = makespan_lower_bound(problem).value
    for entry in compare(problem):
        if entry.timeline is None:
            continue
        # the per-device relaxation holds for every schedule, fitting or not
        relaxed = max(device_lower_bound(problem, d) for d in range(p))
        assert entry.timeline.makespan >= relaxed - 1e-6, entry.name
        if entry.fits:
            assert entry.timeline.makespan >= bound - 1e-6, entry.name
