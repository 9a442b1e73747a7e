"""The CP-SAT model's ASAP consistency: every op starts at the end of something it waits for.

The simulator starts every op as soon as its dependencies, its device's previous op and its
issue point allow; it never waits for memory. A solution that delays an F on purpose (to let an
offload free memory first) would re-simulate with an earlier F and a higher peak. So every op
must be *tight*: it starts at the end of a data predecessor (plus lag), or of a compute op on
its device (which is then its device predecessor or issue point), or of a transfer on its
channel, or at 0. With every op tight the start times are the least fixed point of the
simulator's recurrence for the decoded order: the simulator reproduces them exactly.

One literal per (op, what it may start after), keyed by ``Tight``; only pairs whose windows
allow it to happen get one.

On a floor grid (floor_relax.py) "at the end" loosens to "within ``GIVE`` units after it": a
real op that starts right at t_i + d_i + lag starts, floored, between floor(t_i) + floor(d_i) +
floor(lag) and two units later (three fractional parts sum to less than 3).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

from ortools.sat.python import cp_model

from optpipe.core.errors import InternalError
from optpipe.core.schedule import Op

from .cpsat_vars import COMPUTE, OFF, RC, REL, TRANSFERS, B, F, Variables

__all__ = ["Tight", "add_tightness", "hint_tightness", "GIVE"]

GIVE = 2  # units a tight op may start late on a floor grid (the module docstring says why)

Reasons = list[tuple[Op, int]]  # (what the op may start right after, lag units)


class Tight(NamedTuple):
    """A tightness literal's key: ``op`` starts when ``after`` ends (plus its lag), or at 0 when
    ``after`` is None."""

    op: Op
    after: Op | None


def add_tightness(v: Variables, follow_preds: Mapping[Op, Reasons]) -> dict[Tight, cp_model.IntVar]:
    """Require every op of the model to be tight; ``follow_preds`` are what the ops after a
    window wait for in their list order (cpsat_model.py)."""
    tight: dict[Tight, cp_model.IntVar] = {}
    for d in range(v.P):
        recomputes = v.recomputes_on(d)
        compute = v.device_ops(d, COMPUTE) + recomputes
        floor = [(v.floor[d].op, 0)] if v.floor[d] is not None else []
        for op in recomputes:  # right after its F or another compute op on the device
            _require(v, tight, op, v.data_preds(op) + _may_follow(v, op, compute) + floor, False, v.present(op))
        for op in compute:
            if op.kind is RC:
                continue
            zero = op.kind is F and op.stage == 0 and v.floor[d] is None
            _require(v, tight, op, _compute_reasons(v, op) + _may_follow(v, op, compute) + floor, zero, True)
        for kind in TRANSFERS:
            for op in v.device_ops(d, (kind,)):  # its own transfers only: the others are their devices'
                _require(v, tight, op, _transfer_reasons(v, op, compute, floor), False,
                         v.presence((op.stage, op.microbatch)))
    for op, before in follow_preds.items():
        reasons = v.data_preds(op) + before
        if op.kind is B and v.presence((op.stage, op.microbatch)) is not False:
            reasons.append((Op(REL, op.stage, op.microbatch), 0))
        _require(v, tight, op, reasons, False, True)
    return tight


def _compute_reasons(v: Variables, op: Op) -> Reasons:
    """What a compute op waits for: its data, and a B its reload or its recompute."""
    reasons = v.data_preds(op)
    pair = (op.stage, op.microbatch)
    if op.kind is B and v.presence(pair) is not False:
        reasons.append((Op(REL, *pair), 0))
    if op.kind is B and pair in v.recomputed:
        reasons.append((Op(RC, *pair), 0))
    return reasons


def _transfer_reasons(v: Variables, op: Op, compute: list[Op], floor: Reasons) -> Reasons:
    """What a transfer waits for in the simulator, each a time it may start at: its data
    (semantics.waits), its issue point (a compute op or recompute on its own device, or the
    device's last fixed one), and its channel coming free: the transfer before it on the
    channel of its host link, whatever device of the group that one was on (semantics.py,
    "Shared host links"; its own device's previous transfer is one of them), or the channel's
    last fixed transfer. Never another device's compute ops: they issue only their own."""
    channel = v.link_ops(v.device_of[op.stage], op.kind)
    reasons = _may_follow(v, op, compute) + floor + v.data_preds(op) + _may_follow(v, op, channel)
    channel_floor = v.channel_floor.get((v.link[v.device_of[op.stage]], op.kind))
    if channel_floor is not None:
        reasons.append((channel_floor.op, 0))
    return reasons


def _may_follow(v: Variables, op: Op, others: list[Op]) -> Reasons:
    return [(other, 0) for other in others if other != op and _may_end_at(v, other, op)]


def _may_end_at(v: Variables, before: Op, op: Op) -> bool:
    """Can ``before`` end exactly when ``op`` starts, given their windows and FIFO? FIFO binds
    compute ops only, and not the chains a window leaves unordered (window.unordered_chains): a
    channel may carry a later microbatch's transfer of the stage first (its issue point came
    earlier), and on a p = 4, m = 6 case with k = 2 only that order reaches the optimum
    (tests/test_cpsat_transfer_order.py)."""
    if (before.kind in COMPUTE and before.stage == op.stage and before.kind == op.kind
            and before.microbatch > op.microbatch and v.in_order(op)):
        return False
    lo, hi = v.window[before]
    a, b = v.window[op]
    return lo + v.d(before) <= b and hi + v.d(before) + _give(v) >= a


def _give(v: Variables) -> int:
    return GIVE if v.grid.floor else 0


def _require(v: Variables, tight: dict[Tight, cp_model.IntVar], op: Op, reasons: Reasons, zero: bool,
             present) -> None:
    """``op`` starts at the end of one of ``reasons`` (or at 0 when ``zero``), if present.

    One literal per ``Tight`` key, made once: a second one under the same key would be left out
    of the hint (hint_tightness sets the literals it finds in ``tight``)."""
    literals = []
    start, give = v.start[op], _give(v)
    lags: dict[Op, int] = {}
    for pred, lag in reasons:  # a wait with a lag rules out starting right at the end
        lags[pred] = max(lag, lags.get(pred, lag))
    if any(Tight(op, pred) in tight for pred in lags) or Tight(op, None) in tight:
        raise InternalError(f"CP-SAT tightness: {op} is required twice; its first literals would miss the hint")
    for pred, lag in lags.items():
        pred_end = v.end_of(pred)
        if pred_end is None:
            continue
        t = v.cp.new_bool_var(f"t{op}<{pred}")
        if give:
            v.cp.add_linear_constraint(start - pred_end, lag, lag + give).only_enforce_if(t)
        else:
            v.cp.add(start == pred_end + lag).only_enforce_if(t)
        if pred.kind in (OFF, REL, RC):
            pred_present = v.present(pred)
            if pred_present is False:
                v.cp.add_bool_or([~t])
            elif pred_present is not True:
                v.cp.add_implication(t, pred_present)
        tight[Tight(op, pred)] = t
        literals.append(t)
    if zero:
        t = v.cp.new_bool_var(f"t{op}<0")
        v.cp.add(start <= give).only_enforce_if(t)  # == 0 but on a floor grid
        tight[Tight(op, None)] = t
        literals.append(t)
    if present is not True:
        literals.append(~present)
    v.cp.add_bool_or(literals)


def hint_tightness(v: Variables, tight: Mapping[Tight, cp_model.IntVar], starts: Mapping[Op, int],
                   ends: Mapping[Op, int]) -> None:
    """Each literal true where the hinted schedule starts its op right at that end (or at 0)."""
    lags: dict[Op, dict[Op, int]] = {}
    for key, literal in tight.items():
        value = False
        if key.op in starts:
            if key.after is None:
                value = starts[key.op] == 0
            else:
                if key.op not in lags:
                    lags[key.op] = dict(v.data_preds(key.op))
                value = key.after in ends and ends[key.after] + lags[key.op].get(key.after, 0) == starts[key.op]
        v.cp.add_hint(literal, value)
