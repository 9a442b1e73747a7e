"""What compile searches from: the heuristics, repaired and varied, each phase within its share
of the time limit, every phase named on the live line.

1. Judge the heuristics (compare.py) within a quarter of the time limit: past it the costly ones
   are left out once one fits (at p = 64, m = 512 they take over a minute).
2. Under a tight budget (every fitting heuristic far slower than the fastest), the capped
   offloading list schedule and the nearly fitting heuristics repaired, first; from 12 devices
   on, the fastest of those with the W passes on its critical path deferred into later idle
   gaps (wdefer.py) at once: the repaired heuristic defers further than the variants' starts.
3. The warm-start variants (warmstart.py): W-filled, offloaded, GIS's group sizes.
4. The fastest that still overflow, repaired (repair.py), with what is left of the repair share;
   then, below 12 devices with two or more chunks per device, the fastest fitting starts with
   deeper fills (fill_depth.py).
5. From 12 devices on, the fastest that fits and has not been deferred, deferred, within a share
   of its own (more where simulations are slow): where the window search barely runs (p = 32,
   m = 256) the passes are what moves the start. From 16 devices on, passes from the next
   starts of other compute orders follow on both cores, up to the bound's reserve
   (defer_starts.py): where a pass ends depends on its start.

``starts`` (schedules compile was given: a plan compiled earlier, or for a smaller budget) join
the candidates as they are and are repaired with the rest.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from optpipe.core.problem import Problem
from optpipe.core.schedule import Schedule
from optpipe.core.simulate import simulate

from .bounds import Bound
from .capped_offload import capped_offload_starts
from .compare import Entry, applicable, best_fitting, compare
from .defer_starts import deferred as deferred_start, deferred_starts
from .fill_depth import deeper_fills, fill_depth_applies
from .repair import REACH, repair_candidates
from .result import Judged, Progress, fastest_fitting
from .warmstart import warm_starts
from .wdefer import pays

__all__ = ["MIN_STEP_S", "build_starts", "early_starts", "simulate_s", "tight"]

# Of the time limit, for building the heuristics: past it the costly ones are left out, once one
# fits (compare.py). At p = 64, v = 2, m = 512 they took 70 s (ZB-I's variants alone 47 s), and a
# 30 s limit returned after 77 s with 1F1B-capped at twice the bound; the small ones take
# milliseconds and p = 32, m = 256 about 13 s, so below that scale nothing changes at 60 s.
_HEURISTICS_SHARE = 0.25
# Of the time limit, at most, for building warm starts; from _WIDE devices on, where the window
# search moves a start by well under 1% in 60 s (grid20, p = 24: 5,572.1 -> 5,556.6 ms) and the GIS
# group sizes need about 9 s to give 5,447.5, the larger share. Below, the share stays as it was:
# the larger one was measured to pay only there.
_WARM_SHARE, _WIDE_WARM_SHARE, _WIDE = 0.3, 0.45, 16
_WARM_AFTER = 0.2  # ... or this much after the heuristics, when they took longer (within the limit)
_REPAIR_SHARE = 0.6  # ... and for repairing the overflowing ones (large problems overrun the warm share,
_REPAIR_AFTER = 0.4  # so at least this much of the time limit after the warm starts, within the limit)
_EARLY_REPAIR, _FAR_SLOWER = 0.35, 1.5  # repair the plain heuristics first for this much of the limit when
# the fastest fitting one is this much slower than the fastest (tight budgets; tight)
MIN_STEP_S = 0.05  # a repair round takes longer than this on the smallest problems
# Of the time limit, at most, for deferring the fastest start's critical W passes (wdefer.py; it
# stops by itself once no round pays): on the 60 s schedules of grid20 (p = 24, m = 48) it takes
# 7.5 s from 5,437.2 ms to 5,327.4, and of grid24 (p = 32, m = 256, 0.4 s a round) 25.5 s from
# 27,381.2 to 26,714.6. The warm-start variants and the repairs stop this long before the limit:
# at p = 32, m = 256 they ran up to it in one grid run (27,381.2 ms returned undeferred).
_DEFER_SHARE = 0.25
# ... or, where simulations are slow, this many of them (one a round), up to _DEFER_MOST of the
# limit: grid24's pass ends after about 50 rounds (24 s at 0.46 s a simulation, 26,708.3 ms), and
# at 60 s the quarter left it at 26,826.2 after 15 s. Below p = 32, m = 256 the quarter is more.
_DEFER_ROUNDS, _DEFER_MOST = 60, 0.5
# Under a tight budget the repaired heuristic is deferred first, for up to this much of the limit
# (the pass stops by itself when no round pays): on grid22 (p = 32, v = 2, m = 64) PO-H repaired
# (4,369.5 ms) defers to 4,100.6 in 34 s, where the variants' fastest start, GIS(g = 25) repaired
# (4,314.4), reaches only 4,245.6 in 27 s; at 60 s compile had deferred the latter alone, from
# 45 s, to 4,265.6 (6.9% above the bound). The share counts from the end of the heuristics'
# share: once they came in under it (repair.REACH), a pass from their end had 30 s (4,115.1 ms),
# one to 45 s 39 s (4,102.1).
_EARLY_DEFER_SHARE = 0.5
# ... and then the fastest start not yet deferred (defer_starts.py); from _WIDE devices on, where
# the window search moves no start in a 60 s compile (grid17, 19 and 20 returned their deferred
# start as it was), up to this many starts, until _BOUND_RESERVE of the limit is left for the
# bound's relaxations (a few seconds there).
_DEFER_STARTS, _BOUND_RESERVE = 6, 0.1
# Of the time limit, at most, for the deeper fills (fill_depth.py): on the grid's rows they apply to
# (p <= 8) they took 0.1 to 1.1 s.
_FILL_SHARE = 0.05
# A warm-start variant takes about this many simulations (W-filling ZB-I at p = 32, m = 256: 18 in
# 8.6 s); none is started that could not end before the variants' deadline.
_VARIANT_SIMS = 10
# W deferral stops this many simulations before the limit: its last round runs past its deadline,
# and compile simulates the answer again. At p = 64, m = 512 (2 s a simulation), passes that ran
# up to the limit returned after 65.9 s at 60 and 128.9 s at 120.
_SETTLE_SIMS = 4


def build_starts(problem: Problem, starts: Sequence[Schedule], bound: Bound, clock: tuple[float, float],
                 report: Callable[[Progress], None]) -> tuple[list[Entry], list[Judged]]:
    """The heuristics (compare's entries) and every candidate start, fitting or not, by the
    phases above; ``clock``: (when compile began, its time limit)."""
    began, time_limit_s = clock
    end = began + time_limit_s
    entries = compare(problem, deadline=began + _HEURISTICS_SHARE * time_limit_s,
                      peak_cap=REACH * problem.memory.budget, on_built=_heuristics_line(report, bound, began))
    phase = lambda message, best: report(Progress(  # noqa: E731
        time.monotonic() - began, best.timeline.makespan if best else None, bound.value, f"warm starts: {message}"))
    baseline = best_fitting(entries)
    if tight(problem, entries):
        phase("repairing the nearly fitting heuristics", baseline)
    heuristics = applicable(entries)
    simulation_s = simulate_s(problem, heuristics[0].schedule) if heuristics else 0.0
    settle = end - _SETTLE_SIMS * simulation_s  # a pass's last round, and compile's checks after, end by the limit
    # the early repairs end there too: at p = 64, m = 512, on a slow run of the heuristics (40 s of
    # 60), repairs to the limit left compile's checks 3.4 s past it
    early = early_starts(problem, entries, min(settle, time.monotonic() + _EARLY_REPAIR * time_limit_s))
    # from 12 devices on W deferral moves the start most: the phases before it leave it its share
    reserve = _defer_reserve(problem, time_limit_s, simulation_s)
    repaired = fastest_fitting(early or [])
    deferred_first = None  # the start deferred before the variants
    if repaired is not None and pays(problem) and end - time.monotonic() > MIN_STEP_S:
        # under a tight budget the repaired heuristic defers furthest: its own pass, before the variants
        phase("deferring the W passes of the repaired heuristic", repaired)
        deferred_first = repaired.name
        # half the limit from where the heuristics' share ends: time they save goes to this pass
        heuristics_end = max(time.monotonic(), began + _HEURISTICS_SHARE * time_limit_s)
        deferred = deferred_start(problem, repaired, min(settle, heuristics_end + _EARLY_DEFER_SHARE * time_limit_s))
        if deferred is not None:
            early.append(deferred)
    warm_until = min(_warm_until(problem, began, time_limit_s), max(time.monotonic(), end - reserve))
    given = [Judged(f"given:{start.name}", start, simulate(problem, start)) for start in starts]
    phase("W-filled and offloaded variants", fastest_fitting([*given, *(early or []), *([baseline] if baseline else [])]))
    candidates = given + warm_starts(problem, entries, deadline=warm_until, bound_ms=bound.value,
                                     capped=early is None, step_s=_VARIANT_SIMS * simulation_s) + (early or [])
    now = time.monotonic()
    if end - now > MIN_STEP_S:  # with no time left, the heuristics as they are
        phase("repairing the fastest that overflow", fastest_fitting(candidates))
        repair_until = min(end, max(began + _REPAIR_SHARE * time_limit_s, now + _REPAIR_AFTER * time_limit_s),
                           max(now, end - reserve))
        repaired_early = {e.name for e in entries} if early is not None else set()
        candidates += repair_candidates(problem, [c for c in candidates if c.fits or c.name not in repaired_early],
                                        deadline=repair_until)
    if fill_depth_applies(problem) and end - time.monotonic() > MIN_STEP_S:
        phase("deeper fills", fastest_fitting(candidates))
        fill_until = min(end, time.monotonic() + _FILL_SHARE * time_limit_s)
        candidates += deeper_fills(problem, candidates, deadline=fill_until)
    if pays(problem) and end - time.monotonic() > MIN_STEP_S:
        phase("deferring the W passes on the critical path", fastest_fitting(candidates))
        until = min(settle, time.monotonic() + reserve)
        # from 16 devices on the window search moves no start: the next starts' passes get its time
        later = min(settle, end - _BOUND_RESERVE * time_limit_s)
        candidates += deferred_starts(problem, candidates, deferred_first, (until, later),
                                      _DEFER_STARTS if problem.devices >= _WIDE else 1, simulation_s, phase)
    return entries, candidates


def simulate_s(problem: Problem, schedule: Schedule) -> float:
    """How long one simulation of ``schedule`` takes here (s): what the phases that simulate
    once a round, and compile's check of its answer, must leave time for."""
    began = time.monotonic()
    simulate(problem, schedule)
    return time.monotonic() - began


def _defer_reserve(problem: Problem, time_limit_s: float, simulation_s: float) -> float:
    """The time W deferral is kept (s): _DEFER_SHARE of the limit, or _DEFER_ROUNDS simulations
    where that is more, up to _DEFER_MOST; 0 where compile does not defer."""
    if not pays(problem):
        return 0.0
    return max(_DEFER_SHARE * time_limit_s, min(_DEFER_MOST * time_limit_s, _DEFER_ROUNDS * simulation_s))


def _heuristics_line(report: Callable[[Progress], None], bound: Bound,
                     began: float) -> Callable[[Entry, int, int], None]:
    """compare's progress as live lines: at p = 64, m = 512 the heuristics take tens of seconds."""
    fastest = float("inf")

    def built(entry: Entry, k: int, n: int) -> None:
        nonlocal fastest
        if entry.fits:
            fastest = min(fastest, entry.judged.timeline.makespan)
        incumbent = fastest if fastest < float("inf") else None
        report(Progress(time.monotonic() - began, incumbent, bound.value, f"heuristics: {entry.name} ({k} of {n})"))

    return built


def _warm_until(problem: Problem, began: float, time_limit_s: float) -> float:
    """When warm-start building stops. The share counts from the start, but at p >= 24 the
    heuristics alone can take most of it: the most promising variants (warmstart.py) still get a
    floor share after them."""
    share = _WIDE_WARM_SHARE if problem.devices >= _WIDE else _WARM_SHARE
    return min(began + time_limit_s, max(began + share * time_limit_s, time.monotonic() + _WARM_AFTER * time_limit_s))


def tight(problem: Problem, entries: list[Entry]) -> bool:
    """Every fitting heuristic far slower than the fastest (or none fits), with offload on."""
    plain = applicable(entries)
    if not plain or not problem.offload.enabled:
        return False
    fitting = fastest_fitting(plain)
    return fitting is None or fitting.timeline.makespan > _FAR_SLOWER * min(c.timeline.makespan for c in plain)


def early_starts(problem: Problem, entries: list[Entry], deadline: float) -> list[Judged] | None:
    """Under a tight budget, before the warm-start variants take their share: the capped
    offloading list schedule (capped_offload.py; about 2 s on the 7B-like problem, where at
    0.6x of PO-H's peak it gives 2,932.5 ms and PO-H repaired 3,654.0; skipped at p >= 24), then
    the nearly fitting heuristics repaired (repair.py; at p >= 24 one round of offloads often
    makes PO-H fit, and the variants may take all the time there is). None when the budget is not
    tight or there is no time: the warm starts then build the capped schedule in their turn."""
    if not tight(problem, entries) or deadline - time.monotonic() <= MIN_STEP_S:
        return None
    capped = capped_offload_starts(problem, deadline)
    return capped + repair_candidates(problem, applicable(entries) + capped, deadline=deadline)
