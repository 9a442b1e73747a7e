"""What an op does, written once: what it waits for, how long it runs, where, and its memory.

The simulator (the judge), the CP-SAT and MILP models, the W-filler, decoding, and through the
simulator lowering's and the verifier's predictions all read this module. A rule written twice
drifts: issue 9 was a CP-SAT model and a simulator that disagreed about when memory comes and
goes. So nothing else spells out a duration, a data dependency or a memory effect.

The rules (docs/design.md, "Semantics"):

- F(s, i) waits for F(s-1, i); B(s, i) for the backward of (s+1, i), or F(s, i) on the last
  stage, and for REL(s, i) when (s, i) is offloaded; W(s, i) for B(s, i); a fused BW(s, i) is B
  then W in one op. Crossing devices adds ``p2p``.
- OFF(s, i) waits for F(s, i) and runs on the device's D2H channel; REL(s, i) waits for
  OFF(s, i) and runs on H2D. Transfers take bytes over the channel's bandwidth.
- RECOMPUTE(s, i) (issue 14) waits for F(s, i), runs ``recompute_ms`` on the compute channel,
  and B(s, i) waits for it. Recomputed, F holds the whole activation while it runs and only
  ``[recompute] resident`` after its end; the recompute takes the rest again from its start.
  A (stage, microbatch) is kept, offloaded or recomputed: one of the three.
- Memory is a set of holds per (stage, microbatch), each from one op's start to another op's
  end: F's start takes ``activation[s]``; B's end frees all but ``weight_activation[s]``, W's
  end the rest (BW's end all of it). Offloaded, the device copy lives from F's start to OFF's
  end and again from REL's start to B's (and W's) end, and the host copy from OFF's start to
  REL's end. Every hold begins at a start and ends at an end.

What the schedule adds (device order, one op per channel at a time, the issue point of a
transfer) is not a property of the op; the simulator derives it from the lists.

Shared host links (``[offload] link_groups``): the devices of a group have one D2H and one H2D
channel between them (``link``), and each transfer still runs at the link's full bandwidth, one
at a time. A device's own transfers keep their list order. Across the group's devices the
channel is a FIFO: it carries next the transfer that became ready first (``ready``: its waits,
its issue point and its device's previous transfer on the channel all met), ties to the lower
device, then the earlier list position. A transfer ready while the channel is busy starts when
it frees. That order is a function of the lists alone, so every simulation of a schedule is the
same. The order stays the simulator's, not a solver's choice: a plan carries per-device lists,
and no rank can see when its neighbour's transfers became ready. CP-SAT's full model encodes this
FIFO (cpsat_links.py); models that order a shared channel otherwise are relaxations whose answers the
simulator re-times.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from itertools import repeat

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind

__all__ = [
    "TOLERANCE_MS",
    "instant",
    "instants",
    "Channel",
    "Place",
    "At",
    "Wait",
    "Point",
    "Hold",
    "Effect",
    "OpSpec",
    "CHANNEL",
    "duration_ms",
    "stage_ms",
    "kept_bytes",
    "lag_ms",
    "exact_ms",
    "waits",
    "holds",
    "effects",
    "spec",
    "link",
    "ready_key",
]

_F, _B, _W, _BW, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD
_RC = OpKind.RECOMPUTE

# Two times closer than this are one instant. Times are sums of at most a few thousand
# durations, so float noise stays far below it; every comparison of times uses it.
TOLERANCE_MS = 1e-9


_DIGITS = 9  # TOLERANCE_MS as decimal places


def instant(t: float) -> float:
    """A time as the memory replay compares it: noise below TOLERANCE_MS is one instant."""
    return round(t, _DIGITS)


def instants(times: Iterable[float]) -> list[float]:
    """``instant`` of each time, in one pass (the simulator rounds every start and end)."""
    return list(map(round, times, repeat(_DIGITS)))


class Channel(Enum):
    """Where an op runs: one op at a time on each channel of a device."""

    COMPUTE = "compute"
    D2H = "D2H"
    H2D = "H2D"


class Place(Enum):
    DEVICE = "device"
    HOST = "host"


class At(Enum):
    START = "start"
    END = "end"


CHANNEL = {_F: Channel.COMPUTE, _B: Channel.COMPUTE, _W: Channel.COMPUTE, _BW: Channel.COMPUTE,
           _OFF: Channel.D2H, _REL: Channel.H2D, _RC: Channel.COMPUTE}


@dataclass(frozen=True, slots=True)
class Wait:
    """``op`` must end, then ``lag_ms`` pass (p2p across devices), before the waiting op starts."""

    op: Op
    lag_ms: float


@dataclass(frozen=True, slots=True)
class Point:
    """The start or the end of an op."""

    op: Op
    at: At


@dataclass(frozen=True, slots=True)
class Hold:
    """``bytes`` held in ``place`` from ``begins`` (always a start) to ``ends`` (always an end)."""

    place: Place
    bytes: int
    begins: Point
    ends: Point


@dataclass(frozen=True, slots=True)
class Effect:
    """A change of memory at one point of an op: positive takes hold, negative releases."""

    place: Place
    at: At
    delta: int


@dataclass(frozen=True, slots=True)
class OpSpec:
    """Everything an op does, as plain data."""

    op: Op
    duration_ms: float
    channel: Channel
    waits: tuple[Wait, ...]
    effects: tuple[Effect, ...]


def duration_ms(problem: Problem, op: Op) -> float:
    """Milliseconds; a transfer takes its bytes over its channel's bandwidth."""
    costs, kind, s = problem.costs, op.kind, op.stage
    if kind is _F:
        return costs.forward[s]
    if kind is _B:
        return costs.backward_input[s]
    if kind is _W:
        return costs.backward_weight[s]
    if kind is _BW:
        return costs.backward_input[s] + costs.backward_weight[s]
    if kind is _OFF:
        return problem.offload_ms(s)
    if kind is _RC:
        return problem.recompute_ms(s)
    return problem.reload_ms(s)


