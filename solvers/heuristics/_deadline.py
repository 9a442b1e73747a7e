"""When a heuristic must stop trying variants: compile builds the heuristics within its time limit.

Most generators write an order down and are done in a second even at p = 64, m = 512; those
that try variants (``cost_aware`` and ``cost_aware_v`` list-schedule a dozen orders, and the
V-shapes a dozen reorderings) took 47 s for ZB-I alone there. Under ``building_until`` they
return the fastest variant found when the deadline passes, so a time limit holds; with no
deadline (``optpipe compare``, the tests) every variant is tried, as before.

Compile also gives a peak past which no variant is tried: variants keep the peak of the order
they start from, so one that holds several budgets' worth stays that far out of reach of the
repairs (repair.py starts from the nearest tiers). ZB-I's variants took 18 s at p = 32, v = 2,
m = 256, where it peaks at 2.75 budgets: the heuristics' whole share of a 60 s compile.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

__all__ = ["building_until", "out_of_time", "variants_pay"]

_UNTIL: ContextVar[float] = ContextVar("optpipe_heuristics_until", default=float("inf"))
_PEAK: ContextVar[float] = ContextVar("optpipe_heuristics_peak", default=float("inf"))


@contextmanager
def building_until(deadline: float | None, peak_cap: float | None = None) -> Iterator[None]:
    """Variant searches inside stop at ``deadline`` (time.monotonic()); None: never. Orders
    that peak above ``peak_cap`` (bytes) get no variants; None: every order does."""
    tokens = (_UNTIL.set(float("inf") if deadline is None else deadline),
              _PEAK.set(float("inf") if peak_cap is None else peak_cap))
    try:
        yield
    finally:
        _UNTIL.reset(tokens[0])
        _PEAK.reset(tokens[1])


def variants_pay(peak: int) -> bool:
    """Whether variants of an order that peaks at ``peak`` are worth building."""
    return peak <= _PEAK.get()


def out_of_time() -> bool:
    """Past the deadline: try no further variant, return the best so far."""
    return time.monotonic() > _UNTIL.get()
