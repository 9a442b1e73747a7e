"""Two window searches that share their incumbents (portfolio.py), seen from one of them.

Each search runs in its own process on its own core, with its own seed. Whenever one finds a
better schedule it offers it; the other picks it up between neighbourhoods and goes on from it,
so the pair moves like one search that solves two neighbourhoods at a time. Messages go through
queues (a feeder thread sends them), so an offer never blocks a search on its peer.

Messages are tuples: ("incumbent", score, schedule), ("done", score, schedule, solved, improved),
("failed", text) and ("stop",).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from optpipe.core.schedule import Schedule

__all__ = ["Peer"]

_OFFER_EVERY_S = 0.5  # a search that keeps improving offers its incumbent at most this often


@dataclass
class Peer:
    """One end of the exchange: ``inbox`` holds the other search's messages, ``outbox`` takes ours."""

    inbox: Any  # a multiprocessing queue
    outbox: Any
    stopped: bool = False
    done: tuple | None = None  # the other search's "done" or "failed" message, once it came
    _offered: tuple[float, float] | None = None
    _offered_at: float = field(default=-1e9)
    _pending: tuple | None = None  # an incumbent held back by the rate limit

    def offer(self, score: tuple[float, float], schedule: Schedule) -> None:
        """Send ``schedule`` when it beats what was sent before (at most every _OFFER_EVERY_S;
        a held-back one goes with the next call to ``offer`` or ``flush``)."""
        if self._offered is not None and score >= self._offered:
            return
        self._pending = (score, schedule)
        if time.monotonic() - self._offered_at >= _OFFER_EVERY_S:
            self.flush()

    def adopted(self, score: tuple[float, float]) -> None:
        """The search went on from the other's incumbent: no need to send it back."""
        if self._offered is None or score < self._offered:
            self._offered, self._pending = score, None

    def flush(self) -> None:
        if self._pending is None:
            return
        score, schedule = self._pending
        self.outbox.put(("incumbent", score, schedule))
        self._offered, self._offered_at, self._pending = score, time.monotonic(), None

    def received(self) -> tuple[tuple[float, float], Schedule] | None:
        """The best incumbent the other search sent since the last call, if any; notes a stop or
        the other search's end on the way."""
        best = None
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return best
            best = self._take(message, best)

    def wait(self, ended: Callable[[], bool], until: float, alive: Callable[[], bool] = lambda: True) -> None:
        """Read messages until ``ended()`` (a stop or the other's end came), ``until`` (monotonic s)
        passes, or the other side is no longer ``alive()`` with nothing left to read."""
        while not ended() and time.monotonic() < until:
            try:
                message = self.inbox.get(timeout=max(0.01, min(0.5, until - time.monotonic())))
            except queue.Empty:
                if not alive():
                    return
                continue
            self._take(message, None)

    def _take(self, message: tuple, best: tuple | None) -> tuple | None:
        """Note a stop or an end; return the better of ``best`` and an incumbent."""
        kind = message[0]
        if kind == "stop":
            self.stopped = True
        elif kind in ("done", "failed"):
            self.done = message
        elif kind == "incumbent" and (best is None or message[1] < best[0]):
            return (message[1], message[2])
        return best
