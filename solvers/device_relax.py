"""A makespan bound from one device's exact memory and host link, the rest of the pipeline relaxed.

Where the budget holds a few activations and offload round trips are slow, a device loses time
all through its warm-up and cool-down in ways no closed-form argument counts: a forward waits
for an offload to end, a reload for room, the last microbatch's round trip for both. This bound
solves that device's own scheduling problem exactly (CP-SAT), keeping everything a schedule of
the whole pipeline must satisfy there and relaxing the rest:

- the device's F, B and W of each of its stages, one at a time, each released no earlier and
  followed by no less than the one-machine relaxation of bounds.py says (data paths through the
  other devices and their own work, the budget's effect on the fill): those hold for the j-th
  op of a kind and stage in time order;
- between the device's own stages, the least data path through the others (a round trip);
- memory as a reservoir over counts, not labels: a stage's bytes on the device at any time are
  its activation times (forwards started - offloads ended + reloads started), less what ended
  backward passes and W passes free; at most the budget;
- offload and reload one at a time on the device's D2H and H2D channels, the k-th offload of a
  stage after its k-th forward ends, the k-th reload after the k-th offload; a backward only
  when an activation of its stage is on the device (forwards ended - offloads started +
  reloads ended >= backwards started).

Why labels can be dropped (every microbatch is the same job): take any schedule that fits and
number each stage's F, B, W, offloads and reloads by start time. Each op of microbatch i waits
for another op of i; of two such kinds sorted by time, the k-th of the later kind still starts
after the k-th of the earlier one ends plus the least delay (the k-th smallest of pairwise
larger numbers is larger). Memory and residency are counts, so the numbered schedule is a
solution of this model with the same makespan: the model's optimum, and any bound CP-SAT proves
on it, is at most the optimum of the real problem.

Only the last K ranks (``last``), for larger problems: every compute op stays, but memory counts
only the last K forwards, backward passes, W passes, offloads and reloads of each stage by time,
and the k-th reload from the end must end before the k-th backward from the end starts (each
reload ends before its own backward). Counted from the end, a stage's bytes at t are what the
events after t give back; with c the number of events of a kind after t, the truncation replaces
each c by min(K, c), and max(0, c - K) is convex and nondecreasing, so with B ends after t at
least the F starts and the reloads after t, and B ends plus offload ends at least F starts plus
reloads (each pair still to finish is resident, on the host or not yet started), the truncated
level is at most the real one (likewise with W ends). What is lost: the link from a forward to
its offload, and the residency count; the level may dip below zero.

Times are whole units of the grid below, every duration, delay, release and tail rounded down
and starts taken down to the unit: a fitting schedule's floored times still satisfy every
constraint (floor(a + b) >= floor(a) + floor(b); a reservoir at a unit counts the events before
the next one, a real instant's level), so the bound stays a proof.

CP-SAT settings: the reservoirs are expanded (their own propagator proves almost nothing here)
and presolve is off. With presolve on, OR-Tools 9.15 claimed an optimum of 286.6 ms for a
problem of this model that has a solution of 265.6 ms satisfying every constraint (device 1 of
the p = 4, v = 2, m = 4 case in tests/test_device_relax.py); without presolve, expanded and
native reservoirs agree. The tests hold the bound against brute-force optima and against
fitting schedules.
"""


from __future__ import annotations

import math
import os
import time
from typing import NamedTuple

from ortools.sat.python import cp_model

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import duration_ms, stage_ms
from optpipe.core.units import format_size

from .bounds import Bound, data_paths, device_job, device_jobs, device_lower_bound

__all__ = ["Relaxed", "relaxation_applies", "relaxation_bound", "relaxed_device_bound"]


class Relaxed(NamedTuple):
    """What CP-SAT said of one device's relaxation."""

    bound_ms: float  # proved: no schedule of the relaxation is faster
    found_ms: float  # the fastest schedule of the relaxation found
    optimal: bool


