"""The simulator: the one judge of every schedule, heuristic or solved.

``simulate(problem, schedule)`` times every op under the semantics of
``semantics.py`` (earliest start given its waits, device order and channel order), then replays memory on each device and
on its host. Invalid schedules raise ``ScheduleError`` naming the op and the rule it breaks.
"""

from __future__ import annotations

import gc
import heapq
import weakref
from dataclasses import dataclass
from functools import cached_property, wraps
from typing import Callable, NamedTuple

from optpipe.core.checks import Nodes, check_ops
from optpipe.core.errors import ScheduleError
from optpipe.core.problem import Problem
from optpipe.core.schedule import COMPUTE_KINDS, Op, OpKind, Schedule
from optpipe.core.semantics import (CHANNEL, At, Channel, Place, duration_ms, effects, instant, instants, link,
                                    ready_key, waits)
from optpipe.core.units import format_size

__all__ = ["OpTiming", "Timeline", "simulate", "try_simulate", "op_times", "start_times", "describe_fit", "op_duration"]

_F, _B, _W, _BW, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD
_RC = OpKind.RECOMPUTE
_COMPUTE, _D2H = Channel.COMPUTE, Channel.D2H
_FUSED, _OFFLOADED, _RECOMPUTED = 1, 2, 4  # a (stage, microbatch)'s case, as bits


class OpTiming(NamedTuple):
    """When one op runs: a tuple, cheaper to make than a frozen dataclass, and a simulation makes
    one per op (65,568 of them for a p = 32, m = 256 schedule with offloads)."""

    op: Op
    device: int
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """What a schedule does on a problem: when each op runs and what memory it holds."""

    problem: Problem
    schedule_name: str
    timings: tuple[OpTiming, ...]  # per device in list order, devices in turn
    makespan: float  # ms, first start to last end
    busy: tuple[float, ...]  # per device compute time, ms
    memory: tuple[tuple[tuple[float, int], ...], ...]  # per device (time, bytes held after it)
    peak_memory: tuple[int, ...]
    peak_time: tuple[float, ...]
    host_peak: tuple[int, ...]

    @property
    def bubble_ratio(self) -> float:
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan > 0 else 0.0

    @property
    def peak(self) -> int:
        return max(self.peak_memory)

    @property
    def peak_device(self) -> int:
        return max(range(len(self.peak_memory)), key=lambda d: (self.peak_memory[d], -d))

    @property
    def busiest_compute(self) -> float:
        return max(self.busy)

    @property
    def idle_time(self) -> float:
        """Makespan minus the busiest device's compute: the time no schedule can hide."""
        return self.makespan - self.busiest_compute

    @property
    def fits_budget(self) -> bool:
        return self.peak <= self.problem.memory.budget

    @property
    def fits_host(self) -> bool:
        return not self.problem.offload.enabled or max(self.host_peak) <= self.problem.offload.host_budget

    @property
    def fits(self) -> bool:
        return self.fits_budget and self.fits_host

    @cached_property
    def by_op(self) -> dict[Op, OpTiming]:
        return {t.op: t for t in self.timings}

    def summary(self) -> dict:
        return {
            "schedule": self.schedule_name,
            "problem": self.problem.name,
            "makespan_ms": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "busy_ms": list(self.busy),
            "peak_memory_bytes": list(self.peak_memory),
            "peak_time_ms": list(self.peak_time),
            "host_peak_bytes": list(self.host_peak),
            "budget_bytes": self.problem.memory.budget,
            "fits_budget": self.fits,
        }


def _gc_paused(function: Callable) -> Callable:
    """``function`` with Python's cycle collector off while it runs. A simulation builds tens of
    thousands of tuples and lists and no reference cycles, so the collections its allocations set
    off find nothing: on a p = 32, m = 256 schedule with offloads they were about a quarter of its
    time (with OpTiming a tuple, a simulation of seed 1's grid24 start took 0.63 to 0.77 s on
    average before, 0.39 to 0.51 after, alternating runs). Another thread may turn the collector
    back on early; that costs time, nothing else."""

    @wraps(function)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return function(*args, **kwargs)
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            gc.enable()

    return paused


def op_duration(problem: Problem, op: Op) -> float:
    """Milliseconds (semantics.duration_ms; kept here for callers that time ops)."""
    return duration_ms(problem, op)


