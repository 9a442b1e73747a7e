"""Large-neighbourhood search: re-solve one time window of a schedule at a time with CP-SAT.

A full CP-SAT model grows with the square of the ops on a device (its tightness literals), so
beyond a few dozen ops per device it no longer finds good schedules in time. This search keeps
a complete schedule and improves it piece by piece:

1. simulate the current schedule (the simulator is the judge);
2. take a time window [t0, t1) holding about ``per_device`` compute ops per device: the ops in
   it are free to change order, offload decisions (for activations whose F and B both fall in
   it) and transfer slots; ops before it keep their times; the ops of the next few windows
   keep their order but are re-timed, so the model sees what the window does downstream; the
   rest is summed up as the compute each device still has to do (window.py);
3. solve that model exactly with cpsat.py (memory and ASAP timing exact; without CP-SAT's LP,
   which only slows a window), minimising the latest device end plus the compute still to come,
   then the sum of device ends;
4. splice the result into the schedule, re-simulate, and keep it when the makespan is no worse
   and the devices finish no later in sum (sideways moves let the search cross plateaus).

Neighbourhoods (neighbourhoods.py): every other one sweeps the schedule from the start, overlapping by
half, growing by one op per device after a pass that gained nothing; the others are the warm-up, the
cool-down, a pair of devices that exchange data or one device over a long slice (the other devices
re-timed in their order), a slice around a long idle gap, a few microbatches over a long slice (the other
ops there held in their order, free ops between them: ``Scope.chains``), a round of list moves (moves.py)
that carry single ops, or chains of them along the critical path, across any distance, or rounds that
move a W out of every stretch of the critical path at once (wdefer.py), which also runs right after a
window makes the schedule faster: a re-timed stretch often leaves a W on the new critical path
(design.md, "W passes on the critical path"), and from 16 devices on first of all, until no round
pays (``wdefer.search_defers_first``: there the pass the starts began may have been cut). The
portfolio's second search also solves the whole warm-up in long windows (``deep_warm_up``). Kinds
that pay are picked more often (seeded); a neighbourhood solved without gain is not solved again at
the same incumbent, and a kind's retries look at larger slices. Every accepted step is simulated,
fits, and is no worse than the incumbent.

Restarts: with other warm starts, each gets a share of the time first; the search then goes on from the best
of them, trading incumbents with a second search when compile runs two (portfolio.py: one per core; ``peer``).
Measured with compile at 30 s on 2 cores (issue 11), none of this moved the makespan of gpt-p8-v2-m32-quarter,
longseq-p8-v2-m16, zb15b-p8-m32, zb15b-p8-m32-half or scale-p16-v2-m64 by more than 0.1% either way (the
built-in demo problem at 20 s: 2,899 ms with time windows alone, 2,884 ms with all of it); on each, the path
that sets the makespan is the last microbatch's backward chain through a cool-down in which every device runs
B and W in turn; list moves that defer W or keep activations on the device, and cool-down windows of 16 ops
per device solved to optimality, find nothing faster within budget. Whether those schedules are optimal is for
a bound that knows the cool-down to say.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from ortools.sat.python import cp_model

from optpipe.core.problem import Problem
from optpipe.core.schedule import Schedule
from optpipe.core.semantics import TOLERANCE_MS
from optpipe.core.simulate import Timeline, simulate

from .cpsat import Model, solve_model
from .exchange import Peer
from .moves import improve_by_moves
from .neighbourhoods import KINDS as WINDOW_KINDS
from .neighbourhoods import DEEP, DEEP_MAX_SIZE, DEEP_SHARE, DEEP_SIZE, Neighbourhood, choose, deep_applies, sweep
from .recompute import flip_decisions
from .result import Judged, Progress
from .timegrid import Grid, choose_grid
from .wdefer import defer_critical_w, pays as defer_pays, search_defers_first
from .window import offloaded_pairs, splice, window_scope

__all__ = ["improve", "Search", "KINDS", "search_score"]

# "moves": list moves judged by the simulator (moves.py); "defer": the critical path's W passes
# deferred into later idle gaps (wdefer.py), which windows of a few ops per device rarely reach
KINDS = WINDOW_KINDS + ("moves", "defer")
_LIST_KINDS = ("moves", "defer")  # kinds that change the lists directly, without a CP-SAT model
_CRITICAL_KINDS = ("idle", "bottleneck")  # windows placed by the critical path (neighbourhoods.py)
_MOVES_S = 1.0  # wall time of one round of list moves
_DEFER_S = 2.0  # ... and of deferring critical W passes (a round at p = 32, m = 256 takes 0.6 s)
_MOVES_TRIES = 40  # simulations in one round of list moves (deterministic mode)
# A window's CP-SAT time, in multiples of ``window_limit_s``: the short slices once, the long ones
# twice, and the bottleneck device's cool-down five times: on grid17 (p = 16, v = 2, m = 32) its
# 60-op windows solved in 4 s moved 4,045.4 ms to 4,043.6 in 60 s, in 20 s to 4,021.1.
# A deep warm-up window (neighbourhoods.DEEP) gets five too: 10 s, what one needs on grid04.
# Its one CP-SAT worker also runs CP-SAT's LNS helpers (``interleave_search``; a second worker runs
# them anyway) on those few hundred ops. From grid06's 2,993.6 ms schedule, 40 s of deep windows
# with one worker found 2,979.9 ms plain and 2,977.6 interleaved. Interleaving every window gave
# grid06 2,983.0 ms at 60 s against 2,969.2 with the deep ones alone, and moved grid14 and 17
# within their noise.
_LIMIT_FACTOR = {"sweep": 1, "idle": 1, "random": 1, "bottleneck": 5, DEEP: 5}
# A step (a window or a round of list moves) takes at least this many simulations' time: it begins
# with a critical path or a window's scope and ends by simulating what it made. At p = 32, m = 256
# (0.4 s a simulation) a round of list moves begun 0.5 s before the deadline ended 0.9 s past it.
_STEP_SIMS = 2
_FLIP_SHARE = 0.25  # of the time, with [recompute]: keep / offload / recompute flips after the windows

_EPS = TOLERANCE_MS


@dataclass(frozen=True)
class Search:
    """What the search did: the best schedule it found, judged, and how it got there."""

    best: Judged  # under the schedule's own name
    windows: int  # windows solved
    improvements: int  # windows that made the schedule faster


def search_score(timeline: Timeline) -> tuple[float, float]:
    """Makespan first; then the sum of the devices' last ends, so that slack elsewhere counts."""
    ends = [0.0] * len(timeline.busy)
    for t in timeline.timings:
        ends[t.device] = max(ends[t.device], t.end)
    return (round(timeline.makespan, 6), round(sum(ends), 6))



