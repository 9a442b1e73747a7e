"""When the budget holds back the pipeline: the earliest the j-th F and B of each stage start.

A device can start a forward only while its held activations leave room for one more. Before
the j-th F(s) in time order starts, j + 1 microbatches have started F(s) and every F of the
device's stages below s, so their bytes are taken, less what has been freed since. Only ends
free memory: an offload's end frees its activation, a B's end the activation less its weight
part, a W's end the weight part (memory holds, design.md). So the forward waits until the
offloads, backward passes and W passes that can have ended by then free the excess.

Those ends have their own earliest times: the i-th offload of a device in time order ends no
earlier than the end of the device's i-th forward plus one offload, nor than one offload after
the previous one (the D2H channel runs one at a time); the i-th B no earlier than the i-th
smallest of the B start bounds plus B, and the i-th W the i-th smallest of them plus B and W of
their stage. The B bounds come from the F bounds along the data chain, and the F bounds from the
B bounds through memory, so the two are raised in turn until nothing moves: every pass keeps a
proof, since it reasons only from bounds already proven.
That is the round trip a tight budget makes each microbatch wait for: with room for A
activations and no offload, the (j + A)-th forward of stage 0 waits for the j-th backward.

Delays carry down the pipeline: the j-th F(s) also waits for j + 1 forwards of stage s - 1, and
the j-th B for j + 1 of the stage above. The per-device relaxation in bounds.py takes these as
releases. A recomputed activation holds only its resident bytes from F's end to the recompute,
so with recompute on only those count as taken; its B and W free what they free kept.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from itertools import accumulate

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import Place, duration_ms, holds, kept_bytes, lag_ms, stage_ms

__all__ = ["memory_releases", "device_frees"]

_F, _B, _W, _OFF = OpKind.F, OpKind.B, OpKind.W, OpKind.OFFLOAD
_INF = float("inf")
_PASSES = 64  # raising F and B in turn stops here at the latest (each pass is a proof on its own)
_MOVED_MS = 1e-6


def memory_releases(problem: Problem, head: dict[tuple[OpKind, int], float]) -> dict[tuple[OpKind, int], list[float]]:
    """(kind, stage) -> the earliest start of its j-th op in time order, j = 0..m-1, for F and B.

    ``head``: the earliest start of each (kind, stage) for one microbatch alone (bounds.data_paths).
    """
    shape = _Shape.of(problem)
    out = _chain(problem, shape, head, None)
    for _ in range(_PASSES):
        frees = {d: _Frees(problem, shape, d, out) for d in range(problem.devices)}
        raised = _chain(problem, shape, head, frees)
        moved = max(max(x - y for x, y in zip(raised[key], out[key])) for key in out)
        out = raised
        if moved <= _MOVED_MS:
            break
    return out


def device_frees(problem: Problem, releases: dict[tuple[OpKind, int], list[float]]) -> tuple[_Frees, ...]:
    """Per device, the most bytes it can have freed by a time, from ``releases`` (memory_releases's
    answer): for arguments that count a device's forwards of every stage at once (pace.py)."""
    shape = _Shape.of(problem)
    return tuple(_Frees(problem, shape, d, releases) for d in range(problem.devices))


