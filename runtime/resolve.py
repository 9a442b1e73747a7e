"""The background half of online improvement: solve the measured problem, lower it, say what it gains.

It needs no torch: the solver process works on plain data and touches no accelerator.
"""

from __future__ import annotations

from optpipe.plan.bytecode import encode
from optpipe.plan.lower import lower, raise_schedule
from optpipe.core.problem import Problem
from optpipe.core.simulate import simulate
from optpipe.plan.program import Program
from optpipe.solvers.compile import compile_problem

__all__ = ["resolve"]


def resolve(problem: Problem, current: Program, solver: str, time_limit_s: float) -> tuple[bytes, str, float, float]:
    """In the background process: (plan bytes, schedule name, predicted new ms, predicted current ms)."""
    compiled = compile_problem(problem, solver=solver, time_limit_s=time_limit_s, workers=1)
    before = simulate(problem, raise_schedule(current)).makespan
    return encode(lower(problem, compiled.judged.schedule)), compiled.judged.schedule.name, compiled.makespan_ms, before
