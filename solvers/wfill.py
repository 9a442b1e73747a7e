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

import heapq
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
    filler = _Filler(problem, _spine(schedule))
    remaining = sum(len(row) for row in filler.spine)
    while remaining:
        d, r = filler.next_device()
        op = filler.spine[d][filler.position[d]]
        filler.fill_gap(d, r, slack)
        if memory_cap is not None and op.kind is _F:
            filler.make_room(d, op, memory_cap)
        filler.run(d, op, max(filler.free[d], r))
        filler.position[d] += 1
        filler.queue(d)
        remaining -= 1
    for d in range(problem.devices):
        filler.out[d].extend(w for _, w in filler.pending[d])
    return Schedule.of(name or f"{schedule.name}+W", filler.out)


def _spine(schedule: Schedule) -> list[list[Op]]:
    """Per device: its F and B in order (a fused BW becomes its B; W passes and transfers dropped)."""
    spine = []
    for ops in schedule.devices:
        row = []
        for op in ops:
            if op.kind is _F:
                row.append(op)
            elif op.kind in (_B, _BW):
                row.append(Op(_B, op.stage, op.microbatch))
        spine.append(row)
    return spine


class _Filler:
    """The list scheduler's state: per device, the next F/B, when it is free, the W passes waiting
    (by the time their B ended) and what it holds; the end of every op placed so far."""

    def __init__(self, problem: Problem, spine: list[list[Op]]):
        devices = problem.devices
        self.problem = problem
        self.spine = spine
        self.position = [0] * devices
        self.free = [0.0] * devices
        self.pending: list[deque[tuple[float, Op]]] = [deque() for _ in range(devices)]  # (ready, W)
        self.end: dict[Op, float] = {}
        self.out: list[list[Op]] = [[] for _ in range(devices)]
        # A device's memory changes at its own F starts and B, W ends, which come in time order, and
        # an F starts no earlier than the device is free: what it holds then is a running sum of
        # the ops' device effects (semantics.effects; transfers are dropped, so nothing is offloaded).
        self.held = [0] * devices
        # The devices whose next F/B has known inputs, by (free, device), and the others by the
        # op they wait for: picking the next device costs a heap pop, not a scan of every device
        # (at p = 64, m = 512 the scan took 19 s of a W-fill).
        self.heap: list[tuple[float, int, float]] = []
        self.blocked: dict[Op, list[int]] = {}
        for d in range(devices):
            self.queue(d)

    def taken(self, op: Op) -> int:
        """What the op takes on the device at its start."""
        return sum(e.delta for e in effects(self.problem, op) if e.place is Place.DEVICE and e.at is At.START)

    def run(self, d: int, op: Op, start: float) -> None:
        finish = start + duration_ms(self.problem, op)
        self.end[op] = finish
        for waiting in self.blocked.pop(op, ()):
            self.queue(waiting)
        self.free[d] = finish
        self.out[d].append(op)
        if op.kind is _B:
            self.pending[d].append((finish, Op(_W, op.stage, op.microbatch)))
        self.held[d] += sum(e.delta for e in effects(self.problem, op) if e.place is Place.DEVICE)

    def queue(self, d: int) -> None:
        """File device ``d`` by its next F/B: ready (on the heap) or waiting for an unplaced input."""
        if self.position[d] >= len(self.spine[d]):
            return
        op = self.spine[d][self.position[d]]
        at = 0.0
        for wait in waits(self.problem, op):
            e = self.end.get(wait.op)
            if e is None:
                self.blocked.setdefault(wait.op, []).append(d)
                return
            at = max(at, e + wait.lag_ms)
        heapq.heappush(self.heap, (self.free[d], d, at))

    def next_device(self) -> tuple[int, float]:
        """The device that is free first among those whose next F/B has known inputs (the lowest
        such device on a tie), and when those inputs are ready."""
        if not self.heap:  # a cycle in the input order  # pragma: no cover
            raise InternalError("the W-filler's input order of F and B deadlocks")
        _, d, ready = heapq.heappop(self.heap)
        return d, ready

    def fill_gap(self, d: int, ready: float, slack: float) -> None:
        """Run the oldest finished W passes while each ends by the time the next F/B could start."""
        pending = self.pending[d]
        start = max(self.free[d], ready)
        while pending and pending[0][0] <= self.free[d] + _EPS:
            w = pending[0][1]
            if self.free[d] + duration_ms(self.problem, w) > start + slack + _EPS:
                break
            pending.popleft()
            self.run(d, w, self.free[d])
            start = max(self.free[d], ready)

    def make_room(self, d: int, forward: Op, memory_cap: int) -> None:
        """Run deferred W passes until ``forward``'s activation fits under the cap."""
        while self.pending[d] and self.held[d] + self.taken(forward) > memory_cap:
            self.run(d, self.pending[d].popleft()[1], self.free[d])
