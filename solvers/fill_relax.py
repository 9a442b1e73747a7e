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
from optpipe.core.schedule import OpKind
from optpipe.core.semantics import TOLERANCE_MS
from optpipe.core.units import format_size

from .bounds import Bound, Paths, data_paths, device_jobs, device_phases
from .ends_relax import (UNITS, WindowModel, after_last_forward, cool_down_chains, device_start, first_backward,
                         warm_up_chains)

__all__ = ["fed_applies", "fed_bound", "fed_cool_down_idle", "fed_warm_up_idle"]

_F, _B = OpKind.F, OpKind.B
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
                     workers: int | None = None, seed: int = 0, units: int = UNITS) -> tuple[float, bool]:
    """The idle CP-SAT proves before ``device``'s first backward with its feeders modelled (ms),
    and whether it proved it optimal. ``jobs``: bounds.device_jobs per device, where already built."""
    jobs = _all_jobs(problem, paths, jobs)
    end = first_backward(problem, device, jobs[device])
    start = device_start(problem, device, paths)
    if end - start <= TOLERANCE_MS:
        return 0.0, True
    modelled = [d for d in range(problem.devices) if first_backward(problem, d, jobs[d]) >= end - TOLERANCE_MS]
    windows = {d: warm_up_chains(problem, d, paths, jobs[d], 0.0, end) for d in modelled}
    if not any(chain.releases for chain in windows[device][0].values()):
        return end - start, True  # nothing of the target can start before R
    busy, optimal = _most_busy_fed(problem, device, windows, _F, paths.lag_up, end, time_limit_s, workers, seed, units)
    return max(0.0, end - start - busy), optimal


def fed_cool_down_idle(problem: Problem, device: int, paths: Paths, *, time_limit_s: float, jobs: dict | None = None,
                       workers: int | None = None, seed: int = 0, units: int = UNITS) -> tuple[float, bool]:
    """The idle CP-SAT proves after ``device``'s last forward with the devices that send it
    backward passes modelled, backwards in time from the makespan (ms), and whether it proved it."""
    jobs = _all_jobs(problem, paths, jobs)
    window = after_last_forward(problem, device, jobs[device])
    if window <= TOLERANCE_MS:
        return 0.0, True
    modelled = [d for d in range(problem.devices) if after_last_forward(problem, d, jobs[d]) >= window - TOLERANCE_MS]
    windows = {d: cool_down_chains(problem, d, paths, jobs[d], window) for d in modelled}
    busy, optimal = _most_busy_fed(problem, device, windows, _B, paths.lag_up, window, time_limit_s, workers, seed, units)
    return max(0.0, window - busy), optimal


def _most_busy_fed(problem: Problem, device: int, windows: dict, kind: OpKind, lag_up: tuple[float, ...],
                   window: float, time_limit_s: float, workers: int | None, seed: int,
                   units: int) -> tuple[float, bool]:
    """The most busy time of ``device`` in the window, each modelled device's (chains, orders) on
    its own compute line, channel and budget, the k-th ``kind`` of a stage after the k-th of the
    stage below it plus the link wherever both are modelled (seen backwards for B)."""
    pipe = problem.pipeline
    model, chains = WindowModel(window, units), {}
    for d, (own, after) in windows.items():
        for key, chain in own.items():
            model.chain(key, chain, device=d, credited=d == device)
        chains.update(own)
        for earlier, later, lag in after:
            model.order(chains, earlier, later, lag)
    for s in range(problem.stages - 1):
        if (kind, s) in chains and (kind, s + 1) in chains and pipe.device_of(s) != pipe.device_of(s + 1):
            model.order(chains, (kind, s), (kind, s + 1), lag_up[s])
    return model.solve(problem.memory.budget, time_limit_s, workers, seed)


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
    phases = device_phases(problem, paths)
    best = floor
    devices = sorted(phases, key=lambda d: (-phases[d].value, d))[:_DEVICES]
    for device in devices:
        left = time_limit_s - (time.monotonic() - began)
        if left < _MIN_SOLVE_S or best.value >= upper_ms - TOLERANCE_MS:
            break
        if phases[device].with_ends(*_windows(problem, device, paths, jobs)) <= best.value + TOLERANCE_MS:
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
    warm_up = first_backward(problem, device, jobs[device]) - device_start(problem, device, paths)
    return max(0.0, warm_up), after_last_forward(problem, device, jobs[device])
