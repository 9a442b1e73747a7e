"""Every reported lower bound is a proof: never above a brute-force optimum on tiny problems (issue 11).

The brute force lists every schedule the simulator accepts for a tiny problem (p = 2, v = 1):
per device, every interleaving of each (stage, microbatch)'s own chain F [OFF REL | RC] B W, in
and out of microbatch order, for every fate of every pair it is asked about, and lets the
simulator judge each. CP-SAT's model only searches schedules that run each stage's
microbatches in order (solvers/cpsat_model.py); its proven bound must still hold for all of
them, and so must every analytic bound.

Two shortcuts keep the lists small and lose no schedule the bound must hold for: an OFF
listed right after a REL (no compute between) starts as it would listed before it, so only
one of the two orders is kept; and REL is listed after its OFF (its data waits for OFF's end,
so an earlier issue point changes nothing). Larger fate sets are tried one pair at a time.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optpipe.core.errors import ScheduleError
from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem, Recompute
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import simulate
from optpipe.solvers.bounds import Bound, device_lower_bound, makespan_lower_bound, memory_lower_bound
from optpipe.solvers.compile import compile_problem
from optpipe.solvers.cpsat import solve_cpsat
from optpipe.solvers.fill_relax import fed_applies, fed_bound
from optpipe.solvers.floor_relax import floor_relaxation_bound
from optpipe.solvers.result import Judged, SolveStatus
from optpipe.solvers.timegrid import choose_grid

from conftest import examples, uniform_problem

F, B, W, OFF, REL, RC = OpKind.F, OpKind.B, OpKind.W, OpKind.OFFLOAD, OpKind.RELOAD, OpKind.RECOMPUTE
_MIDDLE = {"keep": (), "offload": (OFF, REL), "recompute": (RC,)}
_EPS = 1e-6


@dataclass(frozen=True)
class Brute:
    """What the enumeration saw: the fastest fitting schedule and the smallest peak of any."""

    makespan_ms: float
    schedule: Schedule | None
    smallest_peak: int
    schedules: int


def _interleavings(chains: list[list[Op]]):
    """Every merge of the chains that keeps each chain's own order."""
    chains = [c for c in chains if c]
    if not chains:
        yield []
        return
    for k, chain in enumerate(chains):
        for tail in _interleavings(chains[:k] + [chain[1:]] + chains[k + 1:]):
            yield [chain[0]] + tail


def _canonical(ops: list[Op]) -> bool:
    return not any(a.kind is REL and b.kind is OFF for a, b in zip(ops, ops[1:]))


def brute_force(problem: Problem, free: dict[tuple[int, int], tuple[str, ...]]) -> Brute:
    """Every per-device order for every fate in ``free`` (pairs not named are kept)."""
    pairs = sorted(free)
    best, best_schedule, smallest, count = float("inf"), None, None, 0
    for choice in itertools.product(*(free[pair] for pair in pairs)):
        fate = dict(zip(pairs, choice))
        rows = []
        for d in range(problem.devices):
            chains = [[Op(k, s, i) for k in (F, *_MIDDLE[fate.get((s, i), "keep")], B, W)]
                      for s in problem.pipeline.stages_on(d) for i in range(problem.microbatches)]
            rows.append([ops for ops in _interleavings(chains) if _canonical(ops)])
        for lists in itertools.product(*rows):
            schedule = Schedule.of("brute", lists)
            try:
                timeline = simulate(problem, schedule)
            except ScheduleError:  # a deadlock across devices
                continue
            count += 1
            smallest = timeline.peak if smallest is None else min(smallest, timeline.peak)
            if timeline.fits and timeline.makespan < best:
                best, best_schedule = timeline.makespan, schedule
    return Brute(best, best_schedule, smallest, count)


def _problem(m: int, f, b, w, act, keep, budget: int, offload: Offload | None = None,
             recompute: Recompute | None = None, p2p: float = 0.0) -> Problem:
    return Problem("brute", Pipeline(2, 1, Placement.INTERLEAVED, m), Costs(f, b, w, p2p),
                   Memory(act, keep, budget), offload or Offload(), recompute or Recompute())


