"""One registry of schedule generators, by name.

A generator is a function ``Problem -> Schedule`` that raises ``NotApplicable`` (with the
reason) when the problem is outside what its paper defines. Modules register themselves with
``@register`` (``heuristics/_register.py``); importing ``heuristics`` imports them all.
"""

from __future__ import annotations

from optpipe.core.errors import OptpipeError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Schedule

# Importing any module of ``heuristics`` runs the package first, which imports (and so registers) every family.
from .heuristics._register import REGISTERED, Generator, register, require

__all__ = ["Generator", "register", "require", "generators", "get_generator", "generate"]


def generators() -> tuple[Generator, ...]:
    return tuple(REGISTERED.values())


def get_generator(name: str) -> Generator:
    by_lower = {g.name.lower(): g for g in generators()}
    found = by_lower.get(name.lower())
    if found is None:
        raise OptpipeError(f"unknown schedule {name!r}; known schedules: {', '.join(g.name for g in generators())}")
    return found


def generate(name: str, problem: Problem) -> Schedule:
    """The named schedule for ``problem``; raises NotApplicable with the reason when it does not apply."""
    generator = get_generator(name)
    schedule = generator.build(problem)
    return schedule if schedule.name == generator.name else schedule.renamed(generator.name)
