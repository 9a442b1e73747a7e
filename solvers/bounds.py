"""Analytic lower bounds: no schedule that fits can be faster, and no budget below this can fit.

Makespan: the largest of three arguments, each valid for every schedule the simulator accepts.

- Per device, a one-machine relaxation (Carlier's bound): every compute op of the device is a
  job with a release (the longest data path before it, counting p2p, and the fact that the
  j-th op of a stage waits for j+1 ops of the neighbouring stage) and a tail (the longest data
  path after it). Every other device adds its own work to both: before the j-th F of a stage
  it has run j + 1 forwards of each of its stages below, one at a time; after the k-th F from
  the last it still has k + 1 microbatches' forwards above and backward passes (B and W) to
  run (``_other_devices``). Jackson's preemptive schedule, largest tail first, solves the preemptive
  relaxation exactly; its max(completion + tail) is a bound. This covers per-device work and
  pipeline fill and drain at once.
- What the budget forces at a device's ends (``phases.py``): before its first backward it runs
  only forwards, each holding its activation; after its last forward, until the same
  microbatch's backward comes back, only what pending microbatches still hold on the device;
  after its last backward only deferred W passes, whose weight parts stay on the device. Where
  the budget holds few of them, the device idles there, whatever the order.
- How fast the devices before it can pass forwards on (``pace.py``): each holds back its forwards of
  every chunk together, by its budget and host link, so a device's warm-up may starve for them.
- What the budget and the host link force: memory a device holds over time (bytes x ms) is at
  most budget x (makespan - the earliest its first forward can start). Each activation is held
  at least from F's start to B's end (its round trip through the later stages) plus its weight
  part until W ends, or, offloaded, for F plus the offload and the reload plus B; and the
  device's offloads (reloads) run one at a time on its D2H (H2D) channel, so within the
  makespan only so many can go to the host. The least area for a given makespan (offloading
  the best savings per ms of link first, fractions allowed) against the room the budget gives
  meets at the bound (``_area_bound``).
  A recomputed activation holds at least its whole size for F, the recompute and B.
- The same argument with whole activations (``packing.py``): at any instant the budget holds a
  whole number of each stage's activations and weight parts, which can be far less than the
  bytes allow when only a few fit. A covering LP over those memory configurations bounds it.

A split backward (B then W) relaxes a fused BW, so bounds computed with B and W apart hold for
schedules that fuse them.

Memory: with offload off, when the last stage of a device starts its forward for a microbatch,
the device still holds that microbatch's activation of each of its earlier stages, so the
budget must hold the sum of its stages' activations; with offload on only one activation must
fit at a time.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import duration_ms, lag_ms, stage_ms
from optpipe.core.units import format_size

from .fill import device_frees, memory_releases
from .pace import warm_up_pace_idle
from .packing import packing_bound
from .phases import PhaseIdle, phase_idle

__all__ = [
    "Bound",
    "Paths",
    "data_paths",
    "makespan_lower_bound",
    "device_job",
    "device_jobs",
    "device_lower_bound",
    "device_phases",
    "warm_up_pace",
    "memory_area_bound",
    "memory_lower_bound",
]

_F, _B, _W, _BW = OpKind.F, OpKind.B, OpKind.W, OpKind.BW
_OFF, _REL, _RC = OpKind.OFFLOAD, OpKind.RELOAD, OpKind.RECOMPUTE
_EPS_MS = 1e-9


@dataclass(frozen=True)
class Bound:
    value: float  # ms for a makespan bound, bytes for a memory bound
    reason: str  # the argument that gives it, in words


@dataclass(frozen=True)
class Paths:
    """Per stage: earliest start (head) and the least time after the end (tail) of F, B, W."""

    head: dict[tuple[OpKind, int], float]
    tail: dict[tuple[OpKind, int], float]
    lag_up: tuple[float, ...]  # lag_up[s]: p2p from stage s to s+1 (0 on the same device)
    gap: tuple[float, ...]  # least time from F(s)'s end to B(s)'s start: the round trip through later stages


def data_paths(problem: Problem) -> Paths:
    """Heads and tails of one microbatch's data chain F(0..S-1) -> B(S-1..0), B(s) -> W(s)."""
    S = problem.stages
    f, b, w = (stage_ms(problem, kind) for kind in (_F, _B, _W))
    lag_up = tuple(lag_ms(problem, s, s + 1) for s in range(S - 1))
    head: dict = {}
    tail: dict = {}
    head[(_F, 0)] = 0.0
    for s in range(1, S):
        head[(_F, s)] = head[(_F, s - 1)] + f[s - 1] + lag_up[s - 1]
    head[(_B, S - 1)] = head[(_F, S - 1)] + f[S - 1]
    for s in range(S - 2, -1, -1):
        head[(_B, s)] = head[(_B, s + 1)] + b[s + 1] + lag_up[s]
    for s in range(S):
        head[(_W, s)] = head[(_B, s)] + b[s]
        tail[(_W, s)] = 0.0
    tail[(_B, 0)] = w[0]
    for s in range(1, S):
        tail[(_B, s)] = max(w[s], lag_up[s - 1] + b[s - 1] + tail[(_B, s - 1)])
    tail[(_F, S - 1)] = b[S - 1] + tail[(_B, S - 1)]
    for s in range(S - 2, -1, -1):
        tail[(_F, s)] = lag_up[s] + f[s + 1] + tail[(_F, s + 1)]
    gap = tuple(head[(_B, s)] - head[(_F, s)] - f[s] for s in range(S))
    return Paths(head, tail, lag_up, gap)


