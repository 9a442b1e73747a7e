"""Deeper fills: more first-chunk forwards on every device before its second chunk begins.

With two or more chunks per device, a device's first forward of its second chunk waits for
microbatch 0 to pass every device once, a data chain as long as the pipeline; until then the
device can only run first-chunk forwards of later microbatches. The heuristics list as few of
those as their memory rule allows (PO-H, GIS), so the last devices idle in the fill, and windows
of a few ops per device cannot deepen a fill: it takes every device at once. Here the fastest
fitting starts get ``extra`` more first-chunk forwards listed ahead of each device's second chunk,
then their activations offloaded (the two ways of warmstart.py); those that fit join the starts.
Only orders faster than the fastest fitting start before offloading are offloaded: offloading
never makes a schedule faster (grid09, p = 8, v = 2, m = 24: 2.3 s for nothing before that rule,
1.1 s after).

On grid04 (p = 6, v = 2, m = 12, k = 0.6) PO-H + W(1) + offload takes 837.1 ms; with two more
forwards and offloaded again, 820.8. The window search from it reached 797.1 ms (bound 794.1) in
both of two 48 s runs, where compile at 60 s, from 837.1, ended between 806.8 and 823.1 in five
(those runs had a search refresh on that was then taken out: design.md, "Deeper fills").
Only below _BELOW_DEVICES devices: on grid14 (p = 12) the fastest deepened start took 1,490.0
ms against the W-deferred start's 1,446.4, and at p = 32 (grid24) listing more first-chunk
forwards overflowed and gained nothing (design.md, "Why no steady-state block solver").
"""

from __future__ import annotations

import time
from itertools import islice

from optpipe.core.errors import ScheduleError
from optpipe.core.problem import Problem
from optpipe.core.schedule import OpKind, Schedule
from optpipe.core.simulate import simulate

from .result import Judged, one_per_compute_order
from .warmstart import offloaded_variants

__all__ = ["deeper_fills", "deepened", "fill_depth_applies", "was_deepened"]

_BELOW_DEVICES = 12  # measured to pay below this many devices only, where the window search runs long
_STARTS = 4  # the fastest fitting starts of different compute orders deepened
_MOST_EXTRA = 4  # up to this many more first-chunk forwards a device
_MARK = "+fill("  # in a deepened schedule's name: "+fill(2)", two more a device


def fill_depth_applies(problem: Problem) -> bool:
    """Whether compile tries deeper fills on ``problem`` (see the module docstring)."""
    return problem.devices < _BELOW_DEVICES and problem.pipeline.chunks_per_device >= 2


def deepened(schedule: Schedule, extra: int) -> Schedule:
    """``schedule``'s compute ops with each device's next ``extra`` first-chunk forwards (of its
    lowest stage) moved ahead of its first forward of another chunk; transfers are dropped (the
    caller places them again). A device whose first chunk has no forwards left there keeps its
    order."""
    rows = []
    for ops in schedule.compute_only().devices:
        ops = list(ops)
        first = min((op.stage for op in ops), default=0)
        turn = next((n for n, op in enumerate(ops) if op.kind is OpKind.F and op.stage != first), None)
        if turn is None:
            rows.append(ops)
            continue
        later = [n for n in range(turn + 1, len(ops)) if ops[n].kind is OpKind.F and ops[n].stage == first][:extra]
        moved = set(later)
        rest = [op for n, op in enumerate(ops) if n not in moved]
        rows.append(rest[:turn] + [ops[n] for n in later] + rest[turn:])
    return Schedule.of(f"{schedule.name}{_MARK}{extra})", rows)


def was_deepened(name: str) -> bool:
    """Whether the start of this name had its fill deepened here (or came from one that had)."""
    return _MARK in name


def deeper_fills(problem: Problem, candidates: list[Judged], deadline: float | None = None) -> list[Judged]:
    """The fitting schedules made from the fastest fitting candidates (_STARTS of different
    compute orders) by deepening their fills 1 to _MOST_EXTRA forwards, as they are or offloaded;
    none where ``fill_depth_applies`` says no, and no more once ``deadline`` (monotonic s) passes."""
    if not fill_depth_applies(problem):
        return []
    out: list[Judged] = []
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: c.timeline.makespan)
    fastest = fitting[0].timeline.makespan if fitting else float("inf")
    for start in islice(one_per_compute_order(fitting), _STARTS):
        order = start.schedule.compute_only().devices
        for extra in range(1, _MOST_EXTRA + 1):
            if deadline is not None and time.monotonic() > deadline:
                return out
            schedule = deepened(start.schedule, extra)
            if schedule.devices == order:
                break  # no device had a first-chunk forward left to move
            try:
                timeline = simulate(problem, schedule)
            except ScheduleError:  # an order the data cannot follow is simply not a start
                break
            if timeline.makespan >= fastest:
                continue  # no faster than the fastest start before offloading, which never makes one faster
            plain = Judged(schedule.name, schedule, timeline)
            variants = offloaded_variants(problem, schedule.name, schedule, timeline, deadline) \
                if problem.offload.enabled else []
            out += [j for j in (plain, *variants) if j.fits]
    return out
