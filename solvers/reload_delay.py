"""Issue later the reloads that hold memory where a device overflows: room for a faster round.

A reload holds its activation from its start, and it starts when the compute op listed before
it ends; after W passes move (wdefer.py), many reloads come back well before their backward
needs them. On grid17's 60 s schedule (p = 16, v = 2, m = 32, 4,019.3 ms) every W deferral round
that was faster overflowed device 15, so the pass stopped; with a budget 5% larger it went on to
4,006.1 ms, peaking at 1.004 of the real budget at one instant, where RELOAD(15, 28) had run for
39 ms although B(15, 28) started 68 ms later. Issued two compute ops later it still ends in
time, and the schedule fits. Here each reload that holds its activation through an instant
where its device is over the budget moves to the latest issue point that still lets it end
before its backward starts (by the timeline at hand). The caller simulates the result, as it
does every round: with this, W deferral takes that schedule to 3,984.3 ms at the real budget.
"""

from __future__ import annotations

from optpipe.core.problem import Problem
from optpipe.core.schedule import COMPUTE_KINDS, OpKind, Schedule
from optpipe.core.semantics import TOLERANCE_MS, duration_ms
from optpipe.core.simulate import Timeline

from .reload_advance import backward_of

__all__ = ["delayed_reloads"]

_REL = OpKind.RELOAD
_EPS = TOLERANCE_MS


def delayed_reloads(problem: Problem, schedule: Schedule, timeline: Timeline, devices: frozenset[int]) -> Schedule | None:
    """``schedule`` with, on each of ``devices``, every reload that holds memory through one of
    the device's overflowing instants in ``timeline`` listed just after the last compute op that
    ends early enough for it to end by its backward's start; None when none moves."""
    budget, by_op = problem.memory.budget, timeline.by_op
    lists = [list(ops) for ops in schedule.devices]
    moved = 0
    for device in sorted(devices):
        over = [at for at, held in timeline.memory[device] if held > budget]
        if not over:
            continue
        row = lists[device]
        for reload in [op for op in row if op.kind is _REL]:
            backward = backward_of(timeline, reload)
            if backward is None:
                continue
            began, needed = by_op[reload].start, by_op[backward].start
            if not any(began - _EPS <= at < needed - _EPS for at in over):
                continue
            latest = needed - duration_ms(problem, reload)  # a later start would hold the backward up
            position, last = row.index(reload), row.index(backward)
            later = [k for k in range(position + 1, last)
                     if row[k].kind in COMPUTE_KINDS and began + _EPS < by_op[row[k]].end <= latest + _EPS]
            if later:
                row.insert(later[-1], row.pop(position))  # after that op (the pop shifted it down one)
                moved += 1
    return Schedule.of(schedule.name, lists) if moved else None
