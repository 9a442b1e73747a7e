"""The project's error types.

Every error a user can cause is an ``OptpipeError``: the command line prints its message and
exits non-zero without a traceback. Messages say what is wrong, what was expected, and the fix.
"""

from __future__ import annotations

__all__ = [
    "OptpipeError",
    "ProblemError",
    "ScheduleError",
    "NotApplicable",
    "SolverError",
    "InfeasibleError",
    "PlanError",
]


class OptpipeError(Exception):
    """Base of every user-facing error; ``exit_code`` is what the command line returns."""

    exit_code = 1


class ProblemError(OptpipeError):
    """A problem file (or a problem built in code) is malformed or inconsistent."""


class ScheduleError(OptpipeError):
    """A schedule does not describe a valid execution of its problem."""


class NotApplicable(OptpipeError):
    """A schedule generator does not apply to this problem; the message says why."""


class SolverError(OptpipeError):
    """A solver failed in a way the user can act on (bad option, missing backend)."""


class InfeasibleError(SolverError):
    """No schedule fits the memory budget; carries what was learnt about the smallest budget."""

    exit_code = 2

    def __init__(self, message: str, *, smallest_found: int | None = None, memory_lower_bound: int | None = None):
        super().__init__(message)
        self.smallest_found = smallest_found
        self.memory_lower_bound = memory_lower_bound


class PlanError(OptpipeError):
    """A plan file is damaged, foreign, or describes a program that cannot run."""
