"""A bound from a device's warm-up solved together with the devices that feed it.

ends_relax.py solves each device's warm-up alone: its forwards are released when the one-machine
relaxation of bounds.py says, as if the devices before it could run forwards as fast as their
compute allows. Under a tight budget they cannot: before its own first backward a device runs
only forwards, holds each activation until its offload ends, and offloads one at a time, so it
passes forwards on no faster than its host link frees room. On grid14 (p = 12, v = 2, m = 24,
k = 1.6) device 1 alone could be busy all but 15 ms of its warm-up; every schedule found idles it
about 90 ms there, waiting for forwards that device 0 has no room to run.

Here the target device's warm-up (from its earliest start to R, the earliest its first backward
can start) is solved with every device whose own first backward cannot start before R: in
[0, R) those run forwards only, so each is modelled as ends_relax.py models the target (its
forwards of each stage numbered by time, one at a time, each taking its activation from its
start; an optional offload per forward, one at a time on its D2H channel, freeing it at its end;
the budget), and the k-th forward of a stage starts after the k-th forward of the stage before
it ends plus the link between them, wherever both devices are modelled. Elsewhere the releases
of the one-machine relaxation stand. CP-SAT maximises the target's busy time alone; R, less its
start and that, is idle.

Why it is a relaxation: in any fitting schedule the modelled devices run nothing but forwards,
offloads and reloads before R (a backward or W pass needs a backward of the device first).
Dropping the reloads only frees memory; numbering each stage's forwards and offloads by time maps
the schedule onto a solution (device_relax.py's argument); whole units are taken as in
ends_relax.py. Devices whose first backward can start before R are left out altogether (their
backward passes free memory the model would not see), and with them every constraint between
their forwards and the modelled ones, apart from the releases.
"""

from __future__ import annotations

import math
import time

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import duration_ms, stage_ms
from optpipe.core.units import format_size

from .bounds import Bound, Paths, data_paths, device_job, device_jobs
from .ends_relax import Chain, WindowModel, while_in
from .phases import phase_idle

__all__ = ["fed_applies", "fed_bound", "fed_cool_down_idle", "fed_warm_up_idle"]

_F, _B, _W, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.OFFLOAD, OpKind.RELOAD
_UNITS = 4000
_EPS_MS = 1e-9
_MIN_SOLVE_S = 0.05
# A device's two ends get at most this long together, the cool-down what the warm-up leaves:
# grid06 (p = 6, v = 3, m = 18) and grid09 (p = 8, v = 2, m = 24) raise their bounds by 8.3 and
# 6.8 ms, their warm-ups proved in 0.5 s, grid09's cool-down in 4.2 to 4.7 s (nothing at 2.5).
_DEVICE_S = 8.0
# Only the devices whose closed-form bound is highest: the bound's device on grid06 and grid09;
# on gpt-p8-v2-m32-quarter and longseq-p8-v2-m16 10 s raised nothing.
_DEVICES = 2
_MAX_DEVICES = 8


def fed_warm_up_idle(problem: Problem, device: int, paths: Paths, *, time_limit_s: float, jobs: dict | None = None,
                     workers: int | None = None, seed: int = 0, units: int = _UNITS) -> tuple[float, bool]:
    """The idle CP-SAT proves before ``device``'s first backward with its feeders modelled (ms),
    and whether it proved it optimal. ``jobs``: bounds.device_jobs per device, where already built."""
    jobs = _all_jobs(problem, paths, jobs)
    pipe, memory, m = problem.pipeline, problem.memory, problem.microbatches
    first_backward = {d: _first_backward(problem, jobs, d) for d in range(problem.devices)}
    end = first_backward[device]
    start = min(paths.head[(_F, s)] for s in pipe.stages_on(device))
    if end - start <= _EPS_MS:
        return 0.0, True
    modelled = [d for d in range(problem.devices) if first_backward[d] >= end - _EPS_MS]
    f = stage_ms(problem, _F)
    model, chains = WindowModel(end, units), {}
    for d in modelled:
        for i, s in enumerate(pipe.stages_on(d)):
            releases = while_in(end, (device_job(jobs[d], m, i, j, _F)[0] for j in range(m)))
            offload = duration_ms(problem, Op(_OFF, s, 0)) if problem.offload.enabled else None
            chains[(_F, s)] = Chain(f[s], memory.activation[s], releases, offload, memory.activation[s])
            model.chain((_F, s), chains[(_F, s)], device=d, credited=d == device)
    for s in range(problem.stages - 1):  # the link between neighbouring stages on modelled devices
        if (_F, s) in chains and (_F, s + 1) in chains and pipe.device_of(s) != pipe.device_of(s + 1):
            model.order(chains, (_F, s), (_F, s + 1), paths.lag_up[s])
    for d in modelled:  # a device's own stages: the path between them
        stages = pipe.stages_on(d)
        for s in stages:
            for t in (t for t in stages if t > s):
                model.order(chains, (_F, s), (_F, t), paths.head[(_F, t)] - paths.head[(_F, s)] - f[s])
    if not any(chains[(_F, s)].releases for s in pipe.stages_on(device)):
        return end - start, True
    busy, optimal = model.solve(memory.budget, time_limit_s, workers, seed)
    return max(0.0, end - start - busy), optimal


