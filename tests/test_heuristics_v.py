"""ZBV, V-Half and V-Min against the figures of Qi et al. (arXiv 2405.15362).

Units. Memory is counted in chunk activations: ``memory.activation`` of one stage (ACT). A
device of the V-shape placement holds two chunks, so 1F1B on the same model (one stage per
device made of both chunks) holds p whole-device activations on device 0, 2p chunk activations.
Time: every stage costs F = B = W = 1 and p2p = 0, so each device computes 6m and any makespan
above 6m is idle time. 1F1B on the same model idles 6(p-1) (checked below on the merged model).

The paper's own table (reference repository sail-sg/zero-bubble-pipeline-parallelism) gives the
activation memory in whole-device activations: 1F1B p, V-Min (p+4)//3, V-Half (p+2)//2, V-ZB p;
and bubble rates ~p/m, ~2p/3m, ~p/2m and 0, which with 6m of work are idle times of about 6p,
4p, 3p and 0.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from conftest import examples, uniform_problem
from hypothesis import given, settings
from hypothesis import strategies as st

from optpipe.core.errors import NotApplicable
from optpipe.core.problem import Costs, Memory, Placement, Problem
from optpipe.core.schedule import OpKind
from optpipe.core.simulate import Timeline, simulate
from optpipe.solvers.heuristics._vshape_blocks import INTERVAL, REORDERS, _extend, _orders, _short
from optpipe.solvers.heuristics.vshape import V_HALF_BLOCK, V_MIN_BLOCK, ZBV_BLOCK
from optpipe.solvers.registry import generate

NAMES = ["ZBV", "V-Half", "V-Min"]
BLOCKS = {"ZBV": ZBV_BLOCK, "V-Half": V_HALF_BLOCK, "V-Min": V_MIN_BLOCK}
# (8, 32) repeats (4, 16)'s m = 4p at twice the size and costs as much as the rest together: full form only.
CASES = [(4, 8), (4, 16), (6, 12), (8, 16), pytest.param(8, 32, marks=pytest.mark.slow, id="8-32")]
ODD = [(3, 9), (5, 10)]
ACT, KEEP = 100, 50  # uniform_problem's activation and weight_activation


def _vshape(p: int, m: int, **kwargs) -> Problem:
    return uniform_problem(p, m, v=2, placement=Placement.VSHAPE, **kwargs)


def _run(name: str, problem: Problem) -> Timeline:
    return simulate(problem, generate(name, problem))


def _idle(timeline: Timeline, m: int) -> float:
    return timeline.makespan - 6 * m


def _one_f_one_b(p: int, m: int) -> Timeline:
    """1F1B on the same model: one stage per device made of both chunks (costs and memory doubled)."""
    merged = uniform_problem(p, m, f=2.0, b=2.0, w=2.0, act=2 * ACT, keep=2 * KEEP)
    return _run("1F1B", merged)


# --------------------------------------------------------------------------- the blocks


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", range(1, 17))
def test_blocks_repeat_without_collision_and_respect_dependencies(name, p):
    slots = BLOCKS[name].slots(p)
    for f0, f1, b1, b0 in slots:
        assert len({f0 % INTERVAL, f1 % INTERVAL, b1 % INTERVAL, b0 % INTERVAL}) == 4
    assert all(slots[d + 1][0] > slots[d][0] for d in range(p - 1))  # F of chunk 0 walks down
    assert all(slots[d][1] > slots[d + 1][1] for d in range(p - 1))  # F of chunk 1 walks back up
    assert all(slots[d + 1][2] > slots[d][2] for d in range(p - 1))  # B of chunk 1 walks down
    assert all(slots[d][3] > slots[d + 1][3] for d in range(p - 1))  # B of chunk 0 walks back up
    assert slots[p - 1][1] > slots[p - 1][0] and slots[0][2] > slots[0][1] and slots[p - 1][3] > slots[p - 1][2]


@pytest.mark.parametrize("p", range(1, 17))
def test_collision_gaps_match_the_reference_blocks(p):
    """The derived gap gives the reference's blocks: +2 for V-Min when 3 | p, +3 for V-Half when 2 | p."""
    gap_min = 2 if p % 3 == 0 else 0
    gap_half = 3 if p % 2 == 0 else 0
    assert V_MIN_BLOCK.slots(p) == tuple(
        (d, 2 * p - 1 - d, 2 * p + gap_min + d, 4 * p + gap_min - 1 - d) for d in range(p))
    assert V_HALF_BLOCK.slots(p) == tuple(
        (2 * d, 3 * p - 2 - d, 3 * p + gap_half + 2 * d - 1, 6 * p + gap_half - d - 2) for d in range(p))
    assert ZBV_BLOCK.slots(p) == tuple(
        (4 * d, 6 * p - 3 - 2 * d, 6 * p - 2 + 4 * d, 12 * p - 5 - 2 * d) for d in range(p))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_long_orders_repeat_the_steady_state_of_a_short_one(name, p):
    """Orders for many microbatches are built by repeating a shorter order's steady state
    (``_extend``); they are exactly what reordering the whole repeated block gives."""
    short = _short(p)
    for how in REORDERS:
        for keep in ((1,) * 2 * p, (2,) * 2 * p):
            base = _orders(BLOCKS[name], p, short, (2,) * 2 * p, keep, how)
            assert _extend(base, 3) == _orders(BLOCKS[name], p, short + 3, (2,) * 2 * p, keep, how)


