"""W deferral from several starts: distinct orders, fastest first, and a second process that can only add."""

from __future__ import annotations

import os
import time

import pytest

from optpipe.core.simulate import simulate
from optpipe.solvers import defer_starts, registry
from optpipe.solvers.defer_starts import DEFERRED, deferred_starts
from optpipe.solvers.result import Judged


def _problem_and_candidates():
    """grid204 (p = 4, v = 3, m = 4, k = 3, uneven costs) with room for GIS: GIS fits at 610.0 ms,
    GIS-H and PO-H at 646.0, 1F1B-I (655.7) overflows by 7%."""
    from benchmarks.problem_grid import small

    problem = small(5)[4]
    schedules = {name: registry.generate(name, problem) for name in ("GIS", "GIS-H", "PO-H", "1F1B-I")}
    problem = problem.with_budget(simulate(problem, schedules["GIS"]).peak)
    return problem, [Judged(name, s, simulate(problem, s)) for name, s in schedules.items()]


PROBLEM, CANDIDATES = _problem_and_candidates()


@pytest.fixture
def within(monkeypatch):
    """Every candidate within reach of GIS (the module's 5% leaves this small case one start)."""
    monkeypatch.setattr(defer_starts, "_WITHIN", 1.1)


def _order(judged):
    return judged.schedule.compute_only().devices


def test_the_pool_is_the_fastest_fitting_start_then_other_orders_fastest_first(within):
    pool = defer_starts._pool(PROBLEM, CANDIDATES, skip=None)
    assert pool[0].name == "GIS" and pool[0].fits
    assert len({_order(c) for c in pool}) == len(pool)  # offloaded variants of one order count once
    assert [c.timeline.makespan for c in pool[1:]] == sorted(c.timeline.makespan for c in pool[1:])
    assert "1F1B-I" in [c.name for c in pool] and not simulate(PROBLEM, CANDIDATES[3].schedule).fits
    fastest = min(c.timeline.makespan for c in CANDIDATES if c.fits)
    assert all(c.timeline.makespan <= 1.1 * fastest for c in pool)


def test_the_pool_leaves_out_the_start_deferred_already_far_slower_ones_and_deferred_ones(within, monkeypatch):
    assert "GIS" not in [c.name for c in defer_starts._pool(PROBLEM, CANDIDATES, skip="GIS")]
    renamed = [Judged(c.name + DEFERRED, c.schedule, c.timeline) if c.name == "GIS-H" else c for c in CANDIDATES]
    assert all(not c.name.endswith(DEFERRED) for c in defer_starts._pool(PROBLEM, renamed, skip=None))
    monkeypatch.setattr(defer_starts, "_WITHIN", 1.0)
    assert [c.name for c in defer_starts._pool(PROBLEM, CANDIDATES, skip=None)] == ["GIS"]


def _made(fork: bool, monkeypatch) -> list[Judged]:
    if not fork:
        monkeypatch.setattr(defer_starts.multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    said = []
    out = deferred_starts(PROBLEM, CANDIDATES, None, (time.monotonic() + 60,) * 2, 3, 0.0,
                          lambda message, best: said.append((message, best)))
    assert said and all(best is not None for _, best in said)  # the live line keeps an incumbent
    return out


def test_passes_from_several_starts_fit_and_the_other_process_s_count(within, monkeypatch):
    made = _made(True, monkeypatch)
    assert made and all(c.fits and c.timeline.makespan == simulate(PROBLEM, c.schedule).makespan for c in made)
    names = [c.name for c in made]
    assert "GIS" + DEFERRED in names  # this process: the first start (610.0 ms to 599.7 when written)
    assert any(n.startswith("GIS-H") for n in names)  # the forked one: the second
    by_name = {c.name: c for c in CANDIDATES}
    for c in made:
        if c.name.endswith(DEFERRED):
            start = c.name[:-len(DEFERRED)]
            assert c.timeline.makespan < by_name.get(start, c).timeline.makespan or start not in by_name


def test_without_fork_the_same_passes_run_here(within, monkeypatch):
    forked = {(c.name, round(c.timeline.makespan, 6)) for c in _made(True, monkeypatch)}
    assert {(c.name, round(c.timeline.makespan, 6)) for c in _made(False, monkeypatch)} == forked


def test_a_failing_other_process_leaves_this_one_s_passes(within, monkeypatch):
    parent, real = os.getpid(), defer_starts.deferred

    def failing_there(problem, start, deadline):
        if os.getpid() != parent:
            raise RuntimeError("the forked pass failed")
        return real(problem, start, deadline)

    monkeypatch.setattr(defer_starts, "deferred", failing_there)
    names = [c.name for c in _made(True, monkeypatch)]
    assert "GIS" + DEFERRED in names and not any(n.startswith("GIS-H") for n in names)


def test_a_passed_deadline_makes_nothing_and_the_later_starts_keep_their_own(within):
    assert deferred_starts(PROBLEM, CANDIDATES, None, (time.monotonic() - 1,) * 2, 3, 0.0, lambda *_: None) == []
    first_only = deferred_starts(PROBLEM, CANDIDATES, None, (time.monotonic() + 60, time.monotonic() - 1), 3, 0.0,
                                 lambda *_: None)
    assert [c.name for c in first_only] == ["GIS" + DEFERRED]


def test_a_late_other_process_is_not_waited_for_past_the_deadline(within, monkeypatch):
    parent, real = os.getpid(), defer_starts.deferred

    def late_there(problem, start, deadline):
        if os.getpid() != parent:
            time.sleep(30)
        return real(problem, start, deadline)

    monkeypatch.setattr(defer_starts, "deferred", late_there)
    began = time.monotonic()
    made = deferred_starts(PROBLEM, CANDIDATES, None, (began + 2.0,) * 2, 3, 0.0, lambda *_: None)
    assert time.monotonic() - began < 6.0  # the deadline, the forked process stopped, and no more
    names = [c.name for c in made]
    assert "GIS" + DEFERRED in names and not any(n.startswith("GIS-H") for n in names)
