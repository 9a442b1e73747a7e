"""When the budget holds back the pipeline's fill: the earliest the j-th F and B of each stage start.

A device can start a forward only while its held activations leave room for one more. Before
the j-th F(s) in time order starts, j + 1 microbatches have started F(s) and every F of the
device's stages below s, so their bytes are taken, less what has been freed since. An
activation stops being held whole only when its offload ends or its B ends, and those run one
at a time on the D2H channel and on the compute channel; so once the started bytes exceed the
budget by more than k - 1 of the largest activations, k such ends must have come first, and
the k-th cannot come before the fastest mix of offloads and backward passes allows.

Delays carry down the pipeline: the j-th F(s) also waits for j + 1 forwards of stage s - 1, and
the j-th B for j + 1 of the stage above. The per-device relaxation in bounds.py takes these as
releases. A recomputed activation holds its resident bytes between F and the recompute, so with
recompute on only those count as held.
"""

from __future__ import annotations

import math

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import duration_ms, lag_ms, stage_ms

__all__ = ["memory_releases"]

_F, _B, _OFF = OpKind.F, OpKind.B, OpKind.OFFLOAD
_INF = float("inf")


def memory_releases(problem: Problem, head: dict[tuple[OpKind, int], float]) -> dict[tuple[OpKind, int], list[float]]:
    """(kind, stage) -> the earliest start of its j-th op in time order, j = 0..m-1, for F and B.

    ``head``: the earliest start of each (kind, stage) for one microbatch alone (bounds.data_paths).
    """
    pipe, memory = problem.pipeline, problem.memory
    S, m = pipe.stages, pipe.microbatches
    f, b = stage_ms(problem, _F), stage_ms(problem, _B)
    held = list(memory.activation)
    if problem.recompute.enabled:
        held = [min(a, r) for a, r in zip(held, problem.recompute.resident)]
    ends = {d: _Ends(problem, d, head) for d in range(pipe.devices)}
    out: dict[tuple[OpKind, int], list[float]] = {}
    for s in range(S):
        device = pipe.device_of(s)
        below = [t for t in pipe.stages_on(device) if t <= s]
        taken, largest = sum(held[t] for t in below), max(held[t] for t in below)
        starts: list[float] = []
        for j in range(m):
            start = head[(_F, s)]
            if s > 0:
                start = max(start, out[(_F, s - 1)][j] + f[s - 1] + lag_ms(problem, s - 1, s))
            if j > 0:
                start = max(start, starts[j - 1] + f[s])
            excess = (j + 1) * taken - memory.budget
            if excess > 0:
                start = max(start, ends[device].kth(math.ceil(excess / largest)))
            starts.append(start)
        out[(_F, s)] = starts
    for s in range(S - 1, -1, -1):
        starts = []
        for j in range(m):
            if s == S - 1:
                start = max(head[(_B, s)], out[(_F, s)][j] + f[s])
            else:
                start = max(head[(_B, s)], out[(_B, s + 1)][j] + b[s + 1] + lag_ms(problem, s + 1, s))
            if j > 0:
                start = max(start, starts[j - 1] + b[s])
            starts.append(start)
        out[(_B, s)] = starts
    return out


class _Ends:
    """The earliest a device's k-th offload-or-backward end can come."""

    def __init__(self, problem: Problem, device: int, head: dict[tuple[OpKind, int], float]):
        stages = problem.pipeline.stages_on(device)
        f, b = stage_ms(problem, _F), stage_ms(problem, _B)
        self.first_b = min(head[(_B, s)] + b[s] for s in stages)
        self.b = min(b[s] for s in stages)
        self.first_off = self.out = _INF
        if problem.offload.enabled:
            self.out = min(duration_ms(problem, Op(_OFF, s, 0)) for s in stages)
            self.first_off = min(head[(_F, s)] + f[s] for s in stages) + self.out

    def _off(self, i: int) -> float:
        if i == 0:
            return -_INF
        return _INF if self.out == _INF else self.first_off + (i - 1) * self.out

    def _back(self, i: int) -> float:
        return -_INF if i == 0 else self.first_b + (i - 1) * self.b

    def kth(self, k: int) -> float:
        """min over i of max(i-th offload end, (k - i)-th B end): the first is rising in i and the
        second falling, so the least max is where they cross (bisection)."""
        low, high = 0, k
        while low < high:  # the least i whose offload end is no earlier than its B partner
            mid = (low + high) // 2
            if self._off(mid) >= self._back(k - mid):
                high = mid
            else:
                low = mid + 1
        best = max(self._off(low), self._back(k - low))
        if low > 0:
            best = min(best, max(self._off(low - 1), self._back(k - low + 1)))
        return best