# --------------------------------------------------------------------------- every schedule runs


@pytest.mark.parametrize("p, m", CASES + ODD + [(4, 2), (8, 3), (1, 3), (2, 5)])
@pytest.mark.parametrize("name", NAMES)
def test_simulates_with_split_backward(name, p, m):
    problem = _vshape(p, m)
    schedule = generate(name, problem)
    assert schedule.name == name and schedule.splits_backward
    timeline = simulate(problem, schedule)
    assert sum(timeline.busy) == pytest.approx(6 * m * p)


@settings(max_examples=examples(25, ci=5), deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 10), seed=st.integers(0, 10**6), p2p=st.sampled_from([0.0, 0.1, 1.5]))
def test_uneven_costs_and_memory_simulate(p, m, seed, p2p):
    """The order is built in unit slots; any real costs and per-stage sizes must still run."""
    rng = random.Random(seed)
    stages = 2 * p
    costs = Costs(*(tuple(rng.uniform(0.3, 3.0) for _ in range(stages)) for _ in range(3)), p2p=p2p)
    act = tuple(rng.randint(10, 300) for _ in range(stages))
    keep = tuple(rng.randint(0, a) for a in act)
    problem = replace(_vshape(p, m), costs=costs, memory=Memory(act, keep, sum(act) * m))
    for name in NAMES:
        timeline = _run(name, problem)
        assert timeline.peak <= sum(act) * m


# --------------------------------------------------------------------------- ZBV


@pytest.mark.parametrize("p, m", CASES + ODD)
def test_zbv_idles_only_for_the_pipeline_fill(p, m):
    """Makespan 6m + (p-1): the steady state has no idle slot; the first forward reaches device
    p-1 after p-1 slots, and each device idles that long in all (start or end). The paper counts
    this as zero bubble; our bubble ratio is (p-1)/(6m+p-1), 3.0% at (4, 16), 3.5% at (8, 32)."""
    timeline = _run("ZBV", _vshape(p, m))
    assert timeline.makespan == 6 * m + p - 1
    assert timeline.bubble_ratio == pytest.approx((p - 1) / (6 * m + p - 1))
    assert all(timeline.makespan - busy == p - 1 for busy in timeline.busy)


@pytest.mark.parametrize("p, m", CASES + ODD)
def test_zbv_holds_one_f_one_b_memory(p, m):
    timeline = _run("ZBV", _vshape(p, m))
    assert timeline.peak_memory == (2 * p * ACT,) * p
    assert timeline.peak == _one_f_one_b(p, m).peak


@pytest.mark.parametrize("p", [4, 6, 8])
def test_zbv_warmup_is_zb_v(p):
    """Reordering the warm-up gives ZB-V's (arXiv 2401.10241, PyTorch's ScheduleZBVZeroBubble):
    device d first runs 2(p-d)-1 forwards of chunk 0, then the first forward of chunk 1."""
    schedule = generate("ZBV", _vshape(p, 4 * p))
    for d, ops in enumerate(schedule.devices):
        warmup = 2 * (p - d) - 1
        assert all(op.kind is OpKind.F and op.stage == d for op in ops[:warmup])
        assert (ops[warmup].kind, ops[warmup].stage, ops[warmup].microbatch) == (OpKind.F, 2 * p - 1 - d, 0)


