"""Large-neighbourhood search: re-solve one time window of a schedule at a time with CP-SAT.

A full CP-SAT model grows with the square of the ops on a device (its tightness literals), so
beyond a few dozen ops per device it no longer finds good schedules in time. This search keeps
a complete schedule and improves it piece by piece:

1. simulate the current schedule (the simulator is the judge);
2. take a time window [t0, t1) holding about ``per_device`` compute ops per device: the ops in
   it are free to change order, offload decisions (for activations whose F and B both fall in
   it) and transfer slots; ops before it keep their times; the ops of the next few windows
   keep their order but are re-timed, so the model sees what the window does downstream; the
   rest is summed up as the compute each device still has to do;
3. solve that model exactly with cpsat.py (memory and ASAP timing exact), minimising the latest
   device end plus the compute still to come, then the sum of device ends;
4. splice the result into the schedule, re-simulate, and keep it when the makespan is no worse
   and the devices finish no later in sum (sideways moves let the search cross plateaus).

Windows sweep the schedule from the start, overlapping by half; after a pass that gained
nothing they grow by one op per device.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable

from ortools.sat.python import cp_model

from optpipe.compiler.problem import Problem
from optpipe.compiler.schedule import COMPUTE_KINDS, Op, OpKind, Schedule
from optpipe.compiler.semantics import TOLERANCE_MS, duration_ms
from optpipe.compiler.simulate import Timeline, simulate

from .cpsat import Model, Scope, solve_model
from .decode import schedule_from_starts
from .result import Progress
from .timegrid import Grid, choose_grid

__all__ = ["improve", "Search"]

_F, _B, _W, _BW, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD
_EPS = TOLERANCE_MS


@dataclass(frozen=True)
class Search:
    """What the search did: the best schedule and its timeline, and how it got there."""

    schedule: Schedule
    timeline: Timeline
    windows: int  # windows solved
    improvements: int  # windows that made the schedule faster


def _score(timeline: Timeline) -> tuple[float, float]:
    """Makespan first; then the sum of the devices' last ends, so that slack elsewhere counts."""
    ends = [0.0] * len(timeline.busy)
    for t in timeline.timings:
        ends[t.device] = max(ends[t.device], t.end)
    return (round(timeline.makespan, 6), round(sum(ends), 6))


def _regions(timeline: Timeline, t0: float, t1: float, t2: float) -> dict[Op, int]:
    """Each schedule op's region: 0 before the window, 1 in it, 2 following it, 3 after that.

    A compute op goes by its start. A transfer goes with the compute op it is listed after (its
    issue point), so that the ops of a region keep their list order; one that starts before t0
    stays fixed, and one issued before t0 that starts later joins the window.
    """
    region: dict[Op, int] = {}
    by_device: dict[int, list] = {}
    for t in timeline.timings:
        by_device.setdefault(t.device, []).append(t)
    for timings in by_device.values():
        issue = 0
        for t in timings:
            start = t.start
            if t.op.kind in COMPUTE_KINDS:
                issue = 0 if start < t0 - _EPS else 1 if start < t1 - _EPS else 2 if start < t2 - _EPS else 3
                region[t.op] = issue
            else:
                region[t.op] = 0 if start < t0 - _EPS else max(issue, 1)
    return region


def _model_op(problem: Problem, grid: Grid, op: Op, start: float) -> list[tuple[Op, int]]:
    """A schedule op in model terms, with its start in units rounded up like every model time
    (timegrid.py): a fused BW is B then W."""
    if op.kind is not _BW:
        return [(op, grid.up(start))]
    b, w = Op(_B, op.stage, op.microbatch), Op(_W, op.stage, op.microbatch)
    return [(b, grid.up(start)), (w, grid.up(start) + grid.up(duration_ms(problem, b)))]


def _scope(problem: Problem, timeline: Timeline, grid: Grid, t0: float, t1: float,
           t2: float) -> tuple[Scope, dict[Op, int]]:
    """The window [t0, t1), re-timed ops up to t2, as a model scope; and the hint (current starts)."""
    pipe = problem.pipeline
    region = _regions(timeline, t0, t1, t2)
    offloaded = frozenset((t.op.stage, t.op.microbatch) for t in timeline.timings if t.op.kind is _OFF)
    fixed, inside, window = {}, {}, set()
    rest = [0] * pipe.devices
    follow: list[list[Op]] = [[] for _ in range(pipe.devices)]
    for t in timeline.timings:
        where = region[t.op]
        for op, units in _model_op(problem, grid, t.op, t.start):
            if where == 0:
                fixed[op] = units
            elif where in (1, 2):
                inside[op] = units
                if where == 2:
                    follow[t.device].append(op)
                else:
                    window.add(op)
            elif op.kind in COMPUTE_KINDS:
                rest[t.device] += grid.up(duration_ms(problem, op))
    pairs = frozenset((op.stage, op.microbatch) for op in window if op.kind is _F
                      and Op(_B, op.stage, op.microbatch) in window) if problem.offload.enabled else frozenset()
    compute = frozenset(op for op in window if op.kind in COMPUTE_KINDS)
    transfers = frozenset(op for op in window if op.kind in (_OFF, _REL) and (op.stage, op.microbatch) not in pairs)
    scope = Scope(compute=compute, open_pairs=pairs, offloaded=offloaded - pairs, transfers=transfers,
                  fixed=fixed, t0=grid.down(t0), rest=tuple(rest), follow=tuple(tuple(ops) for ops in follow))
    return scope, inside


