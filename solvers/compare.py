"""Run every registered heuristic on a problem and judge each with the simulator."""

from __future__ import annotations

from dataclasses import dataclass

from optpipe.core.errors import NotApplicable
from optpipe.core.problem import Problem
from optpipe.core.simulate import simulate

from .registry import generate, generators
from .result import Judged, fastest_fitting

__all__ = ["Entry", "compare", "applicable", "best_fitting"]

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


def compare(problem: Problem, names: list[str] | None = None) -> list[Entry]:
    """Every heuristic (or the named ones): fitting first, fastest first, then the misfits, then n/a."""
    entries = []
    for generator in generators():
        if names is not None and generator.name not in names:
            continue
        try:
            schedule = generate(generator.name, problem)
        except NotApplicable as why:
            entries.append(Entry(generator.name, None, str(why)))
            continue
        entries.append(Entry(generator.name, Judged(generator.name, schedule, simulate(problem, schedule))))
    return sorted(entries, key=_order)


def applicable(entries: list[Entry]) -> list[Judged]:
    """The heuristics that apply, in the comparison's order."""
    return [e.judged for e in entries if e.judged is not None]


def best_fitting(entries: list[Entry]) -> Judged | None:
    """The fastest heuristic that fits."""
    return fastest_fitting(applicable(entries))
