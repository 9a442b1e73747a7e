"""Split every fused backward and let its W fill the device's idle time (the zero-bubble move).

Zero Bubble PP (Qi et al., arXiv 2401.10241, section 2) observes that W (the weight gradient)
is on no other op's path: delaying it costs nothing as long as the device has nothing else to
do. ZB-H1 is 1F1B with its W passes moved into the bubbles. This pass does the same to any
schedule: it keeps each device's order of F and B (a fused BW becomes its B) and places every W
by list scheduling: when the device would wait for its next F or B, it runs the oldest W whose
B is done, if that W ends by the time the F or B could start (plus ``slack``); the W passes left
over run at the end. Timing follows the simulator's rule, and the simulator judges the result.
Transfers are dropped (offloads are placed again by warmstart.py's variants).
"""

from __future__ import annotations

from collections import deque

from optpipe.core.errors import InternalError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.semantics import TOLERANCE_MS, At, Place, duration_ms, effects, waits

__all__ = ["fill_with_w"]

_F, _B, _W, _BW = OpKind.F, OpKind.B, OpKind.W, OpKind.BW
_EPS = TOLERANCE_MS


def fill_with_w(problem: Problem, schedule: Schedule, memory_cap: int | None = None, slack: float = 0.0,
                name: str | None = None) -> Schedule:
    """``schedule`` with split backwards and each W in the first idle gap after its B that holds it.

    With ``memory_cap``, a deferred W also runs before an F whose activation would take the
    device over the cap (each W frees its weight part): W passes wait only as long as memory
    allows. Without offload the cap is the budget; with offload callers try caps above it,
    since offloads placed afterwards relieve the device.
    """
    pipe = problem.pipeline
    spine = []  # per device: F and B in order
    for ops in schedule.devices:
        row = []
        for op in ops:
            if op.kind is _F:
                row.append(op)
            elif op.kind in (_B, _BW):
                row.append(Op(_B, op.stage, op.microbatch))
        spine.append(row)
    position = [0] * pipe.devices
    free = [0.0] * pipe.devices
    pending: list[deque[tuple[float, Op]]] = [deque() for _ in range(pipe.devices)]  # (ready, W)
    end: dict[Op, float] = {}
    out: list[list[Op]] = [[] for _ in range(pipe.devices)]
    # A device's memory changes at its own F starts and B, W ends, which come in time order, and
    # an F starts no earlier than the device is free: what it holds then is a running sum of
    # the ops' device effects (semantics.effects; transfers are dropped, so nothing is offloaded).
    held = [0] * pipe.devices

    def ready(op: Op) -> float | None:
        """When the op's data waits (semantics.waits) are met, or None while one is unscheduled."""
        at = 0.0
        for wait in waits(problem, op):
            e = end.get(wait.op)
            if e is None:
                return None
            at = max(at, e + wait.lag_ms)
        return at

    def taken(op: Op) -> int:
        """What the op takes on the device at its start."""
        return sum(e.delta for e in effects(problem, op) if e.place is Place.DEVICE and e.at is At.START)

    def run(d: int, op: Op, start: float) -> None:
        finish = start + duration_ms(problem, op)
        end[op] = finish
        free[d] = finish
        out[d].append(op)
        if op.kind is _B:
            pending[d].append((finish, Op(_W, op.stage, op.microbatch)))
        held[d] += sum(e.delta for e in effects(problem, op) if e.place is Place.DEVICE)

    remaining = sum(len(row) for row in spine)
    while remaining:
        # the device that is free first among those whose next F/B has known inputs
        best = None
        for d in range(pipe.devices):
            if position[d] < len(spine[d]):
                r = ready(spine[d][position[d]])
                if r is not None and (best is None or free[d] < best[0]):
                    best = (free[d], d, r)
        if best is None:  # a cycle in the input order  # pragma: no cover
            raise InternalError("the W-filler's input order of F and B deadlocks")
        _, d, r = best
        op = spine[d][position[d]]
        start = max(free[d], r)
        while pending[d] and pending[d][0][0] <= free[d] + _EPS:
            w = pending[d][0][1]
            if free[d] + duration_ms(problem, w) > start + slack + _EPS:
                break
            pending[d].popleft()
            run(d, w, free[d])
            start = max(free[d], r)
        if memory_cap is not None and op.kind is _F:
            while pending[d] and held[d] + taken(op) > memory_cap:
                run(d, pending[d].popleft()[1], free[d])
        run(d, op, max(free[d], r))
        position[d] += 1
        remaining -= 1
    for d in range(pipe.devices):
        out[d].extend(w for _, w in pending[d])
    return Schedule.of(name or f"{schedule.name}+W", out)