def _splice(problem: Problem, timeline: Timeline, scope: Scope, modelled: frozenset[Op], solved: dict[Op, int],
            grid: Grid, shift: float) -> Schedule:
    """Ops before the window as they were, the window and what follows as solved (transfers the
    solution drops are gone), the rest after them in their order."""
    starts: dict[Op, float] = {}
    for t in timeline.timings:
        op = t.op
        key = Op(_B, op.stage, op.microbatch) if op.kind is _BW else op
        if key in scope.fixed:
            starts[op] = t.start
        elif key not in modelled:
            starts[op] = t.start + shift  # after every re-timed op, order kept
    for op, units in solved.items():
        starts[op] = grid.ms(units)
    return schedule_from_starts(problem, timeline.schedule_name, starts)


def _window_at(timeline: Timeline, cursor: float, size: int, follow: int) -> tuple[float, float, float, float]:
    """The slice holding ``size`` compute ops from the first one starting at ``cursor`` or later.

    Returns (t0, t1, t2, next cursor): [t1, t2) holds the ``follow`` compute ops after the window
    (all of them when ``follow`` is negative), and the next window starts half-way through this one.
    """
    starts = sorted(t.start for t in timeline.timings if t.op.kind in COMPUTE_KINDS)
    inf = float("inf")
    k = next((n for n, s in enumerate(starts) if s >= cursor - _EPS), len(starts) - 1)
    t0 = starts[k]
    t1 = starts[k + size] if k + size < len(starts) else inf
    t2 = inf if follow < 0 or k + size + follow >= len(starts) else starts[k + size + follow]
    half = k + max(1, size // 2)
    return t0, t1, t2, (starts[half] if half < len(starts) and t1 != inf else inf)


def improve(problem: Problem, schedule: Schedule, *, time_limit_s: float, seed: int = 0,
            workers: int | None = None, per_device: int = 4, max_per_device: int = 12, follow: int = 3,
            window_limit_s: float = 2.0, on_progress: Callable[[Progress], None] | None = None,
            bound_ms: float | None = None) -> Search:
    """Improve a fitting schedule window by window until the time limit (or ``bound_ms``); never worse.

    Each window is followed by ``follow`` windows' worth of ops that the model re-times in their
    order, so that it sees what the window's choices do downstream.
    """
    if schedule.recomputed:  # window models decide keep or offload only (issue 14): left as it is
        return Search(schedule, simulate(problem, schedule), 0, 0)
    began = time.monotonic()
    deadline = began + time_limit_s
    rng = random.Random(seed)
    grid = choose_grid(problem)
    best = simulate(problem, schedule)
    best_schedule, score = schedule, _score(best)
    solved = improved = 0
    size, cursor, gained = per_device, 0.0, False
    while (left := deadline - time.monotonic()) > 0.05:
        if bound_ms is not None and best.makespan <= bound_ms + _EPS:
            break  # meets the lower bound: nothing left to gain
        count = size * problem.devices
        t0, t1, t2, cursor = _window_at(best, cursor, count, follow * count)
        scope, inside = _scope(problem, best, grid, t0, t1, t2)
        model = Model(problem, grid, scope, grid.up(best.makespan) + 1)
        model.hint(inside, scope.offloaded | (scope.open_pairs & _offloaded(best)))
        solver, code = solve_model(model, time_limit_s=min(window_limit_s, left), seed=rng.randrange(1 << 30),
                                   workers=workers, light_presolve=True)
        solved += 1
        if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            candidate = _splice(problem, best, scope, frozenset(model.start), model.values(solver), grid,
                                best.makespan + 1.0)
            timeline = simulate(problem, candidate)
            new_score = _score(timeline)
            if timeline.fits and new_score < score:
                if new_score[0] < score[0] - _EPS:
                    improved += 1
                    if on_progress is not None:
                        on_progress(Progress(time.monotonic() - began, timeline.makespan, bound_ms,
                                             f"window search: {timeline.makespan:,.1f} ms"))
                best, best_schedule, score, gained = timeline, candidate, new_score, True
        if cursor == float("inf"):  # a pass is over: grow the windows if it gained nothing
            if not gained:
                size = min(max_per_device, size + 1)
            cursor, gained = 0.0, False
    return Search(best_schedule, best, solved, improved)


def _offloaded(timeline: Timeline) -> frozenset[tuple[int, int]]:
    return frozenset((t.op.stage, t.op.microbatch) for t in timeline.timings if t.op.kind is _OFF)
