"""W deferral (wdefer.py) from several starts, on both cores: where a pass ends depends on its start.

A pass is greedy, so it ends where its start's critical path lets it, and a start that is a
little slower may end faster: grid17's (p = 16, v = 2, m = 32) GIS(g=12) + W(1) + hidden offload
(4,064.9 ms) defers to 4,017.0, GIS(g=13)'s (4,123.3) to 4,005.7; grid19's GIS(g=13) with hidden
offloads (7,037.3) to 6,939.7, GIS(g=14)'s (7,037.7) to 6,908.9 (bounds 3,932.6 and 6,795.3). So
compile defers the fastest start that fits and, from 16 devices on, where the window search moves
no start in a 60 s compile, the next ones of other compute orders within _WITHIN of the fastest,
those that overflow a little repaired first.

A pass is Python and simulations (about 0.1 s a round at p = 16, m = 64, some 90 rounds from
GIS(g=14)), and nothing else runs while the starts are built, so the passes run on two cores: a
forked process takes every second start and hands back the fastest schedule it made, which is
judged again here. Where fork is missing, or the other process fails or is late, the passes
run here alone: the second process can only add.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from typing import Any, Callable

from optpipe.core.problem import Problem
from optpipe.core.schedule import Schedule
from optpipe.core.simulate import simulate

from .repair import repair
from .result import Judged, fastest_fitting, one_per_compute_order
from .wdefer import defer_critical_w

__all__ = ["DEFERRED", "deferred", "deferred_starts"]

DEFERRED = "+W-deferred"  # the name a deferred start gets
# A start within this factor of the fastest so far is deferred; a slower one is not: no pass brings
# it back (grid19's PO-H repaired, 7,108.2 ms, defers only to 6,991.0, where GIS(g=13)'s 7,037.3 ends
# at 6,939.7).
_WITHIN = 1.05
_NEARLY = 1.5  # a start peaking at most this many budgets is repaired for a pass (repair's nearest tier)
# The second process is forked only when the time left holds this many simulations: its answer is
# simulated again here, and at p = 64, m = 512 (3 s a simulation) that time is the answer's.
_FORK_SIMS = 20
# The forked pass stops this many simulations and seconds before the deadline, which is when this
# one stops waiting for it: sending a schedule and reading it back takes about a simulation's time
# (0.5 s at p = 32, m = 256), and the deadline is the phase's, past which compile has its own work.
# Its last round ends by its own deadline: wdefer.py begins none that the longest so far would
# carry past it (a round may simulate a move, its retries and the reloads moved for room: over two
# seconds at p = 32, m = 64, where a pass waited for two simulations past its deadline was lost).
_SEND_SIMS, _SEND_S = 2, 0.2
# A start is taken up only with this many simulations left, or this many where it must be
# repaired first: a repair's rounds place hidden offloads, and one begun 0.1 s before the deadline
# took 1.3 s of grid24's 60 s (p = 32, m = 256, 0.46 s a simulation).
_LEAST_SIMS, _LEAST_REPAIR_SIMS = 4, 20


def deferred(problem: Problem, start: Judged, deadline: float) -> Judged | None:
    """``start`` with its critical W passes deferred, when that is faster."""
    schedule, timeline = defer_critical_w(problem, start.schedule, start.timeline, deadline)
    if timeline.makespan >= start.timeline.makespan:
        return None
    name = f"{start.name}{DEFERRED}"
    return Judged(name, schedule.renamed(name), timeline)


def deferred_starts(problem: Problem, candidates: list[Judged], skip: str | None, deadlines: tuple[float, float],
                    most: int, simulation_s: float, phase: Callable[[str, Judged | None], None]) -> list[Judged]:
    """What passes from up to ``most`` starts make (with the repaired starts they needed) by
    their deadlines: the first start's, and the later ones' (the two may differ); ``skip``: a
    start deferred already."""
    pool = _pool(problem, candidates, skip)[:most]
    if not pool:
        return []
    best = fastest_fitting(candidates)
    ceiling = best.timeline.makespan
    said = lambda message, made: phase(message, fastest_fitting([best, *made]))  # noqa: E731
    later = deadlines[1]
    if len(pool) == 1 or not _forks(later, simulation_s):
        return _passes(problem, pool, ceiling, deadlines, simulation_s, said)
    theirs = Pending.forked(_fastest_of_passes, (problem, pool[1::2], ceiling, simulation_s), later, simulation_s)
    out = []
    try:
        out = _passes(problem, pool[::2], ceiling, deadlines, simulation_s, said)
    finally:
        other = theirs.answer(problem)
    return out + ([other] if other is not None else [])


@dataclass
class Pending:
    """The answer of passes in a forked process (``answer`` waits for it, once)."""

    process: Any
    conn: Any
    until: float  # how long ``answer`` waits: the deadline
    made: Judged | None = None

    @staticmethod
    def forked(target: Callable, args: tuple, deadline: float, simulation_s: float) -> Pending:
        """``target(*args, its deadline)`` in a forked process, its deadline moved up by a send."""
        context = multiprocessing.get_context("fork")
        ours, theirs = context.Pipe(duplex=False)
        args = (*args, deadline - _SEND_SIMS * simulation_s - _SEND_S)
        process = context.Process(target=_send, args=(target, args, theirs), daemon=True)
        process.start()
        theirs.close()
        return Pending(process, ours, deadline)

    def answer(self, problem: Problem) -> Judged | None:
        """The passes' fastest fitting schedule, judged again here; None when they made none, or
        the process failed, died or is late."""
        if self.process is None:
            return self.made
        try:
            sent = _received(self.conn, self.process, self.until)
        finally:
            self.conn.close()
            self.process.join(timeout=1.0)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(timeout=1.0)
            self.process = None
        if sent is None:
            return None
        name, schedule = sent
        timeline = simulate(problem, schedule)  # its own verdict, judged again before it counts
        self.made = Judged(name, schedule, timeline) if timeline.fits else None
        return self.made


def _forks(deadline: float, simulation_s: float) -> bool:
    return ("fork" in multiprocessing.get_all_start_methods()
            and deadline - time.monotonic() > _FORK_SIMS * simulation_s)


def _pool(problem: Problem, candidates: list[Judged], skip: str | None) -> list[Judged]:
    """The starts, fastest first: the fastest that fits, then those of other compute orders
    within _WITHIN of the fastest candidate, fitting or peaking at most _NEARLY budgets."""
    best = fastest_fitting(candidates)
    plain = sorted((c for c in candidates if c.name != skip and not c.name.endswith(DEFERRED)),
                   key=lambda c: c.timeline.makespan)
    first = fastest_fitting(plain)
    if best is None or first is None:
        return []
    budget, most = problem.memory.budget, _WITHIN * best.timeline.makespan
    near = [first] + [c for c in plain if c is not first and c.timeline.peak <= _NEARLY * budget]
    # a compute order takes the whole schedule's ops: only for those in reach
    return list(one_per_compute_order(start for start in near if start.timeline.makespan <= most))


def _passes(problem: Problem, pool: list[Judged], ceiling: float, deadlines: tuple[float, float], simulation_s: float,
            phase: Callable[[str, list[Judged]], None] | None = None) -> list[Judged]:
    """A pass from each start in turn, the first by the first deadline, the others by the second;
    what they made."""
    out: list[Judged] = []
    for n, start in enumerate(pool):
        deadline = deadlines[min(n, 1)]
        least = _LEAST_SIMS if start.fits else _LEAST_REPAIR_SIMS
        if time.monotonic() + least * simulation_s >= deadline:
            continue  # no time for its repair and a round
        if start.timeline.makespan > _WITHIN * ceiling:
            continue
        if phase is not None and n:
            phase(f"deferring the W passes of {start.name}", out)
        if not start.fits:
            start = repair(problem, start.schedule, "hidden", deadline, name=f"{start.name}+repaired(hidden, step 1)",
                           max_step=1, ceiling=_WITHIN * ceiling)
            if start is None:
                continue
            out.append(start)
        made = deferred(problem, start, deadline)
        if made is not None:
            out.append(made)
            ceiling = min(ceiling, made.timeline.makespan)
    return out


def _fastest_of_passes(problem: Problem, pool: list[Judged], ceiling: float, simulation_s: float,
                       deadline: float) -> Judged | None:
    return fastest_fitting(_passes(problem, pool, ceiling, (deadline, deadline), simulation_s))


def _send(target: Callable, args: tuple, conn) -> None:
    """In the forked process: ``target(*args)``'s schedule goes back as (name, schedule), or None."""
    try:
        made = target(*args)
        conn.send(None if made is None else (made.name, made.schedule))
    except BaseException:  # noqa: BLE001 - whatever it was, the parent goes on without it
        conn.send(None)
    finally:
        conn.close()


def _received(conn, process, until: float) -> tuple[str, Schedule] | None:
    """The forked process's answer, or None when it failed, died or is late (an answer already
    sent counts however late this one asks)."""
    while True:
        if conn.poll(timeout=max(0.0, min(0.5, until - time.monotonic()))):
            try:
                return conn.recv()
            except (EOFError, OSError):
                return None
        if (time.monotonic() >= until or not process.is_alive()) and not conn.poll():
            return None
