"""The critical path of a timeline: the chain of ops that sets its makespan, walked back from the end.

Only idle on this path costs time. On the grid's unbalanced problems most devices idle for a
third of the run and none of it matters; what does is a short gap on the busiest device where
it waits for data that another device held back (grid17, p = 16, v = 2: 6.6 ms before F31:24,
because device 11 ran B11:19 before F27:24). Searches aim at these gaps rather than at the
longest ones.

Each step goes to what the op waited for: the data it needs (its waits' ends plus lags, as the
simulator times them), else, for a compute op, the op before it on its device; for a transfer,
the transfer before it on its channel, else its issue point (the compute op listed before it).
The walk stops at an op that waited for none of these, or at the first op. Walking through
transfers matters under offload: on grid17 (p = 16, v = 2) the last backward chain waits 2 ms
for a reload that was issued late, and a walk that stopped there saw 17 ops, too few to say
which device holds the path.
"""

from __future__ import annotations

from dataclasses import dataclass

from optpipe.core.problem import Problem
from optpipe.core.schedule import COMPUTE_KINDS, Op, OpKind
from optpipe.core.semantics import CHANNEL, TOLERANCE_MS, link, waits
from optpipe.core.simulate import OpTiming, Timeline

__all__ = ["Gap", "binding", "critical_gaps", "critical_path"]

_B, _BW = OpKind.B, OpKind.BW
_EPS = TOLERANCE_MS
_TIGHT_MS = 1e-6


@dataclass(frozen=True)
class Gap:
    """Idle on a device just before an op of the critical path: the op waited for data."""

    length: float  # ms
    device: int
    op: Op
    at: float  # the op's start


def binding(problem: Problem, timeline: Timeline, op: Op, offloaded: frozenset) -> OpTiming | None:
    """The op whose data ``op`` waited for last (its end plus lag is ``op``'s start), if any."""
    by_op = timeline.by_op
    start = by_op[op].start
    for wait in waits(problem, op, offloaded=(op.stage, op.microbatch) in offloaded):
        pred = wait.op
        if pred not in by_op and pred.kind is _B:
            pred = Op(_BW, pred.stage, pred.microbatch)
        t = by_op.get(pred)
        if t is not None and abs(t.end + wait.lag_ms - start) <= _TIGHT_MS:
            return t
    return None


def critical_path(problem: Problem, timeline: Timeline) -> list[OpTiming]:
    """The compute ops and transfers of the path that ends last, latest first."""
    compute = [t for t in timeline.timings if t.op.kind in COMPUTE_KINDS]
    if not compute:
        return []
    before: dict[Op, OpTiming] = {}  # compute op -> the compute op before it on its device
    issued: dict[Op, OpTiming] = {}  # transfer -> the compute op listed before it (its issue point)
    last: dict[int, OpTiming] = {}
    for t in timeline.timings:  # per device in list order
        if t.op.kind in COMPUTE_KINDS:
            if t.device in last:
                before[t.op] = last[t.device]
            last[t.device] = t
        elif t.device in last:
            issued[t.op] = last[t.device]
    channel_before = _channel_order(problem, timeline)
    offloaded = frozenset((t.op.stage, t.op.microbatch) for t in timeline.timings if t.op.kind is OpKind.OFFLOAD)
    current = max(compute, key=lambda t: (t.end, t.device))
    path = [current]
    while len(path) <= len(timeline.timings):
        data = binding(problem, timeline, current.op, offloaded)
        if data is None:
            for previous in ((before.get(current.op),) if current.op.kind in COMPUTE_KINDS
                             else (channel_before.get(current.op), issued.get(current.op))):
                if previous is not None and abs(previous.end - current.start) <= _TIGHT_MS:
                    data = previous
                    break
        if data is None:
            break
        path.append(data)
        current = data
    return path


def _channel_order(problem: Problem, timeline: Timeline) -> dict[Op, OpTiming]:
    """Each transfer's predecessor on its channel (its host link's D2H or H2D), by start time."""
    by_channel: dict[tuple[int, object], list[OpTiming]] = {}
    for t in timeline.timings:
        if t.op.kind not in COMPUTE_KINDS:
            by_channel.setdefault((link(problem, t.device), CHANNEL[t.op.kind]), []).append(t)
    out: dict[Op, OpTiming] = {}
    for transfers in by_channel.values():
        transfers.sort(key=lambda t: (t.start, t.end))
        for previous, t in zip(transfers, transfers[1:]):
            out[t.op] = previous
    return out


def critical_gaps(problem: Problem, timeline: Timeline) -> list[Gap]:
    """Every idle gap just before a compute op of the critical path, latest first."""
    ends: dict[Op, float] = {}
    last: dict[int, float] = {}
    for t in timeline.timings:
        if t.op.kind in COMPUTE_KINDS:
            if t.device in last:
                ends[t.op] = last[t.device]
            last[t.device] = t.end
    gaps = []
    for t in critical_path(problem, timeline):
        previous = ends.get(t.op)
        if previous is not None and t.start - previous > _EPS:
            gaps.append(Gap(t.start - previous, t.device, t.op, t.start))
    return gaps