def fed_cool_down_idle(problem: Problem, device: int, paths: Paths, *, time_limit_s: float, jobs: dict | None = None,
                       workers: int | None = None, seed: int = 0, units: int = _UNITS) -> tuple[float, bool]:
    """The idle CP-SAT proves after ``device``'s last forward with the devices that send it
    backward passes modelled, backwards in time from the makespan (ms), and whether it proved it."""
    jobs = _all_jobs(problem, paths, jobs)
    pipe, memory, m = problem.pipeline, problem.memory, problem.microbatches
    b, w = stage_ms(problem, _B), stage_ms(problem, _W)
    after_forwards = {d: _after_forwards(problem, jobs, d) for d in range(problem.devices)}
    window = after_forwards[device]
    if window <= _EPS_MS:
        return 0.0, True
    modelled = [d for d in range(problem.devices) if after_forwards[d] >= window - _EPS_MS]
    model, chains = WindowModel(window, units), {}
    for d in modelled:
        for i, s in enumerate(pipe.stages_on(d)):
            act, keep = memory.activation[s], memory.weight_activation[s]
            tails = while_in(window, (device_job(jobs[d], m, i, m - 1 - k, _B)[2] for k in range(m)))
            reload = duration_ms(problem, Op(_REL, s, 0)) if problem.offload.enabled else None
            chains[(_B, s)] = Chain(b[s], act - keep, tails, reload, act)
            chains[(_W, s)] = Chain(w[s], keep, (0.0,) * min(m, math.floor(window / w[s]) + 1), None, 0)
            model.chain((_B, s), chains[(_B, s)], device=d, credited=d == device)
            model.chain((_W, s), chains[(_W, s)], device=d, credited=d == device)
    for s in range(problem.stages):
        if (_W, s) in chains:
            model.order(chains, (_W, s), (_B, s), 0.0)
    for s in range(problem.stages - 1):  # seen backwards, B(s + 1) follows B(s) over the link
        if (_B, s) in chains and (_B, s + 1) in chains and pipe.device_of(s) != pipe.device_of(s + 1):
            model.order(chains, (_B, s), (_B, s + 1), paths.lag_up[s])
    for d in modelled:
        stages = pipe.stages_on(d)
        for s in stages:
            for t in (t for t in stages if t > s):
                model.order(chains, (_B, s), (_B, t), paths.head[(_B, s)] - paths.head[(_B, t)] - b[t])
    busy, optimal = model.solve(memory.budget, time_limit_s, workers, seed)
    return max(0.0, window - busy), optimal


def _all_jobs(problem: Problem, paths: Paths, jobs: dict | None) -> dict:
    jobs = jobs if jobs is not None else {}
    for d in range(problem.devices):
        if d not in jobs:
            jobs[d] = device_jobs(problem, paths, d)
    return jobs


def fed_applies(problem: Problem) -> bool:
    """Recompute is not modelled; above _MAX_DEVICES CP-SAT proves little in seconds (grid14,
    p = 12: nothing above the bound in 10 s; grid20, p = 24: no device proved in 5 s each), and
    the time is the search's."""
    return not problem.recompute.enabled and problem.devices <= _MAX_DEVICES


def fed_bound(problem: Problem, *, floor: Bound, time_limit_s: float, upper_ms: float = math.inf,
              workers: int | None = None, seed: int = 0) -> Bound:
    """``floor`` raised by the two ends of the _DEVICES devices whose closed-form bound is highest,
    each solved with the devices that feed it, the highest first, each _DEVICE_S while the time lasts."""
    if not fed_applies(problem):
        return floor
    began = time.monotonic()
    paths = data_paths(problem)
    jobs = _all_jobs(problem, paths, None)
    phases = {d: phase_idle(problem, d, paths.head, paths.tail) for d in range(problem.devices)}
    best = floor
    devices = sorted(phases, key=lambda d: (-phases[d].value, d))[:_DEVICES]
    for device in devices:
        left = time_limit_s - (time.monotonic() - began)
        if left < _MIN_SOLVE_S or best.value >= upper_ms - _EPS_MS:
            break
        if phases[device].with_ends(*_windows(problem, device, paths, jobs)) <= best.value + _EPS_MS:
            continue  # idle through both whole windows would not raise it
        # the likeliest first, each its whole share; the cool-down what the warm-up leaves of it
        until = time.monotonic() + min(_DEVICE_S, left)
        warm_up, _ = fed_warm_up_idle(problem, device, paths, time_limit_s=min(_DEVICE_S, left) / 2, jobs=jobs,
                                      workers=workers, seed=seed)
        cool_down, _ = fed_cool_down_idle(problem, device, paths, time_limit_s=until - time.monotonic(), jobs=jobs,
                                          workers=workers, seed=seed)
        value = phases[device].with_ends(warm_up, cool_down)
        if value > best.value:
            best = Bound(value, f"device {device}: {phases[device].work:,.1f} ms of compute from "
                                f"{phases[device].start:,.1f} ms on, and the budget of {format_size(problem.memory.budget)} "
                                f"and host link of it and of the devices that feed it, solved together at its ends, "
                                f"leave it idle at least {warm_up:,.1f} ms before its first backward and "
                                f"{cool_down:,.1f} ms after its last forward")
    return best


def _windows(problem: Problem, device: int, paths: Paths, jobs: dict) -> tuple[float, float]:
    """The lengths of the device's warm-up and cool-down windows: the most idle either can prove."""
    start = min(paths.head[(_F, s)] for s in problem.pipeline.stages_on(device))
    return max(0.0, _first_backward(problem, jobs, device) - start), _after_forwards(problem, jobs, device)


def _first_backward(problem: Problem, jobs: dict, device: int) -> float:
    """The earliest the device's first backward can start: the warm-up window's end."""
    m = problem.microbatches
    return min(device_job(jobs[device], m, i, 0, _B)[0] for i in range(len(problem.pipeline.stages_on(device))))


def _after_forwards(problem: Problem, jobs: dict, device: int) -> float:
    """The least time from the device's last forward's end to the makespan: the cool-down window."""
    m = problem.microbatches
    return min(device_job(jobs[device], m, i, m - 1, _F)[2] for i in range(len(problem.pipeline.stages_on(device))))