def _jobs(problem: Problem, paths: Paths, device: int, fitting: bool) -> list[tuple[float, float, float]]:
    """(release, duration, tail) of every compute op on ``device``.

    The j-th F of stage s (in time order) needs j+1 forwards of stage s-1 done, which run one at
    a time on their device; so it is released no earlier than head + j x F(s-1) when s-1 is on
    another device. Symmetrically the j-th from last still has j+1 forwards of stage s+1 after
    it. The same holds for B along the backward chain.
    """
    pipe = problem.pipeline
    f, b, w = (stage_ms(problem, kind) for kind in (_F, _B, _W))
    S, m = pipe.stages, pipe.microbatches
    other = lambda s: 0 <= s < S and pipe.device_of(s) != device  # noqa: E731
    lines = _other_devices(problem, paths, device)
    fill = _fill(problem) if fitting else None
    jobs = []
    for s in pipe.stages_on(device):
        fill_f, fill_b = (fill[(_F, s)], fill[(_B, s)]) if fill else ([0.0] * m, [0.0] * m)
        for j in range(m):
            k = m - 1 - j  # forwards after this one
            release = paths.head[(_F, s)] + (j * f[s - 1] if other(s - 1) else 0.0)
            release = max(release, _envelope(lines[(_F, s, "release")], j + 1), fill_f[j])
            after = paths.tail[(_F, s)] + (k * f[s + 1] if other(s + 1) else 0.0)
            after = max(after, _envelope(lines[(_F, s, "tail")], k + 1))
            jobs.append((release, f[s], after))
            upstream = s + 1  # where B comes from
            release = paths.head[(_B, s)] + (j * b[upstream] if other(upstream) else 0.0)
            release_b = max(release, _envelope(lines[(_B, s, "release")], j + 1), fill_b[j])
            after = paths.tail[(_B, s)]
            if other(s - 1):
                after = max(after, paths.lag_up[s - 1] + (k + 1) * b[s - 1] + paths.tail[(_B, s - 1)])
            after = max(after, _envelope(lines[(_B, s, "tail")], k + 1))
            jobs.append((release_b, b[s], after))
            release = paths.head[(_W, s)] + (j * b[upstream] if other(upstream) else 0.0)
            jobs.append((max(release, release_b + b[s]), w[s], 0.0))
    return jobs


@lru_cache(maxsize=16)
def _fill(problem: Problem) -> dict[tuple[OpKind, int], list[float]]:
    """What the budget does to the fill (fill.py); cached, as every device's relaxation asks."""
    return memory_releases(problem, data_paths(problem).head)


@lru_cache(maxsize=16)
def warm_up_pace(problem: Problem) -> tuple[float, ...]:
    """Per device, the idle before its first backward that its feeders' pace forces (pace.py);
    cached, as every device's ends ask."""
    return warm_up_pace_idle(problem, data_paths(problem).head, device_frees(problem, _fill(problem)))


def device_phases(problem: Problem, paths: Paths) -> dict[int, PhaseIdle]:
    """Every device's forced idle at its ends (phases.py) with its feeders' pace (pace.py): the one
    place that pairs them, for this bound and the relaxations that start from it."""
    paced = warm_up_pace(problem)
    return {d: phase_idle(problem, d, paths.head, paths.tail, paced[d]) for d in range(problem.devices)}


