"""What every exact solver returns: a schedule, re-simulated, with its proof of quality."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from optpipe.core.schedule import Schedule
from optpipe.core.simulate import Timeline

__all__ = ["gap", "SolveStatus", "SolveResult", "Progress"]


def gap(makespan_ms: float | None, bound_ms: float | None) -> float | None:
    """How far a makespan may be above the optimum, as a share of it: (makespan - bound) / makespan,
    never negative; None when either is unknown or the makespan is not positive."""
    if makespan_ms is None or bound_ms is None or makespan_ms <= 0:
        return None
    return max(0.0, (makespan_ms - bound_ms) / makespan_ms)


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
        return gap(self.makespan_ms, self.lower_bound_ms)
