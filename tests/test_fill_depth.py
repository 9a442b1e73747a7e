"""Deeper fills: a reordering of each device's fill that keeps every op, and starts that fit."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.problem_grid import grid
from optpipe.core.problem import Offload
from optpipe.core.schedule import OpKind
from optpipe.core.simulate import simulate
from optpipe.solvers.compare import compare
from optpipe.solvers.fill_depth import deeper_fills, deepened, fill_depth_applies
from optpipe.solvers.registry import get_generator
from optpipe.solvers.result import Judged, fastest_fitting

from conftest import uniform_problem


def _turn(ops, first):
    return next(n for n, op in enumerate(ops) if op.kind is OpKind.F and op.stage != first)


@settings(max_examples=25, deadline=None)
@given(p=st.integers(2, 6), v=st.integers(2, 3), extra=st.integers(1, 4), rounds=st.integers(1, 3))
def test_deepened_lists_the_next_first_chunk_forwards_before_the_second_chunk(p, v, extra, rounds):
    problem = uniform_problem(p, p * rounds, v=v)
    plain = get_generator("1F1B-I").build(problem)
    deep = deepened(plain, extra)
    simulate(problem, deep)  # an order the data can follow
    for before, after in zip(plain.compute_only().devices, deep.devices):
        assert Counter(before) == Counter(after)
        first = min(op.stage for op in before)
        firsts = [op for op in before if op.kind is OpKind.F and op.stage == first]
        ahead = [op for op in after[:_turn(after, first)] if op.kind is OpKind.F and op.stage == first]
        was = [op for op in before[:_turn(before, first)] if op.kind is OpKind.F and op.stage == first]
        assert ahead == firsts[:min(len(firsts), len(was) + extra)]
        # everything else keeps its order
        assert [op for op in after if op not in set(ahead)] == [op for op in before if op not in set(ahead)]


def test_only_small_pipelines_with_several_chunks():
    assert fill_depth_applies(uniform_problem(4, 8, v=2))
    assert not fill_depth_applies(uniform_problem(4, 8, v=1))
    assert not fill_depth_applies(uniform_problem(12, 24, v=2))
    assert deeper_fills(uniform_problem(4, 8, v=1), []) == []


def test_deeper_fills_fit_and_beat_the_fastest_start_where_the_fill_idles():
    """grid04 (p = 6, v = 2, m = 12, k = 0.6): PO-H + W(1) + offload, 837.1 ms, is the fastest
    fitting start; two more first-chunk forwards a device, offloaded, give 820.8."""
    from optpipe.solvers.warmstart import warm_starts

    problem = grid(0, True)[4]
    candidates = warm_starts(problem, compare(problem))
    fastest = fastest_fitting(candidates)
    deeper = deeper_fills(problem, candidates)
    assert deeper and all(j.fits and isinstance(j, Judged) for j in deeper)
    for j in deeper:
        again = simulate(problem, j.schedule)
        assert again.fits and again.makespan == j.timeline.makespan
    assert fastest_fitting(deeper).timeline.makespan < fastest.timeline.makespan - 1.0


def test_no_deeper_fill_without_a_fitting_start():
    problem = uniform_problem(4, 8, v=2, budget=10, offload=Offload(True, 1e5, 1e5, 10**9))
    assert deeper_fills(problem, [j for e in compare(problem) if (j := e.judged) is not None and not j.fits]) == []


def test_a_deepened_start_is_a_family_of_its_own_for_the_restarts():
    from optpipe.solvers.restarts import restarts

    problem = uniform_problem(4, 8, v=2)
    plain = get_generator("1F1B-I").build(problem)
    timeline = simulate(problem, plain)
    original = Judged("PO-H+W(1)", plain.renamed("PO-H+W(1)"), timeline)
    deeper = deepened(plain, 1)
    assert deeper.name.endswith("+fill(1)")
    start = Judged("PO-H+W(1)+fill(1)", deeper.renamed("PO-H+W(1)+fill(1)"), simulate(problem, deeper))
    same_family = Judged("PO-H+offload", plain.renamed("PO-H+offload"), timeline)
    assert restarts(problem, start, [start, original, same_family]) == [original.schedule]
