"""The CP-SAT model's memory: per device a cumulative over every hold of semantics.holds.

Each hold is one interval, for each fate of its activation (kept, offloaded, recomputed: the
pair's literal picks one), from the op point where it begins to the one where it ends; an end
after the window is the horizon. A transfer's release is held ``grid.slack`` longer, so that on
a rounded grid the simulated peak stays within the model's (timegrid.py). Host memory likewise
when ``host_budget`` could bind. Sizes are in units of the gcd of all byte counts, coarser
(demands rounded up, capacity down) where capacity x horizon could overflow int64.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Mapping, NamedTuple

from ortools.sat.python import cp_model

from optpipe.core.schedule import Op
from optpipe.core.semantics import At, Place, Point, holds

from .cpsat_vars import TRANSFERS, F, Pair, Variables

__all__ = ["Case", "Segment", "Memory", "add_memory", "hint_memory"]

_OVERFLOW = 2**62  # keep capacity x horizon of the cumulatives below this (int64 with headroom)


class Case(Enum):
    """An activation's fate, whose holds an interval belongs to; the value starts the interval's name."""

    KEPT = "o"
    OFFLOADED = "x"
    RECOMPUTED = "r"


class Segment(NamedTuple):
    """A memory interval whose length is a variable: the hint needs its ends by name."""

    size: cp_model.IntVar
    begins: Point
    ends: Point | None  # None: the horizon (the hold ends after the window)
    pair: Pair
    case: Case  # the interval is present when its pair's fate is this


class Memory(NamedTuple):
    exact: bool  # bytes per unit divide every size: the cumulatives are the budget, no rounding
    segments: list[Segment]


def add_memory(v: Variables) -> Memory:
    """Per device (and per host, when it could bind) a cumulative over every hold, every fate."""
    problem, memory = v.problem, v.problem.memory
    act = memory.activation
    scale, exact = _scale(v)
    up = lambda b: -(-b // scale)  # noqa: E731  (demands round up, capacity down: safe)
    host_binds = problem.offload.enabled and any(
        v.m * sum(act[s] for s in problem.pipeline.stages_on(d)) > problem.offload.host_budget
        for d in range(v.P))
    segments: list[Segment] = []
    for d in range(v.P):
        intervals: dict[Place, list[cp_model.IntervalVar]] = {Place.DEVICE: [], Place.HOST: []}
        demands: dict[Place, list[int]] = {Place.DEVICE: [], Place.HOST: []}
        for s in problem.pipeline.stages_on(d):
            for i in range(v.m):
                if v.start_of(Op(F, s, i)) is None:
                    continue
                for case, present in _cases(v, (s, i)):
                    if case is Case.OFFLOADED and not problem.offload.enabled:
                        continue
                    fate = holds(problem, s, i, offloaded=case is Case.OFFLOADED, recomputed=case is Case.RECOMPUTED)
                    for n, hold in enumerate(fate):
                        if hold.place is Place.HOST and not host_binds:
                            continue
                        segment = _segment(v, f"{case.value}{n}_{s}:{i}", hold.begins, hold.ends, present, case,
                                           segments)
                        if segment is not None:
                            intervals[hold.place].append(segment)
                            demands[hold.place].append(up(hold.bytes))
        for place, capacity in ((Place.DEVICE, memory.budget), (Place.HOST, problem.offload.host_budget)):
            if intervals[place]:
                v.cp.add_cumulative(intervals[place], demands[place], capacity // scale)
    return Memory(exact, segments)


def _cases(v: Variables, pair: Pair) -> list[tuple[Case, object]]:
    """Each fate of a pair with its presence: True, False or a literal."""
    x = v.presence(pair)
    if pair in v.recomputed:
        return [(Case.KEPT, v.kept[pair]), (Case.OFFLOADED, x), (Case.RECOMPUTED, v.recomputed[pair])]
    never = True if x is False else (False if x is True else ~x)
    return [(Case.KEPT, never), (Case.OFFLOADED, x)]


def _scale(v: Variables) -> tuple[int, bool]:
    """Bytes per memory unit: the gcd of all sizes, coarser (rounding safely) if products could overflow."""
    memory = v.problem.memory
    sizes = [memory.budget, *memory.activation, *(k for k in memory.weight_activation if k)]
    sizes += [a - k for a, k in zip(memory.activation, memory.weight_activation) if a > k]
    if v.recomputed:  # the holds of a recomputed activation (semantics.holds)
        sizes += [hold.bytes for s in range(v.S) for hold in holds(v.problem, s, 0, recomputed=True)]
        sizes += [hold.bytes for s in range(v.S) for hold in holds(v.problem, s, 0, fused=True, recomputed=True)]
    scale = math.gcd(*sizes)
    exact = True
    while (memory.budget // scale) * v.horizon > _OVERFLOW:
        scale *= 2
        exact = False
    return scale, exact


def _segment(v: Variables, name: str, begins: Point, ends: Point, present, case: Case,
             segments: list[Segment]):
    """An interval from one op point to another (variables or constants), or None when it lies
    before the window or its start is after it."""
    first = v.end_of(begins.op) if begins.at is At.END else v.start_of(begins.op)
    last = v.end_of(ends.op) if ends.at is At.END else v.start_of(ends.op)
    if first is None or present is False:
        return None
    if last is not None and ends.at is At.END and ends.op.kind in TRANSFERS:
        last = last + v.grid.slack  # a transfer's release is kept late enough for any rounding (timegrid.py)
    until: Point | None = ends
    if last is None:
        last, until = v.horizon, None
    if isinstance(first, int) and isinstance(last, int):
        if last <= v.scope.t0 or last <= first:
            return None
        size = last - first
    else:
        size = v.cp.new_int_var(0, v.horizon + v.grid.slack, f"len_{name}")
        segments.append(Segment(size, begins, until, (begins.op.stage, begins.op.microbatch), case))
    if present is True:
        return v.cp.new_interval_var(first, size, last, name)
    return v.cp.new_optional_interval_var(first, size, last, present, name)


def hint_memory(v: Variables, segments: list[Segment], begins: Mapping[Op, int], ends: Mapping[Op, int],
                offloaded: frozenset[Pair], recomputed: set[Pair]) -> None:
    """Each segment's length in the hinted schedule; 0 where its case is not the pair's fate."""
    for segment in segments:
        value = 0
        pair = segment.pair
        if segment.case is Case.RECOMPUTED:
            matches = pair in recomputed
        elif segment.case is Case.KEPT:
            matches = pair not in offloaded and pair not in recomputed
        else:
            matches = pair in offloaded
        if matches:
            a = _time(segment.begins, begins, ends)
            z = v.horizon if segment.ends is None else _time(segment.ends, begins, ends)
            if z is not None and segment.ends is not None and segment.ends.at is At.END \
                    and segment.ends.op.kind in TRANSFERS:
                z += v.grid.slack
            value = z - a if a is not None and z is not None else 0
        v.cp.add_hint(segment.size, max(0, value))


def _time(point: Point, begins: Mapping[Op, int], ends: Mapping[Op, int]) -> int | None:
    return (ends if point.at is At.END else begins).get(point.op)
