"""The project's error types.

Every error a user can cause is an ``OptpipeError``: the command line prints its message and
exits non-zero without a traceback. Messages say what is wrong, what was expected, and the fix.
"""

from __future__ import annotations

__all__ = [
    "OptpipeError",
    "ProblemError",
    "BudgetTooSmall",
    "EXIT_OK",
    "EXIT_ERROR",
    "EXIT_NO_FIT",
    "EXIT_USAGE",
    "ScheduleError",
    "NotApplicable",
    "SolverError",
    "InfeasibleError",
    "PlanError",
    "InternalError",
]


# Exit codes, the same for every command (README "Exit codes", `optpipe --help`).
EXIT_OK = 0  # done
EXIT_ERROR = 1  # an error the message explains: a bad file or value, a damaged plan, an unwritable path
EXIT_NO_FIT = 2  # no schedule fits the memory budget (or the budget is below one activation)
EXIT_USAGE = 64  # the command line itself is wrong: unknown option, missing or malformed argument (BSD EX_USAGE)


class OptpipeError(Exception):
    """Base of every user-facing error; ``exit_code`` is what the command line returns."""

    exit_code = 1


class ProblemError(OptpipeError):
    """A problem file (or a problem built in code) is malformed or inconsistent."""


class BudgetTooSmall(ProblemError):
    """The budget is below one stage's activation: no schedule can fit, so the exit code is 2."""

    exit_code = 2


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


def printable(text: str) -> str:
    """``text`` with control characters (from a file, schedule or problem name) escaped; newlines kept."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == "\n" else ascii(c)[1:-1] for c in text)


def shown(value: object) -> str:
    """A user's value for a message: ``repr``, but one short line for a 5,000-digit integer or a huge string."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text):,} characters)"
