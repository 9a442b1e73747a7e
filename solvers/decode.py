"""Turn solver start times into a Schedule (the IR every part consumes).

Before: ``starts`` gives a start time (ms) for every op of the schedule, compute and transfer,
consistent with docs/design.md, "What the schedule adds" (one compute op at a time per device,
one transfer per channel).
After: a Schedule whose per-device lists are in start order, each transfer placed after the
last compute op that has ended by the transfer's start, which is where the runtime issues it.
Re-simulating it gives start times no later than ``starts`` (the simulator runs ops as soon as
they may), so its makespan is at most the solver's. ``duration`` gives each op's length as the
solver saw it (rounded up on a model's grid, timegrid.py); by default the op's own
(semantics.duration_ms).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Callable

from optpipe.core.problem import Problem
from optpipe.core.schedule import COMPUTE_KINDS, Op, OpKind, Schedule
from optpipe.core.semantics import TOLERANCE_MS, duration_ms

__all__ = ["schedule_from_starts"]

_TIE = {OpKind.F: 0, OpKind.B: 1, OpKind.BW: 1, OpKind.W: 2, OpKind.OFFLOAD: 3, OpKind.RELOAD: 4,
        OpKind.RECOMPUTE: 0.5}  # a recompute ends before its B starts


def schedule_from_starts(problem: Problem, name: str, starts: dict[Op, float],
                         duration: Callable[[Op], float] | None = None) -> Schedule:
    pipe = problem.pipeline
    length = duration or (lambda op: duration_ms(problem, op))
    per_device: list[list[Op]] = [[] for _ in range(pipe.devices)]
    for op in starts:
        per_device[pipe.device_of(op.stage)].append(op)
    devices = []
    for ops in per_device:
        compute = sorted((op for op in ops if op.kind in COMPUTE_KINDS), key=lambda o: (starts[o], _TIE[o.kind], o))
        transfers = sorted((op for op in ops if op.kind not in COMPUTE_KINDS), key=lambda o: (starts[o], _TIE[o.kind], o))
        ends = [starts[op] + length(op) for op in compute]
        position = {op: k for k, op in enumerate(compute)}
        finished = _running_max(ends)
        slots: list[list[Op]] = [[] for _ in range(len(compute) + 1)]  # slots[k]: after compute[k-1]
        for op in transfers:
            slot = bisect_right(finished, starts[op] + TOLERANCE_MS * max(1.0, starts[op]))
            if op.kind is OpKind.OFFLOAD:
                slot = max(slot, position[Op(OpKind.F, op.stage, op.microbatch)] + 1)
            else:
                backward = Op(OpKind.B, op.stage, op.microbatch)
                if backward not in position:
                    backward = Op(OpKind.BW, op.stage, op.microbatch)
                slot = min(slot, position[backward])
            slots[slot].append(op)
        ordered: list[Op] = list(slots[0])
        for k, op in enumerate(compute):
            ordered.append(op)
            ordered.extend(slots[k + 1])
        devices.append(ordered)
    return Schedule.of(name, devices)


def _running_max(values: list[float]) -> list[float]:
    out, best = [], float("-inf")
    for v in values:
        best = max(best, v)
        out.append(best)
    return out
