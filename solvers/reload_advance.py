"""Issue the reloads that set the makespan earlier: a backward on the critical path that waits
for its activation to come back from the host.

A reload starts once the compute op listed before it has ended (its issue point) and the H2D
channel is free. Where the path runs through a reload, its backward was ready before the
activation was: in grid17's 60 s schedule (p = 16, v = 2, m = 32) B(15, 31) waits 37 ms for a
reload listed after B(15, 30), while the channel sat idle for 19 ms before it. Each such reload
moves to the latest issue point that still lets it end when its backward could start, never
before the transfer ahead of it on the channel (channel order stays as listed) nor before its
own offload; a reload held from an earlier start takes memory sooner, so the caller judges
the round by simulating it, as W deferral's rounds are (wdefer.py, which runs this as its
second round). On grid17 that and the W deferral it lets pay took 4,027.5 ms to 4,019.3 in 2 s.
"""

from __future__ import annotations

from optpipe.core.problem import Problem
from optpipe.core.schedule import COMPUTE_KINDS, Op, OpKind, Schedule
from optpipe.core.semantics import TOLERANCE_MS, duration_ms, waits
from optpipe.core.simulate import OpTiming, Timeline

__all__ = ["advanced_reloads", "backward_of"]

_REL, _OFF, _B, _BW = OpKind.RELOAD, OpKind.OFFLOAD, OpKind.B, OpKind.BW
_EPS = TOLERANCE_MS


def advanced_reloads(problem: Problem, schedule: Schedule, timeline: Timeline, path: list[OpTiming],
                     skip: frozenset[int] = frozenset()) -> Schedule | None:
    """``schedule`` with every reload on ``path`` (the critical path of ``timeline``) listed at
    its latest issue point that lets it end by the time its backward could otherwise start;
    None when none moves. The devices in ``skip`` keep their lists."""
    lists = [list(ops) for ops in schedule.devices]
    moved = 0
    for t in path:
        if t.op.kind is not _REL or t.device in skip:
            continue
        row = lists[t.device]
        target = _wanted_start(problem, timeline, row, t.op)
        if target is None or target >= t.start - _EPS:
            continue
        at = _issue_position(timeline, row, t.op, target)
        position = row.index(t.op)
        if at < position:
            row.insert(at, row.pop(position))
            moved += 1
    return Schedule.of(schedule.name, lists) if moved else None


def _wanted_start(problem: Problem, timeline: Timeline, row: list[Op], reload: Op) -> float | None:
    """When ``reload`` should start to end as its backward becomes ready otherwise: after the
    device's compute op before it and its other waits (the gradient from the stage above)."""
    by_op = timeline.by_op
    backward = backward_of(timeline, reload)
    if backward is None:
        return None
    k = row.index(backward)
    before = next((op for op in reversed(row[:k]) if op.kind in COMPUTE_KINDS), None)
    ready = by_op[before].end if before is not None else 0.0
    for wait in waits(problem, backward, offloaded=True):
        if wait.op.kind is _REL:
            continue
        pred = by_op.get(wait.op) or by_op.get(Op(_BW, wait.op.stage, wait.op.microbatch))
        if pred is not None:
            ready = max(ready, pred.end + wait.lag_ms)
    return ready - duration_ms(problem, reload)


def backward_of(timeline: Timeline, reload: Op) -> Op | None:
    """The backward (B, or a fused BW) that waits for ``reload``'s activation."""
    return next((op for op in (Op(_B, reload.stage, reload.microbatch), Op(_BW, reload.stage, reload.microbatch))
                 if op in timeline.by_op), None)


def _issue_position(timeline: Timeline, row: list[Op], reload: Op, target: float) -> int:
    """The list position for ``reload``: after the last compute op that ends by ``target``,
    and after the transfer ahead of it on the H2D channel and its own offload."""
    by_op = timeline.by_op
    position = row.index(reload)
    offload = Op(_OFF, reload.stage, reload.microbatch)
    floor = max((k for k in range(position) if row[k].kind is _REL or row[k] == offload), default=-1)
    fitting = [k for k in range(floor + 1, position)
               if row[k].kind in COMPUTE_KINDS and by_op[row[k]].end <= target + _EPS]
    return fitting[-1] + 1 if fitting else floor + 1
