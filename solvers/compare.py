"""Run every registered heuristic on a problem and judge each with the simulator."""

from __future__ import annotations

from dataclasses import dataclass

from optpipe.core.errors import NotApplicable
from optpipe.core.problem import Problem
from optpipe.core.schedule import Schedule
from optpipe.core.simulate import Timeline, simulate

from .registry import generate, generators

__all__ = ["Entry", "compare", "best_fitting"]


@dataclass(frozen=True)
class Entry:
    name: str
    schedule: Schedule | None
    timeline: Timeline | None
    reason: str = ""  # why it does not apply

    @property
    def applicable(self) -> bool:
        return self.timeline is not None

    @property
    def fits(self) -> bool:
        return self.timeline is not None and self.timeline.fits

    def to_json(self) -> dict:
        t = self.timeline
        return {
            "name": self.name,
            "applicable": self.applicable,
            "reason": self.reason,
            "makespan_ms": t.makespan if t else None,
            "bubble_ratio": t.bubble_ratio if t else None,
            "peak_memory_bytes": list(t.peak_memory) if t else None,
            "host_peak_bytes": max(t.host_peak) if t else None,
            "fits_budget": t.fits if t else False,
        }


def _order(entry: Entry) -> tuple:
    if entry.timeline is None:
        return (2, 0.0, entry.name)
    return (0 if entry.fits else 1, entry.timeline.makespan, entry.name)


def compare(problem: Problem, names: list[str] | None = None) -> list[Entry]:
    """Every heuristic (or the named ones): fitting first, fastest first, then the misfits, then n/a."""
    entries = []
    for generator in generators():
        if names is not None and generator.name not in names:
            continue
        try:
            schedule = generate(generator.name, problem)
        except NotApplicable as why:
            entries.append(Entry(generator.name, None, None, str(why)))
            continue
        entries.append(Entry(generator.name, schedule, simulate(problem, schedule)))
    return sorted(entries, key=_order)


def best_fitting(entries: list[Entry]) -> Entry | None:
    fitting = [e for e in entries if e.fits]
    return min(fitting, key=lambda e: e.timeline.makespan) if fitting else None
