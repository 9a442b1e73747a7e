"""Recomputation in schedules (issue 14): where a RECOMPUTE op goes, and which pairs get one.

``add_recomputes`` puts RECOMPUTE(s, i) right before the backward of (s, i) on its device: it
re-takes the activation from its start, so the later it starts the less time the memory is
held, and right before B nothing can run between them. Pairs already offloaded are left alone
(an activation is kept, offloaded or recomputed).

``trade_for_offloads`` takes any fitting schedule and moves recomputed pairs to the host where
the simulator says that is faster within the budget: "recompute only what the link cannot hide".
``flip_decisions`` is the window search's move on the choices themselves (lns.py): one pair at a
time kept, offloaded or recomputed instead, kept when the simulator says no worse and fits.
``mixed_neighbour`` is one such change that makes a pure schedule use both ways of freeing
memory: the first solution of compile's search among mixes (compile.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from optpipe.core.errors import ProblemError, ScheduleError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.semantics import TOLERANCE_MS
from optpipe.core.simulate import simulate, try_simulate

from .offload_slots import activation_windows, add_offloads, round_trip_ms

__all__ = ["add_recomputes", "require_recompute", "trade_for_offloads", "flip_decisions", "mixed_neighbour"]

_B, _BW, _RC = OpKind.B, OpKind.BW, OpKind.RECOMPUTE


def require_recompute(problem: Problem) -> None:
    if not problem.recompute.enabled:
        raise ProblemError("recompute is not enabled in the problem, so no forward can run again; add a "
                           "[recompute] table (enabled = true, time = 1.0, resident = the stage input's size)")


def add_recomputes(problem: Problem, schedule: Schedule, pairs: Iterable[tuple[int, int]]) -> Schedule:
    """``schedule`` with RECOMPUTE(s, i) right before the backward of each pair (not offloaded)."""
    require_recompute(problem)
    chosen = set(pairs) - schedule.offloaded
    for stage, microbatch in chosen:
        if not (0 <= stage < problem.stages and 0 <= microbatch < problem.microbatches):
            raise ScheduleError(f"cannot recompute (stage {stage}, microbatch {microbatch}): stages run "
                                f"0..{problem.stages - 1} and microbatches 0..{problem.microbatches - 1}")
    chosen -= schedule.recomputed
    rows = []
    for ops in schedule.devices:
        row: list[Op] = []
        for op in ops:
            if op.kind in (_B, _BW) and (op.stage, op.microbatch) in chosen:
                row.append(Op(_RC, op.stage, op.microbatch))
            row.append(op)
        rows.append(row)
    return Schedule.of(schedule.name, rows)


def trade_for_offloads(problem: Problem, schedule: Schedule, deadline: float | None = None) -> Schedule:
    """``schedule`` with recomputes traded for offloads, longest F-to-B window first, each kept only
    when the simulator says the schedule is no slower and still fits. The input when offload is off
    or nothing is faster; stops trading at ``deadline`` (monotonic s)."""
    if not problem.offload.enabled or not schedule.recomputed:
        return schedule
    best = simulate(problem, schedule)
    if not best.fits:
        return schedule
    windows = activation_windows(best)
    pairs = sorted((pair for pair in schedule.recomputed if windows[pair] + TOLERANCE_MS >= round_trip_ms(problem, pair[0])),
                   key=lambda pair: (-windows[pair], pair))
    for pair in pairs:
        if deadline is not None and time.monotonic() > deadline:
            break
        rc = Op(_RC, *pair)
        without = Schedule(schedule.name, tuple(tuple(op for op in ops if op != rc) for ops in schedule.devices))
        trial = add_offloads(problem, without, [pair])
        timeline = simulate(problem, trial)
        # Not slower is enough: each trade takes a forward's time off its device, and the makespan
        # falls only once every device on the critical path has traded one.
        if timeline.fits and timeline.makespan <= best.makespan + TOLERANCE_MS:
            schedule, best = trial, timeline
    return schedule


def _without(schedule: Schedule, pair: tuple[int, int]) -> Schedule:
    """``schedule`` with (stage, microbatch) kept: its RECOMPUTE, OFFLOAD and RELOAD taken out."""
    gone = {Op(kind, *pair) for kind in (_RC, OpKind.OFFLOAD, OpKind.RELOAD)}
    return Schedule(schedule.name, tuple(tuple(op for op in ops if op not in gone) for ops in schedule.devices))


def flip_decisions(problem: Problem, schedule: Schedule, *, deadline: float, rng=None):
    """Change one pair's choice at a time (keep, offload, recompute), longest F-to-B window first
    (shuffled with ``rng`` among equals), keeping each change the simulator says is no slower, no
    later in the devices' summed ends, and fits; passes over all pairs until one gains nothing or
    ``deadline`` (monotonic s). Returns (schedule, timeline); never worse than the input."""
    def score(timeline):
        ends = [0.0] * problem.devices
        for t in timeline.timings:
            ends[t.device] = max(ends[t.device], t.end)
        return (round(timeline.makespan, 6), round(sum(ends), 6))

    best = simulate(problem, schedule)
    best_score = score(best)
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        windows = activation_windows(best)
        pairs = sorted(windows, key=lambda pair: (-windows[pair], rng.random() if rng else 0, pair))
        for pair in pairs:
            if time.monotonic() > deadline:
                break
            kept = _without(schedule, pair)
            trials = []
            if pair in schedule.recomputed or pair in schedule.offloaded:
                trials.append(kept)
            if problem.recompute.enabled and pair not in schedule.recomputed:
                trials.append(add_recomputes(problem, kept, [pair]))
            if problem.offload.enabled and pair not in schedule.offloaded:
                trials.append(add_offloads(problem, kept, [pair]))
            for trial in trials:
                timeline = try_simulate(problem, trial)
                if timeline is None:
                    continue
                new_score = score(timeline)
                if timeline.fits and new_score < best_score:
                    schedule, best, best_score, changed = trial, timeline, new_score, True
                    break
    return schedule, best


def mixed_neighbour(problem: Problem, schedule: Schedule, *, deadline: float | None = None) -> Schedule | None:
    """The fastest fitting schedule one pair's choice away from ``schedule`` that offloads some
    pair and recomputes another (``schedule`` itself when it does both already); None when no
    such change fits or both are not enabled. Tries every pair until ``deadline`` (monotonic s)."""
    if not (problem.offload.enabled and problem.recompute.enabled):
        return None
    if schedule.offloaded and schedule.recomputed:
        return schedule
    best: tuple[float, Schedule] | None = None
    for stage in range(problem.stages):
        for microbatch in range(problem.microbatches):
            if deadline is not None and time.monotonic() > deadline:
                return best[1] if best else None
            pair = (stage, microbatch)
            kept = _without(schedule, pair)
            if schedule.offloaded and pair not in schedule.offloaded:
                trial = add_recomputes(problem, kept, [pair])
            elif schedule.recomputed and pair not in schedule.recomputed:
                trial = add_offloads(problem, kept, [pair])
            else:  # keeps everything: one change cannot make it use both
                continue
            if not (trial.offloaded and trial.recomputed):
                continue
            timeline = try_simulate(problem, trial)
            if timeline is not None and timeline.fits and (best is None or timeline.makespan < best[0]):
                best = (timeline.makespan, trial)
    return best[1] if best else None
