"""A deadline that a loop of costly steps keeps: no step is begun that the longest so far would
carry past it. Checking the clock only before each step lets the last one run over by a whole
step: at p = 32, m = 256 a simulation takes about 0.4 s, and a W deferral round (a move, its
retries and the reloads moved for room) over two seconds at p = 32, m = 64."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

__all__ = ["Clock"]

T = TypeVar("T")


class Clock:
    def __init__(self, deadline: float | None, least_s: float = 0.0):
        self.deadline = float("inf") if deadline is None else deadline  # monotonic s; None: none
        self.longest = least_s  # s, the longest step so far, or what a step takes at least

    def allows(self) -> bool:
        """Whether a step begun now, as long as the longest so far, ends by the deadline."""
        return time.monotonic() + self.longest < self.deadline

    def timed(self, step: Callable[..., T], *args) -> T:
        """``step(*args)``, its time counted."""
        began = time.monotonic()
        try:
            return step(*args)
        finally:
            self.longest = max(self.longest, time.monotonic() - began)
