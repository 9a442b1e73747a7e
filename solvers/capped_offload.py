"""A memory-capped list schedule that offloads: warm starts for budgets far below PO-H's peak.

PO-H and its repairs keep GIS-H's deep warm-up and make it fit by offloading more; far below
PO-H's peak the offloads cannot keep up (k > 1) and the pipeline runs at the link's pace. Here
the number of microbatches a device has in flight is capped instead, activations are offloaded
right after their F, and each reload is issued as late as still ends before its B. Over all
devices the op that can start earliest is placed next (ties: B, then F, then W; a W only where
it fits in the idle time before the next F or B), and every allocation is checked against the
device's memory from its start on, so the simulator reproduces the times and the peak: a
schedule that comes out fits.

On the 7B-like problem (p = 8, v = 2, m = 32, k = 2.2) at 0.7x of PO-H's peak this gives
2,736 ms where PO-H repaired gives 3,106; on the generated grid it is rarely the best start. A
cap too small starves the pipeline and one too large fills the memory early, so caps are tried
from p outwards, down and up in turn, each way until three in a row bring nothing.

Which activations go to the host is a policy (``Policy``), and both are scanned; neither sends
one whose round trip outlasts its F-to-B path, since its backward would wait for the reload.
Offloading the first chunk queues its transfers behind each other on a slow link, and a forward
waits for room while its predecessors' offloads are still running. Offloading any activation,
but only when the device's D2H channel is idle as its forward ends, never queues. Where the link
keeps up (k < 1, grid07, grid13) the second offloads nearly everything and beats the first chunk
by a sixth to a quarter, though other starts are faster there. With one chunk per device the
round-trip rule matters most: on grid08 (p = 8, v = 1, m = 16, k = 2, 0.3 budgets) offloading
every stage but the last took 727.1, 1,337.1, 914.4 and 848.9 ms on seeds 0 to 3 (the link-free
policy 668.8, 1,262.0, 817.6, 909.0), and leaving the stages with short paths on the device takes
632.8, 1,211.4, 802.8 and 795.9. Compile at 60 s, 1 to 5 runs a seed, ends a median 0.15, 3.32,
0.00 and 0.93% above the bound, against 1.19, 0.89, 0.00 and 4.28% before (design.md, "A start
that never makes a backward wait"): seed 1 lost, seeds 0 and 3 gained more.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from optpipe.core.errors import ScheduleError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.semantics import duration_ms, lag_ms
from optpipe.core.simulate import simulate

from .bounds import data_paths
from .result import Judged

__all__ = ["Policy", "capped_offload", "capped_offload_starts"]

_F, _B, _W, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.OFFLOAD, OpKind.RELOAD
_INF = float("inf")
_EPS = 1e-9
_PATIENCE = 3  # caps in a row that bring nothing before the search over caps stops
# stages x microbatches above which the list pass (quadratic in a device's ops) is skipped: at
# p = 24, v = 2, m = 48 one pass takes about a second and the answer is far from the best start
_MAX_OPS = 1024


class _Memory:
    """A device's memory as (time, change) events; frees before allocations at one instant.

    The list pass asks for the peak from some time on far more often than it places an event
    (grid17, p = 16, m = 32: 500,000 asks against 40,000 events, 14 s of compile's 60 when each
    ask summed the events again), so the levels after each event and their running maximum from
    the end are kept, rebuilt only after an event was added."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.changes: list[int] = []
        self._levels: list[int] | None = None  # held after each event
        self._peaks: list[int] = []  # _peaks[k]: the most held after any of events k, k+1, ...

    def add(self, t: float, change: int) -> None:
        k = bisect.bisect_right(self.times, t) if change < 0 else bisect.bisect_left(self.times, t)
        self.times.insert(k, t)
        self.changes.insert(k, change)
        self._levels = None

    def peak_from(self, t: float) -> int:
        """The most held at any time from ``t`` on, as far as the events placed so far say."""
        if self._levels is None:
            self._levels = list(itertools.accumulate(self.changes))
            self._peaks = list(itertools.accumulate(reversed(self._levels), max))[::-1]
        k = bisect.bisect_right(self.times, t)
        held = self._levels[k - 1] if k else 0
        return max(held, self._peaks[k]) if k < len(self._peaks) else held


