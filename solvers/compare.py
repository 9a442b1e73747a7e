"""Run every registered heuristic on a problem and judge each with the simulator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from optpipe.core.errors import NotApplicable
from optpipe.core.problem import Problem
from optpipe.core.simulate import simulate

from .heuristics._deadline import building_until, out_of_time
from .registry import generate, generators
from .result import Judged, fastest_fitting

__all__ = ["Entry", "compare", "applicable", "best_fitting"]

_LEFT_OUT = "not built: the time limit ran out first (a longer --time-limit builds it)"
_NOT_JUDGED = {"makespan_ms": None, "bubble_ratio": None, "peak_memory_bytes": None, "host_peak_bytes": None,
               "fits_budget": False}


@dataclass(frozen=True)
class Entry:
    """One heuristic in the comparison: judged, or the reason it does not apply."""

    name: str
    judged: Judged | None  # None when the heuristic does not apply
    reason: str = ""  # why it does not apply

    @property
    def applicable(self) -> bool:
        return self.judged is not None

    @property
    def fits(self) -> bool:
        return self.judged is not None and self.judged.fits

    def to_json(self) -> dict:
        view = {"name": self.name, "applicable": self.applicable, "reason": self.reason}
        view.update(self.judged.to_json() if self.judged is not None else _NOT_JUDGED)
        return view


def _order(entry: Entry) -> tuple:
    if entry.judged is None:
        return (2, 0.0, entry.name)
    return (0 if entry.fits else 1, entry.judged.makespan_ms, entry.name)


def compare(problem: Problem, names: list[str] | None = None, *, deadline: float | None = None,
            peak_cap: float | None = None, on_built: Callable[[Entry, int, int], None] | None = None) -> list[Entry]:
    """Every heuristic (or the named ones): fitting first, fastest first, then the misfits, then n/a.

    The cheaper generators are built first (``Generator.effort``; the slow capped fallbacks last
    of theirs). With ``deadline`` (time.monotonic(); compile's share of its time limit) variant
    searches stop at it with the fastest variant found (heuristics/_deadline.py), and once it
    has passed the generators not yet started are left out, listed with the reason, but only
    when one built already fits: the deadline never costs the only schedule that fits. Orders
    that peak above ``peak_cap`` (bytes) are built without their variants (_deadline.py).
    ``on_built(entry, k, n)``: called after each, for live progress."""
    order = sorted(generators(), key=lambda g: (g.effort, g.fallback))
    chosen = [g for g in order if names is None or g.name in names]
    entries: list[Entry] = []
    with building_until(deadline, peak_cap):
        for k, generator in enumerate(chosen):
            if out_of_time() and any(e.fits for e in entries):
                entry = Entry(generator.name, None, _LEFT_OUT)
            else:
                entry = _built(problem, generator.name)
            entries.append(entry)
            if on_built is not None:
                on_built(entry, k + 1, len(chosen))
    return sorted(entries, key=_order)


def _built(problem: Problem, name: str) -> Entry:
    try:
        schedule = generate(name, problem)
    except NotApplicable as why:
        return Entry(name, None, str(why))
    return Entry(name, Judged(name, schedule, simulate(problem, schedule)))


def applicable(entries: list[Entry]) -> list[Judged]:
    """The heuristics that apply, in the comparison's order."""
    return [e.judged for e in entries if e.judged is not None]


def best_fitting(entries: list[Entry]) -> Judged | None:
    """The fastest heuristic that fits."""
    return fastest_fitting(applicable(entries))
