"""Analytic lower bounds: no schedule that fits can be faster, and no budget below this can fit.

Makespan: the larger of two arguments, each valid for every schedule the simulator accepts.

- Per device, a one-machine relaxation (Carlier's bound): every compute op of the device is a
  job with a release (the longest data path before it, counting p2p, and the fact that the
  j-th op of a stage waits for j+1 ops of the neighbouring stage) and a tail (the longest data
  path after it). Jackson's preemptive schedule, largest tail first, solves the preemptive
  relaxation exactly; its max(completion + tail) is a bound. This covers per-device work and
  pipeline fill and drain at once.
- What the budget forces: memory held over time (bytes x ms) is at most budget x makespan.
  A recomputed activation holds at least its whole size for F, the recompute and B.
  Each activation is held at least from F's start to B's end (its round trip through the
  later stages) plus its weight part until W ends, or, offloaded, for F plus the offload and
  the reload plus B. The smaller of the two per activation, summed, over the budget.

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

from optpipe.compiler.problem import Problem
from optpipe.compiler.schedule import OpKind
from optpipe.compiler.units import format_size

__all__ = [
    "Bound",
    "Paths",
    "data_paths",
    "makespan_lower_bound",
    "device_lower_bound",
    "memory_area_bound",
    "memory_lower_bound",
]

_F, _B, _W = OpKind.F, OpKind.B, OpKind.W


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
    pipe, costs = problem.pipeline, problem.costs
    S = pipe.stages
    f, b, w = costs.forward, costs.backward_input, costs.backward_weight
    lag_up = tuple(costs.p2p if pipe.device_of(s) != pipe.device_of(s + 1) else 0.0 for s in range(S - 1))
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


def _jobs(problem: Problem, paths: Paths, device: int) -> list[tuple[float, float, float]]:
    """(release, duration, tail) of every compute op on ``device``.

    The j-th F of stage s (in time order) needs j+1 forwards of stage s-1 done, which run one at
    a time on their device; so it is released no earlier than head + j x F(s-1) when s-1 is on
    another device. Symmetrically the j-th from last still has j+1 forwards of stage s+1 after
    it. The same holds for B along the backward chain.
    """
    pipe, costs = problem.pipeline, problem.costs
    f, b, w = costs.forward, costs.backward_input, costs.backward_weight
    S, m = pipe.stages, pipe.microbatches
    other = lambda s: 0 <= s < S and pipe.device_of(s) != device  # noqa: E731
    jobs = []
    for s in pipe.stages_on(device):
        for j in range(m):
            k = m - 1 - j  # forwards after this one
            release = paths.head[(_F, s)] + (j * f[s - 1] if other(s - 1) else 0.0)
            after = paths.tail[(_F, s)] + (k * f[s + 1] if other(s + 1) else 0.0)
            jobs.append((release, f[s], after))
            upstream = s + 1  # where B comes from
            release = paths.head[(_B, s)] + (j * b[upstream] if other(upstream) else 0.0)
            after = paths.tail[(_B, s)]
            if other(s - 1):
                after = max(after, paths.lag_up[s - 1] + (k + 1) * b[s - 1] + paths.tail[(_B, s - 1)])
            jobs.append((release, b[s], after))
            jobs.append((paths.head[(_W, s)] + (j * b[upstream] if other(upstream) else 0.0), w[s], 0.0))
    return jobs


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


def device_lower_bound(problem: Problem, device: int, paths: Paths | None = None) -> float:
    """Jackson's preemptive bound for one device's compute ops."""
    return _jackson_preemptive(_jobs(problem, paths or data_paths(problem), device))


def memory_area_bound(problem: Problem, paths: Paths | None = None) -> Bound:
    """Makespan >= (least bytes x ms any schedule holds on a device) / budget."""
    paths = paths or data_paths(problem)
    pipe, costs, memory = problem.pipeline, problem.costs, problem.memory
    f, b, w = costs.forward, costs.backward_input, costs.backward_weight
    best = Bound(0.0, "")
    for device in range(pipe.devices):
        area = 0.0
        for s in pipe.stages_on(device):
            act, keep = memory.activation[s], memory.weight_activation[s]
            resident = act * (f[s] + paths.gap[s] + b[s])
            if problem.offload.enabled:
                resident = min(resident, act * (f[s] + problem.offload_ms(s) + problem.reload_ms(s) + b[s]))
            if problem.recompute.enabled:  # recomputed: the whole activation for F, the recompute and B
                resident = min(resident, act * (f[s] + problem.recompute_ms(s) + b[s]))
            area += pipe.microbatches * (resident + keep * w[s])
        value = area / memory.budget
        if value > best.value:
            best = Bound(value, f"device {device} must hold activations for {area / 2**30:,.1f} GiB x ms, "
                                f"which a budget of {format_size(memory.budget)} spreads over at least {value:,.1f} ms")
    return best


def makespan_lower_bound(problem: Problem) -> Bound:
    """The largest of the per-device relaxations and the memory-area bound."""
    paths = data_paths(problem)
    best = Bound(0.0, "")
    for device in range(problem.devices):
        value = device_lower_bound(problem, device, paths)
        if value > best.value:
            busy = sum(problem.costs.forward[s] + problem.costs.backward(s) for s in problem.pipeline.stages_on(device))
            best = Bound(value, f"device {device}: {busy * problem.microbatches:,.1f} ms of compute "
                                f"plus pipeline fill and drain")
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