@dataclass
class _State:
    """The incumbent of one search and what the search has learnt about its neighbourhoods."""

    schedule: Schedule
    timeline: Timeline
    score: tuple[float, float]
    size: int
    cursor: float = 0.0
    gained: bool = False  # in the current sweep pass
    solved: int = 0
    improved: int = 0
    tries: dict[str, int] = field(default_factory=dict)
    gains: dict[str, int] = field(default_factory=dict)
    tabu: set = field(default_factory=set)  # neighbourhoods solved without gain at the current score
    retries: dict[str, int] = field(default_factory=dict)  # per kind, tries since the last gain
    last_size: int = 0  # ops per device of the last neighbourhood
    deep_size: int = DEEP_SIZE  # the deep warm-up's size (``deep_warm_up``)
    defer_next: bool = False  # a window made the schedule faster: defer W passes next (_neighbourhood)


def improve(problem: Problem, schedule: Schedule, *, time_limit_s: float, seed: int = 0,
            workers: int | None = None, per_device: int = 4, max_per_device: int = 12, follow: int = 3,
            window_limit_s: float = 2.0, on_progress: Callable[[Progress], None] | None = None,
            bound_ms: float | None = None, restarts: Sequence[Schedule] = (), restart_share: float = 0.4,
            kinds: Sequence[str] = KINDS, max_windows: int | None = None,
            deterministic: bool = False, peer: Peer | None = None, deep_warm_up: bool = False,
            defer_first: bool = True) -> Search:
    """Improve a fitting schedule neighbourhood by neighbourhood until the time limit (or
    ``bound_ms``, or ``max_windows``); never worse than ``schedule``, and always fitting.

    ``restarts``: other fitting schedules to start from. The search first spends
    ``restart_share`` of the time on each start in turn (``schedule`` first), then the rest on
    the best it found. ``kinds``: the neighbourhoods to use (neighbourhoods.py; the default
    leaves out "defer" where ``wdefer.pays`` says no). With
    ``deterministic``, each window stops after ``window_limit_s`` of CP-SAT's deterministic time
    rather than wall time: with one worker, a fixed seed and ``max_windows``, the result is the
    same on every run. ``peer``: another search to trade incumbents with after the restarts
    (exchange.py, portfolio.py). ``deep_warm_up``: below 12 devices with two or more chunks per
    device, solve the whole warm-up in long windows before anything else (after the restarts),
    again at every new incumbent, with at most half the time (``deep_applies``; the portfolio
    gives it to its second search). ``defer_first``: from 16 devices on, finish the start's W deferral
    pass before any window (``wdefer.search_defers_first``; the portfolio's second search does not:
    the pass is deterministic, and that core runs windows meanwhile).
    """
    if schedule.recomputed:  # window models place no RECOMPUTE (issue 14): the choices are searched by flips
        return _flips(problem, schedule, time.monotonic() + time_limit_s, random.Random(seed))
    began = time.monotonic()
    deadline = began + time_limit_s
    first = simulate(problem, schedule)
    simulation_s = time.monotonic() - began
    rng = random.Random(seed)
    if tuple(kinds) == KINDS and not defer_pays(problem):  # the default set: W deferral where it pays
        kinds = tuple(kind for kind in KINDS if kind != "defer")
    grid = choose_grid(problem)
    context = _Context(problem, grid, rng, workers, per_device, max_per_device, follow, window_limit_s,
                       tuple(kinds), deterministic, bound_ms, on_progress, began,
                       defer_first=defer_first and "defer" in kinds and search_defers_first(problem),
                       step_s=_STEP_SIMS * simulation_s)
    starts = [(schedule, first)] + [(s, t) for s in restarts if (t := simulate(problem, s)).fits]
    windows = [max_windows] if max_windows is not None else None
    best = context.restarts(starts, restart_share * time_limit_s / len(starts), deadline, windows)
    flips_from = deadline - _FLIP_SHARE * time_limit_s if problem.recompute.enabled and max_windows is None else deadline
    context.peer = peer
    # after the restarts: a deep window outlasts a restart's share
    context.deep, context.deep_from = deep_warm_up and deep_applies(problem), time.monotonic()
    best = context.search(best, flips_from, windows)
    if peer is not None:
        peer.flush()
    if not (best.timeline.fits and best.score <= search_score(first)):  # pragma: no cover - kept by acceptance
        return Search(_judged(schedule, first), best.solved, 0)
    if flips_from < deadline:  # the window models keep every choice's kind; recompute is decided here
        flipped = _flips(problem, best.schedule, deadline, rng)
        return Search(flipped.best, best.solved + flipped.windows,
                      best.improved + flipped.improvements)
    return Search(_judged(best.schedule, best.timeline), best.solved, best.improved)


