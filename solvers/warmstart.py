"""Starting points for the solvers: every heuristic, reshaped to fit and to fill bubbles.

A heuristic that overlaps many microbatches (ZB-H2, ZBV, GIS) is fast but holds more than the
budget; moving its long-lived activations to the host during the F-to-B gap often brings it
under the budget at (almost) the same speed. And a heuristic with fused backwards leaves idle
time that its W passes could fill (wfill.py). Each heuristic is tried:

- as it is;
- with every activation whose gap holds a round trip offloaded (``add_offloads``), and with only
  those whose transfers the link hides completely (``add_hidden_offloads``);
- with its W passes filling idle time, as far as a memory cap allows, then offloaded the same
  two ways; caps above the budget let the offloads bring the peak down afterwards.

Plus one microbatch at a time, the schedule that holds least; and GIS with every group size
between GIS-H's and GIS's (``groups``). The simulator judges all of them.
Generation stops at the deadline: the plain heuristics come first, so there is always a start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from optpipe.core.errors import OptpipeError
from optpipe.core.problem import Placement, Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import Timeline, simulate

from .capped_offload import capped_offload_starts
from .compare import Entry, applicable
from .heuristics.gis import gis_schedule, smallest_group
from .offload_slots import add_hidden_offloads, add_offloads, offloadable
from .result import Judged
from .wfill import fill_with_w

__all__ = ["warm_starts", "one_at_a_time", "offloaded_variants"]

# GIS's group sizes are built first from this many devices on, with at most this many microbatches a device
_GROUPS_FIRST, _GROUPS_FIRST_DEPTH = 24, 4
_HIDDEN_IF_UNDER = 1.1  # with hidden_if_fits, the peak (in budgets) of offloading everything that still tries hiding
_CAPS = (1.0, 1.5, 2.5)  # W-filling memory caps, as multiples of the budget (1.0 alone without offload)
# The looser caps only below this many devices. From 16 on, they took 12 to 13.5 s of a 60 s
# compile (grid17, grid19) and gave no fitting start, nor one that repaired into compile's answer,
# in any benchmark run (only two p = 8 rows start from one); the window search and W deferral get
# the time: grid19 6,932.6 ms at 60 s against 6,933.7, grid17 4,027.5 against 4,029.2.
_LOOSE_BELOW = 16
# A GIS group within this factor of the fastest fitting candidate still gets its offloaded
# versions: near ties defer differently (defer_starts.py), and grid19's GIS(g=14) (7,037.7 ms
# against GIS(g=13)'s 7,037.3, both fitting with hidden offloads) defers to 6,908.9 ms where
# g = 13 gives 6,939.7.
_NEAR_TIE = 1.005
# The first chunk's leads tried on two GIS groups (heuristics/gis.py): a deeper first-chunk fill
# where the later chunk's data comes late. 60 s compiles, one run each: seed 2's grid17 2,230.7 ->
# 2,178.9 ms from GIS(g=8,lead=3), seed 1's grid20 2,976.6 -> 2,957.9 from GIS(g=12,lead=4); leads
# of 6 and 8 as well changed neither, nor grid22 on either seed.
_LEADS = (1, 2, 3, 4)


def one_at_a_time(problem: Problem) -> Schedule:
    """Each microbatch through the whole pipeline and back before the next starts.

    The slowest schedule there is, and the one that holds least: a device never holds more than
    one microbatch's activations, which is the memory lower bound without offload (bounds.py).
    """
    pipe = problem.pipeline
    devices = []
    for device in range(pipe.devices):
        stages = pipe.stages_on(device)
        ops = []
        for i in range(pipe.microbatches):
            ops += [Op(OpKind.F, s, i) for s in stages]
            ops += [Op(OpKind.BW, s, i) for s in reversed(stages)]
        devices.append(ops)
    return Schedule.of("one-at-a-time", devices)


def warm_starts(problem: Problem, entries: list[Entry], deadline: float | None = None,
                bound_ms: float | None = None, capped: bool = True, step_s: float = 0.0) -> list[Judged]:
    """Candidates in the order above; variants are skipped once ``deadline`` (monotonic s) passes.

    Variants are built most promising first (when the deadline cuts, that is what is left out):
    the fastest heuristic's W passes filled under the budget, then offloaded (what brings a
    zero-bubble schedule, whose deferred W passes hold memory, under a tight budget); the
    memory-capped list schedule that offloads (for budgets far below PO-H's peak; about 2 s at
    p = 8, m = 32, skipped at p = 24); GIS with the group sizes between GIS-H's and GIS's,
    W-filled and offloaded (at p = 24, where it takes about 9 s, the best start: 5,447.5 ms where
    PO-H + W(1) + hidden offload gives 5,572.1); the fitting heuristics' W passes filled and
    offloaded (their spare memory bought back as speed); every heuristic's offloaded versions,
    fastest first (what repair.py starts from); the overflowing heuristics' W passes filled under
    the budget; then, below 16 devices, the looser W-filling caps. From p = 24 on, GIS's group
    sizes come first (``_steps``). They are returned in the order above whatever order they were built in, so
    ties go the same way with and without a deadline. With ``bound_ms`` (a proven lower bound),
    building stops once a fitting candidate meets it. ``capped=False`` leaves out the capped
    list schedule (compile builds it first under a tight budget). ``step_s``: how long a variant
    is expected to take before one has been timed (none is started that could not end by the
    deadline).
    """
    build = _Build(problem, applicable(entries), deadline, bound_ms, last_step=step_s)
    for step in _steps(problem, capped):
        if not step(build):
            break
    return build.done()


def _steps(problem: Problem, capped: bool) -> tuple[Callable[[_Build], bool], ...]:
    """The order the variants are built in: ``_Build``'s steps. From p = 24 on, with at most
    4p microbatches, the group sizes come first: there the fastest heuristic's variants alone
    take 11 s (ZB-I at p = 32: W-filled and offloaded it still peaks at 2.6 x the budget), and
    compile's warm-start share ended before any GIS group was built; repaired, GIS(g = 25) + W(1)
    gives 4,314.4 ms at p = 32, v = 2, m = 64, k = 1.6, against PO-H repaired's 4,367.4. With more
    microbatches each group costs more and PO-H repaired was as fast (p = 32, m = 256)."""
    steps = (_Build.fill_fastest, *((_Build.capped,) if capped else ()), _Build.groups, _Build.fill_fitting,
             _Build.offload_each, _Build.fill_others,
             *((_Build.fill_looser,) if problem.devices < _LOOSE_BELOW else ()))
    if problem.devices >= _GROUPS_FIRST and problem.microbatches <= _GROUPS_FIRST_DEPTH * problem.devices:
        steps = (_Build.groups,) + tuple(step for step in steps if step is not _Build.groups)
    return steps


@dataclass
class _Build:
    """The candidates built so far, each keyed by its place in the returned order, and the clock.

    Keys: (0, n) the n-th heuristic as it is; (1,) one at a time; (2, n, k) heuristic n offloaded
    the k-th way; (3, rank, cap, k) the rank-th fastest heuristic W-filled under caps[cap], then
    offloaded the k-th way (k = 0: not offloaded); (4, k) the capped offloading list schedule;
    (5, g, lead, w, k) GIS with group size g and the first chunk ``lead`` microbatches ahead,
    W-filled (w = 1) or not, offloaded the k-th way.
    """

    problem: Problem
    plain: list[Judged]  # the heuristics that apply, in the comparison's order
    deadline: float | None
    bound_ms: float | None
    built: list[tuple[tuple, Judged]] = field(default_factory=list)
    # how long the last variant took: at p >= 24, where one takes seconds, one that cannot end by
    # the deadline is not started (a short one may overrun it a little, as it always could)
    last_step: float = 0.0
    unfillable: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.built += [((0, n), j) for n, j in enumerate(self.plain)]
        sequential = one_at_a_time(self.problem)
        self.built.append(((1,), Judged(sequential.name, sequential, simulate(self.problem, sequential))))
        self.caps = _CAPS if self.problem.offload.enabled else _CAPS[:1]
        self.fastest = sorted(range(len(self.plain)), key=lambda n: self.plain[n].timeline.makespan)

    def done(self) -> list[Judged]:
        return [j for _, j in sorted(self.built, key=lambda item: item[0])]

    def stop(self) -> bool:
        """Past the deadline (counting the last step's length when it was long), or a fitting
        candidate already meets the lower bound."""
        if self.deadline is not None:
            if time.monotonic() + (self.last_step if self.last_step > 1.0 else 0.0) > self.deadline:
                return True
        return self.bound_ms is not None and any(
            j.fits and j.timeline.makespan <= self.bound_ms + 1e-9 for _, j in self.built)

    def fill_fastest(self) -> bool:
        """The fastest heuristic's W passes filled under the budget (and offloaded)."""
        for rank, n in enumerate(self.fastest[:1]):
            if self.stop():
                return False
            self.fill(rank, n, 0)
        return True

    def fill_fitting(self) -> bool:
        """The fitting heuristics' W passes filled under the budget (and offloaded), fastest first:
        a fitting schedule with memory to spare turns it into speed. At p >= 24, where one
        variant takes a second or more, this comes before the offloaded versions of schedules
        that may never fit (PO-H + W(1) + hidden offload: 5,572 ms against PO-H's 5,986 at
        p = 24, v = 2, m = 48, k = 1.6, built in time only so)."""
        return self._fill_rest(fitting=True)

    def _fill_rest(self, fitting: bool) -> bool:
        """W-fill under the budget every heuristic but the fastest that fits (or overflows)."""
        for rank, n in enumerate(self.fastest[1:], start=1):
            if self.plain[n].fits != fitting:
                continue
            if self.stop():
                return False
            self.fill(rank, n, 0)
        return True

    def capped(self) -> bool:
        """The memory-capped offloading list schedule (capped_offload.py): far below PO-H's peak
        it is the fastest start on the 7B-like problem (2,736 ms at 0.7x, where PO-H repaired
        gives 3,106)."""
        if self.stop():
            return False
        starts = self._timed(lambda: capped_offload_starts(self.problem, self.deadline))
        self.built += [((4, k), j) for k, j in enumerate(starts)]
        return True

    def offload_each(self) -> bool:
        """Every heuristic's offloaded versions, fastest first."""
        if not self.problem.offload.enabled:
            return True
        for n in self.fastest:
            if self.stop():
                return False
            plain = self.plain[n]
            variants = self._timed(lambda: offloaded_variants(self.problem, plain.name, plain.schedule,
                                                              plain.timeline, self.deadline))
            self.built.extend(((2, n, k), v) for k, v in enumerate(variants))
        return True

    def groups(self) -> bool:
        """GIS with each group size strictly between GIS-H's (ceil(p/2)) and GIS's (p): all of them
        as they are, then W-filled under the budget in the order of their makespans, then, fastest
        first, the offloaded versions of those faster than every fitting candidate so far, or
        nearly as fast (_NEAR_TIE; offloading never makes a schedule faster). A group between the
        two trades warm-up depth for memory in finer steps: GIS(8) + hidden offload takes 1,499.9
        ms at p = 12, v = 2, m = 24, k = 1.6, 0.3 budget, where PO-H takes 1,522.3. Then GIS-H's group
        and the fastest between with the first chunk ``_LEADS`` microbatches ahead, W-filled and
        offloaded the same way."""
        pipe, problem = self.problem.pipeline, self.problem
        if pipe.placement is not Placement.INTERLEAVED or pipe.chunks_per_device < 2:
            return True
        bases = []
        for g in range(smallest_group(pipe.devices) + 1, pipe.devices):
            if self.stop():
                return False
            bases.append(((5, g, 0, 0), _gis(problem, g, 0)))
        for g in _lead_groups(pipe.devices, bases):
            for lead in _LEADS:
                if self.stop():
                    return False
                bases.append(((5, g, lead, 0), _gis(problem, g, lead)))
        self.built += [(key + (0,), judged) for key, judged in bases]
        for (_, g, lead, _), plain in sorted(bases, key=lambda item: item[1].timeline.makespan):
            if self.stop():
                return False
            filled = self._timed(lambda: _w_filled(problem, plain))
            if filled is not None:
                bases.append(((5, g, lead, 1), filled))
                self.built.append(((5, g, lead, 1, 0), filled))
        if not problem.offload.enabled:
            return True
        for key, base in sorted(bases, key=lambda item: item[1].timeline.makespan):
            fitting = [j.timeline.makespan for _, j in self.built if j.fits]
            if fitting and base.timeline.makespan > _NEAR_TIE * min(fitting):
                break
            if self.stop():
                return False
            variants = self._timed(lambda: offloaded_variants(problem, base.name, base.schedule, base.timeline,
                                                              self.deadline, hidden_if_fits=True))
            self.built.extend(((*key, 1 + k), v) for k, v in enumerate(variants))
        return True

    def _timed(self, build):
        """``build()``, its length kept as the last step's (``stop`` counts it)."""
        began = time.monotonic()
        out = build()
        self.last_step = time.monotonic() - began
        return out

    def fill_others(self) -> bool:
        """The other (overflowing) heuristics' W passes filled under the budget (and offloaded)."""
        return self._fill_rest(fitting=False)

    def fill_looser(self) -> bool:
        """Every heuristic W-filled under the looser caps, cap by cap."""
        for c in range(1, len(self.caps)):
            for rank, n in enumerate(self.fastest):
                if n in self.unfillable:
                    continue
                if self.stop():
                    return False
                self.fill(rank, n, c)
        return True

    def fill(self, rank: int, n: int, c: int) -> None:
        self._timed(lambda: self._fill(rank, n, c))

    def _fill(self, rank: int, n: int, c: int) -> None:
        problem = self.problem
        filled = _w_filled(problem, self.plain[n], self.caps[c])
        if filled is None:
            self.unfillable.add(n)
            return
        self.built.append(((3, rank, c, 0), filled))
        if problem.offload.enabled:
            self.built.extend(((3, rank, c, 1 + k), v) for k, v in enumerate(
                offloaded_variants(problem, filled.name, filled.schedule, filled.timeline, self.deadline)))


def _gis(problem: Problem, group: int, lead: int) -> Judged:
    """GIS(g) or GIS(g, lead), judged by the simulator."""
    name = f"GIS(g={group})" if not lead else f"GIS(g={group},lead={lead})"
    schedule = gis_schedule(problem, group, name, lead)
    return Judged(name, schedule, simulate(problem, schedule))


def _lead_groups(devices: int, bases: list[tuple[tuple, Judged]]) -> list[int]:
    """The groups whose first chunk also runs ahead (``_LEADS``): GIS-H's and the fastest other."""
    groups = [smallest_group(devices)]
    if bases:
        (_, fastest, _, _), _ = min(bases, key=lambda item: item[1].timeline.makespan)
        groups.append(fastest)
    return groups


def _w_filled(problem: Problem, plain: Judged, cap: float = 1.0) -> Judged | None:
    """``plain`` with its W passes filling idle time under ``cap`` x the budget (None: an order
    W-filling cannot follow, which is simply not a candidate)."""
    try:
        filled = fill_with_w(problem, plain.schedule, memory_cap=int(problem.memory.budget * cap))
    except ValueError:
        return None
    name = f"{plain.name}+W({cap:g})"
    return Judged(name, filled.renamed(name), simulate(problem, filled))


def offloaded_variants(problem: Problem, name: str, schedule: Schedule, timeline: Timeline,
                       deadline: float | None = None, hidden_if_fits: bool = False) -> list[Judged]:
    """The two offloaded variants; the hidden one is dropped when it cannot be placed by ``deadline``,
    and with ``hidden_if_fits`` when offloading everything peaks over 1.1 x the budget: hiding
    offloads fewer, so it rarely fits then (on the grid it never did), and it is the slow one to
    place (seconds at p = 24)."""
    pairs = offloadable(timeline)
    if not pairs:
        return []
    out = []
    hidden = lambda problem, schedule, pairs: add_hidden_offloads(problem, schedule, pairs, deadline)  # noqa: E731
    for suffix, place in (("offload", add_offloads), ("hidden-offload", hidden)):
        if hidden_if_fits and out and out[0].timeline.peak > _HIDDEN_IF_UNDER * problem.memory.budget:
            break
        try:
            placed = place(problem, schedule, pairs)
            if placed is None:
                continue
            placed_timeline = simulate(problem, placed)
        except OptpipeError:  # a variant that does not apply is simply not a candidate
            continue
        variant = f"{name}+{suffix}"
        out.append(Judged(variant, placed.renamed(variant), placed_timeline))
    return out