def _other_devices(problem: Problem, paths: Paths, device: int) -> dict[tuple, list[tuple[float, float]]]:
    """What the other devices' own work adds to a release or a tail of ``device``'s ops: lines
    (intercept, slope per microbatch) whose value at n bounds the n-th release or tail.

    Before the j-th F(s) in time order starts, j + 1 microbatches have their F(s) started, so
    every other device has run their forwards of each of its stages below s, one at a time, from
    the earliest any of them can start; the last of those ends no earlier than that start plus
    (j + 1) times their durations, and the data still needs the least delay from one of them to
    F(s). The j-th B(s) likewise waits for every forward and for the backwards above s of j + 1
    microbatches; the j-th W(s) for a B(s) that starts no earlier than the j-th. After the k-th
    F(s) from the last ends, the k + 1 microbatches whose F(s) ends no earlier still need, on
    every other device, their forwards above s and all their backward passes (B and W); after
    the k-th B(s) from the last, their B and W below s. Those run one at a time on that device,
    no earlier than the least delay from F(s) (B(s)) to one of them, and end by the makespan.
    """
    pipe = problem.pipeline
    f, b, w = (stage_ms(problem, kind) for kind in (_F, _B, _W))
    head = paths.head
    others = [pipe.stages_on(d) for d in range(pipe.devices) if d != device]
    out: dict[tuple, list[tuple[float, float]]] = {}
    for s in pipe.stages_on(device):
        end_f, end_b = head[(_F, s)] + f[s], head[(_B, s)] + b[s]
        rel_f, rel_b, tail_f, tail_b = [], [], [], []
        for stages in others:
            below = [t for t in stages if t < s]
            above = [t for t in stages if t > s]
            if below:  # forwards below s, before F(s)
                start = min(head[(_F, t)] for t in below)
                delay = min(head[(_F, s)] - head[(_F, t)] - f[t] for t in below)
                rel_f.append((start + delay, sum(f[t] for t in below)))
            # every forward of the device and its backwards above s, before B(s)
            ops = [(_F, t, f[t]) for t in stages] + [(_B, t, b[t]) for t in above]
            start = min(head[(kind, t)] for kind, t, _ in ops)
            delay = min(head[(_B, s)] - head[(kind, t)] - ms for kind, t, ms in ops)
            rel_b.append((start + delay, sum(ms for *_, ms in ops)))
            # forwards above s, every B and W of the device, after F(s)
            ops = [(_F, t) for t in above] + [(_B, t) for t in stages]
            work = sum(f[t] for t in above) + sum(b[t] + w[t] for t in stages)
            tail_f.append((min(head[op] for op in ops) - end_f, work))
            if below:  # B and W below s, after B(s)
                tail_b.append((min(head[(_B, t)] for t in below) - end_b, sum(b[t] + w[t] for t in below)))
        out[(_F, s, "release")] = _prune(rel_f, pipe.microbatches)
        out[(_B, s, "release")] = _prune(rel_b, pipe.microbatches)
        out[(_F, s, "tail")] = _prune(tail_f, pipe.microbatches)
        out[(_B, s, "tail")] = _prune(tail_b, pipe.microbatches)
    return out


def _prune(lines: list[tuple[float, float]], m: int) -> list[tuple[float, float]]:
    """The lines that may be the largest somewhere in [1, m] (a line below another at both ends
    is below it everywhere between)."""
    ends = [(a + x, a + m * x) for a, x in lines]
    return [line for n, line in enumerate(lines)
            if not any(o != n and ends[o][0] >= ends[n][0] and ends[o][1] >= ends[n][1] and (ends[o] != ends[n] or o < n)
                       for o in range(len(lines)))]


def _envelope(lines: list[tuple[float, float]], n: int) -> float:
    return max((a + n * x for a, x in lines), default=0.0)


def _jackson_preemptive(jobs: list[tuple[float, float, float]]) -> float:
    """max(C_j + q_j) of the preemptive schedule that always runs the released job of largest tail."""
    pending = sorted(jobs)  # by release
    ready: list[tuple[float, int, float]] = []  # (-tail, index, remaining)
    time, k, best, n = 0.0, 0, 0.0, len(pending)
    while k < n or ready:
        if not ready and time < pending[k][0]:
            time = pending[k][0]
        while k < n and pending[k][0] <= time:
            r, p, q = pending[k]
            heapq.heappush(ready, (-q, k, p))
            k += 1
        neg_q, index, remaining = heapq.heappop(ready)
        next_release = pending[k][0] if k < n else float("inf")
        run = min(remaining, next_release - time)
        time += run
        if run < remaining:
            heapq.heappush(ready, (neg_q, index, remaining - run))
        else:
            best = max(best, time - neg_q)
    return best


