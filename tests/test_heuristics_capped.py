"""1F1B-capped: fits any budget of at least one activation, and is 1F1B when nothing binds."""

from __future__ import annotations

import pytest
from conftest import examples, uniform_problem
from hypothesis import given, settings
from hypothesis import strategies as st

from optpipe.core.errors import NotApplicable
from optpipe.core.problem import Placement
from optpipe.core.simulate import simulate
from optpipe.solvers import generate


@pytest.mark.parametrize("p, m", [(4, 8), (8, 32), (5, 3)])
@pytest.mark.parametrize("cap", [1, 2, 3, 5, 100])
def test_fits_every_budget(p, m, cap):
    problem = uniform_problem(p, m, act=100, keep=50, budget=100 * cap)
    timeline = simulate(problem, generate("1F1B-capped", problem))
    assert timeline.peak <= 100 * cap
    assert timeline.fits


@pytest.mark.parametrize("p, m", [(4, 8), (8, 32), (3, 2)])
def test_runs_like_1f1b_when_the_budget_allows(p, m):
    problem = uniform_problem(p, m, budget=100 * m)
    assert simulate(problem, generate("1F1B-capped", problem)).makespan == pytest.approx((m + p - 1) * 3)


def test_tighter_budget_costs_time_and_one_in_flight_is_sequential():
    times = [simulate(problem, generate("1F1B-capped", problem)).makespan
             for problem in (uniform_problem(8, 32, budget=100 * c) for c in (8, 6, 4, 2, 1))]
    assert times == sorted(times) and times[0] < times[-1]
    assert times[-1] == pytest.approx(32 * 8 * 3)  # each microbatch crosses the pipeline and back alone


def test_beats_a_strict_short_warm_up():
    """One fewer in flight than 1F1B must not cost much: the list schedule fills the gaps."""
    problem = uniform_problem(8, 32, budget=700)
    assert simulate(problem, generate("1F1B-capped", problem)).makespan < 1.25 * (32 + 7) * 3


@settings(max_examples=examples(40, ci=15), deadline=None)
@given(p=st.integers(1, 5), v=st.integers(1, 2), m=st.integers(1, 8), cap=st.integers(1, 12),
       vshape=st.booleans(), p2p=st.sampled_from([0.0, 0.3]))
def test_any_placement_fits_and_simulates(p, v, m, cap, vshape, p2p):
    placement = Placement.VSHAPE if vshape and v == 2 else Placement.INTERLEAVED
    problem = uniform_problem(p, m, v=v, placement=placement, budget=100 * cap, p2p=p2p)
    if cap < v:  # one microbatch's v chunk activations are live at once on a device
        with pytest.raises(NotApplicable, match="no schedule without offload fits"):
            generate("1F1B-capped", problem)
        return
    assert simulate(problem, generate("1F1B-capped", problem)).fits
