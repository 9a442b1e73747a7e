"""Defer the W passes that set the makespan: the zero-bubble move, aimed by the critical path.

On an unbalanced pipeline neighbouring devices take turns being the bottleneck. In grid24's
best start (p = 32, v = 2, m = 256, PO-H repaired) the critical path runs 48 ops on device 6
(its chunk-1 phase: B, W, F of stage 38, no idle), then 47 on device 7 (its chunk-0 phase:
stage 7, the heaviest), and so on for all 16 groups; meanwhile device 6 waits 6.2 ms before
each B of its chunk-0 phase for device 7, and device 7 waits 10 ms before each F of its
chunk-1 phase for device 6. A W is on no other op's data path, so a W in such a stretch of
the path delays the device's next op for no reason but its place in the list. Moving it past
the stretch, into the device's next idle gap, shortens the path by the W's length wherever
the gap absorbs it.

One W per stretch is moved for every stretch of the path at once, and the simulator judges the
whole round (kept when faster and fitting). At p = 32, m = 256 a simulation takes about 0.4 s,
so moves judged one at a time (moves.py) never get through the hundreds a schedule needs; a
round of all stretches takes one. When a round is not faster, the next of ``ROUNDS`` is tried
(the last W of each stretch to the end of the device's list where the device ends early, half
the stretches, Ws pulled back into earlier gaps where a stretch ends a device's list, ...); the
pass ends when none is, or at the deadline. Second in each pass, after the rule that pays most
often, come the reloads the path waits for, issued earlier (reload_advance.py): a W moved off the
path often leaves a backward waiting for its activation there, and the other way round. (Tried
first, they cost a simulation each pass where the W rule pays: grid24's start reached 26,796.7 ms
in 15 s that way, 26,721.5 this way.) A round that is faster but overflows is tried
again without the devices that overflow. Greedy, so the result depends on the order: on
grid20's 60 s schedule (p = 24, m = 48) this order gives 5,437.2 to 5,327.4 ms in 9 s, and an
earlier one 5,303.5 in 25 s (bound 5,098.3); grid22's (p = 32, m = 64) 4,314.4 to 4,241.2 in 42 s
(bound 3,972.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from optpipe.core.idle import idle_gaps
from optpipe.core.problem import Problem
from optpipe.core.schedule import COMPUTE_KINDS, Op, OpKind, Schedule
from optpipe.core.semantics import TOLERANCE_MS
from optpipe.core.simulate import OpTiming, Timeline, try_simulate

from .clock import Clock
from .critical import critical_path
from .reload_advance import advanced_reloads
from .reload_delay import delayed_reloads

__all__ = ["Round", "ROUNDS", "defer_critical_w", "deferred", "pays", "search_defers_first"]

_W = OpKind.W
_EPS = TOLERANCE_MS
_RETRIES = 3  # a round tried again without the devices that overflowed, at most this often
# From this many devices on compile uses the pass. Below, the window search reaches these moves
# itself, and at 60 s a deferred start or the search's "defer" rounds left grid04 (p = 6) at 2.4%
# and 3.5% above its bound, against 1.5% and 1.6% without, and grid08 (p = 8) at 2.9% and 3.6%,
# against 0.3% and 1.7% (one run each; noisy rows, docs/design.md); at p = 12 they took grid14
# from 4.5% to 2.2% and 3.2% in two grid runs.
_FROM_DEVICES = 12
# From this many devices on the window search defers first, to the end of the pass: there its windows
# moved no start in a 60 s compile (grid17 to grid24), while the starts' pass had stopped at its share of
# the limit with rounds still paying. Seed 1's grid24 (p = 32, v = 2, m = 256): compile returned
# 17,213.4 ms; 40 s more of the same pass took that to 16,188.9 (bound 15,966.4).
_FIRST_FROM_DEVICES = 16


@dataclass(frozen=True)
class Round:
    """Which Ws of each stretch of the critical path move, and to which gaps."""

    last: bool = True  # the stretch's last Ws (else its first)
    per_stretch: int = 1  # how many Ws of each stretch
    min_gap_ms: float = 2.0  # a target gap is longer than this
    stretches: str = "all"  # "all", "odd" or "even" (every other one), "top" (the device with most path ops),
    # "final" (the latest stretch with a W that is not its device's last op)
    where: str = "later"  # "later" idle gaps, the "tail" of the list, or "earlier" gaps (``deferred``)


# In the order they are tried, those that paid most often first: on grid20 and grid22 (p = 24 and
# 32, m = 2p), the last W of each stretch to a later gap, to the tail, or on some stretches only.
# The final stretch's W (``_final``) pays once a pass has nearly converged: tried last, grid24's
# pass (p = 32, m = 256) reached it 6 s after its 26,714.6 ms; here, after 2 s, with the same
# results on the saved starts of grid14, 17, 19 and 20 and 0.3 ms more on grid22's.
ROUNDS = (Round(), Round(where="tail"), Round(stretches="top"), Round(stretches="odd"),
          Round(stretches="final", where="tail"), Round(stretches="even"),
          Round(last=False, where="earlier"), Round(where="earlier"), Round(last=False), Round(min_gap_ms=0.5),
          Round(per_stretch=2), Round(last=False, where="tail"), Round(per_stretch=3, where="tail"),
          Round(per_stretch=3, where="earlier"), Round(last=False, stretches="top"),
          Round(last=False, per_stretch=2, min_gap_ms=0.5))


@dataclass(frozen=True)
class _Path:
    """What every round reads from one timeline: the critical path cut where it changes device,
    (device, its ops there) in time order; each device's idle gaps, (when it opens, the compute op
    after it) in time order; and how long before the makespan each device ends."""

    stretches: list[tuple[int, list[OpTiming]]]
    gaps: list[list[tuple[float, Op]]]
    slack: list[float]
    ops: list[OpTiming]  # the critical path itself, latest first

    @classmethod
    def of(cls, problem: Problem, timeline: Timeline) -> _Path:
        stretches: list[tuple[int, list[OpTiming]]] = []
        path = critical_path(problem, timeline)
        for t in sorted(path, key=lambda t: t.start):
            if stretches and stretches[-1][0] == t.device:
                stretches[-1][1].append(t)
            else:
                stretches.append((t.device, [t]))
        gaps: list[list[tuple[float, Op]]] = [[] for _ in range(problem.devices)]
        for _, device, op, opened in idle_gaps(timeline):
            gaps[device].append((opened, op))
        ends = [0.0] * problem.devices
        for t in timeline.timings:
            if t.op.kind in COMPUTE_KINDS:
                ends[t.device] = max(ends[t.device], t.end)
        return cls(stretches, gaps, [timeline.makespan - end for end in ends], path)

    def chosen(self, rule: Round) -> list[tuple[int, list[OpTiming]]]:
        """The stretches ``rule`` moves Ws out of."""
        if rule.stretches in ("odd", "even"):
            return [s for n, s in enumerate(self.stretches) if n % 2 == (rule.stretches == "odd")]
        if rule.stretches == "top" and self.stretches:
            counts: dict[int, int] = {}
            for device, ops in self.stretches:
                counts[device] = counts.get(device, 0) + len(ops)
            top = max(counts, key=lambda d: (counts[d], -d))
            return [s for s in self.stretches if s[0] == top]
        return self.stretches


def deferred(problem: Problem, schedule: Schedule, timeline: Timeline, rule: Round,
             skip: frozenset[int] = frozenset(), path: _Path | None = None) -> Schedule | None:
    """``schedule`` with the Ws ``rule`` picks moved to other idle time of their devices; None
    when nothing moves. "later": each W goes just before the first compute op (not a W) that
    starts after its stretch ends and after an idle gap longer than ``rule.min_gap_ms``, one W
    per gap; "tail": to the end of the list, while the device still ends before the makespan;
    "earlier": just after the latest such gap before the stretch that opens after the W's B
    ended. The devices in ``skip`` keep their lists; ``path``: ``_Path.of(problem, timeline)``."""
    path = path or _Path.of(problem, timeline)
    lists = [list(ops) for ops in schedule.devices]
    if rule.stretches == "final":
        return _final(schedule, path, rule, lists)
    slack = list(path.slack)
    moved = 0
    for device, ops in path.chosen(rule):
        ws = [t.op for t in ops if t.op.kind is _W]
        ws = ws[-rule.per_stretch:] if rule.last else ws[:rule.per_stretch]
        if device in skip or not ws:
            continue
        row = lists[device]
        for w, before in _targets(timeline, rule, ws, ops, path.gaps[device], slack, device):
            row.remove(w)
            row.insert(len(row) if before is None else row.index(before), w)
            moved += 1
    return Schedule.of(schedule.name, lists) if moved else None


def _final(schedule: Schedule, path: _Path, rule: Round, lists: list[list[Op]]) -> Schedule | None:
    """The last Ws of the latest stretch that has one before its device's last op, moved to the
    end of the list. The "tail" rule asks for room before the makespan; here the W leaves the
    stretch that ends the path, so what follows it on the device runs earlier by its length and
    the device's end stays where it was when those ops ran back to back. Where the path's last
    stretch ends a link-bound cool-down (grid24, p = 32, m = 256: device 6 waits on its reloads,
    and ends 6 ms before the makespan), that took the converged pass from 26,714.6 to 26,708.3 ms."""
    for device, ops in reversed(path.stretches):
        row = lists[device]
        last = next((op for op in reversed(row) if op.kind in COMPUTE_KINDS), None)
        ws = [t.op for t in ops if t.op.kind is _W and t.op != last]
        if not ws:
            continue
        for w in (ws[-rule.per_stretch:] if rule.last else ws[:rule.per_stretch]):
            row.remove(w)
            row.append(w)
        return Schedule.of(schedule.name, lists)
    return None


def _targets(timeline: Timeline, rule: Round, ws: list[Op], stretch: list[OpTiming],
             gaps: list[tuple[float, Op]], slack: list[float], device: int) -> list[tuple[Op, Op | None]]:
    """(W, the op to list it before; None: the end of the list) for the Ws of one stretch, each
    to its own gap (``deferred`` says which); ``slack`` is spent as Ws go to the tail."""
    by_op = timeline.by_op
    if rule.where == "tail":
        out = []
        for w in ws:
            took = by_op[w].end - by_op[w].start
            if took < slack[device] - _EPS:
                slack[device] -= took
                out.append((w, None))
        return out
    open_gaps = [(opened, op) for opened, op in gaps
                 if by_op[op].start - opened > rule.min_gap_ms and op.kind is not _W and op not in ws]
    if rule.where == "earlier":
        first, out = min(t.start for t in stretch), []
        for w in ws:
            ready = by_op[Op(OpKind.B, w.stage, w.microbatch)].end
            before = next((op for opened, op in reversed(open_gaps)
                           if ready - _EPS <= opened and by_op[op].start <= first), None)
            if before is not None:
                open_gaps = [(opened, op) for opened, op in open_gaps if op != before]
                out.append((w, before))
        return out
    end = max(t.end for t in stretch)
    return list(zip(ws, [op for _, op in open_gaps if by_op[op].start >= end - _EPS]))


def pays(problem: Problem) -> bool:
    """Whether compile defers critical W passes on this problem (_FROM_DEVICES)."""
    return problem.devices >= _FROM_DEVICES


def search_defers_first(problem: Problem) -> bool:
    """Whether the window search runs W deferral before any window, until no round pays
    (_FIRST_FROM_DEVICES)."""
    return problem.devices >= _FIRST_FROM_DEVICES


def defer_critical_w(problem: Problem, schedule: Schedule, timeline: Timeline,
                     deadline: float | None = None) -> tuple[Schedule, Timeline]:
    """Rounds of ``deferred`` until none is faster (or the deadline): a fitting schedule no
    slower than ``schedule``, which must fit (one that does not is returned as it is)."""
    if not timeline.fits:
        return schedule, timeline
    clock = Clock(deadline)  # no round is begun that the longest so far would carry past it
    while clock.allows():
        path = _Path.of(problem, timeline)  # what every rule reads, once a timeline
        # the rules in turn, the reloads the path waits for (reload_advance.py) second
        moves = [lambda skip, rule=rule: deferred(problem, schedule, timeline, rule, skip, path) for rule in ROUNDS]
        moves.insert(1, lambda skip: advanced_reloads(problem, schedule, timeline, path.ops, skip))
        for move in moves:
            if not clock.allows():
                return schedule, timeline
            found = clock.timed(_round, problem, timeline, move)
            if found is not None:
                schedule, timeline = found
                break
        else:
            return schedule, timeline
    return schedule, timeline


def _round(problem: Problem, timeline: Timeline,
           move: Callable[[frozenset[int]], Schedule | None]) -> tuple[Schedule, Timeline] | None:
    """One round, ``move(skip)`` (the schedule with the devices in ``skip`` left as they are),
    kept when faster and fitting. A round that is faster but overflows first gets the reloads
    held through its overflows issued later (reload_delay.py; grid17's 60 s schedule, p = 16:
    4,019.3 to 3,984.3 ms, where every faster round had overflowed device 15), then is tried again
    without the moves of the devices that overflow: on grid20 (p = 24) every round overflowed the
    last device, whose W passes hold the last stage's weight parts, once the pass reached 5,384.1
    ms; with the retries it went on to 5,303.5."""
    budget, skip, faster_than = problem.memory.budget, frozenset(), timeline.makespan - _EPS
    for _ in range(_RETRIES):
        candidate = move(skip)
        moved = try_simulate(problem, candidate, faster_than) if candidate is not None else None
        if moved is None:  # no schedule, or no faster
            return None
        if moved.fits:
            return candidate, moved
        over = frozenset(d for d, peak in enumerate(moved.peak_memory) if peak > budget)
        if not moved.fits_host:
            return None
        roomier = delayed_reloads(problem, candidate, moved, over)  # room made where it overflows
        if roomier is not None and (made := try_simulate(problem, roomier, faster_than)) is not None and made.fits:
            return roomier, made
        if not over - skip:
            return None
        skip |= over
    return None