def _flips(problem: Problem, schedule: Schedule, deadline: float, rng: random.Random) -> Search:
    """Keep, offload or recompute, one pair at a time, judged by the simulator (recompute.py)."""
    first = simulate(problem, schedule)
    flipped, timeline = flip_decisions(problem, schedule, deadline=deadline, rng=rng)
    faster = int(timeline.makespan < first.makespan - _EPS)
    return Search(_judged(flipped, timeline), 1, faster)


def _judged(schedule: Schedule, timeline: Timeline) -> Judged:
    return Judged(schedule.name, schedule, timeline)


@dataclass
class _Context:
    problem: Problem
    grid: Grid
    rng: random.Random
    workers: int | None
    per_device: int
    max_per_device: int
    follow: int
    window_limit_s: float
    kinds: tuple[str, ...]
    deterministic: bool
    bound_ms: float | None
    on_progress: Callable[[Progress], None] | None
    began: float
    deep: bool = False  # deep warm-up windows first (``improve``'s ``deep_warm_up``)
    deep_from: float = 0.0  # when they began
    deep_s: float = 0.0  # CP-SAT time spent on them
    peer: Peer | None = None
    defer_first: bool = False  # each start's W deferral pass runs to its end before any window
    step_s: float = 0.0  # the least a step takes (_STEP_SIMS): none is begun with less time left

    def state(self, schedule: Schedule, timeline: Timeline) -> _State:
        return _State(schedule, timeline, search_score(timeline), self.per_device, defer_next=self.defer_first)

    def restarts(self, starts: list[tuple[Schedule, Timeline]], share: float, deadline: float,
                 windows: list[int] | None) -> _State:
        """The best state after ``share`` seconds of search from each start in turn (none with
        one start), with the windows solved from all of them counted."""
        if len(starts) == 1:
            return self.state(*starts[0])
        best: _State | None = None
        for candidate, timeline in starts:
            state = self.search(self.state(candidate, timeline), min(deadline, time.monotonic() + share), windows)
            if best is None or state.score < best.score:
                best = replace(state, solved=state.solved + (best.solved if best else 0),
                               improved=state.improved + (best.improved if best else 0))
            else:
                best.solved += state.solved
                best.improved += state.improved
        return replace(best, tabu=set(), cursor=0.0)

    def _kind(self, state: _State) -> str:
        """Sweep every other window; otherwise a kind by how often it has paid (seeded), the
        kinds aimed at the critical path counted as having paid once already."""
        if "sweep" in self.kinds and (state.solved % 2 == 0 or len(self.kinds) == 1):
            return "sweep"  # (the caller falls back to a sweep too)
        others = [k for k in self.kinds if k != "sweep"] or ["sweep"]
        weights = [(1 + 2 * (state.gains.get(k, 0) + (k in _CRITICAL_KINDS))) / (1 + state.tries.get(k, 0)) ** 0.5
                   for k in others]
        return self.rng.choices(others, weights)[0]

    def _moves(self, state: _State, kind: str, deadline: float) -> None:
        """One round of list moves (moves.py) or of W deferral (wdefer.py); kept when it fits and
        is no worse (it never is)."""
        state.solved += 1
        state.tries[kind] = state.tries.get(kind, 0) + 1
        if kind == "defer":
            # deterministic: every round until none pays, whatever the clock says
            schedule, timeline = defer_critical_w(self.problem, state.schedule, state.timeline,
                                                  None if self.deterministic else deadline)
            kept = timeline.makespan < state.timeline.makespan - _EPS
        else:
            moved = improve_by_moves(self.problem, state.schedule, deadline=deadline, rng=self.rng,
                                     timeline=state.timeline,
                                     max_tries=_MOVES_TRIES if self.deterministic else None)
            schedule, timeline, kept = moved.schedule, moved.timeline, moved.kept
        if not (kept and self._keep(state, kind, schedule, timeline, ties=True)):
            state.tabu.add((kind, state.score))
        self._report(state, "list moves" if kind == "moves" else "critical W passes deferred")

    def _trade(self, state: _State) -> None:
        """Offer our incumbent to the other search; go on from its incumbent when that is better
        (judged here by the simulator, as every step is)."""
        self.peer.offer(state.score, state.schedule)
        got = self.peer.received()
        if got is None or not got[0] < state.score:
            return
        timeline = simulate(self.problem, got[1])
        score = search_score(timeline)
        if timeline.fits and score < state.score:
            state.schedule, state.timeline, state.score = got[1], timeline, score
            state.gained = True
            state.tabu.clear()
            state.retries.clear()
            self.peer.adopted(score)
            self._report(state, "the other search's incumbent")

    def _report(self, state: _State, last: str) -> None:
        if self.on_progress is not None:
            self.on_progress(Progress(time.monotonic() - self.began, state.timeline.makespan, self.bound_ms,
                                      f"window search: {state.solved} neighbourhoods, {state.improved} faster; "
                                      f"last {last}, {state.last_size} ops per device"))

    def _neighbourhood(self, state: _State) -> Neighbourhood | str:
        """The next window to solve, or the name of a list kind (_LIST_KINDS) to run."""
        count = state.size * self.problem.devices
        deep_turn = self.deep_s <= DEEP_SHARE * (time.monotonic() - self.deep_from)
        while self.deep and deep_turn and state.deep_size <= DEEP_MAX_SIZE:
            hood = choose(self.problem, state.timeline, DEEP, state.deep_size, self.follow, self.rng)
            if (hood, state.deep_size) not in state.tabu:
                state.last_size = state.deep_size
                return hood
            state.deep_size += 1  # solved without gain at this incumbent: a larger one
        if state.defer_next:
            state.defer_next = False
            if "defer" in self.kinds and ("defer", state.score) not in state.tabu:
                return "defer"
        for _ in range(4):
            kind = self._kind(state)
            if kind in _LIST_KINDS:
                if (kind, state.score) not in state.tabu:
                    return kind
            elif kind != "sweep":
                # each retry of a kind at the same incumbent looks at a larger slice
                size = min(2 * self.max_per_device, state.size + 2 * state.retries.get(kind, 0))
                hood = choose(self.problem, state.timeline, kind, size, self.follow, self.rng)
                if (hood, size) not in state.tabu:
                    state.retries[kind] = state.retries.get(kind, 0) + 1
                    state.last_size = size
                    return hood
        state.last_size = state.size
        hood, state.cursor = sweep(state.timeline, state.cursor, count, self.follow * count)
        if state.cursor == float("inf"):  # a pass is over: grow the windows if it gained nothing
            if not state.gained:
                state.size = min(self.max_per_device, state.size + 1)
            state.cursor, state.gained = 0.0, False
        return hood

    def _keep(self, state: _State, kind: str, schedule: Schedule, timeline: Timeline, *, ties: bool = False) -> bool:
        """Take ``schedule`` when it fits and scores better (``ties``: or as well): the simulator
        judges, never worse. A window that makes it faster puts W deferral next (_neighbourhood)."""
        new_score = search_score(timeline)
        if not (timeline.fits and (new_score <= state.score if ties else new_score < state.score)):
            return False
        if new_score[0] < state.score[0] - _EPS:
            state.improved += 1
            state.gains[kind] = state.gains.get(kind, 0) + 1
            state.defer_next = kind not in _LIST_KINDS
        state.schedule, state.timeline, state.score = schedule, timeline, new_score
        state.gained = True
        state.tabu.clear()
        return True

    def search(self, state: _State, deadline: float, windows: list[int] | None) -> _State:
        """Solve neighbourhoods of ``state`` until ``deadline`` (or the window count runs out)."""
        problem, grid = self.problem, self.grid
        # What a window costs besides its solve (scope, model, splice, simulate; about a second each at
        # p = 32, m = 256): no window starts, and no solve runs, into the time that needs at the end.
        overhead = self.step_s
        while (left := deadline - time.monotonic() - overhead) > 0.05 and (windows is None or windows[0] > 0):
            iteration = time.monotonic()
            if self.peer is not None:
                self._trade(state)
                if self.peer.stopped:
                    break
            if self.bound_ms is not None and state.timeline.makespan <= self.bound_ms + _EPS:
                break  # meets the lower bound: nothing left to gain
            if windows is not None:
                windows[0] -= 1
            hood = self._neighbourhood(state)
            if isinstance(hood, str):
                whole = hood == "defer" and self.defer_first and state.solved == 0  # the start's pass
                self._moves(state, hood, deadline if whole else
                            min(deadline, time.monotonic() + (_DEFER_S if hood == "defer" else _MOVES_S)))
                continue
            scope, inside = window_scope(problem, state.timeline, grid, hood.t0, hood.t1, hood.t2, hood.devices,
                                   hood.microbatches)
            state.solved += 1
            state.tries[hood.kind] = state.tries.get(hood.kind, 0) + 1
            if not scope.compute:
                continue
            model = Model(problem, grid, scope, grid.up(state.timeline.makespan) + 1)
            model.hint(inside, scope.offloaded | (scope.open_pairs & offloaded_pairs(state.timeline)))
            limit = self.window_limit_s * _LIMIT_FACTOR.get(hood.kind, 2)
            left = deadline - time.monotonic() - overhead
            if left <= 0.05:
                break
            solved_at = time.monotonic()
            solver, code = solve_model(model, time_limit_s=min(limit if not self.deterministic else 10 * limit, left),
                                       seed=self.rng.randrange(1 << 30), workers=self.workers, light_presolve=True,
                                       linear_relaxation=False,
                                       deterministic_s=limit if self.deterministic else None,
                                       interleave=self.workers == 1 and hood.kind == DEEP)
            solve_s = time.monotonic() - solved_at
            self.deep_s += solve_s if hood.kind == DEEP else 0.0
            gained = False
            if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                candidate = splice(problem, state.timeline, scope, frozenset(model.start), model.values(solver),
                                    grid, state.timeline.makespan + 1.0)
                gained = self._keep(state, hood.kind, candidate, simulate(problem, candidate))
            if not gained:
                state.tabu.add((hood, state.last_size))
            else:
                state.retries.clear()
            self._report(state, hood.describe())
            overhead = max(overhead, time.monotonic() - iteration - solve_s)
        return state
