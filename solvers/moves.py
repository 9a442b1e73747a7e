"""List moves judged by the simulator: carry one op across any distance of a schedule.

The window search (lns.py) re-solves a slice of time exactly, but an op never leaves its
slice: a warm-up bubble that a forward from far later could fill, or a cool-down gap that
opens because another device runs a W before the B this device waits for, stays. Two moves
repair exactly that, each aimed at an idle gap of a device (``_targets`` says in what order):

- ``fill``: pull a later compute op of the gap's device, one whose data is ready before the
  gap ends, into the gap (the earliest such op first);
- ``hurry``: the op after the gap waits for data; walk back along what it waits for to the
  first op that its own device held back (it was ready before it started), and list that op
  one to three places earlier, ahead of what delayed it; when the path runs through a reload
  (the B waits for its activation to come back), keep that activation on the device instead.

An op moves with its own transfers: an F with the offload listed right after it, a B with its
reload, which must stay listed before it. Each move is simulated; it is kept when it fits and
lowers (makespan, sum of device ends, sum of compute ends), so the makespan never grows. An
order the simulator rejects (a deadlock) is skipped. Pure: the input schedule is not changed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from optpipe.core.idle import idle_gaps
from optpipe.core.problem import Problem
from optpipe.core.schedule import COMPUTE_KINDS, Op, OpKind, Schedule
from optpipe.core.semantics import TOLERANCE_MS, waits
from optpipe.core.simulate import Timeline, simulate, try_simulate

from .clock import Clock
from .critical import binding as data_binding

__all__ = ["Moved", "improve_by_moves", "move_score"]

_EPS = TOLERANCE_MS
_F, _B, _BW, _OFF, _REL = OpKind.F, OpKind.B, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD


@dataclass(frozen=True)
class Moved:
    schedule: Schedule
    timeline: Timeline
    tried: int  # moves simulated
    kept: int  # moves kept


def move_score(timeline: Timeline) -> tuple[float, float, float]:
    """Makespan; then the sum of the devices' last ends; then the sum of all compute ends."""
    ends = [0.0] * len(timeline.busy)
    total = 0.0
    for t in timeline.timings:
        if t.op.kind in COMPUTE_KINDS:
            ends[t.device] = max(ends[t.device], t.end)
            total += t.end
    return (round(timeline.makespan, 6), round(sum(ends), 6), round(total, 6))


def _ready(problem: Problem, timeline: Timeline, op: Op, offloaded: frozenset) -> float:
    """When the op's data is there in ``timeline`` (its waits' ends plus lags)."""
    by_op = timeline.by_op
    at = 0.0
    for wait in waits(problem, op, offloaded=(op.stage, op.microbatch) in offloaded):
        pred = wait.op
        if pred not in by_op and pred.kind is _B:
            pred = Op(_BW, pred.stage, pred.microbatch)
        if pred in by_op:
            at = max(at, by_op[pred].end + wait.lag_ms)
    return at


def _moved(schedule: Schedule, device: int, op: Op, before: Op) -> Schedule | None:
    """``op`` (with its adjacent transfers) listed just before ``before`` on ``device``."""
    row = list(schedule.devices[device])
    k = row.index(op)
    block = [op]
    if op.kind is _F and k + 1 < len(row) and row[k + 1] == Op(_OFF, op.stage, op.microbatch):
        block.append(row[k + 1])
    reload = Op(_REL, op.stage, op.microbatch)
    if op.kind in (_B, _BW) and reload in row and row.index(reload) >= row.index(before):
        block.insert(0, reload)  # the reload would come after its B: it moves along (else it stays put)
    rest = [x for x in row if x not in block]
    if before not in rest:
        return None
    j = rest.index(before)
    row = rest[:j] + block + rest[j:]
    return Schedule(schedule.name, schedule.devices[:device] + (tuple(row),) + schedule.devices[device + 1:])


def _kept_on_device(schedule: Schedule, device: int, pair: tuple[int, int]) -> Schedule:
    """The schedule without the offload and reload of ``pair``."""
    drop = {Op(_OFF, *pair), Op(_REL, *pair)}
    row = tuple(op for op in schedule.devices[device] if op not in drop)
    return Schedule(schedule.name, schedule.devices[:device] + (row,) + schedule.devices[device + 1:])


