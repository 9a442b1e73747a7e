"""What a cost-aware list schedule has placed so far: the state ``greedy_schedule`` (``_greedy``)
and ``v_rounds`` (``_greedy_v``) both build their orders on.

Both place F and B one at a time, each after what it waits for, and keep the Ws of placed Bs
waiting (in B order) until they fill idle time or the cap needs their room; both then compute
the simulator's times exactly (device order, data dependencies, p2p between devices). What
differs is only how they choose the next op, so this is kept once here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import kept_bytes, lag_ms, stage_ms

__all__ = ["StageCosts", "Placed"]

_F, _B, _W = OpKind.F, OpKind.B, OpKind.W


@dataclass(frozen=True)
class StageCosts:
    """Per stage, the times and bytes the list schedules decide with, read once from the problem."""

    act: list[int]  # what a kept activation takes at F's start
    keep: list[int]  # what W still holds after B
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    wgt: tuple[float, ...]

    @classmethod
    def of(cls, problem: Problem) -> StageCosts:
        pairs = [kept_bytes(problem, s) for s in range(problem.stages)]
        fwd, bwd, wgt = (stage_ms(problem, kind) for kind in (_F, _B, _W))
        return cls([taken for taken, _ in pairs], [after_b for _, after_b in pairs], fwd, bwd, wgt)


@dataclass(frozen=True)
class Placed:
    """The ops placed so far. The fields never change; the lists and tables they hold grow as ops
    are placed (one run of a list schedule owns one ``Placed``).

    Per stage: when each microbatch's F and B end, and the next microbatch of each. Per device:
    its order, when it is free, its idle time since its first op, the bytes it holds, and the
    (stage, microbatch) of the Ws it has not run yet, in B order.
    """

    problem: Problem
    costs: StageCosts
    f_end: list[dict[int, float]]
    b_end: list[dict[int, float]]
    next_f: list[int]
    next_b: list[int]
    free: list[float]
    idle: list[float]
    held: list[int]
    waiting: list[deque[tuple[int, int]]]
    orders: list[list[Op]]

    @classmethod
    def empty(cls, problem: Problem) -> Placed:
        p, stages = problem.pipeline.devices, problem.pipeline.stages
        return cls(problem, StageCosts.of(problem),
                   [{} for _ in range(stages)], [{} for _ in range(stages)], [0] * stages, [0] * stages,
                   [0.0] * p, [0.0] * p, [0] * p, [deque() for _ in range(p)], [[] for _ in range(p)])

    def arrival(self, kind: OpKind, s: int, i: int) -> float | None:
        """When the input of ``kind`` of microbatch ``i`` reaches stage ``s``, or None while the op
        it comes from is not placed: F waits for F below, B for B above (the last stage's B for its
        own F)."""
        if kind is _F:
            if s == 0:
                return 0.0
            source, table = s - 1, self.f_end[s - 1]
        elif s == self.problem.stages - 1:
            source, table = s, self.f_end[s]
        else:
            source, table = s + 1, self.b_end[s + 1]
        end = table.get(i)
        return None if end is None else end + lag_ms(self.problem, source, s)

    def place(self, d: int, op: Op, start: float) -> None:
        """Put F or B ``op`` on device ``d`` at ``start``: an F holds its activation, a B frees all
        of it but what its W still needs, and that W starts waiting."""
        s, i = op.stage, op.microbatch
        self.orders[d].append(op)
        if op.kind is _F:
            end = start + self.costs.fwd[s]
            self.f_end[s][i] = end
            self.next_f[s] += 1
            self.held[d] += self.costs.act[s]
        else:
            end = start + self.costs.bwd[s]
            self.b_end[s][i] = end
            self.next_b[s] += 1
            self.held[d] -= self.costs.act[s] - self.costs.keep[s]
            self.waiting[d].append((s, i))
        self.free[d] = end

    def pop_w(self, d: int) -> int:
        """Put device ``d``'s oldest waiting W next in its order and free what it held; its stage.
        (When it runs is the caller's: ``greedy_schedule`` times Ws with the op they precede.)"""
        s, i = self.waiting[d].popleft()
        self.orders[d].append(Op(_W, s, i))
        self.held[d] -= self.costs.keep[s]
        return s
