"""When a heuristic must stop trying variants: compile builds the heuristics within its time limit.

Most generators write an order down and are done in a second even at p = 64, m = 512; those
that try variants (``cost_aware`` and ``cost_aware_v`` list-schedule a dozen orders, and the
V-shapes a dozen reorderings) took 47 s for ZB-I alone there. Under ``building_until`` they
return the fastest variant found when the deadline passes, so a time limit holds; with no
deadline (``optpipe compare``, the tests) every variant is tried, as before.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

__all__ = ["building_until", "out_of_time"]

_UNTIL: ContextVar[float] = ContextVar("optpipe_heuristics_until", default=float("inf"))


@contextmanager
def building_until(deadline: float | None) -> Iterator[None]:
    """Variant searches inside stop at ``deadline`` (time.monotonic()); None: never."""
    token = _UNTIL.set(float("inf") if deadline is None else deadline)
    try:
        yield
    finally:
        _UNTIL.reset(token)


def out_of_time() -> bool:
    """Past the deadline: try no further variant, return the best so far."""
    return time.monotonic() > _UNTIL.get()
