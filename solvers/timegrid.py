"""The integer time grid the exact models work on, and how far it is from real time.

Exact models need integer times. The best grid is one in which every duration is a whole
number of units: then a model's start times are exactly what the simulator computes. Compute
and p2p times are decimals of a millisecond; a transfer takes bytes x 1000 / bandwidth ms, a
fraction. The greatest common divisor of all of them, as fractions, is such a unit: about
1/12,000,000 ms for 24 GB/s links, so a makespan of seconds is ~1e10 units, far inside 64-bit
integers. When even that is too fine (odd bandwidths), compute stays exact on a decimal grid and
transfers are rounded up: pessimistic about transfers, never optimistic, and refined until one
device's transfers together lose at most 0.1% of the makespan's lower bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from optpipe.compiler.problem import Problem

from .bounds import makespan_lower_bound

__all__ = ["Grid", "choose_grid"]

_DECIMALS = (1.0, 0.5, 0.25, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001)
_TOLERANCE = 1e-9  # relative: float noise in a ratio that should be whole
_MAX_UNITS = 2**40  # largest makespan, in units, for which the exact grid is used


@dataclass(frozen=True)
class Grid:
    """One unit is ``resolution_ms``."""

    resolution_ms: float
    exact: bool  # every duration, transfers included, is a whole number of units
    rounding_bound_ms: float  # how far the model's makespan can be from the simulated one
    transfer_rounding_ms: float  # the most one transfer is lengthened by rounding up

    def units(self, ms: float) -> int:
        return int(round(ms / self.resolution_ms))

    def up(self, ms: float) -> int:
        return int(math.ceil(ms / self.resolution_ms - _TOLERANCE))

    def ms(self, units: float) -> float:
        return units * self.resolution_ms

    def describe(self) -> str:
        if self.exact:
            return (f"time unit {self.resolution_ms:.4g} ms divides every duration exactly; "
                    f"the model's times are the simulator's")
        return (f"time unit {self.resolution_ms:g} ms; transfers rounded up by at most "
                f"{self.transfer_rounding_ms:.3g} ms each; makespan exact to {self.rounding_bound_ms:.3g} ms")


def _durations(problem: Problem) -> tuple[list[Fraction], list[Fraction]]:
    """Compute and p2p times, and transfer times, as exact fractions of a millisecond."""
    costs = problem.costs
    compute = [Fraction(repr(d)) for d in (*costs.forward, *costs.backward_input, *costs.backward_weight)]
    if costs.p2p > 0:
        compute.append(Fraction(repr(costs.p2p)))
    transfers = []
    if problem.offload.enabled:
        for bandwidth in (problem.offload.d2h_bandwidth, problem.offload.h2d_bandwidth):
            rate = Fraction(repr(bandwidth))
            transfers += [Fraction(a * 1000) / rate for a in sorted(set(problem.memory.activation))]
    return compute, transfers


def _gcd(values: list[Fraction]) -> Fraction:
    """The largest unit that divides every value."""
    denominator = math.lcm(*(v.denominator for v in values))
    return Fraction(math.gcd(*(int(v * denominator) for v in values)), denominator)


def _whole(value: float, resolution: float) -> bool:
    q = value / resolution
    return abs(q - round(q)) <= _TOLERANCE * max(1.0, abs(q))


def _round_up_error(durations: list[float], resolution: float) -> float:
    return max((math.ceil(d / resolution - _TOLERANCE) * resolution - d for d in durations), default=0.0)


def choose_grid(problem: Problem, resolution_ms: float | None = None) -> Grid:
    """The exact grid when the makespan stays below 2^40 units on it, else a decimal one."""
    compute, transfers = _durations(problem)
    lower = makespan_lower_bound(problem).value
    floats = [float(t) for t in transfers]
    if resolution_ms is None:
        unit = _gcd(compute + transfers)
        if _MAX_UNITS * unit >= 4 * Fraction(repr(max(lower, 1e-3))):
            resolution_ms = float(unit)
    if resolution_ms is None:
        per_device = 2 * problem.pipeline.chunks_per_device * problem.microbatches
        resolution_ms = next((r for r in _DECIMALS if all(_whole(float(d), r) for d in compute)), _DECIMALS[-1])
        for r in _DECIMALS:
            if r > resolution_ms or not _whole(resolution_ms, r):
                continue
            resolution_ms = r
            if _round_up_error(floats, r) * per_device <= 1e-3 * lower:
                break
    exact_compute = all(_whole(float(d), resolution_ms) for d in compute)
    exact = exact_compute and all(_whole(d, resolution_ms) for d in floats)
    # With compute exact the model's makespan is the simulator's; otherwise each compute op on
    # a path can be off by half a unit.
    bound = 0.0 if exact_compute else resolution_ms / 2 * problem.microbatches * problem.stages * 3
    return Grid(resolution_ms, exact, bound, 0.0 if exact else _round_up_error(floats, resolution_ms))