@dataclass
class _Device:
    stages: list[int]
    free: float = 0.0  # when its compute channel is next free
    ops: list[Op] = field(default_factory=list)
    ends: list[tuple[float, int]] = field(default_factory=list)  # (end, list index) of its compute ops
    d2h_free: float = 0.0
    h2d_free: float = 0.0
    last_reload: int = -1  # list index of the last reload's issue point: reloads keep list order
    memory: _Memory = field(default_factory=_Memory)
    admitted: int = 0  # microbatches whose first F on the device has run
    finished: int = 0  # ... whose B of its lowest stage has run
    waiting_w: list[tuple[int, int]] = field(default_factory=list)
    offload_at: dict[tuple[int, int], int] = field(default_factory=dict)  # list index of OFF(s, i)


class _Pass:
    """One list pass for one cap; ``run`` returns the schedule or None when it deadlocks."""

    def __init__(self, problem: Problem, offloaded_stages: frozenset[int], cap: int,
                 link_free: frozenset[int] = frozenset()):
        self.problem, self.cap = problem, cap
        pipe = problem.pipeline
        self.S, self.m = pipe.stages, pipe.microbatches
        self.offloaded_stages = offloaded_stages if problem.offload.enabled else frozenset()
        self.link_free = link_free if problem.offload.enabled else frozenset()  # offloaded when D2H is idle
        self.devices = [_Device(sorted(pipe.stages_on(d))) for d in range(pipe.devices)]
        self.act, self.keep = problem.memory.activation, problem.memory.weight_activation
        self.largest = [max(self.act[s] for s in dev.stages) for dev in self.devices]
        self.ms = {kind: [duration_ms(problem, Op(kind, s, 0)) for s in range(self.S)]
                   for kind in (_F, _B, _W) + ((_OFF, _REL) if problem.offload.enabled else ())}
        self.lag_up = [lag_ms(problem, s, s + 1) for s in range(self.S - 1)]  # F(s) -> F(s + 1)
        self.lag_down = [lag_ms(problem, s + 1, s) for s in range(self.S - 1)]  # B(s + 1) -> B(s)
        self.device_of = [pipe.device_of(s) for s in range(self.S)]
        self.next = {_F: [0] * self.S, _B: [0] * self.S}
        self.end: dict[tuple[OpKind, int, int], float] = {}
        self.offload_end: dict[tuple[int, int], float] = {}

    def _ready(self, kind: OpKind, s: int, i: int) -> float:
        """When the data of F(s, i) or B(s, i) arrives (inf: its source is not placed yet)."""
        if kind is _F:
            source, lag = ((_F, s - 1, i), self.lag_up[s - 1]) if s > 0 else (None, 0.0)
        elif s == self.S - 1:
            source, lag = (_F, s, i), 0.0
        else:
            source, lag = (_B, s + 1, i), self.lag_down[s]
        if source is None:
            return 0.0
        end = self.end.get(source)
        return _INF if end is None else end + lag

    def _reload_slot(self, dev: _Device, s: int, i: int, ready: float) -> tuple[int, float] | None:
        """(list index to issue after, start) for REL(s, i): the latest compute op whose end still
        lets it finish by ``ready`` with room in memory, else the earliest with room."""
        chosen = None
        back = self.ms[_REL][s]
        first = max(dev.last_reload, dev.offload_at[(s, i)])  # listed after its offload and the last reload
        # issue points: the device's compute ops from ``first`` on, and the end of its list
        start_at = bisect.bisect_left(dev.ends, first, key=lambda item: item[1])
        tail = [(dev.free, len(dev.ops) - 1)] if dev.ends[-1][1] != len(dev.ops) - 1 else []
        for end, index in itertools.chain(itertools.islice(dev.ends, start_at, None), tail):
            start = max(end, self.offload_end[(s, i)], dev.h2d_free)
            if dev.memory.peak_from(start) + self.act[s] > self.problem.memory.budget:
                continue
            if start + back <= ready + _EPS:
                chosen = (index, start)
            else:
                return chosen or (index, start)
        return chosen

    def _choice(self, d: int):
        """(start, rank, -stage, kind, stage, microbatch, reload slot) of the device's next op, or None."""
        dev, budget = self.devices[d], self.problem.memory.budget
        best = None
        for s in reversed(dev.stages):
            i = self.next[_B][s]
            if i >= self.m or (_F, s, i) not in self.end or (ready := self._ready(_B, s, i)) == _INF:
                continue
            slot, start = None, max(dev.free, ready)
            if (s, i) in self.offload_end:
                slot = self._reload_slot(dev, s, i, ready)
                if slot is None:
                    continue
                start = max(start, slot[1] + self.ms[_REL][s])
            best = min(best or (_INF,), (start, 0, -s, _B, s, i, slot))
        for s in reversed(dev.stages):
            i = self.next[_F][s]
            if i >= self.m or (ready := self._ready(_F, s, i)) == _INF:
                continue
            if s == dev.stages[0] and dev.admitted - dev.finished >= self.cap:
                continue
            start = max(dev.free, ready)
            reserve = 0 if i == dev.finished else self.largest[d]  # room for the oldest to move on
            if dev.memory.peak_from(start) + self.act[s] + reserve > budget:
                continue
            best = min(best or (_INF,), (start, 1, -s, _F, s, i, None))
        if dev.waiting_w:
            s, i = dev.waiting_w[0]
            start = max(dev.free, self.end[(_B, s, i)])
            if best is None or start + self.ms[_W][s] <= best[0] + _EPS:
                best = (start, 2, -s, _W, s, i, None)
        return best

    def run(self) -> Schedule | None:
        # A device's choice changes only when an op is placed on it or on a device that feeds it
        # (the neighbouring stages' devices), so the others' are kept from the step before.
        choices = [self._choice(d) for d in range(len(self.devices))]
        for _ in range(3 * self.S * self.m):
            picks = [(c, d) for d, c in enumerate(choices) if c is not None]
            if not picks:
                return None  # every device waits for memory that will not come
            (start, _, _, kind, s, i, slot), d = min(picks)
            self._place(self.devices[d], kind, s, i, start, slot)
            fed = {d} | {self.device_of[t] for t in (s - 1, s + 1) if 0 <= t < self.S}
            for e in fed:
                choices[e] = self._choice(e)
        name = f"capped-offload({self.cap}, link free)" if self.link_free else f"capped-offload({self.cap})"
        return Schedule.of(name, [dev.ops for dev in self.devices])

    def _place(self, dev: _Device, kind: OpKind, s: int, i: int, start: float, slot) -> None:
        act, keep = self.act[s], self.keep[s]
        if slot is not None:  # the reload, issued after compute op number ``index``
            index, at = slot
            dev.ops.insert(index + 1, Op(_REL, s, i))
            dev.ends = [(end, k + 1 if k > index else k) for end, k in dev.ends]
            dev.offload_at = {pair: k + 1 if k > index else k for pair, k in dev.offload_at.items()}
            dev.last_reload, dev.h2d_free = index + 1, at + self.ms[_REL][s]
            dev.memory.add(at, act)
        end = start + self.ms[kind][s]
        dev.ops.append(Op(kind, s, i))
        dev.ends.append((end, len(dev.ops) - 1))
        dev.free = self.end[(kind, s, i)] = end
        if kind is _F:
            dev.memory.add(start, act)
            self.next[_F][s] += 1
            dev.admitted += s == dev.stages[0]
            if s in self.offloaded_stages or (s in self.link_free and dev.d2h_free <= end + _EPS):
                out_start = max(end, dev.d2h_free)
                dev.d2h_free = self.offload_end[(s, i)] = out_start + self.ms[_OFF][s]
                dev.ops.append(Op(_OFF, s, i))
                dev.offload_at[(s, i)] = len(dev.ops) - 1
                dev.memory.add(dev.d2h_free, -act)
        elif kind is _B:
            dev.memory.add(end, -(act - keep))
            self.next[_B][s] += 1
            dev.waiting_w.append((s, i))
            dev.finished += s == dev.stages[0]
        else:
            dev.memory.add(end, -keep)
            dev.waiting_w.pop(0)


