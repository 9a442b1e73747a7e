"""The idle the budget forces at the ends of a device's run: before its first backward, after
its last forward and after its last backward.

Both arguments count a device's time: from its earliest start to the makespan it runs all its
F, B and W (``work``), any recomputes, and is otherwise idle; so the makespan is at least
``head + work + idle`` for any idle that must happen. Recomputes are extra work, never part of
``work``, so they fill no idle that is counted here.

- **Drain.** Let F(s, i) be the last forward the device starts, at t. It is a forward of the
  device's highest stage s (a forward of a lower stage is followed on the device by the same
  microbatch's forward of every higher stage), so every forward is done by t + F(s). From then
  to the start of B(low, i) on the device's lowest stage passes at least the data path between
  them (``span``: the round trip through the later stages, and back down through the device's
  other stages). The device fills that window only with that microbatch's B and W on its other
  stages and the B and W of pairs still pending at t. At t, memory holds F(s, i)'s whole
  activation, the same microbatch's on every lower stage (its backward comes later still;
  offloaded it may hold nothing) and, for each pending pair, its activation (B to come: ``a``,
  recomputed its resident part, offloaded nothing) or its weight part (only W to come:
  ``keep``). An offloaded pair's reload starts no earlier than t (started earlier it would hold
  memory), and the device's reloads run one at a time, so the j-th ends no earlier than
  t + j x reload. The most work the held pairs bring is a knapsack (relaxed to an LP, bounded
  through its dual); with what the reloads allow, the rest of the window is idle.
- **Warm-up.** Before the device's first backward (no earlier than the first microbatch's round
  trip to its highest stage) it runs only forwards (and recomputes), and every one of them still
  holds its activation then, unless its offload ended, and the offloads run one at a time after
  the first forward. The forward work that fits is again a knapsack; the rest of that window is idle.
  The same window is idle where the devices before it cannot pass forwards on fast enough
  (pace.py, given as ``paced``).
- **Burst.** A device that holds stage 0 alone (v = 1, no recompute) cannot pace its warm-up to
  its host link: stage 0's forwards wait for no data, and an op starts as soon as its device and
  data allow, so every forward before the first backward runs back to back from time 0. The k-th
  starts at (k - 1) x F and takes its activation then, while the offloads, one at a time, have
  freed at most those that ended by then (each starting no earlier than its forward's end). The
  first forward that does not fit ends the burst: at most K forwards, and the window less K x F is
  idle; with K below m, not every forward can come before the first backward. The knapsack above
  lets the offloads keep pace instead (seed 1's grid08, p = 8, k = 2: 72.1 ms of idle before
  device 0's first backward there, 143.6 here).

- **Last backward.** The device's last backward is on its lowest stage (the same reason), and
  after it ends the makespan is still at least that stage's tail away (the backward passes
  below it, on other devices, and W). All F and B are done by then: only W passes are left, and
  each holds its pair's weight part (``keep``) until it ends, offloaded or not. When the last
  backward starts, its own pair still holds its whole activation, so the W passes left are its
  own and those whose weight parts fit beside it: a knapsack again; the rest of the tail is idle.

The last window begins after the drain's ends (the drain's microbatch has a backward on the
lowest stage too). The first two do not overlap when the first backward starts before the last forward. If it
does not, every forward of the device is started before any backward: without offload that
needs room for all of them, which the budget refuses whenever a bound here counts; with
offload, enough of them must have gone to the host first, one offload at a time, and the time
before the last forward that those offloads take and the forwards cannot fill is idle in its
place. The bound takes the smaller of the two cases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import duration_ms, stage_ms

__all__ = ["PhaseIdle", "most_pairs", "phase_idle"]

_F, _B, _W, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.OFFLOAD, OpKind.RELOAD
_INF = float("inf")
_SLACK_MS = 1e-6  # an offload that ends this close after a forward's start counts as freed before it


@dataclass(frozen=True)
class PhaseIdle:
    """A device's forced idle (ms) in each window, and the bound it gives."""

    device: int
    start: float  # the earliest any op of the device can start
    work: float  # its F, B and W
    before_backward: float  # idle before the first backward, when it starts before the last forward
    forwards_first: float  # idle before the last forward, when every forward starts before any backward
    drain: float  # idle after the last forward
    last: float  # idle after the last backward

    @property
    def warm_up(self) -> float:
        """The idle of the device's first window, whichever of the two cases holds."""
        return min(self.before_backward, self.forwards_first)

    @property
    def idle(self) -> float:
        return self.warm_up + self.drain + self.last

    @property
    def value(self) -> float:
        return self.start + self.work + self.idle

    def with_ends(self, warm_up: float, cool_down: float) -> float:
        """The bound with two more proofs of idle (ends_relax.py): ``warm_up`` in a window
        before the first backward, ``cool_down`` in one after the last forward ends. Each is a
        part of the window its own argument here counts, so the larger of the two holds there."""
        first = min(max(self.before_backward, warm_up), self.forwards_first)
        return self.start + self.work + first + max(self.drain + self.last, cool_down)


