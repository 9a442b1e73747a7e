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


def test_stops_once_a_fitting_start_meets_the_bound():
    entries = compare(PROBLEM)
    fastest = min(e.judged.makespan_ms for e in entries if e.fits)
    met = warm_starts(PROBLEM, entries, bound_ms=fastest)
    assert _names(met) == [e.name for e in entries if e.applicable] + ["one-at-a-time"]
    assert len(warm_starts(PROBLEM, entries, bound_ms=0.0)) > len(met)