_F, _B, _W, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.OFFLOAD, OpKind.RELOAD
_UNITS = 200_000  # the upper bound in about this many units: rounding down costs < 0.01%
# CP-SAT proves the whole relaxation of p = 4, v = 2, m = 4 (24 compute ops a device) in seconds;
# at 48 (grid08, p = 8, m = 16) it proved nothing in compile's quarter of 60 s, and the search,
# with that much less time, ended at 616.1 ms where it reaches about 600; at 72 (grid04, p = 6,
# v = 2, m = 12) it proves nothing above the analytic bound in 5 s a device.
_MAX_OPS_PER_DEVICE = 36
# Above that, memory and transfers only for each kind's last _LAST ranks (``last``): p = 4, v = 2,
# m = 8 (48 ops) proves 535.4 ms against the analytic 508.0 (586.3 found), grid08 (48) proves
# all its devices in about a second each, and at 144 (grid14) it proves nothing above the
# analytic bound.
_MAX_LAST_OPS, _LAST = 72, 4
_FIRST_ROUND_S = 1.0


def relaxation_applies(problem: Problem) -> bool:
    """Small enough for CP-SAT to prove something in seconds; recompute is not modelled."""
    return not problem.recompute.enabled and problem.compute_ops_per_device <= _MAX_LAST_OPS


def relaxation_bound(problem: Problem, *, upper_ms: float, floor: Bound, time_limit_s: float,
                     workers: int | None = None, seed: int = 0) -> Bound:
    """The largest of the devices' relaxed bounds and ``floor``.

    Two rounds: each device gets a short solve (most are proved at once); then the devices not
    yet proved share what is left in proportion to what each could still add (its relaxation's
    fastest solution found, less the best bound), the largest first. A device whose relaxation
    has a solution no slower than the best bound cannot raise it. (The p = 4 case of the tests
    proves its binding device in 6 to 12 s, the others in under a second.)"""
    paths = data_paths(problem)
    best, began = floor, time.monotonic()
    left = lambda: time_limit_s - (time.monotonic() - began)  # noqa: E731
    jobs = {d: device_jobs(problem, paths, d) for d in range(problem.devices)}
    open_: dict[int, float] = {}  # device -> its relaxation's fastest solution so far
    for device in sorted(range(problem.devices), key=lambda d: -device_lower_bound(problem, d, paths, fitting=True)):
        best = _solve(problem, device, jobs[device], paths, upper_ms, min(left() / 2, _FIRST_ROUND_S), workers, seed,
                      best, open_)
    while open_ and left() > 0.05:
        # the device with the most to gain gets its share of the gains to be had
        gains = {d: found - best.value for d, found in open_.items() if found > best.value}
        if not gains:
            break
        device = max(gains, key=gains.get)
        share = left() * gains[device] / sum(gains.values())
        del open_[device]
        best = _solve(problem, device, jobs[device], paths, upper_ms, share, workers, seed, best, {})
    return best


def _solve(problem: Problem, device: int, jobs, paths, upper_ms: float, time_limit_s: float, workers, seed: int,
           best: Bound, open_: dict[int, float]) -> Bound:
    """``best`` raised by ``device``'s relaxation; ``open_`` records it when not proved."""
    last = None if problem.compute_ops_per_device <= _MAX_OPS_PER_DEVICE else _LAST
    relaxed = relaxed_device_bound(problem, device, jobs, paths.head, upper_ms=upper_ms, time_limit_s=time_limit_s,
                                   workers=workers, seed=seed, last=last)
    if relaxed is None:
        open_[device] = upper_ms
        return best
    if not relaxed.optimal:
        open_[device] = relaxed.found_ms
    if relaxed.bound_ms <= best.value:
        return best
    return Bound(relaxed.bound_ms, f"device {device}: with its own budget of {format_size(problem.memory.budget)} "
                                   f"and host link solved exactly, the rest of the pipeline relaxed, it needs "
                                   f"at least {relaxed.bound_ms:,.1f} ms")