@dataclass(frozen=True)
class _Item:
    """One way a pending pair can be held: its bytes, and the counted work it can bring."""

    bytes: float
    work: float


_NODES = 5000  # choices the exact knapsack may try before the LP's bound is taken instead


def _most_work(groups: list[tuple[int, list[_Item]]], capacity: float) -> float:
    """The most work whole items of total bytes within ``capacity`` bring, at most ``count``
    from each group: exact when few items fit (pairs are whole), else the LP's bound."""
    capacity = max(0.0, capacity)
    if any(len(items) > 2 or any(item.bytes <= 0 for item in items) for _, items in groups):
        return _knapsack_dual(groups, capacity)
    # what the groups from k on can bring at most: each pair its best work, each byte the best rate
    rate = [max(item.work / item.bytes for item in items) for _, items in groups]
    most = [count * max(item.work for item in items) for count, items in groups]
    best, nodes = 0.0, 0

    def visit(k: int, room: float, work: float) -> None:
        nonlocal best, nodes
        if k == len(groups):
            best = max(best, work)
            return
        if work + min(sum(most[k:]), room * max(rate[k:])) <= best:
            return
        nodes += 1
        if nodes > _NODES:
            raise OverflowError
        count, items = groups[k]
        first, second = items[0], items[1] if len(items) > 1 else None
        for n in range(min(count, int(room // first.bytes)), -1, -1):
            left = room - n * first.bytes
            if second is None:
                visit(k + 1, left, work + n * first.work)
                continue
            top = min(count - n, int(left // second.bytes))
            for extra in (range(top, -1, -1) if k + 1 < len(groups) else (top,)):
                visit(k + 1, left - extra * second.bytes, work + n * first.work + extra * second.work)

    try:
        visit(0, capacity, 0.0)
    except OverflowError:
        return _knapsack_dual(groups, capacity)
    return best


def _knapsack_dual(groups: list[tuple[int, list[_Item]]], capacity: float) -> float:
    """An upper bound on the most work items of total bytes within ``capacity`` bring, at most
    ``count`` items from each group: the LP relaxation's dual, min over a price p >= 0 of
    p x capacity + sum count x max(0, best work - p x bytes). Any price gives a valid bound; the
    least over the breakpoints is the LP's optimum."""
    capacity = max(0.0, capacity)
    prices = {0.0}
    for _, items in groups:
        for a in items:
            if a.bytes > 0:
                prices.add(a.work / a.bytes)
            for b in items:
                if a.bytes != b.bytes:
                    price = (a.work - b.work) / (a.bytes - b.bytes)
                    if price > 0:
                        prices.add(price)

    def dual(price: float) -> float:
        return price * capacity + sum(count * max(0.0, max(a.work - price * a.bytes for a in items))
                                      for count, items in groups if items)

    return min(dual(price) for price in prices)


def phase_idle(problem: Problem, device: int, head: dict, tail: dict, paced: float = 0.0) -> PhaseIdle:
    """The forced idle of ``device`` and its bound; ``head`` and ``tail``: each (kind, stage)'s
    earliest start and least time after its end, for one microbatch alone (bounds.data_paths);
    ``paced``: idle before its first backward from the pace of its feeders (pace.py)."""
    pipe, memory, offload, recompute = problem.pipeline, problem.memory, problem.offload, problem.recompute
    f, b, w = (stage_ms(problem, kind) for kind in (_F, _B, _W))
    m, budget = pipe.microbatches, memory.budget
    stages = pipe.stages_on(device)
    top = max(stages)
    start = min(head[(_F, s)] for s in stages)
    work = m * sum(f[s] + b[s] + w[s] for s in stages)
    act, keep = memory.activation, memory.weight_activation
    pending = {s: min(act[s], recompute.resident[s]) if recompute.enabled else act[s] for s in stages}
    out_ms = min(duration_ms(problem, Op(_OFF, s, 0)) for s in stages) if offload.enabled else _INF
    back_ms = min(duration_ms(problem, Op(_REL, s, 0)) for s in stages) if offload.enabled else _INF

    low = min(stages)
    span = head[(_B, low)] - head[(_F, top)] - f[top]  # from the last forward's end to B(low)'s start
    drain = _drain_idle(problem, (f, b, w), stages, span, pending, back_ms)
    last = _last_idle(problem, w, stages, tail[(_B, low)])
    burst = _burst(problem, stages, f, out_ms)
    warm = max(_warm_idle(problem, f, stages, head[(_B, top)] - start, pending, out_ms),
               head[(_B, top)] - start - burst * f[top], paced)
    # Case B: every forward before the first backward. At the last forward's start the device
    # holds every pair it has not offloaded; with offload the offloads that make room end first.
    pairs = m * len(stages)
    room = most_pairs(pending, {s: m - 1 if s == top else m for s in stages}, budget - act[top])
    must_go = max(0, pairs - 1 - room)
    if burst < pairs:  # a burst that ends before the last forward: some backward comes first
        case_b = _INF
    elif must_go == 0:
        case_b = 0.0
    elif offload.enabled:
        forwards = m * sum(f[s] for s in stages)
        case_b = max(0.0, min(f[s] for s in stages) + must_go * out_ms - (forwards - f[top]))
    else:
        case_b = _INF
    return PhaseIdle(device, start, work, warm, case_b, drain, last)


def _drain_idle(problem: Problem, costs: tuple[tuple[float, ...], ...], stages: tuple[int, ...], span: float,
                pending: dict[int, int], back_ms: float) -> float:
    """Idle between the last forward's end and the start of the same microbatch's B on the
    device's lowest stage, at least ``span`` later. In between the device runs that
    microbatch's B (and perhaps W) on its other stages, and pending pairs' B and W."""
    memory, m = problem.memory, problem.microbatches
    f, b, w = costs
    keep = memory.weight_activation
    top, low = max(stages), min(stages)
    # the running forward's whole activation, and the same microbatch's on every lower stage
    capacity = memory.budget - memory.activation[top]
    if not problem.offload.enabled:
        capacity -= sum(pending[s] for s in stages if s != top)
    groups = [(m - 1, [_Item(keep[s], w[s]), _Item(pending[s], b[s] + w[s])]) for s in stages]
    held = _most_work(groups, capacity)
    window = span - sum(b[s] + w[s] for s in stages if s != low)
    reloaded = 0.0
    if problem.offload.enabled:
        most = max(b[s] + w[s] for s in stages)
        j = 1
        while j <= len(stages) * m and f[top] + span - j * back_ms > 0 and held + reloaded < window:
            reloaded += min(most, f[top] + span - j * back_ms)
            j += 1
    return max(0.0, window - held - reloaded)


def _last_idle(problem: Problem, w: tuple[float, ...], stages: tuple[int, ...], after: float) -> float:
    """Idle after the device's last backward, whose end leaves at least ``after`` to the makespan:
    only W passes are left to run, and each holds its weight part until it ends. When that
    backward starts it holds its own pair's whole activation, so the W passes deferred past it
    are its own and those whose weight parts fit beside that activation."""
    memory, m = problem.memory, problem.microbatches
    low = min(stages)
    groups = [(m - 1 if s == low else m, [_Item(memory.weight_activation[s], w[s])]) for s in stages]
    deferred = w[low] + _most_work(groups, memory.budget - memory.activation[low])
    return max(0.0, after - deferred)


def _warm_idle(problem: Problem, f: tuple[float, ...], stages: tuple[int, ...], window: float,
               pending: dict[int, int], out_ms: float) -> float:
    """Idle before the first backward, which starts no earlier than ``window`` after the device's start."""
    m = problem.microbatches
    groups = [(m, [_Item(pending[s], f[s])]) for s in stages]
    held = _most_work(groups, problem.memory.budget)
    if not problem.offload.enabled:
        return max(0.0, window - held)
    # The n-th offload ends no earlier than the first forward's end plus n offloads; each frees
    # room for at most one more forward. The window may run longer than its least length: take
    # the least idle over every length from there on (at the offload ends, where it drops).
    first, most, pairs = min(f[s] for s in stages), max(f[s] for s in stages), m * len(stages)

    # Offload counts are rounded up (a generous 1e-6 of an offload), so rounding never adds idle.
    n = min(pairs, max(0, math.floor((window - first) / out_ms + 1e-6)))
    idles = [window - held - n * most]
    idles += [first + k * out_ms - held - k * most for k in (n + 1, pairs) if n < k]
    return max(0.0, min(idles))


def _burst(problem: Problem, stages: tuple[int, ...], f: tuple[float, ...], out_ms: float) -> float:
    """How many forwards the device can run before its first backward when they run back to back
    from time 0 (the module docstring's burst); inf where the argument does not hold."""
    if stages != (0,) or problem.recompute.enabled:
        return _INF
    act, budget, m = problem.memory.activation[0], problem.memory.budget, problem.microbatches
    ends: list[float] = []  # the offloads' earliest ends, one at a time, so in order
    freed = 0
    for k in range(m):
        start = k * f[0]
        while freed < len(ends) and ends[freed] <= start + _SLACK_MS:  # frees first at one instant, generously
            freed += 1
        if (k + 1 - freed) * act > budget:
            return k
        ends.append(max(start + f[0], ends[-1] if ends else 0.0) + out_ms)
    return m


def most_pairs(sizes: dict[int, int], limits: dict[int, int], room: int) -> int:
    """How many pairs fit in ``room`` bytes at once, at most ``limits[s]`` of stage s, each holding
    ``sizes[s]``: the smallest first."""
    count = 0
    for s in sorted(sizes, key=lambda s: sizes[s]):
        size, limit = sizes[s], limits[s]
        take = limit if size <= 0 else min(limit, max(0, room) // size)
        count += take
        room -= take * size
    return count
