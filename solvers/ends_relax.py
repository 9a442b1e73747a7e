"""A makespan bound from the idle a budget forces at a device's two ends, each end solved exactly.

``phases.py`` counts that idle in closed form: before the first backward a device runs only
forwards, and each holds its activation until its offload ends; after the last forward only
backward and W passes run, and each pending pair holds its bytes until they end. The closed form
takes every forward as available at once and every offload as back to back. Here each end is a
small scheduling problem of its own, solved by CP-SAT, with the releases and tails of the
one-machine relaxation (bounds.py: the data paths through the other devices, their own work,
the budget's effect on the fill) kept. Both models hold only the ops that can run in their window,
so they are small at any number of microbatches: at p = 8, v = 2, m = 24 (grid09) each solves to
optimality in well under a second, and the bound rises from 1,747.8 to 1,792.9 ms.

**Warm-up** (from the device's earliest start to R, the earliest its first backward can start,
the j-th backward of each stage no earlier than ``device_jobs`` says): only forwards run there.
The j-th forward of stage s in time order starts no earlier than its release, and after the j-th
forward of each lower stage of the device plus the data path between them; it takes its whole
activation from its start. The j-th offload of the stage starts after the j-th forward ends,
offloads run one at a time, and each frees its activation at its end. Reloads before the first
backward would only take memory, and are left out. The most forward time that can run before R
bounds the busy time there; R, less the device's start and that, is idle.

**Cool-down** (the last Q ms, Q the least tail of any stage's last forward: every forward has
ended by then), solved backwards in time from the makespan: only B and W run there. The k-th B
from the last of stage s ends no later than its tail before the makespan, after the k-th from the
last of each higher stage of the device plus the path; the k-th W from the last starts after the
k-th B from the last ends. Memory at time t is at least (a - keep) per B still to end, keep per
W still to end, less a per reload still to start (a pair whose reload starts after t is on the
host at t, at best), with the k-th reload from the last ending before the k-th B from the last
starts, reloads one at a time. Seen backwards, B and W passes take memory at their ends and
reloads give it back: the same model as the warm-up's, whose most busy time bounds Q's.

Why labels can be dropped: numbering each kind's ops of a stage by time maps every fitting
schedule onto a solution (device_relax.py's argument, from the first ranks and from the last);
memory counts are at most what the device really holds.

Every time is in whole units of 1/4000 of the window (1/64000 in a last solve), every
duration, lag and release rounded down and starts taken down to the unit (floor(a + b) >=
floor(a) + floor(b); a reservoir at a unit counts the events before the next one, a real
instant's level), and busy time is credited rounded up: every fitting schedule maps onto a
solution whose busy time is no less. CP-SAT's proven bound on the most busy time holds whether
or not it proves its answer optimal.

A device's bound is ``PhaseIdle.with_ends``: its start, its work, and the larger of each end's
two proofs of idle. Also relaxed: a shared host link (each device's transfers only keep off each
other), the host budget, and a fused BW (a B then its W, whose part of the memory is freed
earlier). Recompute is not modelled (a recomputed forward holds less).
"""

from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import duration_ms, stage_ms
from optpipe.core.units import format_size

from .bounds import Bound, Paths, data_paths, device_job, device_jobs, device_phases
from .phases import PhaseIdle

__all__ = ["UNITS", "EndIdle", "WindowModel", "after_last_forward", "cool_down_chains", "device_start", "ends_applies",
           "ends_bound", "end_idle", "first_backward", "warm_up_chains"]

_F, _B, _W, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.OFFLOAD, OpKind.RELOAD
UNITS = 4000  # a window in this many units: rounding down costs a few units per op
_FINE = 16  # ... and the bound's device once more on a grid this many times finer
_ROUND = 1e-6  # of a unit: float noise never rounds a length up, or a credit down
_MIN_SOLVE_S = 0.05
_EPS_MS = 1e-9
# A device's two ends get at most this long in each round: most are proved in the first, in a
# tenth of it; the hardest on the grid (grid14's device 11) in about 1.3 s.
_ROUND_S = (0.5, 3.0)


@dataclass(frozen=True)
class EndIdle:
    """What CP-SAT proves of one device's two ends (ms of idle; 0 where it proves nothing)."""

    device: int
    warm_up: float  # idle before the first backward
    cool_down: float  # idle after the last forward
    proved: bool  # both ends solved to optimality: more time proves no more


