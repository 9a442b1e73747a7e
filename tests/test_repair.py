"""Repair: fast schedules that overflow the budget made to fit, judged by the simulator."""

from __future__ import annotations

from collections import Counter

import pytest

from optpipe.core.problem import Offload
from optpipe.core.schedule import OpKind
from optpipe.core.simulate import simulate
from optpipe.solvers.compare import compare
from optpipe.solvers.compile import compile_problem
from optpipe.solvers.registry import generate
from optpipe.solvers.repair import excess, hold_back, repair, repair_candidates
from optpipe.solvers.warmstart import warm_starts

from conftest import uniform_problem

# p = 4, v = 2, m = 8, F = B = W = 1 ms; activations of 100 bytes (50 kept for W) and a link that
# takes 1.5 ms each way: PO-H offloads half the stages and still holds several activations.
LINK = Offload(True, 100 / 1.5 * 1e3, 100 / 1.5 * 1e3, 10**9)


def _problem(budget: int | None = None, offload: bool = True):
    return uniform_problem(4, 8, v=2, act=100, keep=50, budget=budget, offload=LINK if offload else None)


def _peak(problem, name: str) -> int:
    return simulate(problem, generate(name, problem)).peak


def _same_ops_same_orders(before, after) -> None:
    for old, new in zip(before.devices, after.devices):
        assert Counter(old) == Counter(new)
        for keep in ({OpKind.F}, {OpKind.B, OpKind.W, OpKind.BW}):
            assert [op for op in old if op.kind in keep] == [op for op in new if op.kind in keep]


@pytest.mark.parametrize("factor", [0.999, 0.9, 0.75])
@pytest.mark.parametrize("policy", ["hidden", "all", "none"])
def test_po_h_repaired_under_its_own_peak(factor, policy):
    base = _problem()
    problem = base.with_budget(int(_peak(base, "PO-H") * factor))
    schedule = generate("PO-H", problem)
    assert not simulate(problem, schedule).fits
    repaired = repair(problem, schedule, policy, max_step=1)
    assert repaired is not None
    timeline = simulate(problem, repaired.schedule)  # the simulator, not the repair, says it fits
    assert timeline.fits
    assert timeline.makespan == pytest.approx(repaired.timeline.makespan)
    capped = simulate(problem, generate("1F1B-capped", problem))
    assert timeline.makespan <= capped.makespan


def test_repair_without_offload_holds_back_forwards():
    base = _problem(offload=False)
    problem = base.with_budget(int(_peak(base, "GIS-H") * 0.8))
    schedule = generate("GIS-H", problem)
    repaired = repair(problem, schedule, "none")
    assert repaired is not None and repaired.fits
    _same_ops_same_orders(schedule, repaired.schedule)


def test_hold_back_keeps_every_op_and_both_orders():
    base = _problem(offload=False)
    problem = base.with_budget(int(_peak(base, "GIS") * 0.7))
    schedule = generate("GIS", problem)
    timeline = simulate(problem, schedule)
    moved = hold_back(problem, schedule, timeline, range(problem.devices))
    _same_ops_same_orders(schedule, moved)
    assert moved.devices != schedule.devices
    assert excess(simulate(problem, moved)) < excess(timeline)


def test_a_fitting_schedule_comes_back_as_it_is():
    problem = _problem()
    schedule = generate("PO-H", problem)
    repaired = repair(problem, schedule)
    assert repaired is not None and repaired.schedule.devices == schedule.devices


def test_candidates_fit_and_beat_the_capped_schedule():
    # at 0.6 x PO-H's peak no warm start fits but the capped ones (129 ms at best); PO-H repaired: 76
    base = _problem()
    problem = base.with_budget(int(_peak(base, "PO-H") * 0.6))
    entries = compare(problem)
    candidates = warm_starts(problem, entries)
    repaired = repair_candidates(problem, candidates)
    assert repaired
    assert all(c.fits for c in repaired)
    assert [c.timeline.makespan for c in repaired] == sorted(c.timeline.makespan for c in repaired)
    fitting = min(c.timeline.makespan for c in candidates if c.fits)
    assert repaired[0].timeline.makespan < fitting


def test_compile_starts_from_a_repaired_schedule():
    base = _problem()
    problem = base.with_budget(int(_peak(base, "PO-H") * 0.6))
    compiled = compile_problem(problem, time_limit_s=3.0, workers=2)
    capped = simulate(problem, generate("1F1B-capped", problem))
    assert compiled.judged.fits
    assert compiled.makespan_ms < capped.makespan
    assert compiled.makespan_ms >= compiled.lower_bound_ms - 1e-6


def test_zb_h1_repaired_by_pulling_its_deferred_weight_passes():
    # v = 1: the last device's forwards cannot pass their own backwards; what it holds over the
    # budget is the weight part of deferred W passes, which must run earlier instead.
    base = uniform_problem(4, 8, act=100, keep=90, offload=LINK)
    problem = base.with_budget(int(_peak(base, "ZB-H1") * 0.6))
    schedule = generate("ZB-H1", problem)
    assert not simulate(problem, schedule).fits
    repaired = repair(problem, schedule, "all", max_step=1)
    assert repaired is not None and simulate(problem, repaired.schedule).fits


def test_hiding_offloads_past_the_deadline_ends_the_repair(monkeypatch):
    # at p = 64, m = 512 hiding a round's offloads took minutes; out of time it gives up (None)
    import optpipe.solvers.repair as repair_module

    base = _problem()
    problem = base.with_budget(int(_peak(base, "PO-H") * 0.9))
    schedule = generate("PO-H", problem)
    assert repair(problem, schedule, "hidden", max_step=1) is not None
    asked = []

    def out_of_time(problem, schedule, pairs, deadline=None):
        asked.append(deadline)
        return None

    monkeypatch.setattr(repair_module, "add_hidden_offloads", out_of_time)
    deadline = 10**9.0  # far off: only the placement runs out of time
    assert repair(problem, schedule, "hidden", deadline, max_step=1) is None
    assert asked and set(asked) == {deadline}


def test_starts_after_the_first_three_are_repaired_when_time_allows():
    # p = 4, v = 2, m = 8 at 0.85 x PO-H's peak: none of the three fastest overflowing starts
    # repairs faster than the fitting candidates; a later one (GIS(g = 3) offloaded) does.
    base = _problem()
    problem = base.with_budget(int(_peak(base, "PO-H") * 0.85))
    candidates = warm_starts(problem, compare(problem))
    fitting = min(c.timeline.makespan for c in candidates if c.fits)
    assert not repair_candidates(problem, candidates, more=0)
    repaired = repair_candidates(problem, candidates)
    assert repaired and all(c.fits for c in repaired)
    assert repaired[0].timeline.makespan < fitting


def test_where_rounds_are_slow_the_first_round_that_fits_ends_the_repairs(monkeypatch):
    # at p = 32, m = 256 a round takes a second; there the time goes to W deferral instead
    import time

    import optpipe.solvers.repair as repair_module

    base = _problem()
    problem = base.with_budget(int(_peak(base, "PO-H") * 0.5))
    candidates = warm_starts(problem, compare(problem))
    every = repair_candidates(problem, candidates, deadline=time.monotonic() + 60)
    monkeypatch.setattr(repair_module, "_MAX_ROUNDS", 10**7)  # 64 rounds' time now exceeds any deadline
    first = repair_candidates(problem, candidates, deadline=time.monotonic() + 60)
    assert first and all(c.fits and c.name.endswith("+repaired(all, step 1)") for c in first)
    assert {c.name for c in first} < {c.name for c in every}