def exact_ms(problem: Problem, op: Op) -> Fraction:
    """``duration_ms`` as the fraction its float stands for: the decimal a cost was written as,
    a transfer's bytes x 1000 / bandwidth exactly. Time grids look for a unit that divides these."""
    costs, kind, s = problem.costs, op.kind, op.stage
    if kind is _OFF or kind is _REL:
        bandwidth = problem.offload.d2h_bandwidth if kind is _OFF else problem.offload.h2d_bandwidth
        return Fraction(problem.memory.activation[s] * 1000) / Fraction(repr(bandwidth))
    if kind is _BW:
        return Fraction(repr(costs.backward_input[s])) + Fraction(repr(costs.backward_weight[s]))
    return Fraction(repr(duration_ms(problem, op)))


def lag_ms(problem: Problem, a: int, b: int) -> float:
    """What data from stage ``a`` takes to reach stage ``b``: p2p across devices, nothing on one."""
    pipe = problem.pipeline
    return problem.costs.p2p if pipe.device_of(a) != pipe.device_of(b) else 0.0


_lag = lag_ms


def kept_bytes(problem: Problem, stage: int) -> tuple[int, int]:
    """(what F's start takes on the device, what stays after B until W ends) for a kept activation,
    read off ``holds``: for list schedulers that track memory per stage rather than per hold."""
    taken = after_b = 0
    for hold in holds(problem, stage, 0):
        if hold.place is Place.DEVICE:
            taken += hold.bytes
            if hold.ends.op.kind is _W:
                after_b += hold.bytes
    return taken, after_b


def stage_ms(problem: Problem, kind: OpKind) -> tuple[float, ...]:
    """``duration_ms`` of ``kind`` for every stage, for passes that reason per stage (bounds)."""
    return tuple(duration_ms(problem, Op(kind, s, 0)) for s in range(problem.stages))


def waits(problem: Problem, op: Op, *, fused_above: bool = False, offloaded: bool = False,
          recomputed: bool = False) -> tuple[Wait, ...]:
    """The data an op waits for, with lags.

    ``fused_above``: the backward of (s+1, i) is one BW op rather than B and W. ``offloaded``:
    the op's (stage, microbatch) goes to the host, so its backward waits for the reload. Every
    wait is on the op's own microbatch, and so is every hold: callers may ask once per (kind,
    stage) and substitute the microbatch (the simulator does).
    """
    s, i, kind = op.stage, op.microbatch, op.kind
    if kind is _F:
        return (Wait(Op(_F, s - 1, i), _lag(problem, s - 1, s)),) if s > 0 else ()
    if kind is _B or kind is _BW:
        if s == problem.stages - 1:
            data = Wait(Op(_F, s, i), 0.0)
        else:
            data = Wait(Op(_BW if fused_above else _B, s + 1, i), _lag(problem, s + 1, s))
        if recomputed:
            return (data, Wait(Op(_RC, s, i), 0.0))
        return (data, Wait(Op(_REL, s, i), 0.0)) if offloaded else (data,)
    if kind is _RC:
        return (Wait(Op(_F, s, i), 0.0),)
    if kind is _W:
        return (Wait(Op(_B, s, i), 0.0),)
    if kind is _OFF:
        return (Wait(Op(_F, s, i), 0.0),)
    return (Wait(Op(_OFF, s, i), 0.0),)


