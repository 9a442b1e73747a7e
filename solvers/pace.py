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
  shortest forwards (one at a time), nor before u can have freed what x activations take beyond
  the budget (``fill.device_frees``: the ends that can have come by then, each freeing the most
  its kind frees).
- Device w feeds u when every stage of u has a stage of w below it, each a different one
  (interleaved: w < u): then forward (s, i) of u waits for forward (t, i) of w, t the highest
  stage of w below s, plus the chain of forwards and links between them. So when x forwards of u
  have started, x different forwards of w have started at least that chain (the shortest over u's
  stages) earlier, and the x-th forward of u starts no earlier than w's x-th plus the chain.
  Taken down the pipeline, every feeder's pace counts.
- In the device's warm-up window (from its earliest start to the earliest its first backward can
  start) it can be busy at most as long as running every forward as soon as that allows, each
  taking the device's longest forward: wherever that greedy is idle, every forward released by
  then is done in any schedule too. The rest of the window is idle.

Recompute adds ops that run in the warm-up and are not forwards, so there the argument is not made.
"""

from __future__ import annotations

from optpipe.core.problem import Problem
from optpipe.core.schedule import OpKind
from optpipe.core.semantics import kept_bytes, lag_ms, stage_ms

from .fill import device_frees

__all__ = ["warm_up_pace_idle"]

_F, _B = OpKind.F, OpKind.B


def warm_up_pace_idle(problem: Problem, head: dict, releases: dict) -> tuple[float, ...]:
    """Per device, the idle (ms) the pace of its feeders forces before its first backward.

    ``head``: each (kind, stage)'s earliest start for one microbatch alone (bounds.data_paths);
    ``releases``: the earliest j-th F and B of each stage (fill.memory_releases)."""
    pipe = problem.pipeline
    if problem.recompute.enabled:
        return (0.0,) * pipe.devices
    f = stage_ms(problem, _F)
    frees = device_frees(problem, releases)
    paced: dict[int, list[float]] = {}
    idle = [0.0] * pipe.devices
    for device in sorted(range(pipe.devices), key=lambda d: min(pipe.stages_on(d))):
        stages = pipe.stages_on(device)
        starts = _own_pace(problem, device, head, frees[device], f)
        for feeder, earlier in paced.items():
            lead = _lead(problem, feeder, device, f)
            if lead is not None:
                starts = [max(x, y + lead) for x, y in zip(starts, earlier)]
        paced[device] = starts
        window_end = head[(_B, max(stages))]
        idle[device] = _least_idle(starts, min(head[(_F, s)] for s in stages), window_end,
                                   max(f[s] for s in stages))
    return tuple(idle)


def _own_pace(problem: Problem, device: int, head: dict, frees, f: tuple[float, ...]) -> list[float]:
    """The earliest start of the device's x-th forward (x = 1..its forwards) from its own
    compute and memory."""
    stages = problem.pipeline.stages_on(device)
    count = problem.microbatches * len(stages)
    first, shortest = min(head[(_F, s)] for s in stages), min(f[s] for s in stages)
    taken, budget = min(kept_bytes(problem, s)[0] for s in stages), problem.memory.budget
    starts = []
    for x in range(1, count + 1):
        start = first + (x - 1) * shortest
        excess = x * taken - budget
        if excess > 0:
            start = max(start, frees.time_to_free(excess))
        starts.append(start)
    return starts


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


def _least_idle(starts: list[float], first: float, window_end: float, longest: float) -> float:
    """Idle in [first, window_end) when each forward starts no earlier than ``starts`` says (in
    order) and takes at most ``longest``: the as-soon-as-possible run is busy the longest."""
    now, busy = first, 0.0
    for start in starts:
        now = max(now, start)
        if now >= window_end:
            break
        busy += min(longest, window_end - now)
        now += longest
    return max(0.0, window_end - first - busy)
