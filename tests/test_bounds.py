"""Lower bounds: exact on closed-form cases, and never above any schedule the simulator accepts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem
from optpipe.solvers.bounds import (_area_bound, _packing_bound, data_paths, device_lower_bound, makespan_lower_bound,
                                    memory_area_bound, memory_lower_bound)
from optpipe.solvers.compare import applicable, compare

from conftest import uniform_problem


def test_fill_and_drain_of_the_last_device():
    # F = B = W = 1, p2p = 0: the last device starts after p-1 forwards and then works 3m;
    # ZB-H2 reaches this (m(F+B+W) + (p-1)F, Qi et al. section 3.2).
    problem = uniform_problem(4, 8)
    bound = makespan_lower_bound(problem)
    assert bound.value == 27.0
    assert device_lower_bound(problem, 3) == 27.0  # (device 0 proves it too: its drain waits on the others)


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
    # Whole round trips do better: F(0, j + 1) waits for W(0, j), which ends 5 ms after F(0, j)
    # starts, so the last F(0) starts at 15 and its own round trip ends at 20, the optimum.
    assert makespan_lower_bound(problem).value == pytest.approx(20.0)
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
    from optpipe.core.schedule import OpKind

    assert paths.head[(OpKind.F, 2)] == 3.0  # two forwards and two hops
    assert paths.head[(OpKind.B, 0)] == 3.0 + 1 + 2 * 1.5  # the last forward, then back
    # after F(0): two hops forward, B(2), two hops back, W(0)
    assert paths.tail[(OpKind.F, 0)] == 1.5 + 1.5 + 1 + 1.5 + 1.5 + 1
    assert paths.gap[2] == 0.0  # the last stage's B may follow its F at once


def test_never_above_a_heuristic_on_the_instances(instance):
    bound = makespan_lower_bound(instance).value
    fitting = [entry for entry in compare(instance) if entry.fits]
    assert fitting  # 1F1B-capped fits any budget, so there is always one to hold the bound against
    for entry in fitting:
        assert entry.judged.makespan_ms >= bound - 1e-6, entry.name


@settings(max_examples=25, deadline=None)
@given(p=st.integers(2, 4), v=st.integers(1, 2), m=st.integers(1, 6),
       f=st.sampled_from([1.0, 2.0, 3.5]), b=st.sampled_from([1.0, 2.5]), w=st.sampled_from([0.5, 1.0]),
       p2p=st.sampled_from([0.0, 0.5]), budget=st.sampled_from([1, 2, 4, 100]), vshape=st.booleans())
def test_never_above_any_fitting_schedule(p, v, m, f, b, w, p2p, budget, vshape):
    placement = Placement.VSHAPE if vshape and v == 2 else Placement.INTERLEAVED
    problem = uniform_problem(p, m, v=v, f=f, b=b, w=w, p2p=p2p, act=100, keep=40, budget=100 * budget,
                              placement=placement)
    bound = makespan_lower_bound(problem).value
    for judged in applicable(compare(problem)):
        # the per-device relaxation holds for every schedule, fitting or not
        relaxed = max(device_lower_bound(problem, d) for d in range(p))
        assert judged.makespan_ms >= relaxed - 1e-6, judged.name
        if judged.fits:
            assert judged.makespan_ms >= bound - 1e-6, judged.name


# --------------------------------------------------------------------------- the budget and the host link

def _slow_link(p: int, m: int, budget: int, ms_each_way: float, v: int = 1):
    """F = B = W = 1 ms, activations of 100 bytes (50 kept for W), transfers of ``ms_each_way``."""
    bandwidth = 100 / ms_each_way * 1e3
    return uniform_problem(p, m, v=v, act=100, keep=50, budget=budget,
                           offload=Offload(True, bandwidth, bandwidth, 10**9))


def test_a_slow_link_cannot_offload_everything():
    # p = 8, m = 16, four activations of budget. Device 0 holds an activation for F + 14 ms of
    # round trip through the later stages + B = 16 ms, or offloaded F + 3 + 3 + B = 8 ms, and its
    # weight part for W: 16 x 1650 = 26,400 byte-ms resident, 16 x 850 offloaded. Within T the
    # link (3 ms per offload, starting after the first F) moves at most (T - 1) / 3 of them, each
    # saving 800: 26,400 - 800 (T - 1) / 3 <= 400 T gives T >= 40, between 34 (a free link) and
    # 66 (no offload).
    # Counting whole activations (packing.py) adds the last W, when none is held whole (41), and
    # the device's ends, where its first and last few ops leave room for fewer pairs: 42.1.
    problem = _slow_link(8, 16, budget=400, ms_each_way=3.0)
    paths = data_paths(problem)
    assert _area_bound(problem.without_offload(), paths, 0).value == pytest.approx(66.0)
    bound = _area_bound(problem, paths, 0)
    assert bound.value == pytest.approx(40.0)
    assert "host link" in bound.reason
    assert memory_area_bound(problem).value == pytest.approx(42.107139, rel=1e-6)


def test_the_link_bound_is_never_below_the_old_area_argument():
    for budget in (100, 150, 250):
        for ms in (0.5, 1.0, 2.0):
            problem = _slow_link(3, 6, budget=budget, ms_each_way=ms)
            old = 0.0  # the per-activation minimum over the budget, the argument before the link was counted
            paths = data_paths(problem)
            for device in range(3):
                area = 0.0
                for s in problem.pipeline.stages_on(device):
                    held = min(1 + paths.gap[s] + 1, 1 + 2 * ms + 1) * 100
                    area += 6 * (held + 50 * 1)
                old = max(old, area / budget)
            assert memory_area_bound(problem).value >= old - 1e-9


# Tiny problems where memory and the link bind, solved to proven optimality by CP-SAT with the
# analytic bound taken out of its model (it would otherwise cut off anything below the bound).
_TINY = [
    dict(p=2, m=3, budget=100, ms=1.0),
    dict(p=2, m=4, budget=100, ms=2.0),
    dict(p=2, m=4, budget=150, ms=1.0),
    dict(p=3, m=3, budget=100, ms=1.0),
    dict(p=3, m=3, budget=200, ms=2.0),
    dict(p=2, m=3, budget=200, ms=1.0, v=2),
]


@pytest.mark.parametrize("case", _TINY, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_never_above_a_proven_optimum(case, monkeypatch):
    from optpipe.solvers import cpsat
    from optpipe.solvers.bounds import Bound
    from optpipe.solvers.result import SolveStatus

    problem = _slow_link(case["p"], case["m"], case["budget"], case["ms"], v=case.get("v", 1))
    bound = makespan_lower_bound(problem).value
    monkeypatch.setattr(cpsat, "makespan_lower_bound", lambda problem: Bound(0.0, "none"))
    result = cpsat.solve_cpsat(problem, time_limit_s=60.0, workers=2, seed=0)
    assert result.status is SolveStatus.OPTIMAL
    assert result.timeline.makespan >= bound - 1e-6
    without = problem.without_offload()
    if memory_lower_bound(without).value <= without.memory.budget:
        plain = cpsat.solve_cpsat(without, time_limit_s=60.0, workers=2, seed=0)
        assert plain.status is SolveStatus.OPTIMAL
        assert plain.timeline.makespan >= makespan_lower_bound(without).value - 1e-6


# Tiny problems where the other devices' work (bounds._other_devices) raises the per-device bound
# above the one-neighbour releases and tails: the proven optimum (no offload, so CP-SAT's
# microbatch order loses nothing) is never below it.
@pytest.mark.parametrize("p, v, m, p2p", [(2, 2, 2, 0.0), (3, 2, 3, 0.0), (3, 2, 3, 0.5)])
def test_other_devices_work_never_above_the_optimum(p, v, m, p2p, monkeypatch):
    from optpipe.solvers import bounds, cpsat
    from optpipe.solvers.bounds import Bound
    from optpipe.solvers.result import SolveStatus

    problem = uniform_problem(p, m, v=v, f=2.0, b=2.0, w=1.0, p2p=p2p)
    bound = makespan_lower_bound(problem).value
    with monkeypatch.context() as patched:
        patched.setattr(bounds, "_other_devices", lambda *args: __import__("collections").defaultdict(list))
        assert makespan_lower_bound(problem).value < bound  # what the other devices' work adds
    monkeypatch.setattr(cpsat, "makespan_lower_bound", lambda problem: Bound(0.0, "none"))
    result = cpsat.solve_cpsat(problem, time_limit_s=60.0, workers=2, seed=0)
    assert result.status is SolveStatus.OPTIMAL
    assert result.timeline.makespan >= bound - 1e-6


def test_whole_activations_force_more_than_their_bytes():
    # p = 4, m = 8, F = B = W = 1: device 0 holds an activation whole for F + 6 + B = 8 ms and its
    # weight part (90 of 100 bytes) for W. The budget holds two whole, one whole and one weight
    # part, or two weight parts; never 2.2 of them, as the bytes alone (35.6 ms) would allow. The
    # covering LP: 2 x + y >= 64 whole-ms, y + 2 z >= 8 weight-ms, z >= 1 (the last W holds no
    # whole activation) gives x + y + z >= 36. The device's ends add that until its second op
    # starts and after its last op begins it holds one pair only: with u ms of one whole and
    # u' of one weight part, u + u' >= 2 and 2 x + y + u >= 64, y + 2 z + u' >= 8 give 37.
    # CP-SAT proves 41 optimal for this problem. (The round trips of fill.py give 38.)
    problem = uniform_problem(4, 8, act=100, keep=90, budget=200)
    paths = data_paths(problem)
    assert _area_bound(problem, paths, 0).value == pytest.approx(35.6)
    packed = _packing_bound(problem, paths, 0)
    assert packed.value == pytest.approx(37.0, rel=1e-6)
    assert "whole activations" in packed.reason
    assert 37.0 < makespan_lower_bound(problem).value <= 41.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(1, 9)), min_size=4, max_size=4),
       st.integers(0, 20), st.integers(1, 3))
def test_the_pricing_knapsack_is_exact(paid, budget, m):
    """The column generation proves the LP optimal only if pricing misses no configuration."""
    import itertools

    from optpipe.solvers.packing import _knapsack

    items = [(pay, size, stage, phase) for (pay, size), (stage, phase) in zip(paid, itertools.product((0, 1), (0, 1)))]
    value, (whole, weight) = _knapsack(items, budget, m, 2)
    best = 0.0
    for counts in itertools.product(*(range(budget // size + 1) for _, size, _, _ in items)):
        per_stage = [sum(c for c, item in zip(counts, items) if item[2] == s) for s in (0, 1)]
        if sum(c * item[1] for c, item in zip(counts, items)) <= budget and max(per_stage) <= m:
            best = max(best, sum(c * item[0] for c, item in zip(counts, items)))
    assert value == pytest.approx(best)
    counts = [(weight if phase else whole)[stage] for _, _, stage, phase in items]
    assert sum(c * item[1] for c, item in zip(counts, items)) <= budget
    assert max(whole[s] + weight[s] for s in (0, 1)) <= m
    assert sum(c * item[0] for c, item in zip(counts, items)) == pytest.approx(value)


def test_a_budget_of_one_activation_holds_back_the_fill():
    # p = 2, m = 2, F = (1, 2), B = (2, 1), W = 1: the budget (150) holds one activation of 100, so
    # device 0 starts its second F only when the first's B(0) has ended, at 1 + 2 + 1 + 2 = 6. That
    # microbatch then needs F(1), B(1), B(0) and W(0): 6 + 2 + 1 + 2 + 1 + 1 = 13 (fill.py), where
    # compute alone gives 10.
    problem = Problem("fill", Pipeline(2, 1, Placement.INTERLEAVED, 2), Costs((1.0, 2.0), (2.0, 1.0), (1.0, 1.0), 0.0),
                      Memory((100, 100), (50, 50), 150))
    assert max(device_lower_bound(problem, d) for d in range(2)) == pytest.approx(10.0)
    assert max(device_lower_bound(problem, d, fitting=True) for d in range(2)) == pytest.approx(13.0)
    bound = makespan_lower_bound(problem)
    assert bound.value == pytest.approx(13.0) and "slowed by the budget" in bound.reason