@dataclass(frozen=True)
class _Chain:
    """One kind's ops of one stage in a window, numbered by time from the window's start."""

    duration: float  # ms
    takes: int  # bytes taken from the op's start
    releases: tuple[float, ...]  # per rank in the window, its earliest start (ms from the window's start)
    transfer_ms: float | None  # an optional transfer per rank, after the rank's op ends
    frees: int  # bytes the transfer gives back at its end


def ends_applies(problem: Problem) -> bool:
    """Recompute is not modelled; everything else is, at any size."""
    return not problem.recompute.enabled


def end_idle(problem: Problem, device: int, paths: Paths, *, time_limit_s: float, workers: int | None = None,
             seed: int = 0) -> EndIdle:
    """The idle CP-SAT proves at ``device``'s warm-up and cool-down, half the time limit each."""
    return _solve(device, _windows(problem, device, paths), problem.memory.budget, time_limit_s, workers, seed)


def ends_bound(problem: Problem, *, floor: Bound, time_limit_s: float, workers: int | None = None,
               seed: int = 0, upper_ms: float = math.inf) -> Bound:
    """``floor`` raised by the devices' ends, within the time limit; ``upper_ms``, a fitting
    schedule's makespan, ends the search once the bound meets it.

    Two rounds, as in device_relax.py: every device that could raise the bound (with the idle
    of a greedy solution at both ends) gets a short solve, the largest analytic bound first (most
    are proved at once); the ones not proved then share what is left, those that could raise it
    most first. Then the device that sets the bound is solved again on a grid _FINE times finer:
    rounding down costs a few units per op, 0.9 ms of grid14's bound (p = 12, v = 2, m = 24), and
    the finer grid is too slow to solve every device on (grid11's ends proved nothing on it in 15 s)."""
    if not ends_applies(problem):
        return floor
    began = time.monotonic()
    left = lambda: time_limit_s - (time.monotonic() - began)  # noqa: E731
    paths, budget = data_paths(problem), problem.memory.budget
    phases = device_phases(problem, paths)
    windows: dict[int, tuple] = {}  # built when a device is first looked at
    best, coarse = _rounds(problem, phases, paths, windows, floor, left, upper_ms, workers, seed)
    if coarse is not None and left() >= _MIN_SOLVE_S and best.value < upper_ms - _EPS_MS:
        device = coarse.device
        fine = _solve(device, windows[device], budget, min(_ROUND_S[1], left()), workers, seed, UNITS * _FINE)
        # each end's idle is a proof on either grid: the larger of the two counts
        both = EndIdle(device, max(coarse.warm_up, fine.warm_up), max(coarse.cool_down, fine.cool_down),
                       coarse.proved or fine.proved)
        best = _raised(problem, phases[device], both, best)
    return best


def _rounds(problem: Problem, phases: dict[int, PhaseIdle], paths: Paths, windows: dict[int, tuple], floor: Bound,
            left, upper_ms: float, workers: int | None, seed: int) -> tuple[Bound, EndIdle | None]:
    """``ends_bound``'s two rounds: the bound and what was proved of the device that raised it
    last (None: none did)."""
    budget = problem.memory.budget
    most: dict[int, float] = {}  # the device's bound with a greedy solution's idle at both ends
    best, setter, open_ = floor, None, []
    for round_ in (0, 1):
        devices = sorted(phases, key=lambda d: (-phases[d].value, d)) if round_ == 0 else \
            sorted(open_, key=lambda d: (-most[d], d))
        open_ = []
        for index, device in enumerate(devices):
            if left() < _MIN_SOLVE_S or best.value >= upper_ms - _EPS_MS:
                return best, setter
            if device not in windows:
                windows[device] = _windows(problem, device, paths)
                most[device] = phases[device].with_ends(*(window - _greedy_busy(window, chains, after, budget)
                                                          for window, chains, after in windows[device]))
            if most[device] <= best.value:
                continue
            share = min(_ROUND_S[round_], left() / (len(devices) - index))
            ends = _solve(device, windows[device], budget, share, workers, seed)
            if not ends.proved:
                open_.append(device)
            raised = _raised(problem, phases[device], ends, best)
            best, setter = raised, (ends if raised is not best else setter)
    return best, setter


def _windows(problem: Problem, device: int, paths: Paths) -> tuple[tuple, tuple]:
    """The device's warm-up and cool-down: each (length, chains, orders)."""
    jobs = device_jobs(problem, paths, device)
    return _warm_up(problem, device, paths, jobs), _cool_down(problem, device, paths, jobs)


