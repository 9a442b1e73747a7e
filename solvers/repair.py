"""Repair: make a fast schedule that overflows the budget fit, at as little cost in time as it can.

The fastest heuristics (PO-H, GIS-H, ZB-H1, 1F1B-I, ...) often peak just over the budget, while
the memory-capped list schedule that always fits is two or three times slower. Three moves bring
a schedule's peak down, and the simulator judges every step:

- **Offload more**, on the devices that overflow: activations whose F-to-B window holds a round
  trip through the host and that are live while the device is over the budget. Policy "hidden"
  keeps only those whose transfers the link hides completely (``add_hidden_offloads``: the
  compute timeline does not change); policy "all" keeps them all (a backward may wait for its
  reload). The move stands when it lowers the excess over the budget (summed over devices); after
  two misses in a row the link is taken to be full and only the other move is made.
- **Hold back forwards** (``hold_back``), on the devices that overflow: each forward that starts
  while its device is over the budget and ends a run of forwards in the device's list moves past
  the next ops until they free the excess (or one op per round, ``max_step = 1``); a reload that
  opens an overflow moves the forward before it. Forwards behind a moved one follow it, so each
  device keeps its order of forwards and its order of backwards, and a forward never passes a
  backward of its own microbatch. A transient peak costs one forward a short wait; a device over
  the budget all through its steady state ends up with fewer microbatches in flight. Downstream
  devices then hold back what the moved forwards feed (``_propagate``), so no two lists wait on
  each other.
- **Pull W passes forward**, when holding back stalls (the excess did not fall, or nothing
  moved): deferred W passes that hold their weight part through an overflow run before it.

Rounds go on until the schedule fits (returned), or it is no faster than a fitting schedule
already known, or nothing moves, or the deadline passes (None).

``repair_candidates`` runs this on the fastest nearly fitting warm starts, with each policy and
step size, and returns the repaired ones that fit.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable

from optpipe.core.errors import OptpipeError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.semantics import Place, effects
from optpipe.core.simulate import Timeline, simulate

from .clock import Clock
from .offload_slots import activation_windows, add_hidden_offloads, add_offloads, round_trip_ms
from .result import Judged

__all__ = ["repair", "repair_candidates", "excess", "hold_back", "POLICIES", "REACH"]

_F, _B, _W, _BW = OpKind.F, OpKind.B, OpKind.W, OpKind.BW
_EPS = 1e-9
# How many offloads each round may add: "hidden" never delays compute, "all" may make a backward
# wait for its reload, "none" only holds back forwards.
POLICIES = ("hidden", "all", "none")
_MAX_ROUNDS = 64
_TIERS = (1.5, 2.5)  # peaks, in budgets, that make a start nearly fitting, then fairly close
REACH = _TIERS[-1]  # past this many budgets a start is repaired only when no closer one is there
_MORE_STARTS = 9  # further starts of the tier, repaired one at a time when the first ones leave time
_STEPS = (1, None)  # forwards move one op a round (least time lost), or as far as the excess asks (fewer rounds)


def excess(timeline: Timeline) -> int:
    """Bytes over the budget, summed over devices (0 when the schedule fits)."""
    budget = timeline.problem.memory.budget
    return sum(max(0, peak - budget) for peak in timeline.peak_memory)


def _overflow_start(timeline: Timeline, device: int) -> float | None:
    """The first time ``device`` holds more than the budget."""
    budget = timeline.problem.memory.budget
    return next((t for t, held in timeline.memory[device] if held > budget), None)


def _over_intervals(timeline: Timeline, device: int) -> list[tuple[float, float]]:
    """Time intervals during which ``device`` holds more than the budget."""
    budget = timeline.problem.memory.budget
    out, opened = [], None
    for t, held in timeline.memory[device]:
        if held > budget and opened is None:
            opened = t
        elif held <= budget and opened is not None:
            out.append((opened, t))
            opened = None
    if opened is not None:
        out.append((opened, math.inf))
    return out


def hold_back(problem: Problem, schedule: Schedule, timeline: Timeline, devices: Iterable[int],
              max_step: int | None = None, pull_weights: bool = False) -> Schedule:
    """``schedule`` (compute ops only) with forwards held back on ``devices``.

    Before: ``timeline`` is the simulator's timing of ``schedule`` or of it with transfers, and
    ``schedule`` has no cycle. After: on each named device, every F that starts while the device
    is over the budget and ends a run of forwards in the list moves past as many of the next ops
    as free the excess at its start (at least one, at most ``max_step``); when a reload opens an
    overflow, the last F before it moves instead. The forwards behind a moved one follow it, so
    a device's forwards keep their order, its other ops keep theirs, and no forward passes a
    backward of its own microbatch. Over many rounds a transient peak costs one forward a short
    wait, and a device that overflows all through its steady state ends up with fewer
    microbatches in flight. The
    downstream devices then hold back what the moved forwards feed (``_propagate``), so that no
    two lists wait on each other. With ``pull_weights``, the deferred W passes that hold memory
    through an overflow first move in front of it (``_pull_weights``): where holding back alone
    stalls, as on the last devices of ZB-H1, whose forwards cannot pass their own backwards.
    """
    by_op = timeline.by_op
    budget = problem.memory.budget
    rows = [list(ops) for ops in schedule.devices]
    for device in devices:
        over = _over_intervals(timeline, device)
        if not over:
            continue
        if pull_weights:
            rows[device] = _pull_weights(rows[device], by_op, over)
        ops = rows[device]
        curve = timeline.memory[device]
        times = [t for t, _ in curve]
        excess_at = lambda t: curve[max(0, bisect.bisect_right(times, t + _EPS) - 1)][1] - budget  # noqa: E731
        late = {}
        forwards = [k for k, op in enumerate(ops) if op.kind is _F]
        starts = [by_op[ops[k]].start for k in forwards]
        for lo, hi in over:
            # a device runs its list in order, so its forwards' starts rise: bisect for the interval
            first, stop = bisect.bisect_left(starts, lo - _EPS), bisect.bisect_left(starts, hi - _EPS)
            inside = forwards[first:stop]
            # the last of each run of forwards; when a reload opened the interval, the last F before it
            ends = [k for k in inside if k + 1 == len(ops) or ops[k + 1].kind is not _F]
            if not inside:
                ends = forwards[first - 1:first] if first else []
            for k in ends:
                when = max(lo, by_op[ops[k]].start)
                step = _ops_to_free(problem, ops, k + 1, excess_at(when))
                late[ops[k]] = step if max_step is None else min(step, max_step)
        rows[device] = _shift_forwards(rows[device], late, relative=True)
    _propagate(problem, rows)
    return Schedule(schedule.name, tuple(tuple(ops) for ops in rows))


def _pull_weights(ops: list[Op], by_op, over: list[tuple[float, float]]) -> list[Op]:
    """Deferred W passes that hold their weight part through an overflow, moved in front of it.

    A W whose B ended before an overflow starts and that itself starts after it moves to just
    before the first op that starts at or after the overflow's start (never before its own B,
    which is earlier still). W feeds no other op, so this makes no cycle.
    """
    starts = [by_op[op].start for op in ops]  # rising: a device runs its list in order
    before: dict[int, list[Op]] = {}  # list position -> W passes to run just before it
    pulled = set()
    for lo, _ in over:
        at = bisect.bisect_left(starts, lo - _EPS)
        for op in ops[at:]:
            if op.kind is _W and op not in pulled and by_op[Op(_B, op.stage, op.microbatch)].end <= lo + _EPS:
                before.setdefault(at, []).append(op)
                pulled.add(op)
    if not pulled:
        return ops
    out: list[Op] = []
    for k, op in enumerate(ops):
        out.extend(before.get(k, ()))
        if op not in pulled:
            out.append(op)
    return out


def _ops_to_free(problem: Problem, ops: list[Op], first: int, need: int) -> int:
    """How many non-forward ops from ``ops[first]`` on free ``need`` bytes (at least one)."""
    offloaded = {(op.stage, op.microbatch) for op in ops if op.kind is OpKind.OFFLOAD}
    freed = count = 0
    for op in ops[first:]:
        if op.kind is _F:
            continue
        count += 1
        freed -= sum(e.delta for e in effects(problem, op, fused=op.kind is _BW,
                                              offloaded=(op.stage, op.microbatch) in offloaded)
                     if e.place is Place.DEVICE and e.delta < 0)
        if freed >= need:
            break
    return max(count, 1)


def _shift_forwards(ops: list[Op], wanted: dict[Op, int], relative: bool) -> list[Op]:
    """Forwards moved later: by ``wanted[F]`` non-forward ops (relative) or to at least that slot.

    A slot counts the non-forward ops before a forward. The forwards keep their order (one
    behind a moved forward follows it) and never pass a backward of their own microbatch.
    """
    forwards = [op for op in ops if op.kind is _F]
    others = [op for op in ops if op.kind is not _F]
    slot, seen = [], 0
    for op in ops:
        if op.kind is _F:
            slot.append(seen)
        else:
            seen += 1
    cap, first_back = [len(others)] * len(forwards), {}
    for j, op in enumerate(others):
        first_back.setdefault(op.microbatch, j)
    for k, op in enumerate(forwards):
        cap[k] = first_back.get(op.microbatch, len(others))
    for k in range(len(forwards) - 2, -1, -1):
        cap[k] = min(cap[k], cap[k + 1])
    changed = False
    for k, op in enumerate(forwards):
        want = wanted.get(op)
        target = slot[k] if want is None else (slot[k] + want if relative else max(want, slot[k]))
        if k:
            target = max(target, slot[k - 1])
        target = min(target, max(cap[k], slot[k]))
        if target != slot[k]:
            slot[k] = target
            changed = True
    if not changed:
        return ops
    out: list[Op] = []
    k = 0
    for j in range(len(others) + 1):
        while k < len(forwards) and slot[k] == j:
            out.append(forwards[k])
            k += 1
        if j < len(others):
            out.append(others[j])
    return out


def _propagate(problem: Problem, rows: list[list[Op]]) -> None:
    """Hold back downstream forwards until no two device lists wait on each other this way:

    on device d a backward B(x, j) comes before F(s, i), while on the device of stage s + 1 (also
    that of x + 1) F(s + 1, i) comes before B(x + 1, j). B(x, j) waits for B(x + 1, j), which
    waits for F(s + 1, i), which waits for F(s, i), which waits for B(x, j): a cycle. The fix
    moves F(s + 1, i) behind B(x + 1, j); that may ask the same of the next device, and so on
    (rows is changed in place).
    """
    pipe = problem.pipeline
    last = pipe.stages - 1
    device_of = [pipe.device_of(s) for s in range(pipe.stages)]
    for _ in range(4 * pipe.devices * pipe.chunks_per_device + 4):
        moved = False
        slots = []  # per device: op -> its slot (non-forward ops before it, itself included)
        for ops in rows:
            seen, mine = 0, {}
            for op in ops:
                if op.kind is not _F:
                    seen += 1
                    mine[op] = seen
            slots.append(mine)
        wanted: list[dict[Op, int]] = [{} for _ in rows]
        for d, ops in enumerate(rows):
            need: dict[int, int] = {}  # target device -> slot its forward must reach
            for op in ops:
                kind, s = op.kind, op.stage
                if (kind is _B or kind is _BW) and s < last:
                    e = device_of[s + 1]
                    if e != d:
                        up = slots[e].get(Op(_B, s + 1, op.microbatch)) or slots[e].get(Op(_BW, s + 1, op.microbatch))
                        if up is not None and up > need.get(e, 0):
                            need[e] = up
                elif kind is _F and s < last:
                    e = device_of[s + 1]
                    if e != d and need.get(e, 0):
                        wanted[e][Op(_F, s + 1, op.microbatch)] = need[e]
        for e, want in enumerate(wanted):
            if not want:
                continue
            before = rows[e]
            after = _shift_forwards(before, want, relative=False)
            if after is not before:
                rows[e] = after
                moved = True
        if not moved:
            return


def _more_offloads(problem: Problem, timeline: Timeline, have: frozenset) -> frozenset:
    """Pairs on overflowing devices, live while over the budget, whose window holds a round trip."""
    pipe = problem.pipeline
    windows = activation_windows(timeline)
    by_op = timeline.by_op
    over = {d: _over_intervals(timeline, d) for d in range(pipe.devices)
            if timeline.peak_memory[d] > problem.memory.budget}
    chosen = set(have)
    for (stage, microbatch), window in windows.items():
        device = pipe.device_of(stage)
        if device not in over or (stage, microbatch) in have or window + _EPS < round_trip_ms(problem, stage):
            continue
        f_end = by_op[Op(_F, stage, microbatch)].end
        b_start = f_end + window
        if any(f_end < hi and b_start > lo for lo, hi in over[device]):
            chosen.add((stage, microbatch))
    return frozenset(chosen)


def _place(problem: Problem, compute: Schedule, pairs: frozenset, policy: str,
           deadline: float | None = None) -> Schedule | None:
    """``compute`` with ``pairs`` offloaded by ``policy``; None when hiding them runs past ``deadline``
    (on a saturated link that takes a round of two simulations per pair dropped: minutes at
    p = 64, m = 512)."""
    if not pairs:
        return compute
    if policy == "all":
        return add_offloads(problem, compute, pairs)
    return add_hidden_offloads(problem, compute, pairs, deadline)


def repair(problem: Problem, schedule: Schedule, policy: str = "hidden", deadline: float | None = None,
           name: str | None = None, max_step: int | None = None, ceiling: float = math.inf) -> Judged | None:
    """A fitting schedule made from ``schedule`` by the rounds of the module docstring, or None.

    ``deadline`` is a ``time.monotonic()`` value; the repair gives up (None) when it passes.
    ``max_step`` caps how far a forward moves in one round: small steps lose less time, large
    ones need fewer rounds. A repair that gets no faster than ``ceiling`` ms (a fitting schedule
    already known) gives up too: holding back only ever slows a schedule down.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: expected one of {', '.join(POLICIES)}")
    offload = problem.offload.enabled and policy != "none"
    name = name or f"{schedule.name}+repaired({policy})"
    compute = schedule.compute_only()
    pairs = schedule.offloaded
    placed = schedule
    began = time.monotonic()
    timeline = simulate(problem, placed)
    # a round simulates at least twice: one that cannot end by the deadline is not started
    # (at p = 32, m = 256 a simulation takes a second or more)
    clock = Clock(deadline, least_s=2 * (time.monotonic() - began))
    misses = 0  # offload rounds in a row that did not help: the link is full, stop asking it
    stalled = False  # the last hold-back did not lower the excess: pull W passes forward too
    for _ in range(_MAX_ROUNDS):
        if timeline.fits:
            return Judged(name, placed.renamed(name), timeline)
        if not clock.allows() or not timeline.fits_host or timeline.makespan >= ceiling - _EPS:
            return None
        if offload and misses < 2:
            wanted = _more_offloads(problem, timeline, pairs)
            if wanted != pairs:
                trial = _place(problem, compute, wanted, policy, deadline)
                if trial is None:
                    return None
                trial_timeline = simulate(problem, trial)
                if excess(trial_timeline) < excess(timeline):
                    placed, timeline, pairs, misses = trial, trial_timeline, trial.offloaded, 0
                    continue
                misses += 1
        over = [d for d in range(problem.devices) if timeline.peak_memory[d] > problem.memory.budget]
        step = _held_back(problem, compute, timeline, over, pairs, policy, max_step, stalled, deadline)
        if step is None and not stalled:
            step = _held_back(problem, compute, timeline, over, pairs, policy, max_step, True, deadline)
        if step is None:
            return None
        stalled = excess(step[2]) >= excess(timeline)
        compute, placed, timeline = step
        pairs = placed.offloaded
    return None


