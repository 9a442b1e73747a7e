"""The idle a budget forces before a device's first backward and after its last forward and
its last backward (solvers/phases.py): tight where a schedule meets it, and never above an optimum (issue 11).

Every case here is one where this bound is above every other analytic bound, so each check
tests this argument and no other. Without offload and recompute, CP-SAT's optimum is the
optimum over all schedules (design.md: renaming by rank keeps every wait and the peak), so a
bound above it would be wrong; the analytic bound is taken out of CP-SAT's model first, since
the model uses it as a floor.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem, Recompute
from optpipe.core.problem_file import load_problem
from optpipe.core.schedule import Schedule
from optpipe.core.simulate import simulate
from optpipe.solvers import cpsat
from optpipe.solvers.bounds import Bound, data_paths, device_lower_bound, makespan_lower_bound, memory_area_bound
from optpipe.solvers.compare import best_fitting, compare
from optpipe.solvers.phases import _Item, _knapsack_dual, _most_work, phase_idle
from optpipe.solvers.registry import generate
from optpipe.solvers.result import SolveStatus

from conftest import PROBLEM_DIR, examples
from test_bound_proofs import _BOTH, brute_force

_EPS = 1e-6


def _phase(problem: Problem) -> float:
    paths = data_paths(problem)
    return max(phase_idle(problem, d, paths.head, paths.tail).value for d in range(problem.devices))


def _others(problem: Problem) -> float:
    paths = data_paths(problem)
    return max(max(device_lower_bound(problem, d, paths, fitting=True) for d in range(problem.devices)),
               memory_area_bound(problem, paths).value)


def test_zero_bubble_h1_is_optimal_on_the_zero_bubble_profile():
    """p = 8, m = 32, 8 activations of budget, no offload: device 0 holds 8 forwards (148 ms)
    before the first backward can come back (283.1 ms), and after its last forward pending
    microbatches bring at most 7 x 27.4 ms into the 264.6 ms round trip. ZB-H1 idles exactly
    that long: it is optimal, and compile proves it at once."""
    problem = load_problem(PROBLEM_DIR / "zb15b-p8-m32.toml")
    zb = simulate(problem, generate("ZB-H1", problem))
    paths = data_paths(problem)
    ends = phase_idle(problem, 0, paths.head, paths.tail)
    assert ends.warm_up == pytest.approx(283.1 - 8 * 18.5)
    assert ends.drain == pytest.approx(264.6 - 7 * 27.4)
    assert zb.fits and ends.value == pytest.approx(zb.makespan)
    assert makespan_lower_bound(problem).value == pytest.approx(zb.makespan)
    assert "before its first backward" in makespan_lower_bound(problem).reason
    assert _others(problem) < zb.makespan - 70


def _problem(p, v, placement, m, f, b, w, act, keep, budget, offload=None, recompute=None, p2p=0.0) -> Problem:
    return Problem("phases", Pipeline(p, v, placement, m), Costs(f, b, w, p2p), Memory(act, keep, budget),
                   offload or Offload(), recompute or Recompute())


_I, _V = Placement.INTERLEAVED, Placement.VSHAPE
# (problem, CP-SAT's optimum): found by a seeded search for problems where this bound is the largest.
OPTIMA = [
    (_problem(3, 1, _I, 4, (2.0, 2.0, 2.0), (2.0, 1.0, 2.0), (2.0, 2.0, 1.0), (100, 80, 80), (90, 8, 40), 200), 32.0),
    (_problem(3, 1, _I, 3, (2.0, 3.0, 2.0), (3.0, 1.0, 2.0), (1.0, 2.0, 1.0), (100, 100, 80), (50, 10, 40), 200), 28.0),
    (_problem(2, 2, _I, 3, (2.0, 2.0, 3.0, 1.0), (2.0, 3.0, 3.0, 3.0), (2.0, 2.0, 1.0, 1.0), (100, 80, 100, 80),
              (50, 72, 90, 8), 300), 45.0),
    (_problem(3, 2, _V, 4, (1.0, 2.0, 1.0, 1.0, 1.0, 1.0), (1.0, 3.0, 3.0, 3.0, 2.0, 1.0), (1.0, 1.0, 2.0, 1.0, 1.0, 1.0),
              (100, 100, 100, 100, 80, 80), (10, 10, 50, 50, 8, 8), 300), 53.0),
    (_problem(2, 2, _I, 4, (2.0, 3.0, 2.0, 1.0), (3.0, 1.0, 1.0, 1.0), (1.0, 1.0, 2.0, 2.0), (100, 80, 100, 80),
              (50, 40, 90, 72), 400, Offload(True, 1e4, 1e4, 10**9)), 45.0),
    # the last backward's window binds
    (_problem(3, 1, _I, 4, (1.0, 1.0, 2.0), (2.0, 2.0, 3.0), (1.0, 1.0, 1.0), (100, 80, 100), (50, 72, 90), 200,
              Offload(True, 4e5, 1e5, 10**9)), 29.0),
    (_problem(3, 1, _I, 4, (1.0, 2.0, 2.0), (2.0, 3.0, 3.0), (3.0, 2.0, 2.0), (100, 100, 100), (50, 90, 50), 200,
              Offload(True, 1e5, 4e5, 10**9)), 33.0),
]


@pytest.mark.parametrize("problem, optimum", OPTIMA, ids=[f"case{k}" for k in range(len(OPTIMA))])
def test_never_above_the_cpsat_optimum(problem, optimum, monkeypatch):
    monkeypatch.setattr(cpsat, "makespan_lower_bound", lambda problem: Bound(0.0, "none"))
    # hinted as compile hints it: unhinted, case 4 took 36 s for a first solution once a transfer
    # could start right after a later microbatch's (cpsat_tight.py)
    hint = best_fitting(compare(problem))
    result = cpsat.solve_cpsat(problem, time_limit_s=20.0, workers=1, seed=0, hint=hint.schedule if hint else None)
    assert result.status is SolveStatus.OPTIMAL and result.makespan_ms == pytest.approx(optimum)
    assert _phase(problem) <= optimum + _EPS and _others(problem) <= optimum + _EPS


# Cases 1 and 3 no longer: there the fill's round trips (fill.py) prove as much (28 and 51 ms).
@pytest.mark.parametrize("index", [0, 2, 4, 5, 6])
def test_the_phases_prove_more_than_the_other_bounds(index):
    problem, _ = OPTIMA[index]
    assert _others(problem) < _phase(problem)


def test_tight_where_a_schedule_meets_it():
    """Case 0: 32 ms, what CP-SAT proves optimal, is what the bound says."""
    problem, optimum = OPTIMA[0]
    assert _phase(problem) == pytest.approx(optimum)


_costs = st.sampled_from([1.0, 2.0, 3.0])


@settings(max_examples=examples(60, ci=12), deadline=None)
@given(f=st.tuples(_costs, _costs), b=st.tuples(_costs, _costs), w=st.tuples(st.sampled_from([0.5, 1.0, 2.0]), _costs),
       keep=st.tuples(st.sampled_from([10, 50, 90]), st.sampled_from([10, 50, 90])),
       budget=st.sampled_from([100, 140, 150, 190, 200]), fate=st.sampled_from(["keep", "offload", "recompute"]),
       bandwidth=st.sampled_from([2e4, 5e4, 4e5]), p2p=st.sampled_from([0.0, 2.0]))
def test_never_above_the_brute_force_optimum(f, b, w, keep, budget, fate, bandwidth, p2p):
    """p = 2, m = 2: every schedule the simulator accepts, listed (test_bound_proofs.py), with
    stage 0's activations kept, offloaded or recomputed in every combination; a slow p2p makes
    the warm-up long beside the offloads, where device 0's burst counts."""
    offload = Offload(True, bandwidth, bandwidth, 10**9) if fate == "offload" else None
    recompute = Recompute(True, f, (20, 20)) if fate == "recompute" else None
    problem = _problem(2, 1, _I, 2, f, b, w, (100, 100), keep, budget, offload, recompute, p2p)
    free = {} if fate == "keep" else {(0, i): ("keep", fate) if fate == "recompute" else _BOTH for i in range(2)}
    brute = brute_force(problem, free)
    if brute.schedule is not None:
        assert _phase(problem) <= brute.makespan_ms + _EPS, brute.schedule.to_text()