def _solve(device: int, windows: tuple, budget: int, time_limit_s: float, workers: int | None, seed: int,
           units: int = UNITS) -> EndIdle:
    half = max(_MIN_SOLVE_S, time_limit_s / 2)
    idle, proved = [], True
    for window, chains, after in windows:
        busy, optimal = _most_busy(window, chains, after, budget, half, workers, seed, units)
        idle.append(max(0.0, window - busy))
        proved = proved and optimal
    return EndIdle(device, idle[0], idle[1], proved)


def _raised(problem: Problem, phase: PhaseIdle, ends: EndIdle, best: Bound) -> Bound:
    value = phase.with_ends(ends.warm_up, ends.cool_down)
    if value <= best.value:
        return best
    after = max(phase.drain + phase.last, ends.cool_down)
    before = max(0.0, value - phase.start - phase.work - after)  # the first window's idle, as with_ends counts it
    return Bound(value, f"device {phase.device}: {phase.work:,.1f} ms of compute from {phase.start:,.1f} ms on, and "
                        f"its budget of {format_size(problem.memory.budget)} and host link, solved exactly at its "
                        f"ends, leave it idle at least {before:,.1f} ms before its first backward and "
                        f"{after:,.1f} ms after its last forward")


def _greedy_busy(window: float, chains: dict, after: list, budget: int) -> float:
    """The busy time in [0, window) of one solution of the window's model: the op that can start
    first goes next, each followed by its transfer. A lower bound on the most, so that devices
    whose ends cannot raise the bound are never solved (at p = 32 that is most of them)."""
    rank = dict.fromkeys(chains, 0)
    ends: dict[tuple, float] = {}  # (chain, rank) -> end
    frees: list[tuple[float, int]] = []  # (time, bytes) the transfers give back, in time order (one channel)
    done = 0  # frees[:done] have happened by ``machine``
    held, machine, channel, busy = 0, 0.0, 0.0, 0.0
    before = {key: [(earlier, lag) for earlier, later, lag in after if later == key] for key in chains}
    while True:
        choice = None
        for key, chain in chains.items():
            r = rank[key]
            if r >= len(chain.releases) or any((earlier, r) not in ends for earlier, _ in before[key]):
                continue
            start = max([machine, chain.releases[r]] + [ends[(earlier, r)] + lag for earlier, lag in before[key]])
            level, k = held, done
            while k < len(frees) and (frees[k][0] <= start or level + chain.takes > budget):
                start, level, k = max(start, frees[k][0]), level - frees[k][1], k + 1  # room, if a transfer gives it
            if level + chain.takes <= budget and start < window and (choice is None or start < choice[0]):
                choice = (start, key)
        if choice is None:
            return busy
        start, key = choice
        chain = chains[key]
        busy += min(chain.duration, window - start)
        ends[(key, rank[key])] = machine = start + chain.duration
        rank[key] += 1
        while done < len(frees) and frees[done][0] <= start:
            held, done = held - frees[done][1], done + 1
        held += chain.takes
        if chain.transfer_ms is not None:
            channel = max(channel, machine) + chain.transfer_ms
            frees.append((channel, chain.frees))


def _while_in(window: float, releases) -> tuple[float, ...]:
    """The releases of the ranks that can start in the window: a prefix, as ranks are numbered by time."""
    return tuple(itertools.takewhile(lambda release: release < window, releases))


def device_start(problem: Problem, device: int, paths: Paths) -> float:
    """The earliest any forward of the device can start: its warm-up window's start."""
    return min(paths.head[(_F, s)] for s in problem.pipeline.stages_on(device))


def first_backward(problem: Problem, device: int, jobs) -> float:
    """R, the earliest the device's first backward can start (``jobs``: bounds.device_jobs):
    its warm-up window's end."""
    m = problem.microbatches
    return min(device_job(jobs, m, i, 0, _B)[0] for i in range(len(problem.pipeline.stages_on(device))))


def after_last_forward(problem: Problem, device: int, jobs) -> float:
    """Q, the least time from the device's last forward's end to the makespan: its cool-down window."""
    m = problem.microbatches
    return min(device_job(jobs, m, i, m - 1, _F)[2] for i in range(len(problem.pipeline.stages_on(device))))