# --------------------------------------------------------------------------- V-Half and V-Min


@pytest.mark.parametrize("keep", [KEEP, ACT])
@pytest.mark.parametrize("p, m", CASES + ODD)
def test_v_half_memory_is_the_papers_count(p, m, keep):
    """(p+2)//2 whole-device activations: 3/4 of 1F1B's at p = 4, 5/8 at p = 8, tending to 1/2.
    It holds whether B frees half the activation or (keep = ACT, as the reference code counts)
    nothing until W."""
    timeline = _run("V-Half", _vshape(p, m, keep=keep))
    assert timeline.peak == 2 * ((p + 2) // 2) * ACT
    assert timeline.peak < _one_f_one_b(p, m).peak


@pytest.mark.parametrize("p, m", CASES + ODD + [(12, 24)])
def test_v_min_memory_is_the_papers_count(p, m):
    """(p+4)//3 whole-device activations when B frees nothing until W (the reference code's
    count): 1/2 of 1F1B's at p = 4 and 8, 5/12 at p = 12, a third as p grows. Our default,
    where B frees half the activation, can hold one chunk activation less (7, not 8, at p = 8)."""
    exact = _run("V-Min", _vshape(p, m, keep=ACT))
    assert exact.peak == 2 * ((p + 4) // 3) * ACT
    assert _run("V-Min", _vshape(p, m)).peak <= exact.peak


@pytest.mark.parametrize("p, m", CASES + ODD)
def test_bubbles_against_one_f_one_b_and_the_paper(p, m):
    """Idle time above 6m: 1F1B's 6(p-1); V-Half at most half of it and below the paper's ~3p
    (here 3p-7 for even p, 3p-4 for odd); V-Min at most two thirds and below the paper's ~4p
    (here 4p-5, 4p-7 when 3 | p, as the authors' generator gives; at p = 3 that ties V-Half). Ours sit a
    little under the paper's leading terms because the warm-up and
    cool-down are reordered; the table's figures ignore those ends."""
    baseline = _idle(_one_f_one_b(p, m), m)
    assert baseline == 6 * (p - 1)
    half, least = _idle(_run("V-Half", _vshape(p, m)), m), _idle(_run("V-Min", _vshape(p, m)), m)
    assert half <= baseline / 2 and half <= 3 * p
    assert least <= baseline * 2 / 3 and least <= 4 * p
    assert half == (3 * p - 7 if p % 2 == 0 else 3 * p - 4)
    assert least == (4 * p - 7 if p % 3 == 0 else 4 * p - 5)
    assert _idle(_run("ZBV", _vshape(p, m)), m) < half <= least


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", [4, 6, 8])
def test_steady_state_has_no_idle_slot(name, p):
    """Eight more microbatches add exactly 8 x 6 units: every repeat of the block is dense."""
    short, long = _run(name, _vshape(p, 2 * p)), _run(name, _vshape(p, 2 * p + 8))
    assert long.makespan - short.makespan == 48


# --------------------------------------------------------------------------- where they apply


OUTSIDE = [(1, Placement.INTERLEAVED), (2, Placement.INTERLEAVED), (3, Placement.VSHAPE)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("v, placement", OUTSIDE)
def test_not_applicable_outside_the_v_shape(name, v, placement):
    problem = uniform_problem(4, 8, v=v, placement=placement)
    with pytest.raises(NotApplicable) as error:
        generate(name, problem)
    message = str(error.value)
    assert name in message and 'placement = "vshape"' in message and "chunks_per_device = 2" in message
    assert f"{v} chunk(s) per device" in message


@pytest.mark.parametrize("name", NAMES)
def test_benchmark_instances(name, instance):
    pipe = instance.pipeline
    if pipe.placement is not Placement.VSHAPE:
        with pytest.raises(NotApplicable, match="vshape"):
            generate(name, instance)
        return
    timeline = _run(name, instance)
    assert timeline.makespan > 0 and timeline.peak > 0
