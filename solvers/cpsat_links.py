"""The CP-SAT model's shared host links: a group's channel serves its transfers FIFO by ready time.

semantics.py ("Shared host links"): each transfer's ``ready`` is the latest end of what it waits
for in the simulator (its data, its issue point: the last compute op on its device that ended by
its start, where decoding lists it, and its device's transfer before it on the channel), and of
two transfers of different devices the one served first has the smaller (ready, device). With
that the simulator reproduces the model's order and times. The full model only: a window's
shared channels stay a relaxation (lns.py re-simulates).

The literals and ready times are kept as typed entries, in the order they were made, so that a
hint sets them in that order too.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Union

from ortools.sat.python import cp_model

from optpipe.core.schedule import Op

from .cpsat_vars import COMPUTE, RC, TRANSFERS, Variables

__all__ = ["Before", "EndedBy", "ReadyIs", "Ready", "Entry", "add_shared_fifo", "hint_shared_fifo"]


class Before(NamedTuple):
    literal: cp_model.IntVar  # ``a`` is served before ``b`` (two devices, one channel)
    a: Op
    b: Op


class EndedBy(NamedTuple):
    literal: cp_model.IntVar  # ``other`` (same device) ended by ``op``'s start: decoding lists it before
    other: Op
    op: Op


class ReadyIs(NamedTuple):
    literal: cp_model.IntVar  # ``op``'s ready time is ``after``'s end; None: the end of its data wait
    op: Op
    after: Op | None


class Ready(NamedTuple):
    var: cp_model.IntVar  # ``op``'s ready time
    op: Op


Entry = Union[Before, EndedBy, ReadyIs, Ready]


def add_shared_fifo(v: Variables) -> list[Entry]:
    """Order every shared channel FIFO by (ready, device); returns what the hint sets."""
    entries: list[Entry] = []
    if v.scope.window or not v.problem.offload.enabled:
        return entries
    for group in v.problem.offload.link_groups:
        if len(group) < 2:
            continue
        for kind in TRANSFERS:
            ops = [op for d in group for op in v.device_ops(d, (kind,))]
            ready = {op: _ready(v, op, entries) for op in ops}
            for x, a in enumerate(ops):
                for b in ops[x + 1:]:
                    if v.device_of[a.stage] != v.device_of[b.stage]:
                        _serve_in_order(v, a, b, ready, entries)
    return entries


def _serve_in_order(v: Variables, a: Op, b: Op, ready: Mapping[Op, cp_model.IntVar], entries: list[Entry]) -> None:
    """Of two transfers of different devices on one channel, the one with the smaller
    (ready, device) goes first."""
    both = _both(v, a, b)
    if both is None:
        return
    first = v.cp.new_bool_var(f"fifo{a}<{b}")  # a is served before b
    v.cp.add(v.end_of(a) <= v.start[b]).only_enforce_if([first] + both)
    v.cp.add(v.end_of(b) <= v.start[a]).only_enforce_if([~first] + both)
    # the lower device wins a tie
    if v.device_of[a.stage] < v.device_of[b.stage]:
        v.cp.add(ready[a] <= ready[b]).only_enforce_if([first] + both)
        v.cp.add(ready[b] < ready[a]).only_enforce_if([~first] + both)
    else:
        v.cp.add(ready[a] < ready[b]).only_enforce_if([first] + both)
        v.cp.add(ready[b] <= ready[a]).only_enforce_if([~first] + both)
    entries.append(Before(first, a, b))


def _both(v: Variables, a: Op, b: Op) -> list | None:
    """The presence literals of two transfers (None when one is absent for sure)."""
    out = []
    for op in (a, b):
        present = v.present(op)
        if present is False:
            return None
        if present is not True:
            out.append(present)
    return out


def _ready_others(v: Variables, op: Op) -> list[Op]:
    """The ops on the transfer's device whose end may be its ready time: compute ops,
    recomputes, and its device's other transfers on the channel."""
    d = v.device_of[op.stage]
    return [o for o in v.device_ops(d, COMPUTE) + v.recomputes_on(d) + v.device_ops(d, (op.kind,)) if o != op]


def _ready(v: Variables, op: Op, entries: list[Entry]) -> cp_model.IntVar:
    """A variable equal to the simulator's ready time of a transfer on a shared channel."""
    present = v.present(op)
    when = [] if present is True else [present]
    ready = v.cp.new_int_var(0, v.horizon, f"ready{op}")
    start = v.start[op]
    terms: list[tuple[object, object, Op | None]] = [(v.end_of(v.transfer_source(op)), None, None)]  # (end, by, after)
    for other in _ready_others(v, op):
        other_present = v.present(other)
        if other_present is False:
            continue
        by = v.cp.new_bool_var(f"by{other}<{op}")  # ended by op's start (listed before it)
        guard = [] if other_present is True else [other_present]
        if other_present is not True:
            v.cp.add_implication(by, other_present)
        v.cp.add(v.end_of(other) <= start).only_enforce_if([by] + when)
        if other.kind in COMPUTE or other.kind is RC:
            v.cp.add(v.end_of(other) > start).only_enforce_if([~by] + guard + when)
        else:  # one channel: one of the two runs first
            v.cp.add(v.end_of(op) <= v.start[other]).only_enforce_if([~by] + guard + when)
        terms.append((v.end_of(other), by, other))
        entries.append(EndedBy(by, other, op))
    tight = [] if present is True else [~present]
    for n, (end, by, after) in enumerate(terms):
        v.cp.add(ready >= end).only_enforce_if(([by] if by is not None else []) + when)
        t = v.cp.new_bool_var(f"rt{op}#{n}")
        v.cp.add(ready == end).only_enforce_if(t)
        if by is not None:
            v.cp.add_implication(t, by)
        tight.append(t)
        entries.append(ReadyIs(t, op, after))
    v.cp.add_bool_or(tight)
    entries.append(Ready(ready, op))
    return ready


def hint_shared_fifo(v: Variables, entries: list[Entry], starts: Mapping[Op, int], ends: Mapping[Op, int]) -> None:
    """The shared-channel literals and ready times of the hinted schedule."""
    if not entries:
        return
    ready: dict[Op, int] = {}
    for entry in entries:
        if isinstance(entry, Ready):
            op = entry.op
            if op not in starts:
                ready[op] = 0
                continue
            values = [ends[v.transfer_source(op)]]
            values += [ends[o] for o in _ready_others(v, op) if o in ends and ends[o] <= starts[op]]
            ready[op] = max(values)
    for entry in entries:
        if isinstance(entry, Ready):
            v.cp.add_hint(entry.var, ready[entry.op])
        elif isinstance(entry, Before):
            v.cp.add_hint(entry.literal, entry.a in starts and entry.b in starts and starts[entry.a] < starts[entry.b])
        elif isinstance(entry, EndedBy):
            other, op = entry.other, entry.op
            v.cp.add_hint(entry.literal, other in ends and op in starts and ends[other] <= starts[op])
    chosen: set[Op] = set()  # one equality literal per ready: the first term that attains it
    for entry in entries:
        if not isinstance(entry, ReadyIs):
            continue
        op, after = entry.op, entry.after
        value = False
        if op in starts and op not in chosen:
            if after is None or (after in ends and ends[after] <= starts[op]):
                end = ends[v.transfer_source(op) if after is None else after]
                value = end == ready[op]
        if value:
            chosen.add(op)
        v.cp.add_hint(entry.literal, value)