def _graph(problem: Problem, schedule: Schedule) -> _Graph:
    """Nodes in (device, position) order and, per node, (predecessor node, lag ms).

    The data waits are the op's (semantics.py); the schedule adds the device order of compute
    ops, the issue point of a transfer (the compute op listed before it) and channel order.
    """
    nodes = check_ops(problem, schedule)
    rules = _Rules(problem, nodes)
    index, keys, first = nodes.index, nodes.keys, nodes.first
    preds: list[list[tuple[int, float]]] = []
    effects: list[tuple[tuple[bool, bool, int], ...]] = []
    duration: list[float] = []
    case, known = rules.case.get, rules.known.get
    for device in range(len(schedule.devices)):
        compute = d2h = h2d = None  # the last node on each channel
        for n in range(first[device], first[device + 1]):
            kind, stage, i = keys[n]
            # the rule's key: only backwards ask whether the stage above is fused
            above = (kind is _B or kind is _BW) and bool(case((stage + 1, i), 0) & _FUSED)
            key = (kind, stage, case((stage, i), 0), above)
            channel, data, effect, length = known(key) or rules.rule(key)
            mine = [(compute, 0.0)] if compute is not None else []  # device order, or a transfer's issue point
            if channel is _COMPUTE:
                compute = n
            elif channel is _D2H:
                if d2h is not None:
                    mine.append((d2h, 0.0))
                d2h = n
            else:
                if h2d is not None:
                    mine.append((h2d, 0.0))
                h2d = n
            for wait_kind, wait_stage, lag in data:
                mine.append((index[wait_kind, wait_stage, i], lag))
            preds.append(mine)
            effects.append(effect)
            duration.append(length)
    return _Graph(nodes.ops, nodes.device, preds, effects, duration)


class _Graph(NamedTuple):
    ops: list[Op]
    device: list[int]  # per node
    preds: list[list[tuple[int, float]]]  # per node, (predecessor, lag ms)
    effects: list[tuple[tuple[bool, bool, int], ...]]  # per node, _Rules.rule's
    duration: list[float]  # per node, ms


# Each problem's rules, kept while the problem lives: a search simulates thousands of schedules
# of one problem, and building the rules anew took a sixth of each simulation (p = 12, m = 24)
_KNOWN: weakref.WeakKeyDictionary[Problem, dict] = weakref.WeakKeyDictionary()


class _Rules:
    """semantics.py's answers for one schedule, asked once per (kind, stage, case) and problem:
    the simulator is hot, and an op's waits, effects and duration depend on its microbatch only
    through its own index."""

    def __init__(self, problem: Problem, nodes: Nodes):
        self.problem = problem
        self.case: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> _FUSED | _OFFLOADED | _RECOMPUTED
        for kind, bit in ((_BW, _FUSED), (_OFF, _OFFLOADED), (_RC, _RECOMPUTED)):
            for pair in nodes.of_kind(kind):
                self.case[pair] = self.case.get(pair, 0) | bit
        try:
            self.known: dict = _KNOWN.setdefault(problem, {})
        except TypeError:  # a problem that cannot be hashed or weakly referenced: rules for this schedule only
            self.known = {}

    def rule(self, key: tuple[OpKind, int, int, bool]) -> tuple[Channel, tuple[tuple[OpKind, int, float], ...],
                                                                  tuple[tuple[bool, bool, int], ...], float]:
        """The rule for ``key`` (kind, stage, case bits, whether the stage above is fused), made
        on first use: the op's channel, waits (kind, stage, lag), effects (on the host?, at the
        end?, bytes taken (+) or released (-)) and duration (ms). ``_graph`` makes the keys."""
        rule = self.known.get(key)
        if rule is None:
            kind, s, case, above = key
            op, problem = Op(kind, s, 0), self.problem
            fused, offloaded, recomputed = bool(case & _FUSED), bool(case & _OFFLOADED), bool(case & _RECOMPUTED)
            rule = self.known[key] = (
                CHANNEL[kind],
                tuple((w.op.kind, w.op.stage, w.lag_ms)
                      for w in waits(problem, op, fused_above=above, offloaded=offloaded, recomputed=recomputed)),
                tuple((e.place is Place.HOST, e.at is At.END, e.delta)
                      for e in effects(problem, op, fused=fused, offloaded=offloaded, recomputed=recomputed)),
                duration_ms(problem, op))
        return rule


@_gc_paused
def start_times(problem: Problem, schedule: Schedule, measure: Callable[[float], float]) -> dict[Op, float]:
    """Each op's start under the simulator's rule, with every duration and lag passed through
    ``measure`` first: ``measure=grid.up`` gives a schedule's times in a model's units."""
    graph = _graph(problem, schedule)
    duration = [measure(length) for length in graph.duration]
    scaled = [[(p, measure(lag)) for p, lag in mine] for mine in graph.preds]
    start, _ = _paths(problem, graph.ops, graph.device, scaled, duration)
    return dict(zip(graph.ops, start))


@_gc_paused
def op_times(problem: Problem, schedule: Schedule) -> list[tuple[Op, int, float, float]]:
    """(op, device, start, end) of every op, as ``simulate`` times them, without the memory
    replay: for passes that judge timing alone, many times over (a third of a simulation)."""
    graph = _graph(problem, schedule)
    start, end = _paths(problem, graph.ops, graph.device, graph.preds, graph.duration)
    return list(zip(graph.ops, graph.device, start, end))


