"""Which part of a schedule the window search (lns.py) re-solves next.

A neighbourhood is a slice of time [t0, t1) and the devices whose ops in it are free: those
ops may change order, offload decisions and transfer slots. Ops of the other devices in the
slice, and the ops of every device in [t1, t2), keep their list order but are re-timed, so the
model sees what the free ops do to them. Everything before t0 is fixed; everything after t2 is
summed up as the compute each device still has to do (cpsat.Scope).

Kinds, each a different shape of the same model:

- ``sweep``: about ``size`` ops per device, sliding from the start, overlapping by half (the
  original search: it polishes everywhere);
- ``warm-up`` and ``cool-down``: the schedule's first or last ``2 x size`` ops per device, where
  pipeline fill and drain decide how many forwards are in flight and when W passes run;
- ``devices``: two devices that pass data to each other (d and d+1, the last and the first
  with v > 1) over three times as long a slice: a producer and its consumer re-paired, and a
  stage's microbatches moved together, without the model growing with every device;
- ``device``: one device over four times as long a slice: its offload decisions and its order
  over a long microbatch range, the others re-timed;
- ``idle``: a slice ending just after an idle gap on the critical path (critical.py), most of
  it before the gap: only there does idle cost time (the longest gaps are mostly on devices
  with time to spare), and what causes it, another device running something else first,
  happens earlier than the gap; with no such gap, one of the longest gaps, the slice centred;
- ``bottleneck``: the last ``10 x size`` ops of the device the critical path spends most ops
  on, to the end, the others re-timed in their order: on an unbalanced pipeline that device's
  cool-down (which W passes it keeps for the last backward chain, which activations it keeps
  rather than waiting for their reloads) sets the makespan, and the cool-down windows, a few
  ops on every device, are too short to change it (grid14, p = 12, v = 2: its last 50 ops
  re-solved in 4 s take the makespan from 1,487.2 to 1,480.9 ms);
- ``deep warm-up`` (the portfolio's second search, ``lns.improve(deep_warm_up=True)``): the
  warm-up's shape, ``2 x size`` ops per device from a size of DEEP_SIZE, with 10 s of CP-SAT
  time rather than a few (lns._LIMIT_FACTOR; below the constants: why, and where it applies);
- ``microbatches``: a few consecutive microbatches over four times as long a slice, on every
  device, the other microbatches' ops there re-timed in their order: a group's forwards and
  backwards move past many others at once, which changes how many microbatches are in flight
  (the warm-up's depth, a wave of GIS) where single swaps only trade memory for time.

The chooser is a pure function of the timeline, the kind, the size and a seeded ``random``:
the same seed gives the same neighbourhoods.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from optpipe.core.idle import idle_gaps
from optpipe.core.problem import Problem
from optpipe.core.schedule import COMPUTE_KINDS
from optpipe.core.semantics import TOLERANCE_MS
from optpipe.core.simulate import Timeline

from .critical import critical_gaps, critical_path

__all__ = ["Neighbourhood", "KINDS", "DEEP", "choose", "deep_applies", "sweep"]

_EPS = TOLERANCE_MS
_INF = float("inf")
_BOTTLENECK_OPS = 10  # a bottleneck window's ops, per op of ``size``
_BEFORE_GAP = 0.75  # of an idle slice's ops, the share that starts before its gap
KINDS = ("sweep", "warm-up", "cool-down", "devices", "idle", "device", "bottleneck", "microbatches")
DEEP = "deep warm-up"  # not among KINDS: the search asks for it by itself (lns.py)
# The deep warm-up: the first DEEP_SIZE x 2 compute ops of every device in one window, 10 s of
# CP-SAT time each, growing by two ops a device (to DEEP_MAX_SIZE x 2) while one gains nothing.
# Below 12 devices the gap to the bound sits in the warm-up, and the usual windows (8 ops a device,
# 4 s) cannot reorder a whole fill: from compile's 60 s answers, one such window with one worker
# took grid04 (p = 6, v = 2, m = 12) from 814.2 ms to 797.9 in 13.6 s, and grid02 (p = 4, v = 3,
# m = 12) from 1,078.5 to 1,073.6 within 30 s (bounds 794.1 and 1,056.3). At most DEEP_SHARE of a
# search's time goes to them: where they find nothing the usual windows still get the rest. With
# one chunk per device the fill is a plain staircase that the usual windows get right, and there
# the deep windows cost: grid08 (p = 8, v = 1) ended 7.5% above its bound with them at every new
# incumbent, 0.3 to 2.5% without.
DEEP_SIZE, DEEP_MAX_SIZE, DEEP_SHARE = 8, 16, 0.5
_DEEP_BELOW_DEVICES = 12


def deep_applies(problem: Problem) -> bool:
    """Whether a search asked for deep warm-up windows uses them: below _DEEP_BELOW_DEVICES (from
    12 on one such window holds hundreds of ops, and W deferral, wdefer.py, works there instead),
    with two or more chunks per device."""
    return problem.devices < _DEEP_BELOW_DEVICES and problem.pipeline.chunks_per_device >= 2


@dataclass(frozen=True)
class Neighbourhood:
    kind: str
    t0: float  # first start in the slice
    t1: float  # end of the free slice (inf: to the end)
    t2: float  # end of the re-timed ops after it (inf: all of them)
    devices: frozenset[int] | None = None  # devices whose ops in [t0, t1) are free; None: all
    microbatches: range | None = None  # microbatches whose ops in [t0, t1) are free; None: all

    def describe(self) -> str:
        where = "" if self.devices is None else " on devices " + ",".join(map(str, sorted(self.devices)))
        if self.microbatches is not None:
            first, last = self.microbatches.start, self.microbatches.stop - 1
            where += f" {first}" if first == last else f" {first}-{last}"
        return f"{self.kind}{where}"


def _starts(timeline: Timeline) -> list[float]:
    return sorted(t.start for t in timeline.timings if t.op.kind in COMPUTE_KINDS)


def _slice(starts: list[float], k: int, count: int, follow: int) -> tuple[float, float, float]:
    k = max(0, min(k, len(starts) - 1))
    t1 = starts[k + count] if k + count < len(starts) else _INF
    t2 = _INF if follow < 0 or k + count + follow >= len(starts) else starts[k + count + follow]
    return starts[k], t1, t2


def _before(starts: list[float], at: float, count: int, ahead: int, follow: int) -> tuple[float, float, float]:
    """The slice of ``count`` ops whose first ``ahead`` start before ``at``."""
    k = next((j for j, s in enumerate(starts) if s >= at - _EPS), len(starts) - 1)
    return _slice(starts, max(0, k - ahead), count, follow)


def sweep(timeline: Timeline, cursor: float, count: int, follow: int) -> tuple[Neighbourhood, float]:
    """The slice of ``count`` compute ops from the first starting at ``cursor`` or later, and the
    next cursor (half-way through it; inf after the last slice)."""
    starts = _starts(timeline)
    k = next((n for n, s in enumerate(starts) if s >= cursor - _EPS), len(starts) - 1)
    t0, t1, t2 = _slice(starts, k, count, follow)
    half = k + max(1, count // 2)
    following = starts[half] if half < len(starts) and t1 != _INF else _INF
    return Neighbourhood("sweep", t0, t1, t2), following


def _neighbours(problem: Problem, device: int) -> list[int]:
    """Devices that exchange data with ``device``: those of the stages next to its stages."""
    pipe = problem.pipeline
    out = set()
    for s in pipe.stages_on(device):
        for other in (s - 1, s + 1):
            if 0 <= other < pipe.stages and pipe.device_of(other) != device:
                out.add(pipe.device_of(other))
    return sorted(out)


def choose(problem: Problem, timeline: Timeline, kind: str, size: int, follow: int,
           rng: random.Random) -> Neighbourhood:
    """A neighbourhood of ``kind`` with about ``size`` free ops per free device."""
    P = problem.devices
    starts = _starts(timeline)
    n = len(starts)
    count = size * P
    if kind in ("warm-up", DEEP):
        t0, t1, t2 = _slice(starts, 0, 2 * count, follow * count)
        return Neighbourhood(kind, t0, t1, t2)
    if kind == "cool-down":
        t0, t1, t2 = _slice(starts, n - 2 * count, 2 * count, -1)
        return Neighbourhood(kind, t0, t1, t2)
    if kind in ("devices", "device"):
        device = rng.randrange(P)
        free = {device}
        if kind == "devices":
            free.add(rng.choice(_neighbours(problem, device) or [device]))
        span = (3 if kind == "devices" else 4) * count
        k = rng.randrange(max(1, n - span // 2))
        t0, t1, t2 = _slice(starts, k, span, follow * count)
        return Neighbourhood(kind, t0, t1, t2, frozenset(free))
    if kind == "bottleneck":
        counts: dict[int, int] = {}
        for t in critical_path(problem, timeline):
            if t.op.kind in COMPUTE_KINDS:
                counts[t.device] = counts.get(t.device, 0) + 1
        if counts:
            device = max(counts, key=lambda d: (counts[d], -d))
            own = sorted(t.start for t in timeline.timings if t.device == device and t.op.kind in COMPUTE_KINDS)
            span = _BOTTLENECK_OPS * size
            if span >= len(own) or rng.random() < 0.5:  # its cool-down
                return Neighbourhood(kind, own[max(0, len(own) - span)], _INF, _INF, frozenset({device}))
            k = rng.randrange(len(own) - span)
            t0, t1 = own[k], own[k + span]
            _, _, t2 = _before(starts, t1, 1, 0, follow * count)
            return Neighbourhood(kind, t0, t1, t2, frozenset({device}))
    if kind == "microbatches":
        span = 4 * count
        k = rng.randrange(max(1, n - span // 2))
        t0, t1, t2 = _slice(starts, k, span, follow * count)
        inside = sorted({t.op.microbatch for t in timeline.timings
                         if t.op.kind in COMPUTE_KINDS and t0 - _EPS <= t.start < t1 - _EPS})
        # about twice ``size`` free ops per device: each microbatch brings 3 v of them at most
        width = max(1, round(2 * size / (3 * problem.pipeline.chunks_per_device)))
        first = rng.choice(inside[:max(1, len(inside) - width + 1)])
        return Neighbourhood(kind, t0, t1, t2, microbatches=range(first, min(first + width, problem.microbatches)))
    if kind == "idle":
        critical = critical_gaps(problem, timeline)
        if critical:
            at = critical[rng.randrange(len(critical))].at
            return Neighbourhood(kind, *_before(starts, at, count, int(_BEFORE_GAP * count), follow * count))
        gaps = sorted(((length, device, timeline.by_op[op].start) for length, device, op, _ in idle_gaps(timeline)),
                      reverse=True)
        if gaps:
            _, _, at = gaps[rng.randrange(min(len(gaps), 2 * P))]
            return Neighbourhood(kind, *_before(starts, at, count, count // 2, follow * count))
    k = rng.randrange(n)
    t0, t1, t2 = _slice(starts, k, count, follow * count)
    return Neighbourhood("random", t0, t1, t2)
