"""Recomputation in schedules (issue 14): where a RECOMPUTE op goes, and which pairs get one.

``add_recomputes`` puts RECOMPUTE(s, i) right before the backward of (s, i) on its device: it
re-takes the activation from its start, so the later it starts the less time the memory is
held, and right before B nothing can run between them. Pairs already offloaded are left alone
(an activation is kept, offloaded or recomputed).
"""

from __future__ import annotations

from collections.abc import Iterable

from optpipe.core.errors import ProblemError, ScheduleError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule

__all__ = ["add_recomputes", "require_recompute"]

_B, _BW, _RC = OpKind.B, OpKind.BW, OpKind.RECOMPUTE


def require_recompute(problem: Problem) -> None:
    if not problem.recompute.enabled:
        raise ProblemError("recompute is not enabled in the problem, so no forward can run again; add a "
                           "[recompute] table (enabled = true, time = 1.0, resident = the stage input's size)")


def add_recomputes(problem: Problem, schedule: Schedule, pairs: Iterable[tuple[int, int]]) -> Schedule:
    """``schedule`` with RECOMPUTE(s, i) right before the backward of each pair (not offloaded)."""
    require_recompute(problem)
    chosen = set(pairs) - schedule.offloaded
    for stage, microbatch in chosen:
        if not (0 <= stage < problem.stages and 0 <= microbatch < problem.microbatches):
            raise ScheduleError(f"cannot recompute (stage {stage}, microbatch {microbatch}): stages run "
                                f"0..{problem.stages - 1} and microbatches 0..{problem.microbatches - 1}")
    chosen -= schedule.recomputed
    rows = []
    for ops in schedule.devices:
        row: list[Op] = []
        for op in ops:
            if op.kind in (_B, _BW) and (op.stage, op.microbatch) in chosen:
                row.append(Op(_RC, op.stage, op.microbatch))
            row.append(op)
        rows.append(row)
    return Schedule.of(schedule.name, rows)