def simulate(problem: Problem, schedule: Schedule) -> Timeline:
    timeline = _simulate(problem, schedule, None)
    assert timeline is not None  # no makespan to beat
    return timeline


def try_simulate(problem: Problem, schedule: Schedule, faster_than: float | None = None) -> Timeline | None:
    """The timeline, or None when the schedule breaks a rule: for searches that try many moves
    and drop the ones that do not make a schedule. With ``faster_than`` (ms), None also when the
    makespan is not below it, found before the memory replay and the per-op timings, which are
    then skipped (about 40% of a simulation at p = 32, m = 256)."""
    try:
        return _simulate(problem, schedule, faster_than)
    except ScheduleError:
        return None


@_gc_paused
def _simulate(problem: Problem, schedule: Schedule, faster_than: float | None) -> Timeline | None:
    graph = _graph(problem, schedule)
    ops, node_device = graph.ops, graph.device
    start, end = _paths(problem, ops, node_device, graph.preds, graph.duration)
    first = min(start) if ops else 0.0
    makespan = (max(end) - first) if ops else 0.0
    if faster_than is not None and makespan >= faster_than:
        return None
    timings = tuple(map(OpTiming, ops, node_device, start, end))
    return _replay_memory(problem, schedule, graph, start, end, timings, makespan, first)


def _successors(preds) -> tuple[list[list[tuple[int, float]]], list[int]]:
    """The wait graph turned around: per node its (successor, lag) and how many waits it has."""
    succs: list[list[tuple[int, float]]] = [[] for _ in preds]
    indegree = list(map(len, preds))
    for k, mine in enumerate(preds):
        for p, lag in mine:
            succs[p].append((k, lag))
    return succs, indegree


def _paths(problem: Problem, ops, node_device, preds, duration) -> tuple[list[float], list[float]]:
    if problem.offload.enabled and problem.offload.link_groups:
        return _shared_paths(problem, ops, node_device, preds, duration)
    return _longest_paths(ops, node_device, preds, duration)


def _shared_paths(problem: Problem, ops, node_device, preds, duration) -> tuple[list[float], list[float]]:
    """Start times when devices share host links (semantics.py, "Shared host links").

    Ops are finished in time order (as Dijkstra does: no op makes another start earlier than
    itself), so when a transfer on a shared channel comes up, every transfer that was ready
    before it has already taken the channel: the FIFO by ready time (semantics.ready_key).
    """
    count = len(ops)
    succs, indegree = _successors(preds)
    grouped = {d for group in problem.offload.link_groups for d in group}
    position = [0] * count
    channel_of: list = [None] * count
    seen: dict[int, int] = {}
    for k, op in enumerate(ops):
        d = node_device[k]
        position[k] = seen.get(d, 0)
        seen[d] = position[k] + 1
        channel = CHANNEL[op.kind]
        if channel is not Channel.COMPUTE and d in grouped:
            channel_of[k] = (link(problem, d), channel)
    ready = [0.0] * count
    start = [0.0] * count
    end = [0.0] * count
    free: dict = {}
    heap = [(instant(0.0), ready_key(0.0, node_device[k], position[k]), 0.0, k) for k in range(count) if indegree[k] == 0]
    heapq.heapify(heap)
    done = 0
    while heap:
        _, key, at, k = heapq.heappop(heap)
        channel = channel_of[k]
        if channel is not None:
            busy_until = free.get(channel)
            if busy_until is not None and instant(busy_until) > instant(at):
                heapq.heappush(heap, (instant(busy_until), key, busy_until, k))  # wait for the channel
                continue
            if busy_until is not None:
                at = max(at, busy_until)
        start[k] = at
        finish = at + duration[k]
        end[k] = finish
        if channel is not None:
            free[channel] = finish
        done += 1
        for nxt in _release(succs[k], finish, ready, indegree):
            r = ready[nxt]
            heapq.heappush(heap, (instant(r), ready_key(r, node_device[nxt], position[nxt]), r, nxt))
    if done < count:
        raise ScheduleError(_describe_cycle(ops, node_device, preds, indegree))
    return start, end