def _held_back(problem: Problem, compute: Schedule, timeline: Timeline, over: list[int], pairs: frozenset,
               policy: str, max_step: int | None, pull_weights: bool,
               deadline: float | None = None) -> tuple[Schedule, Schedule, Timeline] | None:
    """Hold back the overflowing devices and place the offloads again; None when nothing moves
    (or placing them runs past ``deadline``).

    ``_propagate`` rules out the cycles that holding back makes; should the simulator still find
    one, or an offload not place, the repair ends there (None) rather than guess.
    """
    moved = hold_back(problem, compute, timeline, over, max_step, pull_weights)
    if moved.devices == compute.devices:
        return None
    try:
        placed = _place(problem, moved, pairs, policy, deadline) if problem.offload.enabled else moved
        return None if placed is None else (moved, placed, simulate(problem, placed))
    except OptpipeError:
        return None


def _tier(over: float) -> int:
    return next((k for k, limit in enumerate(_TIERS) if over <= limit), len(_TIERS))


def repair_candidates(problem: Problem, candidates: list[Judged], deadline: float | None = None,
                      starts: int = 3, more: int = _MORE_STARTS) -> list[Judged]:
    """Repaired versions of up to ``starts`` overflowing candidates faster than any fitting one,
    then of up to ``more`` after them while the deadline allows.

    The nearest tier of them (peak at most 1.5 x the budget, else at most 2.5 x, else any),
    fastest first; offloaded variants of one compute order count once. Each start
    is repaired with each offload policy ("none" alone when offload is off) and each step size,
    the most promising pair first for every start (where simulations are slow, each with an equal
    share of the time left in that first round); a repair stops once it is slower than the best fitting schedule so far.
    The next starts of the tier follow, one at a time, when the first ones leave time: the fastest
    start is not always the one that repairs best (grid14, p = 12, v = 2, m = 24: GIS(g = 9) +
    hidden offload, the fifth, peaks at 1.01 x the budget and repairs at no cost to 1,491.7 ms,
    where the best fitting start took 1,499.9). Where rounds are slow, the first round that makes
    one fit ends the repairs: at p = 32, m = 256 (grid24) PO-H repaired with every offload placed
    fits at 27,381.2 ms after 13 s, the next variant spent 6 s and never got under that, and the
    W deferral that follows (wdefer.py) takes the start 2.5% lower given the time. The ones that
    fit come back, fastest first.
    """
    fitting = [c.timeline.makespan for c in candidates if c.fits]
    ceiling = min(fitting) if fitting else math.inf
    picked = _starts(problem, candidates, ceiling, starts + more)
    first, later = picked[:starts], picked[starts:]
    policies = ("all", "hidden") if problem.offload.enabled else ("none",)  # "all" takes fewer simulations
    variants = [(policy, step) for step in _STEPS for policy in policies]  # the most promising first
    out: list[Judged] = []
    # Share the first round among the starts only where rounds are slow (p = 32: a second or more
    # a simulation), so that one start's many rounds cannot leave none for one that a round or two
    # repairs; where they are fast, the first start may take the time it needs, as it always did.
    share = False
    if deadline is not None and first:
        began = time.monotonic()
        simulate(problem, first[0].schedule)
        share = 2 * _MAX_ROUNDS * (time.monotonic() - began) > deadline - time.monotonic()
    for round_index, (policy, max_step) in enumerate(variants):
        for n, c in enumerate(first):
            now = time.monotonic()
            if deadline is not None and now > deadline:
                return sorted(out, key=lambda c: c.timeline.makespan)
            until = deadline
            if share and round_index == 0:  # what a start leaves goes to the next
                until = now + (deadline - now) / (len(first) - n)
            ceiling = _repair_into(out, problem, c, policy, max_step, until, ceiling)
        if share and out:  # slow rounds: the first that fit, and the time left to what moves a start more
            return sorted(out, key=lambda c: c.timeline.makespan)
    for c in later:
        for policy, max_step in variants:
            if deadline is not None and time.monotonic() > deadline:
                return sorted(out, key=lambda c: c.timeline.makespan)
            ceiling = _repair_into(out, problem, c, policy, max_step, deadline, ceiling)
    return sorted(out, key=lambda c: c.timeline.makespan)


