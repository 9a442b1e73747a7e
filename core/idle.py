"""Where a device is idle: its gaps between compute ops, and how they split over its run.

A pipeline's bubble has two causes that call for different cures. Idle before a device's first
backward is the fill: forwards did not reach it fast enough (too few in flight, a budget that
holds back the devices before it, a slow host link). Idle after it is the steady state and the
drain: a device waits for its neighbours' backwards. Comparing a schedule's split with the
bound's (solvers/bounds.py counts the fill a budget forces) says which of the two a faster
schedule must fix; on the p >= 12 rows of the solver benchmark it is the fill (design.md). The
gaps themselves are what the search's list moves, W deferral and idle windows aim at.
"""

from __future__ import annotations

from dataclasses import dataclass

from optpipe.core.schedule import COMPUTE_KINDS, Op, OpKind
from optpipe.core.semantics import TOLERANCE_MS
from optpipe.core.simulate import Timeline

__all__ = ["IdlePhases", "idle_gaps", "idle_phases"]

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


def idle_gaps(timeline: Timeline) -> list[tuple[float, int, Op, float]]:
    """Every idle gap between two compute ops of a device: (length, device, the compute op after
    the gap, the gap's start), each device's in time order."""
    last: dict[int, float] = {}
    out = []
    for t in timeline.timings:  # per device in list order: compute ops in start order
        if t.op.kind not in COMPUTE_KINDS:
            continue
        previous = last.get(t.device)
        if previous is not None and t.start - previous > TOLERANCE_MS:
            out.append((t.start - previous, t.device, t.op, previous))
        last[t.device] = t.end
    return out


def idle_phases(timeline: Timeline) -> tuple[IdlePhases, ...]:
    """Per device, its idle time by phase (a device with no backward has no steady state)."""
    devices = timeline.problem.devices
    first: dict[int, float] = {}
    last = [0.0] * devices
    backward: dict[int, float] = {}
    for t in timeline.timings:
        if t.op.kind in COMPUTE_KINDS:
            first.setdefault(t.device, t.start)
            last[t.device] = t.end
            if t.op.kind in _BACKWARDS:
                backward.setdefault(t.device, t.start)
    fill, steady = [0.0] * devices, [0.0] * devices
    for length, device, _, opened in idle_gaps(timeline):
        # a gap opened before the first backward's start ends at it at the latest: the fill's
        if opened < backward.get(device, float("inf")):
            fill[device] += length
        else:
            steady[device] += length
    return tuple(IdlePhases(first.get(d, timeline.makespan), fill[d], steady[d],
                            timeline.makespan - last[d] if d in first else 0.0) for d in range(devices))