def warm_up_chains(problem: Problem, device: int, paths: Paths, jobs, origin: float, window: float) -> tuple[dict, list]:
    """The device's forwards by stage in [origin, origin + window), releases counted from
    ``origin``, and the paths between its stages (``after`` of _most_busy)."""
    memory, m = problem.memory, problem.microbatches
    stages = problem.pipeline.stages_on(device)
    f = stage_ms(problem, _F)
    chains = {}
    for i, s in enumerate(stages):
        releases = _while_in(window, (device_job(jobs, m, i, j, _F)[0] - origin for j in range(m)))
        offload = duration_ms(problem, Op(_OFF, s, 0)) if problem.offload.enabled else None
        chains[(_F, s)] = _Chain(f[s], memory.activation[s], releases, offload, memory.activation[s])
    after = [((_F, s), (_F, t), paths.head[(_F, t)] - paths.head[(_F, s)] - f[s])
             for s in stages for t in stages if t > s]
    return chains, after


def cool_down_chains(problem: Problem, device: int, paths: Paths, jobs, window: float) -> tuple[dict, list]:
    """The device's B and W passes by stage in the last ``window`` ms, backwards from the
    makespan and numbered from the last, and the orders between them in reversed time (a W
    before its B, a stage's B before the B of the stage above it)."""
    memory, m = problem.memory, problem.microbatches
    stages = problem.pipeline.stages_on(device)
    b, w = stage_ms(problem, _B), stage_ms(problem, _W)
    chains = {}
    for i, s in enumerate(stages):
        act, keep = memory.activation[s], memory.weight_activation[s]
        tails = _while_in(window, (device_job(jobs, m, i, m - 1 - k, _B)[2] for k in range(m)))
        reload = duration_ms(problem, Op(_REL, s, 0)) if problem.offload.enabled else None
        chains[(_B, s)] = _Chain(b[s], act - keep, tails, reload, act)
        chains[(_W, s)] = _Chain(w[s], keep, (0.0,) * min(m, math.floor(window / w[s]) + 1), None, 0)
    after = [((_W, s), (_B, s), 0.0) for s in stages]
    after += [((_B, s), (_B, t), paths.head[(_B, s)] - paths.head[(_B, t)] - b[t])
              for s in stages for t in stages if t > s]
    return chains, after


def _warm_up(problem: Problem, device: int, paths: Paths, jobs) -> tuple[float, dict, list]:
    """The window before the first backward: its length, the forwards by stage, the paths between them."""
    start = device_start(problem, device, paths)
    window = first_backward(problem, device, jobs) - start
    return (window, *warm_up_chains(problem, device, paths, jobs, start, window))


def _cool_down(problem: Problem, device: int, paths: Paths, jobs) -> tuple[float, dict, list]:
    """The last window, backwards from the makespan: its length, its B and W passes, their orders."""
    window = after_last_forward(problem, device, jobs)
    return (window, *cool_down_chains(problem, device, paths, jobs, window))


def _most_busy(window: float, chains: dict, after: list, budget: int, time_limit_s: float, workers: int | None,
               seed: int, units: int = UNITS) -> tuple[float, bool]:
    """An upper bound (ms) on the compute time the chains can run in [0, window) within the budget,
    and whether CP-SAT proved it the most.

    ``after``: (earlier, later, lag): the k-th op of ``later`` starts after the k-th of
    ``earlier`` ends plus the lag, and is in the window only if that one is."""
    if window <= 0 or not any(chain.releases for chain in chains.values()):
        return 0.0, True
    model = WindowModel(window, units)
    for key, chain in chains.items():
        model.chain(key, chain)
    for earlier, later, lag in after:
        model.order(chains, earlier, later, lag)
    return model.solve(budget, time_limit_s, workers, seed)