class Policy(Enum):
    """Which activations a pass offloads (never the last stage's, whose B follows its F at once)."""

    FIRST_CHUNK = "first chunk"  # the first chunk's, as the link allows
    LINK_FREE = "link free"  # any, when D2H is idle


def capped_offload(problem: Problem, cap: int, policy: Policy = Policy.FIRST_CHUNK) -> Schedule | None:
    """The list schedule with at most ``cap`` microbatches in flight per device, offloading as
    ``policy`` says; None when it deadlocks. Either policy offloads only the stages whose F-to-B
    path through the later stages outlasts their offload and reload: on a shorter one the
    backward would wait for the reload. With one chunk per device that leaves the last devices'
    activations on the device (seed 0's grid08, p = 8, v = 1, k = 2: stage 6's; its start went
    from 727.1 to 632.8 ms)."""
    pipe = problem.pipeline
    gap = data_paths(problem).gap
    worth = frozenset(s for s in range(pipe.stages - 1)
                      if gap[s] >= duration_ms(problem, Op(_OFF, s, 0)) + duration_ms(problem, Op(_REL, s, 0)))
    if policy is Policy.FIRST_CHUNK:
        return _Pass(problem, frozenset(s for s in worth if s < pipe.devices), cap).run()
    return _Pass(problem, frozenset(), cap, worth).run()


