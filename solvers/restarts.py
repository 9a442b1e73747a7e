"""Which other warm starts the window search also starts from: a search from one start settles in
that start's basin, and a start of another heuristic's family, nearly as fast, is another basin."""

from __future__ import annotations

from optpipe.core.problem import Problem
from optpipe.core.schedule import Schedule

from .fill_depth import was_deepened
from .result import Judged

__all__ = ["restarts"]

_RESTARTS, _RESTART_WITHIN = 2, 0.05  # the window search also starts from two more warm starts within 5%
# ... below this many devices. From 12 on the window search moves a start by well under 1% in the
# seconds each restart gets, so a start 2% behind never catches up and its share is lost: at 60 s,
# without restarts grid19 (p = 16, m = 64) ended at 6,933.7 and 6,934.0 ms, with them 6,936.7,
# 6,937.6 and 6,940.2; grid14, 16, 17, 20 and 22 moved by under 0.1% either way.
_RESTART_DEVICES = 12


def restarts(problem: Problem, start: Judged, candidates: list[Judged]) -> list[Schedule]:
    """Other fitting warm starts close to the best (within _RESTART_WITHIN), from other heuristics,
    fastest first: the window search spends a share of its time on each (lns.py); none from
    _RESTART_DEVICES devices on."""
    if problem.devices >= _RESTART_DEVICES:
        return []
    seen, out = {_family(start.name)}, []
    for c in sorted((c for c in candidates if c.fits), key=lambda c: c.timeline.makespan):
        kind = _family(c.name)
        if kind in seen or c.timeline.makespan > (1 + _RESTART_WITHIN) * start.timeline.makespan:
            continue
        seen.add(kind)
        out.append(c.schedule)
        if len(out) == _RESTARTS:
            break
    return out


def _family(name: str) -> tuple[str, bool]:
    """A start's heuristic, and whether its fill was deepened (fill_depth.py): a deeper fill is
    another basin for the search. On grid06 (p = 6, v = 3, m = 18) the deepened start (3,042.9 ms,
    against 3,058.2) took the original's place as the only PO-H start and 60 s compiles ended at
    1.94, 3.06 and 2.98% above the bound, against 1.93 to 2.46% from the original in five (a
    search refresh, since taken out, was on in most of them: design.md, "Deeper fills")."""
    return name.split("+")[0], was_deepened(name)