class WindowModel:
    """The CP-SAT model of one window, in whole units (the module docstring says why they are safe)."""

    def __init__(self, window: float, units: int = UNITS):
        self.window, self.unit = window, window / units
        self.end = self.up(window)
        self.cp = cp_model.CpModel()
        # per device: its compute line, its D2H (or, seen backwards, H2D) channel, its memory events
        self.compute: dict[int, list] = {}
        self.transfers: dict[int, list] = {}
        self.events: dict[int, list] = {}
        self.credits = []
        self.ops: dict[tuple, tuple] = {}  # (chain, rank) -> (present, start)

    def down(self, ms: float) -> int:
        return max(0, math.floor(ms / self.unit - _ROUND))

    def up(self, ms: float) -> int:
        return math.ceil(ms / self.unit + _ROUND)

    def chain(self, key: tuple, chain: _Chain, device: int = 0, credited: bool = True) -> None:
        """Its ranks: a prefix of them in the window, one after another, each perhaps followed by
        its transfer, on ``device``'s compute line, channel and memory; each ``credited`` with the
        part of it in the window (fill_relax.py models upstream devices whose busy time is not
        asked for)."""
        compute, transfers = self.compute.setdefault(device, []), self.transfers.setdefault(device, [])
        events = self.events.setdefault(device, [])
        # An op longer than the window fills it; a transfer as long ends after it, where it frees
        # nothing the window sees: both cut to the window (more room, so still a relaxation).
        cp, end = self.cp, self.end
        length, most = min(self.down(chain.duration), end), min(self.up(chain.duration), end)
        moved = self.down(chain.transfer_ms) if chain.transfer_ms is not None else end
        moved = moved if moved < end else None
        previous = None  # (present, start, transfer present, transfer start) of the rank before
        for rank, release in enumerate(chain.releases):
            present = cp.new_bool_var("")
            start = cp.new_int_var(min(self.down(release), end), end, "")
            cp.add(start <= end - 1).only_enforce_if(present)
            compute.append(cp.new_optional_fixed_size_interval_var(start, length, present, ""))
            if credited:
                credit = cp.new_int_var(0, most, "")
                cp.add(credit <= most * present)
                cp.add(credit <= end - start).only_enforce_if(present)
                self.credits.append(credit)
            if chain.takes:
                events.append((start, chain.takes, present))
            moving = moving_start = None
            if moved is not None:
                moving = cp.new_bool_var("")
                moving_start = cp.new_int_var(0, end + (len(chain.releases) + 1) * (moved + length), "")
                cp.add_implication(moving, present)
                cp.add(moving_start >= start + length).only_enforce_if(moving)
                transfers.append(cp.new_optional_fixed_size_interval_var(moving_start, moved, moving, ""))
                events.append((moving_start + moved, -chain.frees, moving))
            if previous is not None:
                cp.add_implication(present, previous[0])
                cp.add(start >= previous[1] + length).only_enforce_if(present)
                if moving is not None:
                    cp.add_implication(moving, previous[2])
                    cp.add(moving_start >= previous[3] + moved).only_enforce_if(moving)
            self.ops[(key, rank)] = (present, start)
            previous = (present, start, moving, moving_start)

    def order(self, chains: dict, earlier: tuple, later: tuple, lag: float) -> None:
        length = min(self.down(chains[earlier].duration), self.end)
        for rank in range(len(chains[later].releases)):
            if (earlier, rank) not in self.ops:  # the later one cannot be in the window either
                self.cp.add(self.ops[(later, rank)][0] == 0)
                continue
            (first, first_start), (then, then_start) = self.ops[(earlier, rank)], self.ops[(later, rank)]
            self.cp.add_implication(then, first)
            self.cp.add(then_start >= first_start + length + min(self.down(lag), self.end + 1)).only_enforce_if(then)

    def solve(self, budget: int, time_limit_s: float, workers: int | None, seed: int) -> tuple[float, bool]:
        cp = self.cp
        for device in self.compute:
            cp.add_no_overlap(self.compute[device])
            if self.transfers[device]:
                cp.add_no_overlap(self.transfers[device])
            if events := self.events[device]:
                changes, least, most = _bytes_in_units([e[1] for e in events], budget)
                cp.add_reservoir_constraint_with_active([e[0] for e in events], changes, [e[2] for e in events],
                                                        least, most)
        cp.maximize(sum(self.credits))
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
        solver.parameters.num_workers = workers or max(2, os.cpu_count() or 1)
        solver.parameters.random_seed = seed
        # Presolve is off, as in device_relax.py (it once claimed a wrong optimum on a reservoir
        # model); the reservoir keeps its own propagator: expanded, the same answers took four to
        # eight times longer.
        solver.parameters.cp_model_presolve = False
        solver.parameters.expand_reservoir_constraints = False
        status = solver.solve(cp)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return self.window, False  # nothing proved
        return min(self.window, solver.best_objective_bound * self.unit), status == cp_model.OPTIMAL


def _bytes_in_units(changes: list[int], budget: int) -> tuple[list[int], int, int]:
    """Memory changes and the budget in units CP-SAT's int64 levels hold, with the reservoir's
    least and most level. Exact bytes up to 2**40 in all; past that (sizes up to an EiB) each
    byte count is taken in units of q bytes, what an op takes rounded down and what it gives back
    rounded up, so every level is at most the real one over q, and the budget over q rounded down
    still holds it. A level may then dip below zero by a unit per release: the least allows it."""
    q = -(-sum(c for c in changes if c > 0) // 2**40)
    if q <= 1:
        return changes, 0, budget
    return [c // q for c in changes], -len(changes), budget // q  # floor division: down, or up for a release