def relaxed_device_bound(problem: Problem, device: int, jobs: list[tuple[float, float, float]],
                         head: dict, *, upper_ms: float, time_limit_s: float = 1.0,
                         workers: int | None = None, seed: int = 0, last: int | None = None) -> Relaxed | None:
    """What CP-SAT proves for ``device``'s relaxed problem within the time limit, or None when
    it finds no solution.

    ``jobs``: bounds.device_jobs, (release, duration, tail) per stage, microbatch rank and kind
    F, B, W. ``head``: data_paths' earliest starts. ``upper_ms``: the makespan of a schedule
    that fits; the relaxation's optimum is no later, so it is a safe horizon. ``last``: memory
    and transfers of each kind's last ``last`` ranks only (the module docstring says why that
    is still a proof); None: all of them.
    """
    if problem.recompute.enabled or upper_ms <= 0:
        return None
    unit = upper_ms / _UNITS
    down = lambda ms: max(0, math.floor(ms / unit + 1e-9))  # noqa: E731
    horizon = math.ceil(upper_ms / unit) + 1
    pipe, memory = problem.pipeline, problem.memory
    stages, m = pipe.stages_on(device), pipe.microbatches
    cp = cp_model.CpModel()
    makespan = cp.new_int_var(0, horizon, "makespan")
    ops = _compute(cp, jobs, stages, m, down, horizon, makespan)
    _data_paths(problem, cp, ops, stages, m, head, down)
    events: list[tuple] = []  # (time, bytes, active) of the device's memory
    one = cp.new_constant(1)
    first = 0 if last is None else max(0, m - last)
    for s in stages:
        act, keep = memory.activation[s], memory.weight_activation[s]
        for k in range(first, m):
            events += [(ops[(_F, s, k)][0], act, one), (ops[(_B, s, k)][1], -(act - keep), one),
                       (ops[(_W, s, k)][1], -keep, one)]
    if problem.offload.enabled:
        events += _offload(problem, cp, ops, stages, m, first, down, horizon)
    events = [e for e in events if e[1]]
    low = 0 if not first else -sum(e[1] for e in events if e[1] > 0)
    cp.add_reservoir_constraint_with_active([e[0] for e in events], [e[1] for e in events],
                                            [e[2] for e in events], low, memory.budget)
    cp.minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    solver.parameters.num_workers = workers or max(2, os.cpu_count() or 1)
    solver.parameters.random_seed = seed
    solver.parameters.cp_model_presolve = False  # the module docstring says why
    solver.parameters.expand_reservoir_constraints = True
    status = solver.solve(cp)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None  # nothing proved (INFEASIBLE would mean upper_ms is no schedule's makespan)
    return Relaxed(solver.best_objective_bound * unit, solver.objective_value * unit, status == cp_model.OPTIMAL)


def _compute(cp: cp_model.CpModel, jobs, stages, m: int, down, horizon: int, makespan) -> dict:
    """The device's F, B, W by stage and rank, one at a time, each within its release and tail;
    ops[(kind, stage, rank)] = (start, end)."""
    intervals, ops = [], {}
    for index, s in enumerate(stages):
        for k in range(m):
            for kind in (_F, _B, _W):
                release, ms, tail = device_job(jobs, m, index, k, kind)
                d, q = down(ms), down(tail)
                start = cp.new_int_var(min(down(release), horizon), max(0, horizon - d - q), f"{kind.name}{s}:{k}")
                intervals.append(cp.new_fixed_size_interval_var(start, d, ""))
                ops[(kind, s, k)] = (start, start + d)
                cp.add(makespan >= start + d + q)
                if k:  # numbered by start
                    cp.add(start >= ops[(kind, s, k - 1)][1])
    cp.add_no_overlap(intervals)
    return ops


