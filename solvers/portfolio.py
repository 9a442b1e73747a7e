"""Two window searches at once, one per core, trading incumbents (exchange.py).

Most of a window search's time is Python: cutting the window, building the model, splicing and
simulating the answer, list moves. Only the CP-SAT solves use a second core, so on 2 cores a
search keeps about 1.2 of them busy (grid16 at 60 s: 70 s of CPU). Here a second search, in a
forked process with its own seed, works from the same start; each takes the other's incumbent
when it is better, so both cores do search work all the time and the pair leaves plateaus that
one seed sits on. The result is the better of the two, judged again here. Below 12 devices, with
two or more chunks per device, the second search first solves the whole warm-up in long windows
(lns.py, ``deep_warm_up``), from the best start at once: the restarts from the other warm starts
are the first search's alone, where 40% of the second's time went before (grid06 at 60 s:
2,962.3 ms against 2,969.2 with them; grid02 1,069.0 against 1,075.6).

Falls back to one search where fork is not available, and takes the parent's answer alone when
the other process fails or does not answer in time: it can only add.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Callable, Sequence

from optpipe.core.problem import Problem
from optpipe.core.schedule import Schedule
from optpipe.core.simulate import simulate

from .exchange import Peer
from . import lns
from .lns import Search, search_score
from .neighbourhoods import deep_applies
from .result import Judged, Progress

__all__ = ["improve_in_parallel", "parallel_applies"]

_MIN_S = 10.0  # a shorter search keeps to one process: a second one pays only over many windows
# ... and so does one whose time holds fewer than this many simulations: the other's answer is sent,
# read back and simulated again here, each about a simulation's time. At p = 32, m = 256 (0.4 s a
# simulation) a 10.9 s search with two processes waited 1 s for the other's answer, and compile
# returned 0.1 to 0.3 s past its limit.
_MIN_SIMS = 40
_GRACE_S = 5.0  # how long past its deadline the other search may take to hand in its answer


def parallel_applies(problem: Problem, time_limit_s: float, workers: int, simulation_s: float = 0.0) -> bool:
    """Two processes when there are two cores for them, time for many windows (and simulations,
    each ``simulation_s``) and fork to start the second one cheaply; not with recompute (its flips
    phase is one search's job)."""
    return (workers >= 2 and time_limit_s >= max(_MIN_S, _MIN_SIMS * simulation_s) and not problem.recompute.enabled
            and "fork" in multiprocessing.get_all_start_methods())


def _other(problem: Problem, schedule: Schedule, restarts: Sequence[Schedule], options: dict, deadline: float,
           inbox, outbox) -> None:
    """The second search, in the forked process: its answer goes back as a "done" message.
    (``lns.improve`` is looked up when called, so a test that replaces it replaces both searches.)"""
    peer = Peer(inbox, outbox)
    try:
        search = lns.improve(problem, schedule, time_limit_s=max(0.0, deadline - time.monotonic()),
                             restarts=restarts, peer=peer, **options)
        best = search.best
        outbox.put(("done", search_score(best.timeline), best.schedule, search.windows, search.improvements))
    except BaseException as error:  # noqa: BLE001 - whatever it was, the parent goes on alone
        outbox.put(("failed", f"{type(error).__name__}: {error}"))
    # Read what the parent sent until its stop (it sends nothing after it): a message left in the
    # pipe would block the parent's feeder thread, and break it once this process is gone.
    peer.wait(lambda: peer.stopped, deadline + _GRACE_S)


def improve_in_parallel(problem: Problem, schedule: Schedule, *, time_limit_s: float, seed: int = 0,
                        workers: int = 2, on_progress: Callable[[Progress], None] | None = None,
                        bound_ms: float | None = None, restarts: Sequence[Schedule] = ()) -> Search:
    """``lns.improve`` run twice at once (seeds ``seed`` and ``seed + 1``, CP-SAT's workers split
    between them), trading incumbents; the better answer, never worse than ``schedule``."""
    context = multiprocessing.get_context("fork")
    to_other, to_us = context.Queue(), context.Queue()
    deadline = time.monotonic() + time_limit_s
    # the second search solves the warm-up in long windows first (neighbourhoods.deep_applies),
    # where the first one's short windows cannot reorder a whole fill
    # ... and runs windows while the first finishes the start's W deferral pass (deterministic: one is enough)
    options = dict(seed=seed + 1, workers=max(1, workers // 2), bound_ms=bound_ms, deep_warm_up=True,
                   defer_first=False)
    # ... and leaves the restarts to the first: a deep window needs the time more
    theirs_from = () if deep_applies(problem) else tuple(restarts)
    process = context.Process(target=_other, args=(problem, schedule, theirs_from, options, deadline,
                                                   to_other, to_us), daemon=True)
    process.start()
    peer = Peer(to_us, to_other)
    try:
        ours = lns.improve(problem, schedule, time_limit_s=max(0.0, deadline - time.monotonic()), seed=seed,
                           workers=max(1, workers - workers // 2), on_progress=on_progress, bound_ms=bound_ms,
                           restarts=restarts, peer=peer)
    finally:
        to_other.put(("stop",))
        theirs = _answer(peer, process, deadline + _GRACE_S)
        process.join(timeout=1.0)
        if process.is_alive():
            process.terminate()
            process.join(timeout=1.0)
        for q in (to_other, to_us):
            q.cancel_join_thread()
            q.close()
    if theirs is None:
        return ours
    _, score, other_schedule, solved, improved = theirs
    windows, gains = ours.windows + solved, ours.improvements + improved
    if score < search_score(ours.best.timeline):  # its own verdict; judged again here before it counts
        timeline = simulate(problem, other_schedule)
        if timeline.fits and search_score(timeline) < search_score(ours.best.timeline):
            named = other_schedule.renamed(ours.best.schedule.name)
            return Search(Judged(named.name, named, timeline), windows, gains)
    return Search(ours.best, windows, gains)


def _answer(peer: Peer, process, until: float) -> tuple | None:
    """The other search's "done" message (None when it failed, died or is late)."""
    peer.wait(lambda: peer.done is not None, until, process.is_alive)
    return peer.done if peer.done is not None and peer.done[0] == "done" else None