_BOTH = ("keep", "offload")
# (name, problem, the fates the brute force tries per pair). Uneven stage costs throughout; the
# budgets bind (the unbounded optimum is faster than what fits).
CASES = [
    ("keep-m2", _problem(2, (1.0, 2.0), (2.0, 1.0), (1.0, 1.0), (100, 100), (50, 50), 150), {}),
    ("keep-m2-p2p", _problem(2, (2.0, 1.0), (1.0, 3.0), (1.0, 2.0), (100, 60), (30, 10), 130, p2p=1.0), {}),
    ("offload-stage0-m2", _problem(2, (1.0, 2.0), (2.0, 1.0), (1.0, 1.0), (100, 100), (50, 50), 100,
                                   Offload(True, 1e5, 1e5, 10**9)), {(0, 0): _BOTH, (0, 1): _BOTH}),
    ("offload-host-m2", _problem(2, (1.0, 1.0), (1.0, 1.0), (0.5, 0.5), (100, 50), (10, 10), 110,
                                 Offload(True, 2e5, 2e5, 100)), {(0, 0): _BOTH, (0, 1): _BOTH}),
    ("recompute-stage0-m2", _problem(2, (1.0, 2.0), (2.0, 1.0), (1.0, 1.0), (100, 100), (50, 50), 100,
                                     recompute=Recompute(True, (1.0, 2.0), (10, 10))),
     {(0, 0): ("keep", "recompute"), (0, 1): ("keep", "recompute")}),
    # Only whole activations fit (packing.py): an activation and another's weight part exceed the
    # budget, so device 0 runs its microbatches one after another, whatever the bytes allow.
    ("whole-m2", _problem(2, (1.0, 2.0), (2.0, 1.0), (1.0, 1.0), (100, 100), (90, 90), 150), {}),
    ("whole-offload-m2", _problem(2, (1.0, 2.0), (2.0, 1.0), (1.0, 1.0), (100, 100), (90, 90), 150,
                                  Offload(True, 1e5, 1e5, 10**9)), {(0, 0): _BOTH, (0, 1): _BOTH}),
    ("whole-p2p-m2", _problem(2, (1.0, 1.0), (1.0, 1.0), (2.0, 1.0), (100, 80), (60, 70), 170, p2p=0.5), {}),
    ("link-group-m2", _problem(2, (1.0, 2.0), (2.0, 1.0), (1.0, 1.0), (100, 100), (50, 50), 120,
                               Offload(True, 1e5, 1e5, 10**9, ((0, 1),))), {(0, 0): _BOTH, (1, 0): _BOTH}),
]


@pytest.fixture(scope="module", params=CASES, ids=[case[0] for case in CASES])
def case(request):
    name, problem, free = request.param
    return problem, brute_force(problem, free), free


def test_the_brute_force_finds_a_fitting_schedule(case):
    _, brute, _ = case
    assert brute.schedule is not None and brute.schedules > 0


def test_no_analytic_bound_above_the_brute_force_optimum(case):
    problem, brute, _ = case
    assert makespan_lower_bound(problem).value <= brute.makespan_ms + _EPS
    assert max(device_lower_bound(problem, d) for d in range(problem.devices)) <= brute.makespan_ms + _EPS
    assert memory_lower_bound(problem).value <= brute.smallest_peak


_ms = st.sampled_from([0.5, 1.0, 2.0, 3.0])


@settings(max_examples=examples(40, ci=10), deadline=None)
@given(f=st.tuples(_ms, _ms), b=st.tuples(_ms, _ms), w=st.tuples(_ms, _ms),
       keep=st.tuples(st.sampled_from([10, 60, 90]), st.sampled_from([10, 60, 90])),
       budget=st.sampled_from([100, 130, 160, 190]), offload=st.booleans(), p2p=st.sampled_from([0.0, 1.0]))
def test_no_analytic_bound_above_the_brute_force_optimum_at_random(f, b, w, keep, budget, offload, p2p):
    """Where one or two pairs fit, the budget's arguments (area, whole activations, the phases)
    bind: every schedule, stage 0 kept or offloaded, is listed, at random costs."""
    link = Offload(True, 1e5, 1e5, 10**9) if offload else None
    problem = _problem(2, f, b, w, (100, 100), keep, budget, link, p2p=p2p)
    brute = brute_force(problem, {(0, i): _BOTH for i in range(2)} if offload else {})
    if brute.schedule is not None:
        assert makespan_lower_bound(problem).value <= brute.makespan_ms + _EPS, brute.schedule.to_text()


def test_cpsat_proven_bound_not_above_the_brute_force_optimum(case):
    """CP-SAT proves optimality among microbatch-ordered schedules; the brute force tries the
    others too. Where the brute force covers every fate, the two optima are equal."""
    problem, brute, free = case
    assert choose_grid(problem, None).exact  # so compile would report CP-SAT's bound
    result = solve_cpsat(problem, time_limit_s=20.0, workers=1, seed=0)
    assert result.status is SolveStatus.OPTIMAL
    assert result.lower_bound_ms <= brute.makespan_ms + _EPS, brute.schedule.to_text()
    if not free or not (problem.offload.enabled or problem.recompute.enabled):
        assert result.makespan_ms == pytest.approx(brute.makespan_ms)


@pytest.mark.parametrize("resolution_ms", [0.3, 0.7])
def test_floor_relaxation_bound_not_above_the_brute_force_optimum(case, resolution_ms):
    """The whole model with every length rounded down to a unit that divides none of them
    (floor_relax.py) proves a bound that every schedule, in microbatch order or not, meets."""
    problem, brute, _ = case
    if problem.recompute.enabled:
        pytest.skip("the floor relaxation leaves recompute out")
    assert not choose_grid(problem, resolution_ms).exact
    upper = Judged("brute", brute.schedule, simulate(problem, brute.schedule))
    bound = floor_relaxation_bound(problem, upper=upper, floor=Bound(0.0, "-"), time_limit_s=20.0, workers=1,
                                   resolution_ms=resolution_ms)
    assert 0.0 < bound.value <= brute.makespan_ms + _EPS, brute.schedule.to_text()


