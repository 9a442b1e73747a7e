"""How fast forwards can reach a device when the devices before it hold back theirs.

Before its first backward a device runs only forwards, and they come through the devices before
it. The per-device arguments (fill.py, phases.py, ends_relax.py) release each stage's forwards
on their own: chunk 0's as fast as each earlier device can hold chunk-0 activations, chunk 1's
as fast as it can hold both. Both streams pass the same devices, whose budget and host link
limit how many forwards of any chunk they can have started by a time. On seed 1's grid20
(p = 24, v = 2, 0.3 budgets, k = 1.6) the streams coupled leave device 8 idle 65.0 ms before its
first backward, and the bound rises from 2,808.2 to 2,865.5 ms.

The argument, for forwards numbered in time order on each device:

- The x-th forward of device u starts no earlier than u's earliest start plus x - 1 of its
  shortest forwards (one at a time), nor before u can have freed what x forwards take beyond
  the budget (``fill.device_frees``: the ends that can have come by then, each freeing the most
  its kind frees, as fill.py counts them). A microbatch's forward of a stage comes after its
  forwards of u's lower stages, so x forwards are prefixes of u's stages, m of them: they take
  at least m times the lower convex envelope of the stage sizes' prefix sums at x / m.
- Device w feeds u when every stage of u has a stage of w below it, each a different one
  (interleaved: w < u): then forward (s, i) of u waits for forward (t, i) of w, t the highest
  stage of w below s, plus the chain of forwards and links between them. So when x forwards of u
  have started, x different forwards of w have started at least that chain (the shortest over u's
  stages) earlier, and the x-th forward of u starts no earlier than w's x-th plus the chain.
  Taken down the pipeline, every feeder's pace counts.
- In the device's warm-up window (from its earliest start to the earliest its first backward can
  start) it can be busy at most as long as running every forward as soon as that allows, the
  first x taking the most x forwards can (m times the upper concave envelope of the prefix sums
  of its forward times): wherever that run is idle, every forward released by then is done in
  any schedule too. The rest of the window is idle.

Recompute adds ops that run in the warm-up and are not forwards, so there the argument is not made.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from optpipe.core.problem import Problem
from optpipe.core.schedule import OpKind
from optpipe.core.semantics import kept_bytes, lag_ms, stage_ms

__all__ = ["forward_paces", "warm_up_pace_idle"]

_F, _B = OpKind.F, OpKind.B


def forward_paces(problem: Problem, head: dict, frees: Sequence) -> list[list[float]] | None:
    """Per device, the earliest start of its x-th forward in time order (x = 1.., all its stages
    together), from its own compute and memory and its feeders' paces; None with recompute.

    ``head``: each (kind, stage)'s earliest start for one microbatch alone (bounds.data_paths);
    ``frees``: per device, ``time_to_free(bytes)``, the earliest it can have freed that much
    (fill.device_frees)."""
    pipe = problem.pipeline
    if problem.recompute.enabled:
        return None
    f = stage_ms(problem, _F)
    paced: list[list[float]] = [[] for _ in range(pipe.devices)]
    for device in _fill_order(problem):
        starts = _own_pace(problem, device, head, frees[device], f)
        for feeder, lead in _feeders(problem)[device]:
            starts = [max(x, y + lead) for x, y in zip(starts, paced[feeder])]
        paced[device] = starts
    return paced


def warm_up_pace_idle(problem: Problem, head: dict, frees: Sequence) -> tuple[float, ...]:
    """Per device, the idle (ms) the pace of its feeders forces before its first backward
    (``forward_paces``'s arguments)."""
    pipe = problem.pipeline
    paces = forward_paces(problem, head, frees)
    if paces is None:
        return (0.0,) * pipe.devices
    f = stage_ms(problem, _F)
    idle = []
    for device, starts in enumerate(paces):
        stages = pipe.stages_on(device)
        most = _envelope(problem.microbatches, [f[s] for s in stages], upper=True)
        work = [most(x) - most(x - 1) for x in range(1, len(starts) + 1)]
        idle.append(_least_idle(starts, min(head[(_F, s)] for s in stages), head[(_B, max(stages))], work))
    return tuple(idle)


def _fill_order(problem: Problem) -> list[int]:
    """Devices by their lowest stage: every feeder before the devices it feeds."""
    pipe = problem.pipeline
    return sorted(range(pipe.devices), key=lambda d: min(pipe.stages_on(d)))


@lru_cache(maxsize=16)
def _feeders(problem: Problem) -> tuple[tuple[tuple[int, float], ...], ...]:
    """Per device, (feeder, lead) for every device that feeds it."""
    f, order = stage_ms(problem, _F), _fill_order(problem)
    out = []
    for device in range(problem.devices):
        earlier = order[:order.index(device)]
        out.append(tuple((w, lead) for w in earlier if (lead := _lead(problem, w, device, f)) is not None))
    return tuple(out)


def _own_pace(problem: Problem, device: int, head: dict, frees, f: tuple[float, ...]) -> list[float]:
    """The earliest start of the device's x-th forward (x = 1..its forwards) from its own
    compute and memory."""
    stages = problem.pipeline.stages_on(device)
    m = problem.microbatches
    first, shortest = min(head[(_F, s)] for s in stages), min(f[s] for s in stages)
    least = _least_taken(problem, stages)
    starts = []
    for x in range(1, m * len(stages) + 1):
        start = first + (x - 1) * shortest
        excess = least(x) - problem.memory.budget
        if excess > 0:
            start = max(start, frees.time_to_free(excess))
        starts.append(start)
    return starts


def _least_taken(problem: Problem, stages: tuple[int, ...]):
    """The fewest bytes x started forwards of the device take (``_envelope``)."""
    return _envelope(problem.microbatches, [kept_bytes(problem, s)[0] for s in stages], upper=False)


def _envelope(m: int, per_stage: list[float], *, upper: bool):
    """x -> the least (or most) total of x forwards' ``per_stage`` values. A microbatch's forward of
    a stage comes after its forwards of the device's lower stages, so each of the m microbatches
    has started a prefix of the device's stages; m prefixes of x stages in all total at least m
    times the lower convex envelope of the prefix sums at x / m (at most m times the upper
    concave one)."""
    sign = -1.0 if upper else 1.0
    prefix = [0.0]
    for value in per_stage:
        prefix.append(prefix[-1] + sign * value)
    hull = [0]  # the lower convex envelope of (d, prefix[d]), by its corners
    for d in range(1, len(prefix)):
        while len(hull) >= 2 and _above(hull[-2], hull[-1], d, prefix):
            hull.pop()
        hull.append(d)

    def total(x: int) -> float:
        depth = x / m
        for a, b in zip(hull, hull[1:]):
            if depth <= b:
                return sign * m * (prefix[a] + (prefix[b] - prefix[a]) * (depth - a) / (b - a))
        return sign * m * prefix[-1]
    return total


def _above(a: int, b: int, c: int, y: list[float]) -> bool:
    """Whether corner b lies on or above the segment from a to c (so it is no corner of the envelope)."""
    return (y[b] - y[a]) * (c - a) >= (y[c] - y[a]) * (b - a)


def _lead(problem: Problem, feeder: int, device: int, f: tuple[float, ...]) -> float | None:
    """The least time from a forward's start on ``feeder`` to the start of the forward of the same
    microbatch on ``device`` it feeds; None when ``feeder`` does not feed every stage of
    ``device`` with a stage of its own."""
    pipe = problem.pipeline
    below = {}
    for s in pipe.stages_on(device):
        lower = [t for t in pipe.stages_on(feeder) if t < s]
        if not lower:
            return None
        below[s] = max(lower)
    if len(set(below.values())) < len(below):
        return None
    return min(sum(f[r] + lag_ms(problem, r, r + 1) for r in range(t, s)) for s, t in below.items())


def _least_idle(starts: list[float], first: float, window_end: float, work: list[float]) -> float:
    """Idle in [first, window_end) when the x-th forward starts no earlier than ``starts[x]`` and
    the first x take at most ``sum(work[:x])`` together: the as-soon-as-possible run is busy the
    longest (wherever it idles, every forward released by then is done, with the most work they
    can have; after the last such instant it is busy throughout)."""
    now, busy = first, 0.0
    for start, ms in zip(starts, work):
        now = max(now, start)
        if now >= window_end:
            break
        busy += min(ms, window_end - now)
        now += ms
    return max(0.0, window_end - first - busy)
