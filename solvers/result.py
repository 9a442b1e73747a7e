"""What every exact solver returns: a schedule, re-simulated, with its proof of quality."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from optpipe.core.schedule import Schedule
from optpipe.core.simulate import Timeline

__all__ = ["SolveStatus", "SolveResult", "Progress"]


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
        if self.incumbent_ms is None or self.bound_ms is None or self.incumbent_ms <= 0:
            return None
        return max(0.0, (self.incumbent_ms - self.bound_ms) / self.incumbent_ms)


@dataclass(frozen=True)
class SolveResult:
    solver: str  # "cpsat", "milp-highs", "milp-cbc", "heuristic:NAME"
    status: SolveStatus
    schedule: Schedule | None
    timeline: Timeline | None  # the simulator's verdict on ``schedule``: the numbers we report
    objective_ms: float | None  # the solver's own makespan, in ms (resolution-rounded)
    lower_bound_ms: float  # the larger of the analytic bound and the solver's bound
    solve_time_s: float
    resolution_ms: float  # one time unit of the integer model

    @property
    def makespan_ms(self) -> float | None:
        return self.timeline.makespan if self.timeline else None

    @property
    def gap(self) -> float | None:
        if self.timeline is None or self.timeline.makespan <= 0:
            return None
        return max(0.0, (self.timeline.makespan - self.lower_bound_ms) / self.timeline.makespan)
