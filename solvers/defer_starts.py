"""W deferral (wdefer.py) from several starts, on both cores: where a pass ends depends on its start.

A pass is greedy, so it ends where its start's critical path lets it, and a start that is a
little slower may end faster: grid17's (p = 16, v = 2, m = 32) GIS(g=12) + W(1) + hidden offload
(4,064.9 ms) defers to 4,017.0, GIS(g=13)'s (4,123.3) to 4,005.7; grid19's GIS(g=13) with hidden
offloads (7,037.3) to 6,939.7, GIS(g=14)'s (7,037.7) to 6,908.9 (bounds 3,932.6 and 6,795.3). So
compile defers the fastest start that fits and, from 16 devices on, where the window search moves
no start in a 60 s compile, the next ones of other compute orders within _WITHIN of the fastest,
those that overflow a little repaired first.

A pass is Python and simulations (0.13 s a round at p = 16, m = 64, about 90 rounds from GIS(g=14)),
and nothing else runs while the starts are built, so the passes run on two cores: a forked
process takes every second start and hands back the fastest schedule it made, which is judged
again here. Where fork is missing, or the other process fails or is late, this one's passes
stand alone: the second process can only add.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Callable

from optpipe.core.problem import Problem
from optpipe.core.schedule import Schedule
from optpipe.core.simulate import simulate

from .repair import repair
from .result import Judged, fastest_fitting
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
# How long past the deadline the other process may take to hand in its answer: its last round
# runs past it (a simulation), and sending a schedule takes a fraction of one.
_GRACE_SIMS, _GRACE_S = 2, 0.5


def deferred(problem: Problem, start: Judged, deadline: float) -> Judged | None:
    """``start`` with its critical W passes deferred, when that is faster."""
    schedule, timeline = defer_critical_w(problem, start.schedule, start.timeline, deadline)
    if timeline.makespan >= start.timeline.makespan:
        return None
    name = f"{start.name}{DEFERRED}"
    return Judged(name, schedule.renamed(name), timeline)


def deferred_starts(problem: Problem, candidates: list[Judged], skip: str | None, deadline: float, most: int,
                    simulation_s: float, phase: Callable[[str, Judged | None], None]) -> list[Judged]:
    """What passes from up to ``most`` starts make (with the repaired starts they needed), by
    the deadline; ``skip``: a start deferred already."""
    pool = _pool(problem, candidates, skip)
    if not pool:
        return []
    pool = pool[:most]
    best = fastest_fitting(candidates)
    ceiling = best.timeline.makespan
    said = lambda message, made: phase(message, fastest_fitting([best, *made]))  # noqa: E731
    forks = (len(pool) > 1 and "fork" in multiprocessing.get_all_start_methods()
             and deadline - time.monotonic() > _FORK_SIMS * simulation_s)
    if not forks:
        return _passes(problem, pool, ceiling, deadline, said)
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe(duplex=False)
    process = context.Process(target=_other, args=(problem, pool[1::2], ceiling, deadline, theirs), daemon=True)
    process.start()
    theirs.close()
    try:
        out = _passes(problem, pool[::2], ceiling, deadline, said)
        other = _answer(ours, process, deadline + _GRACE_SIMS * simulation_s + _GRACE_S)
    finally:
        ours.close()
        process.join(timeout=1.0)
        if process.is_alive():
            process.terminate()
            process.join(timeout=1.0)
    if other is not None:
        name, schedule = other
        timeline = simulate(problem, schedule)  # its own verdict, judged again before it counts
        if timeline.fits:
            out.append(Judged(name, schedule, timeline))
    return out


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
    pool, seen = [], set()
    for start in [first] + [c for c in plain if c is not first and c.timeline.peak <= _NEARLY * budget]:
        order = start.schedule.compute_only().devices
        if start.timeline.makespan > most or order in seen:
            continue
        seen.add(order)
        pool.append(start)
    return pool


def _passes(problem: Problem, pool: list[Judged], ceiling: float, deadline: float,
            phase: Callable[[str, list[Judged]], None] | None = None) -> list[Judged]:
    """A pass from each start in turn until the deadline; what they made."""
    out: list[Judged] = []
    for n, start in enumerate(pool):
        if time.monotonic() >= deadline:
            break
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


def _other(problem: Problem, pool: list[Judged], ceiling: float, deadline: float, conn) -> None:
    """The forked process's passes: the fastest fitting schedule they made goes back, or None."""
    try:
        best = fastest_fitting(_passes(problem, pool, ceiling, deadline))
        conn.send(None if best is None else (best.name, best.schedule))
    except BaseException:  # noqa: BLE001 - whatever it was, the parent goes on alone
        conn.send(None)
    finally:
        conn.close()


def _answer(conn, process, until: float) -> tuple[str, Schedule] | None:
    """The other process's answer, or None when it failed, died or is late."""
    while time.monotonic() < until:
        if conn.poll(timeout=max(0.01, min(0.5, until - time.monotonic()))):
            try:
                return conn.recv()
            except (EOFError, OSError):
                return None
        if not process.is_alive() and not conn.poll():
            return None
    return None