def _starts(problem: Problem, candidates: list[Judged], ceiling: float, most: int) -> list[Judged]:
    """Up to ``most`` overflowing candidates faster than ``ceiling``, distinct compute orders only
    (offloaded variants of one heuristic repair alike), of the nearest tier, fastest first."""
    budget = problem.memory.budget
    over = sorted((c for c in candidates if not c.fits and c.timeline.makespan < ceiling - _EPS),
                  key=lambda c: (_tier(c.timeline.peak / budget), c.timeline.makespan, c.timeline.peak))
    picked, seen = [], set()
    for c in over:
        key = c.schedule.compute_only().devices
        if key in seen:
            continue
        seen.add(key)
        if picked and _tier(c.timeline.peak / budget) > _tier(picked[0].timeline.peak / budget):
            break  # farther-off starts only when none is nearer: they take many slow rounds
        picked.append(c)
        if len(picked) == most:
            break
    return picked


def _repair_into(out: list[Judged], problem: Problem, c: Judged, policy: str, max_step: int | None,
                 until: float | None, ceiling: float) -> float:
    """``c`` repaired one way, added to ``out`` when it beats ``ceiling``; the new ceiling."""
    label = f"{c.name}+repaired({policy}{'' if max_step is None else f', step {max_step}'})"
    repaired = repair(problem, c.schedule, policy, until, name=label, max_step=max_step, ceiling=ceiling)
    if repaired is not None and repaired.timeline.makespan < ceiling - _EPS:
        out.append(repaired)
        return min(ceiling, repaired.timeline.makespan)
    return ceiling
