"""The whole model on a floor grid (solvers/floor_relax.py): a relaxation whose bound is a proof.

Soundness against brute force is in test_bound_proofs.py; here, what it is for: a problem whose
exact grid is too fine (transfers of odd byte counts) once reported a 9.6% gap after 30 s on two
devices and two microbatches, its whole model solved in 0.1 s on a rounded grid that proves
nothing.
"""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.problem_grid import generated, vshaped
from optpipe.core.problem import Placement, Recompute
from optpipe.core.simulate import simulate
from optpipe.solvers.bounds import makespan_lower_bound
from optpipe.solvers.compile import compile_problem
from optpipe.solvers.floor_relax import floor_relaxation_applies, floor_relaxation_bound
from optpipe.solvers.registry import generate
from optpipe.solvers.result import Judged, SolveStatus
from optpipe.solvers.timegrid import Grid, choose_grid


def _tiny():
    """p = 2, v = 2 in V placement, m = 2, 0.3 of the activations, k = 1.6 (found by a fuzz run)."""
    return vshaped(generated(127, 2, 2, 2, 0.3, 1.6, seed=26))


def test_a_floor_grid_rounds_lengths_down_and_holds_no_release_late():
    grid = Grid(0.3, False, 4, 0.1).floored()
    assert (grid.length(1.0), grid.up(1.0), grid.slack, grid.exact) == (3, 4, 0, False)
    assert Grid(0.3, False, 4, 0.1).length(1.0) == 4
    assert "rounded down" in grid.describe()


def test_it_applies_where_the_grid_proves_nothing_and_the_whole_model_is_small():
    problem = _tiny()
    assert not choose_grid(problem).exact and floor_relaxation_applies(problem)
    assert not floor_relaxation_applies(dataclasses.replace(problem, offload=dataclasses.replace(
        problem.offload, enabled=False)))  # compute costs to 0.01 ms: an exact grid proves already
    assert not floor_relaxation_applies(dataclasses.replace(problem, recompute=Recompute(True)))
    assert not floor_relaxation_applies(generated(0, 4, 2, 16, 0.3, 1.6, seed=0))  # 384 compute ops


def test_it_proves_v_min_optimal_where_the_analytic_bound_is_9_percent_short():
    problem = _tiny()
    schedule = generate("V-Min", problem)
    v_min = Judged("V-Min", schedule, simulate(problem, schedule))
    analytic = makespan_lower_bound(problem)
    assert v_min.fits and analytic.value < 0.91 * v_min.makespan_ms
    bound = floor_relaxation_bound(problem, upper=v_min, floor=analytic, time_limit_s=20.0, workers=1)
    assert bound.value == pytest.approx(v_min.makespan_ms, abs=0.01)
    assert "rounded down" in bound.reason


def test_compile_reports_it_and_stops_at_the_proof():
    compiled = compile_problem(_tiny(), time_limit_s=20.0, workers=2, seed=0)
    assert compiled.status is SolveStatus.OPTIMAL and compiled.gap == 0.0
    assert "meets the lower bound" in compiled.note and "rounded down" in compiled.lower_bound_reason


def test_the_small_benchmark_set_is_fixed_and_within_the_relaxation_size():
    from benchmarks.problem_grid import small

    first, again = small(20, seed=0), small(20, seed=0)
    assert [p.name for p in first] == [p.name for p in again] and len(first) == 20
    assert all(3 * p.stages * p.microbatches <= 160 and p.offload.enabled for p in first)
    assert any(p.pipeline.placement is Placement.VSHAPE for p in first)
