"""The integer time grid of both exact models (CP-SAT and MILP), and why its answers are safe.

Exact models need integer times. A grid is a unit of time; every duration and lag becomes a
whole number of units by rounding UP (``Grid.up``), never to nearest. The unit is chosen here,
once, for both models; they differ only in how many units a makespan may span (CP-SAT is happy
with 2^40, a MILP's big-M rows are not).

Exact grids. The greatest common divisor of every duration and lag, as fractions, divides them
all: then a model's start times are the simulator's, to the last digit. Compute and p2p times
are often decimals of a millisecond and transfers bytes x 1000 / bandwidth, so the unit is
about 1/12,000,000 ms for 24 GB/s links: a makespan of seconds is ~1e10 units, fine for
CP-SAT. Measured costs (``optpipe profile``) have sixteen digits and no useful common unit.

Rounded grids: safe by construction, not exact. Then a decimal unit is used and:

1. every duration and lag is rounded up, so a model solution, decoded into lists and timed by
   the simulator with the true durations, runs every op no later than the model says (the model's
   times satisfy every wait of the simulator's recurrence, whose least solution the simulator
   computes). So the simulated makespan is at most the model's objective, and every release of
   memory (always at an op's end) happens no later than in the model;
2. running early can still bring an allocation (always at an op's start) before a release
   it followed in the model. Not when the release is a compute op's end: an F starts after
   every compute op listed before it on its device, and a reload after the compute op it is
   issued behind, which ended by its start in the model; decoding keeps both orders. A
   transfer's release (an offload's device copy, a reload's host copy) is ordered with nothing
   on another channel, so there the models keep a margin. Both start every op right after
   something it waits for (the "tight" or as-soon-as-possible rule); along such a chain of
   waits each op runs early by at most its own rounding, so no op runs earlier than modelled
   by more than ``slack_ms``, the sum of the rounding of every op and lag of the problem. A
   transfer's release is therefore held ``slack`` units past its modelled end (the MILP
   keeps the margin in every memory claim). Any schedule the model accepts re-simulates
   within budget.

The price is that a rounded model proves no optimum and, with its padding, may miss a schedule
that fits only by a hair; the unit is chosen fine enough that the padding stays under
``SLACK_SHARE`` of the makespan's lower bound where the model's size allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import TOLERANCE_MS, duration_ms, exact_ms

from .bounds import makespan_lower_bound

__all__ = ["Grid", "choose_grid", "CPSAT_MAX_UNITS", "MILP_MAX_UNITS", "SLACK_SHARE"]

_LADDER = (1.0, 0.5, 0.25, 0.2, 0.1, 0.05, 0.025, 0.02, 0.01, 0.005, 0.0025, 0.002, 0.001,
           5e-4, 2e-4, 1e-4, 5e-5, 2e-5, 1e-5, 5e-6, 2e-6, 1e-6)
CPSAT_MAX_UNITS = 2**40  # a makespan (4x its lower bound) in CP-SAT's units stays below this
MILP_MAX_UNITS = 2**18  # the MILP's big-M rows lose precision on longer horizons
SLACK_SHARE = 1e-3  # of the makespan's lower bound: how much padding a rounded grid may add


@dataclass(frozen=True)
class Grid:
    """One unit is ``resolution_ms``; ``slack`` units is how much earlier than modelled an op may run."""

    resolution_ms: float
    exact: bool  # every duration and lag is a whole number of units: model times are the simulator's
    slack: int  # allocations are taken this many units before the modelled start (0 when exact)
    rounding: float  # the largest relative growth of a duration by rounding up
    floor: bool = False  # durations and lags rounded down: a relaxation, for bounds (floor_relax.py)

    def floored(self) -> Grid:
        """This unit with every duration and lag rounded down and no release held late: a model
        on it is a relaxation of the problem, so what it proves bounds every schedule."""
        return Grid(self.resolution_ms, False, 0, self.rounding, floor=True)

    def length(self, ms: float) -> int:
        """A duration or lag in whole units: rounded up (schedules that re-simulate within the
        model), or on a floor grid down (bounds)."""
        return self.down(ms) if self.floor else self.up(ms)

    def up(self, ms: float) -> int:
        """Whole units, rounded up; a value within float noise of a whole unit is that unit."""
        return self._whole(ms, math.ceil)

    def down(self, ms: float) -> int:
        """Whole units, rounded down: for bounds that must not cut off a model solution."""
        return self._whole(ms, math.floor)

    def _whole(self, ms: float, rounding) -> int:
        quotient = ms / self.resolution_ms
        nearest = round(quotient)
        if abs(quotient - nearest) <= TOLERANCE_MS * max(1.0, abs(quotient)):
            return int(nearest)
        return rounding(quotient)

    def ms(self, units: float) -> float:
        return units * self.resolution_ms

    @property
    def slack_ms(self) -> float:
        return self.slack * self.resolution_ms

    def describe(self) -> str:
        if self.floor:
            return f"time unit {self.resolution_ms:g} ms with durations rounded down (a relaxation, for bounds)"
        if self.exact:
            return (f"time unit {self.resolution_ms:.4g} ms divides every duration exactly; "
                    f"the model's times are the simulator's")
        return (f"time unit {self.resolution_ms:g} ms with durations rounded up (by at most "
                f"{self.rounding:.2%}); transfer releases held {self.slack_ms:.3g} ms")


_PARTS = (OpKind.F, OpKind.B, OpKind.W, OpKind.OFFLOAD, OpKind.RELOAD)  # BW is B + W: whole when they are


def _lengths(problem: Problem, kinds=tuple(OpKind)) -> list[tuple[float, int]]:
    """Every distinct duration and lag in ms, with how many times it can occur in one schedule."""
    m, counts = problem.microbatches, {}
    if not problem.offload.enabled:
        kinds = [kind for kind in kinds if kind not in (OpKind.OFFLOAD, OpKind.RELOAD)]
    if not problem.recompute.enabled:
        kinds = [kind for kind in kinds if kind is not OpKind.RECOMPUTE]
    for s in range(problem.stages):
        for kind in kinds:
            length = duration_ms(problem, Op(kind, s, 0))
            counts[length] = counts.get(length, 0) + m
    if problem.costs.p2p > 0:  # at most one lag into each F and each backward
        counts[problem.costs.p2p] = counts.get(problem.costs.p2p, 0) + 2 * m * problem.stages
    return [(length, count) for length, count in counts.items() if length > 0]


def _exact_lengths(problem: Problem) -> list[Fraction]:
    """The durations of F, B, W and transfers, and the lag, as exact fractions (semantics.exact_ms)."""
    kinds = _PARTS if problem.offload.enabled else _PARTS[:3]
    if problem.recompute.enabled:
        kinds = kinds + (OpKind.RECOMPUTE,)
    values = {exact_ms(problem, Op(kind, s, 0)) for kind in kinds for s in range(problem.stages)}
    if problem.costs.p2p > 0:
        values.add(Fraction(repr(problem.costs.p2p)))
    return [v for v in values if v > 0]


def _gcd(values: list[Fraction]) -> Fraction:
    """The largest unit that divides every value."""
    denominator = math.lcm(*(v.denominator for v in values))
    return Fraction(math.gcd(*(int(v * denominator) for v in values)), denominator)


def _grid(resolution_ms: float, lengths: list[tuple[float, int]]) -> Grid:
    probe = Grid(resolution_ms, True, 0, 0.0)
    excess = [(probe.ms(probe.up(length)) - length, length, count) for length, count in lengths]
    exact = all(probe.up(length) * resolution_ms - length <= TOLERANCE_MS * max(1.0, length)
                for length, _ in lengths)
    if exact:
        return probe
    slack_ms = sum(max(0.0, extra) * count for extra, _, count in excess)
    rounding = max((max(0.0, extra) / length for extra, length, _ in excess), default=0.0)
    return Grid(resolution_ms, False, probe.up(slack_ms) + 1, rounding)


def choose_grid(problem: Problem, resolution_ms: float | None = None, *, max_units: int = CPSAT_MAX_UNITS) -> Grid:
    """The exact grid when a makespan fits in ``max_units`` on it; else the coarsest decimal unit
    whose padding stays under SLACK_SHARE of the lower bound (or the finest that fits).

    ``resolution_ms`` forces a unit (tests; a rounded one is still safe).
    """
    lengths = _lengths(problem)
    if not lengths:
        return Grid(1.0, True, 0, 0.0)
    if resolution_ms is not None:
        return _grid(resolution_ms, lengths)
    span = 4 * max(makespan_lower_bound(problem).value, 1e-3)
    unit = _gcd(_exact_lengths(problem))
    if span <= max_units * unit:
        return _grid(float(unit), lengths)
    chosen = None
    for step in _LADDER:
        if span > max_units * step:
            break
        chosen = _grid(step, lengths)
        if chosen.exact or chosen.slack_ms <= SLACK_SHARE * span / 4:
            return chosen
    return chosen if chosen is not None else _grid(_LADDER[0], lengths)