def test_fed_ends_bound_not_above_the_brute_force_optimum(case):
    """Each device's ends solved with the devices that feed it (fill_relax.py), against every
    order, in microbatch order or not, and every fate of the pairs."""
    problem, brute, _ = case
    if not fed_applies(problem):
        pytest.skip("the fed ends leave recompute out")
    bound = fed_bound(problem, floor=Bound(0.0, "-"), time_limit_s=4.0, workers=1)
    assert 0.0 < bound.value <= brute.makespan_ms + _EPS, brute.schedule.to_text()


def test_out_of_order_schedules_are_in_the_enumeration():
    """The brute force is not the model: it lists a stage running microbatch 1 before 0."""
    chains = [[Op(k, 1, i) for k in (F, B, W)] for i in range(2)]
    orders = [ops for ops in _interleavings(chains)]
    assert len(orders) == 20  # 6! / (3! 3!)
    assert {tuple(op.microbatch for op in ops if op.kind is kind) for ops in orders for kind in (F, B, W)} == {
        (0, 1), (1, 0)}


# --------------------------------------------------------------------------- a shared link

# p = 2, m = 4, a shared host link and a host budget of two stage-0 activations. Before the
# shared-link tightness fix (cpsat_tight.py) CP-SAT's full model called 24 ms optimal, yet this
# schedule (in microbatch order, only device 0 transfers) fits and takes 23; random walks from the
# model's optimum found it. Now CP-SAT finds 23 ms and proves it.
SHARED = _problem(4, (1.0, 2.0), (2.0, 1.0), (2.0, 2.0), (50, 60), (10, 10), 130,
                  Offload(True, 1e5, 1e5, 100, ((0, 1),)), p2p=1.0)
FASTER_THAN_CPSAT = Schedule.from_text("faster", """
d0: F0:0 OFF0:0 F0:1 OFF0:1 F0:2 REL0:0 B0:0 REL0:1 W0:0 B0:1 F0:3 W0:1 B0:2 W0:2 B0:3 W0:3
d1: F1:0 B1:0 F1:1 B1:1 W1:0 F1:2 B1:2 F1:3 B1:3 W1:1 W1:2 W1:3
""")


def test_cpsat_proof_on_a_shared_link_holds_against_a_schedule_it_once_missed():
    faster = simulate(SHARED, FASTER_THAN_CPSAT)
    assert faster.fits and faster.makespan == pytest.approx(23.0)
    assert makespan_lower_bound(SHARED).value <= faster.makespan
    result = solve_cpsat(SHARED, time_limit_s=20.0, workers=1, seed=0)
    assert result.lower_bound_ms <= faster.makespan + _EPS
    assert result.status is SolveStatus.OPTIMAL and result.makespan_ms == pytest.approx(faster.makespan)


def test_floor_relaxation_holds_against_the_schedule_cpsat_once_missed():
    faster = simulate(SHARED, FASTER_THAN_CPSAT)
    for resolution_ms in (0.3, 0.7):
        bound = floor_relaxation_bound(SHARED, upper=Judged("faster", FASTER_THAN_CPSAT, faster),
                                       floor=Bound(0.0, "-"), time_limit_s=20.0, workers=1,
                                       resolution_ms=resolution_ms)
        assert bound.value <= faster.makespan + _EPS


def test_compile_reports_no_bound_above_a_fitting_schedule_on_a_shared_link():
    compiled = compile_problem(SHARED, time_limit_s=2.0, workers=1, seed=0)
    assert compiled.lower_bound_ms <= simulate(SHARED, FASTER_THAN_CPSAT).makespan + _EPS
    if compiled.status is SolveStatus.OPTIMAL:
        assert compiled.makespan_ms <= compiled.lower_bound_ms + _EPS


@settings(max_examples=examples(16, ci=6), deadline=None)
@given(p=st.integers(2, 3), v=st.integers(1, 2), m=st.integers(3, 4), f=_ms, b=_ms, w=_ms,
       keep=st.sampled_from([10, 50, 90]), room=st.sampled_from([0, 40, 100, 150]))
def test_round_trip_releases_not_above_the_optimum_without_offload(p, v, m, f, b, w, keep, room):
    """With room for few activations, a forward waits for earlier microbatches' round trips
    (fill.py); without offload CP-SAT's in-order optimum is every schedule's optimum."""
    problem = uniform_problem(p, m, v=v, f=f, b=b * 1.5, w=w, keep=keep, budget=100 * v + room)
    result = solve_cpsat(problem, time_limit_s=20.0, workers=1, seed=0)
    if result.status is SolveStatus.OPTIMAL:
        assert makespan_lower_bound(problem).value <= result.makespan_ms + _EPS
