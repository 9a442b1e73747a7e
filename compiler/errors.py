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
    "InternalError",
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


class InternalError(SolverError):
    """A fault of optpipe itself (a model and the simulator disagree): never the user's doing.

    Compile catches it, drops the answer with a warning and returns the best verified schedule;
    anywhere else the command line prints it with a request to report it.
    """

    def __init__(self, message: str):
        super().__init__(f"internal: {message}; please report this problem")
