"""Start values for the MILP: every variable set to describe a given schedule (a warm start).

The start times are the schedule's as the simulator would run it with the model's rounded
durations (milp_data.unit_times); every binary is set to what those times make true. The caller
checks the values against the model's rows before handing them to a backend.
"""

from __future__ import annotations

import pulp

from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.semantics import waits

from .milp_data import unit_times
from .milp_model import MilpModel, Relief

__all__ = ["start_values"]

_F, _OFF, _REL, _RC = OpKind.F, OpKind.OFFLOAD, OpKind.RELOAD, OpKind.RECOMPUTE


def start_values(model: MilpModel, schedule: Schedule) -> dict[pulp.LpVariable, float] | None:
    """Values for every variable that describe ``schedule``, or None when it cannot run.

    Relief claims are set where the schedule's unit times make them true; the caller checks
    the values against the constraints (a hint may break the budget at unit times).
    """
    data = model.data
    times = unit_times(data, schedule)
    if times is None:
        return None
    offloaded = schedule.offloaded
    values: dict[pulp.LpVariable, float] = {}
    for op in data.ops:
        values[model.start[op]] = times[op]
    for (s, i), x in model.offload.items():
        off, rel, f = Op(_OFF, s, i), Op(_REL, s, i), Op(_F, s, i)
        chosen = (s, i) in offloaded
        values[x] = 1.0 if chosen else 0.0
        o = times[off] if chosen else times[f] + data.duration[f]
        values[model.start[off]] = o
        values[model.start[rel]] = times[rel] if chosen else o + data.duration[off]
    recomputed = schedule.recomputed
    for (s, i), r in model.recompute.items():
        rc = Op(_RC, s, i)
        values[r] = 1.0 if (s, i) in recomputed else 0.0
        # one that does not run may start anywhere in its bounds: every row it is in is switched off
        values[model.start[rc]] = times[rc] if (s, i) in recomputed else model.start[rc].lowBound
    start = {op: values[var] for op, var in model.start.items()}
    for (a, b), y in model.order.items():
        values[y] = 1.0 if start[a] < start[b] or (start[a] == start[b] and a < b) else 0.0

    def end(op: Op) -> float:
        return start[op] + data.duration[op]

    for relief, var in model.relief.items():
        values[var] = 1.0 if _claim_holds(model, relief, start, offloaded, recomputed) else 0.0
    for (off_a, event), var in model.host.items():
        a = (off_a.stage, off_a.microbatch)
        earlier = start[off_a] < start[event] or (start[off_a] == start[event] and off_a < event)
        back = model.relief[Relief("back", Op(_REL, *a), event)]
        values[var] = max(0.0, values[model.offload[a]] + (1.0 if earlier else 0.0) - 1.0 - values[back])
    for (target, source, lag), var in model.tight.items():
        values[var] = 1.0 if start[target] == end(source) + lag else 0.0
        if source.kind in (_OFF, _REL) and (source.stage, source.microbatch) not in offloaded:
            values[var] = 0.0
        if any(op.kind is _RC and (op.stage, op.microbatch) not in recomputed for op in (source, target)):
            values[var] = 0.0
    _ready_values(model, start, offloaded, recomputed, values)
    values[model.makespan] = max(end(op) for op in data.ops)
    return values


def _claim_holds(model: MilpModel, relief: Relief, start: dict[Op, float], offloaded, recomputed) -> bool:
    """Whether the schedule's unit times make a relief claim true (with the model's margin)."""
    kind, subject, event = relief
    t = start[event]
    margin = model.margin
    item = (subject.stage, subject.microbatch)

    def end(op: Op) -> float:
        return start[op] + model.data.duration[op]

    if kind == "recomputing":  # by the device order at a compute op, by the clock at a RELOAD
        margin = margin if event.kind is _REL else 0
        return item in recomputed and end(subject) + margin <= t and start[Op(_RC, *item)] >= t + 1 + margin
    if kind == "away":
        return item in offloaded and end(subject) + margin <= t and start[Op(_REL, *item)] >= t + 1 + margin
    if kind == "pending":
        return start[subject] >= t + 1 + margin
    return end(subject) + margin <= t  # "ended" and "back"


def _ready_values(model: MilpModel, start: dict[Op, float], offloaded, recomputed, values: dict) -> None:
    """Shared host links (milp_links.py): which compute ops have ended by each transfer's start,
    its ready time (the latest end it waits for) and which op's end that is."""
    data = model.data

    def end(op: Op) -> float:
        return start[op] + data.duration[op]

    for (c, op), var in model.ended.items():
        runs = c.kind is not _RC or (c.stage, c.microbatch) in recomputed
        values[var] = 1.0 if runs and end(c) <= start[op] else 0.0
    for op, ready in model.ready.items():
        (wait,) = waits(data.problem, op)
        ends = {wait.op: end(wait.op) + data.grid.up(wait.lag_ms)}
        ends.update({c: end(c) for (c, target), var in model.ended.items() if target == op and values[var]})
        for (target, source) in model.ready_is:
            if target == op and source.kind is op.kind and source != op:
                earlier = start[source] < start[op] or (start[source] == start[op] and source < op)
                if (source.stage, source.microbatch) in offloaded and earlier:
                    ends[source] = end(source)
        values[ready] = max(ends.values())
        for (target, source), var in model.ready_is.items():
            if target == op:
                values[var] = 1.0 if source in ends and ends[source] == values[ready] else 0.0