@dataclass(frozen=True)
class _Shape:
    """What every pass reads per stage, worked out once: durations, lags, and the bytes a forward
    takes and each end frees (read off the memory holds, core/semantics.py)."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    lag: tuple[float, ...]  # lag[s]: from stage s to s + 1
    taken: tuple[int, ...]  # what F's start takes and keeps until a later end
    b_frees: tuple[int, ...]  # a kept activation's bytes that B's end frees
    w_frees: tuple[int, ...]  # ... that W's end frees
    off_frees: tuple[int, ...]  # an offloaded activation's bytes that the offload's end frees
    off_ms: tuple[float, ...]

    @staticmethod
    def of(problem: Problem) -> _Shape:
        S = problem.stages
        kept = [kept_bytes(problem, s) for s in range(S)]
        taken = [k for k, _ in kept]
        if problem.recompute.enabled:  # a recomputed activation keeps only its resident bytes past F
            taken = [min(k, r) for k, r in zip(taken, problem.recompute.resident)]
        off_frees = [sum(h.bytes for h in holds(problem, s, 0, offloaded=True)
                         if h.place is Place.DEVICE and h.ends.op.kind is _OFF) for s in range(S)]
        off_ms = [duration_ms(problem, Op(_OFF, s, 0)) for s in range(S)] if problem.offload.enabled else [_INF] * S
        return _Shape(stage_ms(problem, _F), stage_ms(problem, _B), stage_ms(problem, _W),
                      tuple(lag_ms(problem, s, s + 1) for s in range(S - 1)), tuple(taken),
                      tuple(k - after for k, after in kept), tuple(after for _, after in kept),
                      tuple(off_frees), tuple(off_ms))


def _chain(problem: Problem, shape: _Shape, head: dict,
           frees: dict[int, _Frees] | None) -> dict[tuple[OpKind, int], list[float]]:
    """F bounds down the pipeline (held back by ``frees`` when given), then B bounds up it."""
    pipe, budget = problem.pipeline, problem.memory.budget
    S, m = pipe.stages, pipe.microbatches
    f, b, lag = shape.f, shape.b, shape.lag
    out: dict[tuple[OpKind, int], list[float]] = {}
    previous = None
    for s in range(S):
        device = pipe.device_of(s)
        taken = sum(shape.taken[t] for t in pipe.stages_on(device) if t <= s)
        wait = frees[device].time_to_free if frees is not None else None
        starts: list[float] = []
        last = -_INF
        for j in range(m):
            start = max(head[(_F, s)], last + f[s])
            if previous is not None:
                start = max(start, previous[j] + f[s - 1] + lag[s - 1])
            excess = (j + 1) * taken - budget
            if wait is not None and excess > 0:
                start = max(start, wait(excess))
            starts.append(start)
            last = start
        out[(_F, s)] = previous = starts
    above = [x + f[S - 1] for x in previous]
    for s in range(S - 1, -1, -1):
        starts = []
        last = -_INF
        for j in range(m):
            last = max(head[(_B, s)], above[j], last + b[s])
            starts.append(last)
        out[(_B, s)] = starts
        if s > 0:
            above = [x + b[s] + lag[s - 1] for x in starts]
    return out


class _Frees:
    """The most bytes a device can have freed by a time: every end that can have come by then,
    each freeing the most its kind frees on the device."""

    def __init__(self, problem: Problem, shape: _Shape, device: int, bounds: dict[tuple[OpKind, int], list[float]]):
        stages = problem.pipeline.stages_on(device)
        f, b, w = shape.f, shape.b, shape.w
        b_ends = sorted(x + b[s] for s in stages for x in bounds[(_B, s)])
        w_ends = sorted(x + b[s] + w[s] for s in stages for x in bounds[(_B, s)])
        b_frees, w_frees = max(shape.b_frees[s] for s in stages), max(shape.w_frees[s] for s in stages)
        events = [(t, b_frees) for t in b_ends] + [(t, w_frees) for t in w_ends]
        if problem.offload.enabled:
            out, off_frees = min(shape.off_ms[s] for s in stages), max(shape.off_frees[s] for s in stages)
            f_ends = sorted(x + f[s] for s in stages for x in bounds[(_F, s)])
            end = -_INF
            for t in f_ends:
                end = max(end + out, t + out)
                events.append((end, off_frees))
        events.sort()
        self.times = [t for t, _ in events]
        self.freed = list(accumulate(bytes_ for _, bytes_ in events))

    def time_to_free(self, excess: float) -> float:
        """The earliest time by which ``excess`` bytes can have been freed."""
        index = bisect.bisect_left(self.freed, excess)
        if index < len(self.times):
            return self.times[index]
        return self.times[-1] if self.times else -_INF  # never freed: no schedule fits, any bound holds