def device_jobs(problem: Problem, paths: Paths, device: int) -> list[tuple[float, float, float]]:
    """(release, duration, tail) of the device's j-th F, B and W of each stage in time order, for
    schedules that fit: per stage, per j, F then B then W (``device_job`` finds one)."""
    return _jobs(problem, paths, device, True)


def device_job(jobs: list[tuple[float, float, float]], m: int, index: int, rank: int,
               kind: OpKind) -> tuple[float, float, float]:
    """From ``device_jobs``: the rank-th F, B or W in time order of the device's index-th stage."""
    return jobs[(index * m + rank) * 3 + (_F, _B, _W).index(kind)]


def device_lower_bound(problem: Problem, device: int, paths: Paths | None = None, *, fitting: bool = False) -> float:
    """Jackson's preemptive bound for one device's compute ops; ``fitting`` adds what the budget does
    to the fill (fill.py), which holds only for schedules that fit."""
    return _jackson_preemptive(_jobs(problem, paths or data_paths(problem), device, fitting))


def memory_area_bound(problem: Problem, paths: Paths | None = None) -> Bound:
    """Makespan >= what the budget and the host link force on the busiest device (see ``_area_bound``)."""
    paths = paths or data_paths(problem)
    best = Bound(0.0, "")
    for device in range(problem.devices):
        for bound in (_area_bound(problem, paths, device), _packing_bound(problem, paths, device)):
            if bound.value > best.value:
                best = bound
    return best


def _packing_bound(problem: Problem, paths: Paths, device: int) -> Bound:
    """What whole activations force (packing.py), from the device's data paths."""
    stages = problem.pipeline.stages_on(device)
    f = stage_ms(problem, _F)
    value = packing_bound(problem, device, head=min(paths.head[(_F, s)] for s in stages),
                          first_end=min(paths.head[(_F, s)] + f[s] for s in stages),
                          gap={s: paths.gap[s] for s in stages},
                          tail_after_b=min(paths.tail[(_B, s)] for s in stages))
    if value is None:
        return Bound(0.0, "")
    return Bound(value, f"device {device}: the budget of {format_size(problem.memory.budget)} holds whole "
                        f"activations only, so they fit only over at least {value:,.1f} ms")


def _area_bound(problem: Problem, paths: Paths, device: int) -> Bound:
    """The least T at which the device's activations fit into budget x (T - head), bytes x ms.

    An activation of stage s held on the device costs at least act x (F + gap + B) bytes x ms,
    plus keep x W for the part W still needs; offloaded, act x (F + offload + reload + B) + keep x W.
    Offloading is limited by the host link: the device's offloads run one at a time on its D2H
    channel and its reloads on its H2D channel, both after the device's first forward ends, so
    their durations sum to at most T minus the earliest that can be. Relaxing the choice of what to
    offload to fractions (the best savings per ms of link first) gives the least area for each
    T, which falls as T grows while the room budget x (T - head) rises; the bound is where they
    meet, found by bisection. ``head`` is the earliest any forward of the device can start. Each
    channel gives a bound on its own; the larger holds.
    """
    pipe, memory, offload = problem.pipeline, problem.memory, problem.offload
    f, b, w = (stage_ms(problem, kind) for kind in (_F, _B, _W))
    m, budget = pipe.microbatches, memory.budget
    stages = pipe.stages_on(device)
    head = min(paths.head[(_F, s)] for s in stages)
    first_end = min(paths.head[(_F, s)] + f[s] for s in stages)  # no transfer starts before
    resident = 0.0
    # per stage that gains by offloading: (saving per ms of D2H, per ms of H2D, D2H ms, H2D ms, saving, count)
    savings: list[tuple[float, float, float, float, float, int]] = []
    for s in stages:
        act, keep = memory.activation[s], memory.weight_activation[s]
        held = act * (f[s] + paths.gap[s] + b[s])
        if problem.recompute.enabled:  # recomputed: the whole activation for F, the recompute and B
            held = min(held, act * (f[s] + duration_ms(problem, Op(_RC, s, 0)) + b[s]))
        resident += m * (held + keep * w[s])
        if offload.enabled:
            out, back = duration_ms(problem, Op(_OFF, s, 0)), duration_ms(problem, Op(_REL, s, 0))
            saved = held - act * (f[s] + out + back + b[s])
            if saved > 0:
                savings.append((saved / out, saved / back, out, back, saved, m))
    value, why = resident / budget + head, "without offload"
    if savings:
        candidates = []
        for channel in (0, 1):
            order = sorted(savings, key=lambda item: -item[channel])
            least = lambda T: _least_area(resident, order, channel, T - first_end)  # noqa: E731
            candidates.append(_meet(least, budget, head, value))
        value = max(candidates)
        why = "with what its host link can move"
    reason = (f"device {device}: the budget of {format_size(budget)} holds its activations ({why}) "
              f"only over at least {value:,.1f} ms")
    return Bound(value, reason)