def test_offload_frees_the_ends_but_not_the_weight_parts():
    """zb15b at half the budget offloads in 18.3 ms, less than a forward: the warm-up and the
    drain need not idle. But after the last device's last B, the 7 B passes below it and W(0)
    take 140.2 ms, and only W passes are left for it: its own, and those whose 209.4 MiB weight
    parts fit beside the last B's 418.9 MiB activation in 1675 MiB (5 of them), 55.8 ms in all."""
    problem = load_problem(PROBLEM_DIR / "zb15b-p8-m32-half.toml")
    paths = data_paths(problem)
    ends = [phase_idle(problem, d, paths.head, paths.tail) for d in range(problem.devices)]
    assert all(e.warm_up == 0.0 and e.drain == 0.0 for e in ends)
    assert ends[7].last == pytest.approx(7 * 18.1 + 7 * 0.6 + 9.3 - 6 * 9.3)
    assert makespan_lower_bound(problem).value == pytest.approx(133.7 + 32 * 45.9 + ends[7].last)
    assert _others(problem) < ends[7].value - 70


# Compiled once (60 s): its makespan is the bound, so both are optimal. Device 3 ends with
# B3:7 and the three W passes whose weight parts fit beside B3:7's activation.
BALANCED_TIGHT_OPTIMUM = Schedule.from_text("optimum", """
d0: F0:0 OFF0:0 F0:1 OFF0:1 F0:2 OFF0:2 F0:3 OFF0:3 F0:4 OFF0:4 F0:5 OFF0:5 F0:6 OFF0:6 REL0:0 REL0:1 B0:0 W0:0 REL0:2 B0:1 W0:1 F0:7 OFF0:7 B0:2 REL0:3 W0:2 B0:3 REL0:4 W0:3 B0:4 REL0:5 W0:4 B0:5 REL0:6 W0:5 B0:6 REL0:7 W0:6 B0:7 W0:7
d1: F1:0 OFF1:0 F1:1 OFF1:1 F1:2 OFF1:2 F1:3 OFF1:3 F1:4 OFF1:4 F1:5 OFF1:5 REL1:0 B1:0 REL1:1 B1:1 W1:0 F1:6 OFF1:6 W1:1 REL1:2 F1:7 OFF1:7 B1:2 REL1:3 W1:2 B1:3 REL1:4 W1:3 B1:4 REL1:5 W1:4 B1:5 REL1:6 W1:5 B1:6 REL1:7 W1:6 B1:7 W1:7
d2: F2:0 OFF2:0 F2:1 OFF2:1 F2:2 OFF2:2 F2:3 OFF2:3 REL2:0 REL2:1 B2:0 B2:1 F2:4 OFF2:4 W2:0 F2:5 OFF2:5 W2:1 REL2:2 F2:6 OFF2:6 B2:2 REL2:3 W2:2 REL2:4 B2:3 B2:4 F2:7 OFF2:7 W2:3 REL2:5 B2:5 REL2:6 W2:4 B2:6 REL2:7 W2:5 B2:7 W2:6 W2:7
d3: F3:0 B3:0 F3:1 B3:1 F3:2 B3:2 W3:0 W3:1 F3:3 B3:3 W3:2 F3:4 B3:4 W3:3 F3:5 B3:5 W3:4 F3:6 B3:6 F3:7 B3:7 W3:5 W3:6 W3:7
""")