def _data_paths(problem: Problem, cp: cp_model.CpModel, ops: dict, stages, m: int, head: dict, down) -> None:
    """The k-th B after the k-th F's round trip, W after B, and the paths between the device's stages."""
    f, b = stage_ms(problem, _F), stage_ms(problem, _B)
    for s in stages:
        for k in range(m):
            cp.add(ops[(_B, s, k)][0] >= ops[(_F, s, k)][1] + down(head[(_B, s)] - head[(_F, s)] - f[s]))
            cp.add(ops[(_W, s, k)][0] >= ops[(_B, s, k)][1])
            for t in stages:
                if t > s:
                    cp.add(ops[(_F, t, k)][0] >= ops[(_F, s, k)][1] + down(head[(_F, t)] - head[(_F, s)] - f[s]))
                    cp.add(ops[(_B, s, k)][0] >= ops[(_B, t, k)][1] + down(head[(_B, s)] - head[(_B, t)] - b[t]))


def _offload(problem: Problem, cp: cp_model.CpModel, ops: dict, stages, m: int, first: int, down,
             horizon: int) -> list[tuple]:
    """An optional offload and its reload per stage and rank from ``first`` on, each channel one
    at a time and each kind numbered by start; returns their memory events.

    With every rank (``first`` 0) the offloaded ranks are the first ones, the k-th offload starts
    after the k-th forward ends, and a backward runs only beside a resident activation of its
    stage. With the last ranks only, the offloaded ranks are the last ones and the k-th reload
    from the end ends before the k-th backward from the end starts."""
    channels: dict[OpKind, list] = {_OFF: [], _REL: []}
    events = []
    one = cp.new_constant(1)
    for s in stages:
        act = problem.memory.activation[s]
        length = {kind: down(duration_ms(problem, Op(kind, s, 0))) for kind in (_OFF, _REL)}
        if length[_OFF] + length[_REL] > horizon:
            continue  # no schedule within the horizon offloads this stage (and a round trip of years is past int64)
        resident = []  # (time, change, active): forwards ended - offloads started + reloads ended - backwards started
        previous = None  # (present, offload end, reload end) of the rank before
        for k in range(first, m):
            present = cp.new_bool_var(f"offloaded{s}:{k}")
            start = {kind: cp.new_int_var(0, horizon, f"{kind.name}{s}:{k}") for kind in (_OFF, _REL)}
            for kind in (_OFF, _REL):
                channels[kind].append(cp.new_optional_fixed_size_interval_var(start[kind], length[kind], present, ""))
            off_end, rel_end = start[_OFF] + length[_OFF], start[_REL] + length[_REL]
            cp.add(start[_REL] >= off_end).only_enforce_if(present)
            if first:
                cp.add(rel_end <= ops[(_B, s, k)][0]).only_enforce_if(present)
            else:
                cp.add(start[_OFF] >= ops[(_F, s, k)][1]).only_enforce_if(present)
                resident += [(ops[(_F, s, k)][1], 1, one), (start[_OFF], -1, present), (rel_end, 1, present),
                             (ops[(_B, s, k)][0], -1, one)]
            if previous is not None:
                earlier, later = (present, previous[0]) if not first else (previous[0], present)
                cp.add_implication(earlier, later)  # offloaded: a prefix of the ranks, or a suffix
                cp.add(start[_OFF] >= previous[1]).only_enforce_if([present, previous[0]])
                cp.add(start[_REL] >= previous[2]).only_enforce_if([present, previous[0]])
            events += [(off_end, -act, present), (start[_REL], act, present)]
            previous = (present, off_end, rel_end)
        if resident:
            cp.add_reservoir_constraint_with_active([r[0] for r in resident], [r[1] for r in resident],
                                                    [r[2] for r in resident], 0, m)
    for kind in (_OFF, _REL):
        cp.add_no_overlap(channels[kind])
    return events
