"""Where activation transfers go in a schedule, and which activations are worth moving.

A transfer is issued once the compute op listed just before it on its device has ended
(core/schedule.py), so choosing a transfer's slot means choosing its list position.
``add_offloads`` puts OFFLOAD(s, i) right after F(s, i), the earliest slot, so the D2H channel
frees the device as soon as it can; and RELOAD(s, i) after the latest compute op that still
lets it end before B(s, i) starts, because a reload holds device memory from its start.

The pass works from the compute-only schedule's timeline: offloads never delay compute, and
a reload placed that way never delays its backward, so when every reload fits, the result has
exactly the compute timeline of its input. A reload fits when its window (from its offload's
end to B's start, minus the H2D channel's queue) holds ``reload_ms``; when it does not, the pass
places it as early as allowed and B waits for it: the trade-off is a later B rather than no
offload. Callers that cannot afford it pick pairs whose window holds a round trip
(``offloadable``, ``longest_lived``) and let ``add_hidden_offloads`` drop those the channels
still cannot hide (queued behind other transfers).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

from optpipe.core.errors import ProblemError, ScheduleError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.semantics import TOLERANCE_MS, duration_ms
from optpipe.core.simulate import Timeline, op_times, simulate

__all__ = [
    "round_trip_ms",
    "activation_windows",
    "offloadable",
    "longest_lived",
    "longest_lived_stages",
    "add_offloads",
    "add_hidden_offloads",
]

_EPS = TOLERANCE_MS
_F, _B, _BW = OpKind.F, OpKind.B, OpKind.BW


def round_trip_ms(problem: Problem, stage: int) -> float:
    """Offload plus reload of one activation of ``stage``: the window it needs between F and B."""
    return duration_ms(problem, Op(OpKind.OFFLOAD, stage, 0)) + duration_ms(problem, Op(OpKind.RELOAD, stage, 0))


def activation_windows(timeline: Timeline) -> dict[tuple[int, int], float]:
    """(stage, microbatch) -> ms from the end of F to the start of its B (or BW)."""
    ends: dict[tuple[int, int], float] = {}
    starts: dict[tuple[int, int], float] = {}
    for timing in timeline.timings:
        op = timing.op
        if op.kind is _F:
            ends[(op.stage, op.microbatch)] = timing.end
        elif op.kind is _B or op.kind is _BW:
            starts[(op.stage, op.microbatch)] = timing.start
    return {pair: starts[pair] - end for pair, end in ends.items()}


def offloadable(timeline: Timeline) -> tuple[tuple[int, int], ...]:
    """Pairs whose window holds a round trip, longest window first (ties by stage, microbatch).

    A pair outside this set (the last stage's, whose B follows F at once) would make its B wait.
    """
    problem = timeline.problem
    windows = activation_windows(timeline)
    fits = [pair for pair, window in windows.items() if window + _EPS >= round_trip_ms(problem, pair[0])]
    return tuple(sorted(fits, key=lambda pair: (-windows[pair], pair)))


def longest_lived(timeline: Timeline, count: int) -> frozenset[tuple[int, int]]:
    """The ``count`` offloadable pairs that live longest between F and B (fewer if fewer fit)."""
    return frozenset(offloadable(timeline)[:max(count, 0)])


def longest_lived_stages(timeline: Timeline) -> tuple[int, ...]:
    """Every stage, by the mean window of its activations, longest first (ties by stage)."""
    windows = activation_windows(timeline)
    total: dict[int, float] = {}
    for (stage, _), window in windows.items():
        total[stage] = total.get(stage, 0.0) + window
    microbatches = timeline.problem.microbatches
    return tuple(sorted(total, key=lambda stage: (-total[stage] / microbatches, stage)))


def _check_pairs(problem: Problem, pairs: Iterable[tuple[int, int]]) -> frozenset[tuple[int, int]]:
    if not problem.offload.enabled:
        raise ProblemError("offload is not enabled in the problem, so no activation can move to the host; "
                           "add [offload] enabled = true with d2h_bandwidth and h2d_bandwidth")
    stages, microbatches = problem.stages, problem.microbatches
    checked = set()
    for pair in pairs:
        stage, microbatch = pair
        if not (0 <= stage < stages and 0 <= microbatch < microbatches):
            raise ScheduleError(f"cannot offload (stage {stage}, microbatch {microbatch}): stages run "
                                f"0..{stages - 1} and microbatches 0..{microbatches - 1}")
        checked.add((stage, microbatch))
    return frozenset(checked)


def add_offloads(problem: Problem, schedule: Schedule, chosen: Iterable[tuple[int, int]]) -> Schedule:
    """``schedule`` with OFFLOAD/RELOAD ops for ``chosen`` (stage, microbatch) pairs.

    Before: a valid schedule; transfers already in it are taken out and their pairs placed again
    with the chosen ones. After: every compute op keeps its list order, each chosen pair (and each
    pair the input offloaded) has OFFLOAD right after its F and RELOAD before its backward; the
    input is not changed.
    """
    pairs = (_check_pairs(problem, chosen) | schedule.offloaded) - schedule.recomputed  # kept, offloaded or recomputed
    compute = schedule.compute_only()
    return _placed(problem, compute, pairs, simulate(problem, compute).by_op)


def _placed(problem: Problem, compute: Schedule, pairs: frozenset[tuple[int, int]], by_op,
            known: dict | None = None) -> Schedule:
    """``add_offloads`` of a compute-only schedule whose timeline (``by_op``) is known. A device's
    ops depend on its own pairs alone: ``known`` keeps them by those, for callers that place
    sets differing on a few devices."""
    devices = []
    for device, ops in enumerate(compute.devices):
        mine = tuple(op for op in ops if op.kind is _F and (op.stage, op.microbatch) in pairs)
        if not mine:
            devices.append(ops)
            continue
        placed = known.get((device, mine)) if known is not None else None
        if placed is None:
            offload_end = _offload_ends(problem, mine, by_op)
            placed = _merge(ops, pairs, _reload_slots(problem, ops, offload_end, by_op))
            if known is not None:
                known[(device, mine)] = placed
        devices.append(placed)
    return Schedule(compute.name, tuple(devices))


def add_hidden_offloads(problem: Problem, schedule: Schedule, candidates: Iterable[tuple[int, int]],
                        deadline: float | None = None) -> Schedule | None:
    """``add_offloads`` for the candidates whose transfers the host link hides completely.

    After: the compute timeline is exactly the input's. A reload that ends after its backward's
    start in the input timeline would delay it. Each round drops, per device, the late pair whose
    backward comes first (the later ones may only queue behind it) and places the rest again,
    until none is late; every round shrinks the set, so this ends. With ``deadline``
    (``time.monotonic()``) it gives up (None) once that passes.

    A round times each device's transfers on their own (``_first_late``): until a reload is late
    the compute timeline is the input's, so that timing is the simulator's up to each device's
    first late reload. What a late reload does to the devices it feeds, it alone does not see, so
    the set it leaves is checked by the simulator before it is returned (and rounds go on if that
    finds more). At p = 24, m = 48 simulating every round took 11 of the 30 s of compile's starts.
    """
    compute = schedule.compute_only()
    timeline = simulate(problem, compute)
    due = {(t.op.stage, t.op.microbatch): t.start for t in timeline.timings
           if t.op.kind is _B or t.op.kind is _BW}
    chosen = set(_check_pairs(problem, candidates))
    known: dict = {}  # a round changes the devices it drops a pair on; the others are placed as before
    alone = not problem.offload.link_groups  # a shared channel orders transfers across devices
    while True:
        if deadline is not None and time.monotonic() > deadline:
            return None
        placed = _placed(problem, compute, frozenset(chosen) - compute.recomputed, timeline.by_op, known)
        late = _first_late(problem, placed, timeline.by_op, due) if alone else {}
        if not late:
            late = _first_late_simulated(problem, placed, due)
            if not late:
                return placed
        chosen -= {pair for _, pair in late.values()}


def _first_late(problem: Problem, placed: Schedule, by_op, due: dict) -> dict[int, tuple[float, tuple[int, int]]]:
    """Per device, (due, pair) of the late reload whose backward comes first, each device's
    transfers timed against the compute timeline ``by_op`` as the simulator times them: issued
    at the end of the compute op listed before, in list order on each channel, an offload after
    its F and a reload after its offload."""
    out: dict[int, tuple[float, tuple[int, int]]] = {}
    for device, ops in enumerate(placed.devices):
        # each offload is listed right after its F (``_merge``), so its end is ``_offload_ends``'
        offloaded = _offload_ends(problem, [Op(_F, op.stage, op.microbatch) for op in ops
                                            if op.kind is OpKind.OFFLOAD], by_op)
        issued, h2d = 0.0, -math.inf
        for op in ops:
            if op.kind is OpKind.RELOAD:
                pair = (op.stage, op.microbatch)
                h2d = max(issued, offloaded[pair], h2d) + duration_ms(problem, op)
                _note_late(out, device, pair, h2d, due)
            elif op.kind is not OpKind.OFFLOAD:
                issued = by_op[op].end
    return out


def _first_late_simulated(problem: Problem, placed: Schedule, due: dict) -> dict[int, tuple[float, tuple[int, int]]]:
    """``_first_late`` as the simulator has it, with what late reloads do to other devices."""
    out: dict[int, tuple[float, tuple[int, int]]] = {}
    for op, device, _, end in op_times(problem, placed):
        if op.kind is OpKind.RELOAD:
            _note_late(out, device, (op.stage, op.microbatch), end, due)
    return out


def _note_late(late: dict, device: int, pair: tuple[int, int], end: float, due: dict) -> None:
    """Keep, per device, the late reload whose backward comes first."""
    if end > due[pair] + _EPS:
        late[device] = min(late.get(device, (math.inf, pair)), (due[pair], pair))


def _offload_ends(problem: Problem, forwards: list[Op], by_op) -> dict[tuple[int, int], float]:
    """The D2H channel runs offloads in F order, each from max(F end, previous offload end)."""
    ends = {}
    free = -math.inf
    for op in forwards:
        start = max(by_op[op].end, free)
        free = start + duration_ms(problem, Op(OpKind.OFFLOAD, op.stage, op.microbatch))
        ends[(op.stage, op.microbatch)] = free
    return ends


def _reload_slots(problem: Problem, ops: tuple[Op, ...], offload_end: dict[tuple[int, int], float],
                  by_op) -> dict[int, list[Op]]:
    """Compute-op index -> reloads listed right after it, in backward order.

    Reloads share one FIFO channel in backward order. Going from the last backward to the first,
    each reload must end by its B's start and by the next reload's start; it goes after the latest
    compute op that allows that, which gives it the latest start (the least time holding memory).
    When no slot allows it, it goes after the latest op that ended when its offload did: as early
    as it can start, and its B waits.
    """
    ends = [by_op[op].end for op in ops]
    forward_at = {(op.stage, op.microbatch): k for k, op in enumerate(ops) if op.kind is _F}
    backward_at = [k for k, op in enumerate(ops)
                   if op.kind in (_B, _BW) and (op.stage, op.microbatch) in offload_end]
    after: dict[int, list[Op]] = {}
    deadline = math.inf  # the next reload's start
    limit = len(ops)  # keeping backward order on the channel, slots never move later going back
    for position in reversed(backward_at):
        op = ops[position]
        pair = (op.stage, op.microbatch)
        length = duration_ms(problem, Op(OpKind.RELOAD, *pair))
        released = offload_end[pair]
        due = min(by_op[op].start, deadline)
        # Slots before F start no later than one right after F (the offload ends after F does),
        # so the search stops at F; and a reload is never listed before its own forward: in the
        # rare case the channel order asks for that, it goes after F and the channel takes it
        # out of backward order.
        first = forward_at[pair]
        candidates = range(max(min(position, limit) - 1, first), first - 1, -1)
        slot = next((k for k in candidates if max(ends[k], released) + length <= due + _EPS), None)
        if slot is None:  # cannot end in time: start when the offload ends (F ends before it does)
            slot = next(k for k in candidates if ends[k] <= released + _EPS)
        start = max(ends[slot], released)
        after.setdefault(slot, []).insert(0, Op(OpKind.RELOAD, *pair))
        deadline, limit = start, slot + 1
    return after


def _merge(ops: tuple[Op, ...], pairs: frozenset[tuple[int, int]], after: dict[int, list[Op]]) -> tuple[Op, ...]:
    merged: list[Op] = []
    for k, op in enumerate(ops):
        merged.append(op)
        if op.kind is _F and (op.stage, op.microbatch) in pairs:
            merged.append(Op(OpKind.OFFLOAD, op.stage, op.microbatch))
        merged.extend(after.get(k, ()))
    return tuple(merged)