def holds(problem: Problem, stage: int, microbatch: int, *, fused: bool = False,
          offloaded: bool = False, recomputed: bool = False) -> tuple[Hold, ...]:
    """The memory one (stage, microbatch) holds, as holds with nonzero bytes."""
    act, keep = problem.memory.activation[stage], problem.memory.weight_activation[stage]
    s, i = stage, microbatch
    f, b, w, bw, off, rel = (Op(k, s, i) for k in (_F, _B, _W, _BW, _OFF, _REL))
    on = Place.DEVICE
    if recomputed:
        return _recomputed_holds(problem, s, i, fused)
    if offloaded:
        taken = Point(rel, At.START)
        out = [Hold(on, act, Point(f, At.START), Point(off, At.END)),
               Hold(Place.HOST, act, Point(off, At.START), Point(rel, At.END))]
    else:
        taken = Point(f, At.START)
        out = []
    if fused:
        out.append(Hold(on, act, taken, Point(bw, At.END)))
    else:
        out += [Hold(on, act - keep, taken, Point(b, At.END)), Hold(on, keep, taken, Point(w, At.END))]
    return tuple(h for h in out if h.bytes > 0)


def _recomputed_holds(problem: Problem, s: int, i: int, fused: bool) -> tuple[Hold, ...]:
    """Recomputed: F holds the whole activation while it runs and keeps ``resident`` (its input)
    from its end; RECOMPUTE(s, i) holds the rest again from its start. B's end frees all but
    ``weight_activation``, W's end the rest, as without recompute. The part W keeps is taken
    from the resident bytes first."""
    act, keep = problem.memory.activation[s], problem.memory.weight_activation[s]
    resident = problem.recompute.resident[s]
    f, b, w, bw, rc = (Op(k, s, i) for k in (_F, _B, _W, _BW, _RC))
    on = Place.DEVICE
    out = [Hold(on, act - resident, Point(f, At.START), Point(f, At.END))]
    if fused:
        out += [Hold(on, resident, Point(f, At.START), Point(bw, At.END)),
                Hold(on, act - resident, Point(rc, At.START), Point(bw, At.END))]
    else:
        early_keep = min(resident, keep)
        out += [Hold(on, early_keep, Point(f, At.START), Point(w, At.END)),
                Hold(on, resident - early_keep, Point(f, At.START), Point(b, At.END)),
                Hold(on, keep - early_keep, Point(rc, At.START), Point(w, At.END)),
                Hold(on, act - resident - (keep - early_keep), Point(rc, At.START), Point(b, At.END))]
    return tuple(h for h in out if h.bytes > 0)


def effects(problem: Problem, op: Op, *, fused: bool = False, offloaded: bool = False,
            recomputed: bool = False) -> tuple[Effect, ...]:
    """What ``op`` itself does to memory, derived from ``holds`` (never written a second time)."""
    out = []
    for hold in holds(problem, op.stage, op.microbatch, fused=fused, offloaded=offloaded, recomputed=recomputed):
        if hold.begins.op == op:
            out.append(Effect(hold.place, At.START, hold.bytes))
        if hold.ends.op == op:
            out.append(Effect(hold.place, At.END, -hold.bytes))
    return tuple(out)


def link(problem: Problem, device: int) -> int:
    """The host link a device's transfers use, named by its group's first device (the device
    itself when it shares its link with no one): ops on (link, channel) run one at a time."""
    return problem.offload.link_of(device)


def ready_key(ready_ms: float, device: int, position: int) -> tuple[float, int, int]:
    """The order in which a shared channel carries transfers: ready first, then lower device, then
    earlier in the device's list."""
    return (instant(ready_ms), device, position)


def spec(problem: Problem, op: Op, *, fused_above: bool = False, fused: bool = False,
         offloaded: bool = False, recomputed: bool = False) -> OpSpec:
    """The op's whole definition in one record (for reading and printing; hot loops call the parts)."""
    return OpSpec(op, duration_ms(problem, op), CHANNEL[op.kind],
                  waits(problem, op, fused_above=fused_above, offloaded=offloaded, recomputed=recomputed),
                  effects(problem, op, fused=fused, offloaded=offloaded, recomputed=recomputed))