def capped_offload_starts(problem: Problem, deadline: float | None = None) -> list[Judged]:
    """The fastest fitting capped-offload schedule, caps tried from p (the microbatches device 0
    holds in 1F1B) outwards, one step down and one up in turn, each way until _PATIENCE caps in a
    row bring nothing (or the deadline); empty without offload or for very large problems. On
    the 7B-like problem the best cap is 6 to 9 at every budget from 0.6x to 1.0x of PO-H's peak,
    so a deadline that cuts the scan short still has it."""
    if not problem.offload.enabled or problem.stages * problem.microbatches > _MAX_OPS:
        return []
    best: list[Judged] = []
    for policy in Policy:
        found = _scan(problem, policy, deadline)
        if found and (not best or found[0].makespan_ms < best[0].makespan_ms - _EPS):
            best = found
    return best


def _scan(problem: Problem, policy: Policy, deadline: float | None) -> list[Judged]:
    """The fastest fitting schedule of one policy over the caps (see capped_offload_starts)."""
    p = problem.devices
    top = problem.pipeline.chunks_per_device * p + p
    ways = [iter(range(p, top)), iter(range(p - 1, 0, -1))]
    stale = [0, 0]
    best: list[Judged] = []
    while any(way is not None for way in ways):
        for k, way in enumerate(ways):
            if way is None:
                continue
            cap = next(way, None)
            if cap is None or stale[k] >= _PATIENCE:
                ways[k] = None
                continue
            if deadline is not None and time.monotonic() > deadline:
                return best
            judged = _judged(problem, cap, policy)
            if judged is not None and (not best or judged.makespan_ms < best[0].makespan_ms - _EPS):
                best, stale[k] = [judged], 0
            else:
                stale[k] += 1
    return best


def _judged(problem: Problem, cap: int, policy: Policy) -> Judged | None:
    """The capped-offload schedule for ``cap`` when it fits, judged; else None."""
    schedule = capped_offload(problem, cap, policy)
    try:
        timeline = simulate(problem, schedule) if schedule is not None else None
    except ScheduleError:  # pragma: no cover - a pass that breaks a list rule is not a start
        return None
    if timeline is None or not timeline.fits:
        return None
    return Judged(schedule.name, schedule, timeline)