def _longest_paths(ops, node_device, preds, duration) -> tuple[list[float], list[float]]:
    """Each op starts when the last of its waits is met: the largest end + lag, or 0. A depth-first
    walk up the waits finishes an op once all it waits for have. Unlike Kahn's order it needs no
    successor lists (a tuple per wait, and more for the garbage collector to chase); a walk that
    comes back to an op it is waiting on has found a cycle."""
    count = len(ops)
    start = [0.0] * count
    end = [0.0] * count
    state = [0] * count  # 0 not reached, 1 on the walk, 2 finished
    for root in range(count):
        if state[root]:
            continue
        walk = [root]
        state[root] = 1
        while walk:
            k = walk[-1]
            for p, _ in preds[k]:
                if state[p] != 2:
                    if state[p] == 1:  # the walk came back to an op it is waiting on
                        raise ScheduleError(_describe_cycle(ops, node_device, preds, _unmet(preds)))
                    state[p] = 1
                    walk.append(p)
                    break
            else:
                walk.pop()
                ready = 0.0
                for p, lag in preds[k]:
                    t = end[p] + lag
                    if t > ready:
                        ready = t
                start[k] = ready
                end[k] = ready + duration[k]
                state[k] = 2
    return start, end


def _unmet(preds) -> list[int]:
    """Per op, its waits on ops that never finish once every op that can has (Kahn's count):
    nonzero on the ops a cycle holds up, for _describe_cycle."""
    succs, indegree = _successors(preds)
    free = [k for k in range(len(preds)) if indegree[k] == 0]
    for k in free:  # grows as ops come free
        for nxt, _ in succs[k]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                free.append(nxt)
    return indegree


def _release(successors, finish: float, ready: list[float], indegree: list[int]):
    """Pass an op's ``finish`` (plus each lag) on to its successors' ready times; yield those
    for which it was the last wait."""
    for nxt, lag in successors:
        t = finish + lag
        if t > ready[nxt]:
            ready[nxt] = t
        indegree[nxt] -= 1
        if indegree[nxt] == 0:
            yield nxt


def _describe_cycle(ops, node_device, preds, indegree) -> str:
    """Walk unfinished predecessors until a node repeats: that loop is the cycle."""
    k = next(n for n in range(len(ops)) if indegree[n] > 0)
    seen: dict[int, int] = {}
    path: list[int] = []
    while k not in seen:
        seen[k] = len(path)
        path.append(k)
        k = next(p for p, _ in preds[k] if indegree[p] > 0)
    loop = path[seen[k]:]
    loop.reverse()  # path follows waits backwards; reversed, each op waits for the one before it
    names = [f"{ops[n]} (device {node_device[n]})" for n in loop]
    chain = " -> ".join(names + [names[0]])
    return (f"dependency cycle: these ops wait on each other, so none can start: {chain}; "
            f"each op waits for the one before it (data dependency or device order); "
            f"reorder the device lists so that every op comes after what it needs")


def _replay_memory(problem: Problem, schedule: Schedule, graph: _Graph, start: list[float], end: list[float],
                   timings: tuple[OpTiming, ...], makespan: float, first: float) -> Timeline:
    """Each op's memory effects (semantics.effects: holds taken at starts, released at ends)
    become events at its times; at one instant releases come before allocations."""
    devices = problem.devices
    on_device: list[list[tuple[float, int, int]]] = [[] for _ in range(devices)]
    on_host: list[list[tuple[float, int, int]]] = [[] for _ in range(devices)]
    busy = [0.0] * devices
    began_at, ended_at = instants(start), instants(end)
    for device, effect, began, ended in zip(graph.device, graph.effects, began_at, ended_at):
        for host, at_end, delta in effect:
            (on_host if host else on_device)[device].append((ended, 0, delta) if at_end else (began, 1, delta))
    for op, device, began, ended in zip(graph.ops, graph.device, start, end):
        if op.kind in COMPUTE_KINDS:
            busy[device] += ended - began
    curves, peaks, peak_times, host_peaks = [], [], [], []
    for d in range(devices):
        curve, peak, when = _curve(on_device[d])
        curves.append(curve)
        peaks.append(peak)
        peak_times.append(when - first if curve else 0.0)
        host_peaks.append(_curve(on_host[d])[1])
    return Timeline(
        problem=problem,
        schedule_name=schedule.name,
        timings=timings,
        makespan=makespan,
        busy=tuple(busy),
        memory=tuple(curves),
        peak_memory=tuple(peaks),
        peak_time=tuple(peak_times),
        host_peak=tuple(host_peaks),
    )


def _curve(events: list[tuple[float, int, int]]) -> tuple[tuple[tuple[float, int], ...], int, float]:
    """Frees at an instant happen before allocations at the same instant."""
    events.sort()
    held = peak = 0
    when = 0.0
    curve: list[tuple[float, int]] = []
    for time, _, delta in events:
        held += delta
        if curve and curve[-1][0] == time:
            curve[-1] = (time, held)
        else:
            curve.append((time, held))
        if held > peak:
            peak, when = held, time
    return tuple(curve), peak, when


def describe_fit(timeline: Timeline) -> str:
    budget = timeline.problem.memory.budget
    return f"peak {format_size(timeline.peak)} on device {timeline.peak_device} against a budget of {format_size(budget)}"
