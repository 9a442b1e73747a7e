"""What the solvers hand on: a judged schedule, what an exact solver adds to it, and the gap.

Every schedule a solver, warm start or heuristic produces is judged by the simulator before
anyone compares it; ``Judged`` is that pair with its name. The heuristics' comparison
(compare.Entry), the window search (lns.Search), a solver's answer (``SolveResult``) and
compile's verdict (compile.Compiled) add their own few fields around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Iterator

from optpipe.core.schedule import Schedule
from optpipe.core.simulate import Timeline

__all__ = ["Judged", "fastest_fitting", "one_per_compute_order", "gap", "SolveStatus", "SolveResult", "Progress"]


def gap(makespan_ms: float | None, bound_ms: float | None) -> float | None:
    """How far a makespan may be above the optimum, as a share of it: (makespan - bound) / makespan,
    never negative; None when either is unknown or the makespan is not positive."""
    if makespan_ms is None or bound_ms is None or makespan_ms <= 0:
        return None
    return max(0.0, (makespan_ms - bound_ms) / makespan_ms)


@dataclass(frozen=True)
class Judged:
    """A named schedule with the simulator's verdict on it: the numbers we compare and report."""

    name: str  # "ZB-H2", "ZB-H2+offload", "1F1B-I+W(1.5)+hidden-offload", "cpsat", ...
    schedule: Schedule
    timeline: Timeline  # simulate(problem, schedule)

    @property
    def makespan_ms(self) -> float:
        return self.timeline.makespan

    @property
    def fits(self) -> bool:
        return self.timeline.fits

    @property
    def peak(self) -> int:
        return self.timeline.peak

    def to_json(self) -> dict:
        t = self.timeline
        return {
            "name": self.name,
            "makespan_ms": t.makespan,
            "bubble_ratio": t.bubble_ratio,
            "peak_memory_bytes": list(t.peak_memory),
            "host_peak_bytes": max(t.host_peak),
            "fits_budget": t.fits,
        }


def fastest_fitting(judged: Iterable[Judged]) -> Judged | None:
    """The fastest that fits (ties: the first listed, so a plain heuristic beats its variants)."""
    fitting = [j for j in judged if j.fits]
    return min(fitting, key=lambda j: j.timeline.makespan) if fitting else None


def one_per_compute_order(judged: Iterable[Judged]) -> Iterator[Judged]:
    """The first of each compute order, in the order given: variants that differ only in their
    transfers are one start to a pass that reorders compute (defer_starts.py, fill_depth.py)."""
    seen = set()
    for j in judged:
        order = j.schedule.compute_only().devices
        if order not in seen:
            seen.add(order)
            yield j


class SolveStatus(str, Enum):
    OPTIMAL = "optimal"  # proven: makespan equals the lower bound (to the resolution)
    FEASIBLE = "feasible"  # a fitting schedule, not proven optimal within the time limit
    NO_IMPROVEMENT = "no_improvement"  # time limit hit; the best fitting heuristic is returned
    INFEASIBLE = "infeasible"  # proven: nothing fits the budget


@dataclass(frozen=True)
class Progress:
    """One live update while solving; solvers call ``on_progress(Progress)`` when they learn something."""

    elapsed_s: float
    incumbent_ms: float | None
    bound_ms: float | None
    message: str = ""

    @property
    def gap(self) -> float | None:
        return gap(self.incumbent_ms, self.bound_ms)


@dataclass(frozen=True)
class SolveResult:
    """An exact solver's answer with its proof of quality.

    It keeps ``schedule`` and ``timeline`` as separate fields (``judged`` is the pair) because a
    solver may end with no schedule and because cpsat.py and milp.py build it field by field.
    """

    solver: str  # "cpsat", "milp-highs", "milp-cbc", "heuristic:NAME"
    status: SolveStatus
    schedule: Schedule | None
    timeline: Timeline | None  # the simulator's verdict on ``schedule``: the numbers we report
    objective_ms: float | None  # the solver's own makespan, in ms (resolution-rounded)
    lower_bound_ms: float  # the larger of the analytic bound and the solver's bound
    solve_time_s: float
    resolution_ms: float  # one time unit of the integer model

    @property
    def judged(self) -> Judged | None:
        """The answer under the solver's name, when there is one."""
        if self.schedule is None or self.timeline is None:
            return None
        return Judged(self.solver, self.schedule, self.timeline)

    @property
    def makespan_ms(self) -> float | None:
        return self.timeline.makespan if self.timeline else None

    @property
    def gap(self) -> float | None:
        return gap(self.makespan_ms, self.lower_bound_ms)
