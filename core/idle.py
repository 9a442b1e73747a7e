"""Where a device's idle time falls: before its first op, in the fill, in the steady state, after.

A pipeline's bubble has two causes that call for different cures. Idle before a device's first
backward is the fill: forwards did not reach it fast enough (too few in flight, a budget that
holds back the devices before it, a slow host link). Idle after it is the steady state and the
drain: a device waits for its neighbours' backwards. Comparing a schedule's split with the
bound's (solvers/bounds.py counts the fill a budget forces) says which of the two a faster
schedule must fix; on the p >= 12 rows of the solver benchmark it is the fill (design.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from optpipe.core.schedule import COMPUTE_KINDS, OpKind
from optpipe.core.simulate import Timeline

__all__ = ["IdlePhases", "idle_phases"]

_BACKWARDS = frozenset({OpKind.B, OpKind.BW})


@dataclass(frozen=True)
class IdlePhases:
    """One device's idle time (ms), split at its first compute op, first backward and last op.

    The four add up to the makespan minus the device's compute time."""

    head: float  # before the first compute op starts
    fill: float  # between the first compute op and the first backward's start
    steady: float  # between the first backward's end and the last compute op's end
    tail: float  # from the last compute op's end to the makespan

    @property
    def total(self) -> float:
        return self.head + self.fill + self.steady + self.tail


def idle_phases(timeline: Timeline) -> tuple[IdlePhases, ...]:
    """Per device, its idle time by phase (a device with no backward has no steady state)."""
    runs: list[list[tuple[float, float, bool]]] = [[] for _ in range(timeline.problem.devices)]
    for t in timeline.timings:
        if t.op.kind in COMPUTE_KINDS:
            runs[t.device].append((t.start, t.end, t.op.kind in _BACKWARDS))
    return tuple(_split(sorted(ops), timeline.makespan) for ops in runs)


def _split(ops: list[tuple[float, float, bool]], makespan: float) -> IdlePhases:
    if not ops:
        return IdlePhases(makespan, 0.0, 0.0, 0.0)
    fill = steady = 0.0
    backward_seen, last_end = ops[0][2], ops[0][1]
    for start, end, backward in ops[1:]:
        gap = max(0.0, start - last_end)
        if backward_seen:
            steady += gap
        else:  # up to the first backward's start, the wait for it included
            fill += gap
        backward_seen, last_end = backward_seen or backward, max(last_end, end)
    return IdlePhases(ops[0][0], fill, steady, max(0.0, makespan - last_end))