def test_the_last_backward_holds_its_activation_beside_the_deferred_weight_parts():
    """p = 4, m = 8, F = B = W = 20, budget 458 MiB: after device 3's last B, 81.5 ms of backward
    passes below it and W(0); beside B's 228.9 MiB activation only two 114.4 MiB weight parts
    fit, so three W passes (60 ms) are left and 21.5 ms are idle: 61.5 + 480 + 21.5 = 563 ms,
    which this schedule takes."""
    problem = load_problem(PROBLEM_DIR / "balanced-p4-m8-tight.toml")
    timeline = simulate(problem, BALANCED_TIGHT_OPTIMUM)
    assert timeline.fits and timeline.makespan == pytest.approx(563.0)
    paths = data_paths(problem)
    assert phase_idle(problem, 3, paths.head, paths.tail).last == pytest.approx(81.5 - 60.0)
    assert makespan_lower_bound(problem).value == pytest.approx(563.0)


_item = st.builds(lambda size, work: _Item(size, work), st.integers(1, 120), st.floats(0.5, 30.0))


@settings(max_examples=examples(300, ci=60), deadline=None)
@given(groups=st.lists(st.tuples(st.integers(0, 4), st.lists(_item, min_size=1, max_size=2)), min_size=1, max_size=3),
       capacity=st.integers(0, 400))
def test_the_knapsack_is_the_best_whole_choice(groups, capacity):
    """Every way to take whole items, listed: _most_work finds the best, and the LP's bound is above it."""
    choices = []
    for count, items in groups:
        options = [(0, 0.0)]
        for n in range(count + 1):
            for extra in range(count - n + 1 if len(items) > 1 else 1):
                if n or extra:
                    size = n * items[0].bytes + (extra * items[1].bytes if extra else 0)
                    options.append((size, n * items[0].work + (extra * items[1].work if extra else 0.0)))
        choices.append(options)
    best = max((sum(w for _, w in pick) for pick in itertools.product(*choices)
                if sum(size for size, _ in pick) <= capacity), default=0.0)
    assert _most_work(groups, capacity) == pytest.approx(best)
    assert _knapsack_dual(groups, capacity) >= best - 1e-9


def test_device_0_cannot_pace_its_warm_up_to_a_slow_link():
    """p = 2, m = 2, one activation and a half of budget, 1.5 ms offloads, p2p 2 ms: stage 0's
    forwards wait for nothing, so the second would start at 1 ms holding both activations (the
    first's offload ends at 2.5). Device 0 runs one forward and waits for the round trip, 6 ms
    (the offload argument alone, pacing forwards to the link, says 1.5); the brute force's
    optimum, 16.5 ms, meets every bound."""
    problem = _problem(2, 1, _I, 2, (1.0, 1.0), (1.0, 1.0), (0.5, 0.5), (100, 100), (50, 50), 150,
                       Offload(True, 100 / 1.5e-3, 100 / 1.5e-3, 10**9), p2p=2.0)
    paths = data_paths(problem)
    device0 = phase_idle(problem, 0, paths.head, paths.tail)
    assert device0.before_backward == pytest.approx(6.0)
    assert device0.forwards_first == float("inf")  # one forward in the burst: not both before a backward
    brute = brute_force(problem, {(0, i): _BOTH for i in range(2)})
    assert brute.makespan_ms == pytest.approx(16.5)
    assert _phase(problem) == pytest.approx(13.5) and makespan_lower_bound(problem).value <= 16.5 + _EPS