def _least_area(resident: float, order: list, channel: int, link_ms: float) -> float:
    """Resident area minus the best fractional savings that ``link_ms`` of one channel allows."""
    area, room = resident, max(0.0, link_ms)
    for item in order:
        length, saved, count = item[2 + channel], item[4], item[5]
        if room <= 0:
            break
        take = min(count, room / length)
        area -= take * saved
        room -= take * length
    return area


def _meet(least, budget: int, head: float, upper: float) -> float:
    """The least T in [head, upper] with least(T) <= budget x (T - head), to 1e-9 relative."""
    low, high = head, upper
    if least(high) > budget * (high - head):  # cannot happen: at ``upper`` the resident area fits
        return high
    for _ in range(100):
        mid = (low + high) / 2
        if least(mid) <= budget * (mid - head):
            high = mid
        else:
            low = mid
        if high - low <= 1e-9 * max(1.0, high):
            break
    return low


def makespan_lower_bound(problem: Problem) -> Bound:
    """The largest of the per-device relaxations, the idle the budget forces at a device's ends
    (phases.py) and the memory-area bound."""
    paths, pace = data_paths(problem), warm_up_pace(problem)
    phases = device_phases(problem, paths)
    best = Bound(0.0, "")
    for device in range(problem.devices):
        busy = problem.microbatches * sum(duration_ms(problem, Op(kind, s, 0))
                                          for s in problem.pipeline.stages_on(device) for kind in (_F, _BW))
        value = device_lower_bound(problem, device, paths, fitting=True)
        if value > best.value:
            slowed = value > device_lower_bound(problem, device, paths) + _EPS_MS
            best = Bound(value, f"device {device}: {busy:,.1f} ms of compute "
                                f"plus pipeline fill and drain" + (", the fill slowed by the budget" if slowed else ""))
        ends = phases[device]
        if ends.value > best.value + _EPS_MS:
            paced = ends.warm_up > _EPS_MS and pace[device] >= ends.warm_up - _EPS_MS
            first = "before its first backward" + (", forwards coming no faster than it and its feeders can hold them"
                                                   if paced else "")
            where = [f"{ms:,.1f} ms {when}" for ms, when in ((ends.warm_up, first),
                                                           (ends.drain, "after its last forward"),
                                                           (ends.last, "after its last backward")) if ms > _EPS_MS]
            best = Bound(ends.value, f"device {device}: {busy:,.1f} ms of compute from {ends.start:,.1f} ms on, "
                                     f"and the budget of {format_size(problem.memory.budget)} leaves it idle "
                                     + ", ".join(where))
    area = memory_area_bound(problem, paths)
    return area if area.value > best.value else best


def memory_lower_bound(problem: Problem) -> Bound:
    """No budget below this fits any schedule (bytes)."""
    pipe, act = problem.pipeline, problem.memory.activation
    largest = max(range(pipe.stages), key=lambda s: act[s])
    best = Bound(float(act[largest]), f"stage {largest} holds {format_size(act[largest])} while its forward runs")
    if not problem.offload.enabled and not problem.recompute.enabled:  # both let a device hold less at once
        for device in range(pipe.devices):
            total = sum(act[s] for s in pipe.stages_on(device))
            if total > best.value:
                best = Bound(float(total), f"device {device} holds one activation of each of its "
                                           f"{len(pipe.stages_on(device))} stages at once ({format_size(total)})")
    return best
