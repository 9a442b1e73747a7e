"""Warm starts: the most promising variants first, the same list in the same order whatever was cut."""

from __future__ import annotations

import time

from optpipe.core.problem import Offload
from optpipe.solvers.compare import compare
from optpipe.solvers.warmstart import warm_starts

from conftest import uniform_problem

# p = 4, v = 2, m = 8, F = B = W = 1 ms; a link of 1.5 ms each way and a budget below PO-H's peak.
PROBLEM = uniform_problem(4, 8, v=2, act=100, keep=50, budget=500, offload=Offload(True, 100 / 1.5 * 1e3,
                                                                                  100 / 1.5 * 1e3, 10**9))


def _names(candidates):
    return [c.name for c in candidates]


def test_the_heuristics_come_first_and_alone_past_the_deadline():
    entries = compare(PROBLEM)
    whole = _names(warm_starts(PROBLEM, entries))
    plain = [e.name for e in entries if e.applicable] + ["one-at-a-time"]
    assert whole[:len(plain)] == plain
    cut = _names(warm_starts(PROBLEM, entries, deadline=time.monotonic() - 1))
    assert cut == plain  # past the deadline: the heuristics as they are
    assert len(whole) > len(plain)


def test_no_variant_starts_that_its_expected_length_would_carry_past_the_deadline():
    entries = compare(PROBLEM)
    plain = [e.name for e in entries if e.applicable] + ["one-at-a-time"]
    soon = time.monotonic() + 5.0  # far more than this problem's variants take, far less than 60 s
    assert len(warm_starts(PROBLEM, entries, deadline=soon)) > len(plain)
    assert _names(warm_starts(PROBLEM, entries, deadline=soon, step_s=60.0)) == plain


def test_stops_once_a_fitting_start_meets_the_bound():
    entries = compare(PROBLEM)
    fastest = min(e.judged.makespan_ms for e in entries if e.fits)
    met = warm_starts(PROBLEM, entries, bound_ms=fastest)
    assert _names(met) == [e.name for e in entries if e.applicable] + ["one-at-a-time"]
    assert len(warm_starts(PROBLEM, entries, bound_ms=0.0)) > len(met)


def test_fitting_heuristics_are_filled_before_the_offloaded_versions_are_built():
    """A fitting heuristic with memory to spare is W-filled right after the fastest one: at
    p >= 24 the offloaded versions of every heuristic can take the whole warm-start share."""
    from optpipe.solvers.compare import applicable
    from optpipe.solvers.warmstart import _Build

    entries = compare(PROBLEM)
    build = _Build(PROBLEM, applicable(entries), None, None)
    assert build.fill_fastest() and build.fill_fitting()
    fitting = [j.name for j in build.plain if j.fits and j.name != build.plain[build.fastest[0]].name]
    assert fitting  # the case the test is about
    names = {j.name for _, j in build.built}
    assert all(f"{name}+W(1)" in names for name in fitting)
    assert not any(name.endswith("+offload") and "+W(" not in name for name in names)  # offload_each not run yet
    whole = _names(warm_starts(PROBLEM, entries))
    assert len(whole) == len(set(whole))  # fill_others does not fill them again


def test_group_sizes_between_gis_h_and_gis_are_tried_and_can_give_the_fastest_start():
    """p = 6, v = 2, m = 12, uneven costs, a link of k = 1.6 and 0.3 of 1F1B-I's activations: GIS
    with a group of 4 (between GIS-H's 3 and GIS's 6), W-filled and offloaded, is the fastest
    fitting start (1,151.8 ms; the best without it 1,162.1)."""
    from benchmarks.problem_grid import generated

    from optpipe.core.simulate import simulate

    problem = generated(0, 6, 2, 12, 0.3, 1.6, seed=2)
    candidates = warm_starts(problem, compare(problem))
    groups = {c.name.split("+")[0] for c in candidates if c.name.startswith("GIS(g=")}
    # the groups between, then GIS-H's group and the fastest between with the first chunk 1 to 4 ahead
    leads = {f"GIS(g={g},lead={lead})" for g in (3, 4) for lead in (1, 2, 3, 4)}
    assert groups == {"GIS(g=4)", "GIS(g=5)"} | leads
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: c.makespan_ms)
    assert fitting[0].name.startswith("GIS(g=")
    others = [c for c in fitting if not c.name.startswith("GIS(g=")]
    assert fitting[0].makespan_ms < others[0].makespan_ms - 1.0
    assert simulate(problem, fitting[0].schedule).makespan == fitting[0].makespan_ms  # the simulator's verdict


def test_group_sizes_come_first_on_wide_pipelines_with_few_microbatches():
    """From p = 24 on, the fastest heuristic's variants can take the whole warm-start share, so
    the GIS group sizes are built first; with many microbatches a device they stay in place."""
    from benchmarks.problem_grid import generated

    from optpipe.solvers.warmstart import _Build, _steps

    wide, deep, narrow = (generated(0, p, 2, m, 0.3, 1.6, seed=0) for p, m in ((24, 48), (32, 256), (8, 32)))
    assert _steps(wide, capped=True)[0] is _Build.groups
    for problem in (deep, narrow):
        steps = _steps(problem, capped=True)
        assert steps[:3] == (_Build.fill_fastest, _Build.capped, _Build.groups)
    # the same steps, less the looser W-filling caps from 16 devices on
    assert set(_steps(wide, capped=False)) == set(_steps(narrow, capped=False)) - {_Build.fill_looser}
    assert _Build.fill_looser in _steps(narrow, capped=True) and _Build.fill_looser not in _steps(deep, capped=True)


def test_group_sizes_need_interleaved_chunks():
    single = uniform_problem(6, 12, v=1, act=100, keep=50, budget=400,
                             offload=Offload(True, 100 / 1.5 * 1e3, 100 / 1.5 * 1e3, 10**9))
    assert not any(c.name.startswith("GIS(g=") for c in warm_starts(single, compare(single)))


def test_the_capped_list_schedule_can_be_left_to_compile():
    """Under a tight budget compile builds the capped offloading schedule before the repairs;
    warm starts then leave it out rather than build it twice."""
    entries = compare(PROBLEM)
    assert any(c.name.startswith("capped-offload(") for c in warm_starts(PROBLEM, entries))
    assert not any(c.name.startswith("capped-offload(") for c in warm_starts(PROBLEM, entries, capped=False))