def _candidates(problem: Problem, schedule: Schedule, timeline: Timeline, gap, offloaded) -> list[Schedule]:
    length, device, after, gap_start = gap
    out = []
    row = [op for op in schedule.devices[device] if op.kind in COMPUTE_KINDS]
    k = row.index(after)
    gap_end = gap_start + length
    # fill: a later op whose data is ready before the gap ends
    fills = 0
    for op in row[k + 1:]:
        if _ready(problem, timeline, op, offloaded) < gap_end - _EPS:
            moved = _moved(schedule, device, op, after)
            if moved is not None:
                out.append(moved)
                fills += 1
                if fills == 2:
                    break
    # hurry: walk back along the data the op after the gap waits for, to the first op on that
    # path that its own device held back, and list that op earlier
    op = after
    for _ in range(2 * problem.stages + 2):
        binding = data_binding(problem, timeline, op, offloaded)
        if binding is None:
            break
        if binding.op.kind is _REL:  # the op waits for its reload: keep that activation on the device
            out.append(_kept_on_device(schedule, binding.device, (binding.op.stage, binding.op.microbatch)))
            break
        if binding.op.kind not in COMPUTE_KINDS:
            break
        if binding.start > _ready(problem, timeline, binding.op, offloaded) + 1e-6:
            other = [x for x in schedule.devices[binding.device] if x.kind in COMPUTE_KINDS]
            j = other.index(binding.op)
            for back in (1, 2, 3):
                if j - back < 0:
                    break
                moved = _moved(schedule, binding.device, binding.op, other[j - back])
                if moved is not None:
                    out.append(moved)
            break
        op = binding.op
    return out


def _targets(timeline: Timeline, rng: random.Random) -> list[tuple[float, int, Op, float]]:
    """Gaps in the order they are worked on: first the op that ends last (a gap of length 0:
    only ``hurry`` applies), then the gaps of the devices that end last, latest first (they
    hold the makespan), then the longest gap, then the others in a seeded random order."""
    last = max((t for t in timeline.timings if t.op.kind in COMPUTE_KINDS), key=lambda t: t.end)
    ends: dict[int, float] = {}
    for t in timeline.timings:
        if t.op.kind in COMPUTE_KINDS:
            ends[t.device] = max(ends.get(t.device, 0.0), t.end)
    gaps = idle_gaps(timeline)
    critical = sorted((g for g in gaps if ends[g[1]] >= timeline.makespan - 1e-6), key=lambda g: -g[3])
    others = sorted((g for g in gaps if ends[g[1]] < timeline.makespan - 1e-6), key=lambda g: -g[0])
    tail = others[1:]
    rng.shuffle(tail)
    return [(0.0, last.device, last.op, last.start)] + critical + others[:1] + tail


def improve_by_moves(problem: Problem, schedule: Schedule, *, deadline: float, rng: random.Random,
                     max_tries: int | None = None, timeline: Timeline | None = None) -> Moved:
    """Fill and hurry moves until no gap yields one, the deadline, or ``max_tries`` simulations;
    ``timeline``: the schedule's, when the caller has it."""
    timeline = timeline if timeline is not None else simulate(problem, schedule)
    score = move_score(timeline)
    tried = kept = 0
    clock = Clock(deadline)  # a simulation past the deadline is not begun
    progress = True
    while progress:
        progress = False
        offloaded = schedule.offloaded
        for gap in _targets(timeline, rng):
            for candidate in _candidates(problem, schedule, timeline, gap, offloaded):
                if not clock.allows() or (max_tries is not None and tried >= max_tries):
                    return Moved(schedule, timeline, tried, kept)
                tried += 1
                new = clock.timed(try_simulate, problem, candidate)
                if new is None:
                    continue
                new_score = move_score(new)
                if new.fits and new_score < score:
                    schedule, timeline, score = candidate, new, new_score
                    kept += 1
                    progress = True
                    break
            if progress:
                break
        if not progress:  # no single move pays: try a chain of them along the critical path
            chained = _chain(problem, schedule, timeline, rng, 2 * problem.devices, clock)
            tried += chained[2]
            if chained[0] is not None and move_score(chained[1]) < score:
                schedule, timeline, score = chained[0], chained[1], move_score(chained[1])
                kept += 1
                progress = clock.allows() and (max_tries is None or tried < max_tries)
    return Moved(schedule, timeline, tried, kept)


def _chain(problem: Problem, schedule: Schedule, timeline: Timeline, rng: random.Random,
           steps: int, clock: Clock) -> tuple[Schedule | None, Timeline | None, int]:
    """Hurry the critical path again and again (an ejection chain): moving one held-back op
    often only hands the delay to the next device, and the makespan falls only when every
    device on the path has moved. Returns the best fitting step (None when none fits), and the
    number of simulations (none begun past ``clock``'s deadline)."""
    best: tuple[Schedule | None, Timeline | None] = (None, None)
    tried = 0
    for _ in range(steps):
        if not clock.allows():
            break
        target = _targets(timeline, rng)[0]
        moves = [c for c in _candidates(problem, schedule, timeline, target, schedule.offloaded)]
        if not moves:
            break
        new = clock.timed(try_simulate, problem, moves[0])
        if new is None:
            break
        tried += 1
        schedule, timeline = moves[0], new
        if new.fits and (best[1] is None or move_score(new) < move_score(best[1])):
            best = (schedule, new)
    return best[0], best[1], tried
