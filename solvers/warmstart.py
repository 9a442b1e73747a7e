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

Plus one microbatch at a time, the schedule that holds least. The simulator judges all of them.
Generation stops at the deadline: the plain heuristics come first, so there is always a start.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from optpipe.core.errors import OptpipeError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import Timeline, simulate

from .compare import Entry
from .offload_slots import add_hidden_offloads, add_offloads, offloadable
from .wfill import fill_with_w

__all__ = ["Candidate", "warm_starts", "one_at_a_time", "best_candidate"]

_CAPS = (1.0, 1.5, 2.5)  # W-filling memory caps, as multiples of the budget (1.0 alone without offload)


@dataclass(frozen=True)
class Candidate:
    name: str  # "ZB-H2", "ZB-H2+offload", "1F1B-I+W(1.5)+hidden-offload", ...
    schedule: Schedule
    timeline: Timeline

    @property
    def fits(self) -> bool:
        return self.timeline.fits


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
                bound_ms: float | None = None) -> list[Candidate]:
    """Candidates in the order above; variants are skipped once ``deadline`` (monotonic s) passes.

    Variants are built most promising first (when the deadline cuts, that is what is left out):
    the fastest heuristic's W passes filled under the budget, then offloaded (what brings a
    zero-bubble schedule, whose deferred W passes hold memory, under a tight budget); every
    heuristic's offloaded versions, fastest first (what repair.py starts from); the other
    heuristics' W passes filled under the budget; then the looser W-filling caps. They are
    returned in the order above whatever order they were built in, so ties go the same way with
    and without a deadline. With ``bound_ms`` (a proven lower bound), building stops once a
    fitting candidate meets it.
    """
    # how long the last variant took: at p >= 24, where one takes seconds, one that cannot end by
    # the deadline is not started (a short one may overrun it a little, as it always could)
    last_step = [0.0]
    late = ((lambda: time.monotonic() + (last_step[0] if last_step[0] > 1.0 else 0.0) > deadline)
            if deadline is not None else (lambda: False))
    applicable = [e for e in entries if e.timeline is not None]
    built: list[tuple[tuple, Candidate]] = [((0, n), Candidate(e.name, e.schedule, e.timeline))
                                            for n, e in enumerate(applicable)]
    sequential = one_at_a_time(problem)
    built.append(((1,), Candidate(sequential.name, sequential, simulate(problem, sequential))))
    met = lambda: bound_ms is not None and any(  # noqa: E731
        c.fits and c.timeline.makespan <= bound_ms + 1e-9 for _, c in built)

    def done() -> list[Candidate]:
        return [c for _, c in sorted(built, key=lambda item: item[0])]

    caps = _CAPS if problem.offload.enabled else _CAPS[:1]
    fastest = sorted(range(len(applicable)), key=lambda n: applicable[n].timeline.makespan)
    unfillable: set[int] = set()

    def fill(rank: int, n: int, c: int) -> None:
        began = time.monotonic()
        _fill(rank, n, c)
        last_step[0] = time.monotonic() - began

    def _fill(rank: int, n: int, c: int) -> None:
        entry, cap = applicable[n], caps[c]
        try:
            filled = fill_with_w(problem, entry.schedule, memory_cap=int(problem.memory.budget * cap))
        except ValueError:  # an order W-filling cannot follow is simply not a candidate
            unfillable.add(n)
            return
        name = f"{entry.name}+W({cap:g})"
        timeline = simulate(problem, filled)
        built.append(((3, rank, c, 0), Candidate(name, filled.renamed(name), timeline)))
        if problem.offload.enabled:
            built.extend(((3, rank, c, 1 + k), v)
                         for k, v in enumerate(_offloaded(problem, name, filled, timeline, deadline)))

    # the fastest heuristic's W passes filled under the budget (and offloaded); every heuristic's
    # offloaded versions; the others' W passes filled under the budget; then the looser caps
    for rank, n in enumerate(fastest[:1]):
        if late() or met():
            return done()
        fill(rank, n, 0)
    if problem.offload.enabled:
        for n in fastest:
            if late() or met():
                return done()
            entry, began = applicable[n], time.monotonic()
            built.extend(((2, n, k), v) for k, v in enumerate(_offloaded(problem, entry.name, entry.schedule,
                                                                             entry.timeline, deadline)))
            last_step[0] = time.monotonic() - began
    for rank, n in enumerate(fastest[1:], start=1):
        if late() or met():
            return done()
        fill(rank, n, 0)
    for c in range(1, len(caps)):
        for rank, n in enumerate(fastest):
            if n in unfillable:
                continue
            if late() or met():
                return done()
            fill(rank, n, c)
    return done()


def _offloaded(problem: Problem, name: str, schedule: Schedule, timeline: Timeline,
               deadline: float | None = None) -> list[Candidate]:
    """The two offloaded variants; the hidden one is dropped when it cannot be placed by ``deadline``."""
    pairs = offloadable(timeline)
    if not pairs:
        return []
    out = []
    hidden = lambda problem, schedule, pairs: add_hidden_offloads(problem, schedule, pairs, deadline)  # noqa: E731
    for suffix, place in (("offload", add_offloads), ("hidden-offload", hidden)):
        try:
            placed = place(problem, schedule, pairs)
            if placed is None:
                continue
            placed_timeline = simulate(problem, placed)
        except OptpipeError:  # a variant that does not apply is simply not a candidate
            continue
        variant = f"{name}+{suffix}"
        out.append(Candidate(variant, placed.renamed(variant), placed_timeline))
    return out


def best_candidate(candidates: list[Candidate]) -> Candidate | None:
    """The fastest that fits (ties: the first listed, so a plain heuristic beats its variants)."""
    fitting = [c for c in candidates if c.fits]
    return min(fitting, key=lambda c: c.timeline.makespan) if fitting else None
