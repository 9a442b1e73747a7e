"""One registry of schedule generators, by name.

A generator is a function ``Problem -> Schedule`` that raises ``NotApplicable`` (with the
reason) when the problem is outside what its paper defines. Modules register themselves with
``@register``; ``heuristics`` imports them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from optpipe.core.errors import NotApplicable, OptpipeError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Schedule

__all__ = ["Generator", "register", "generators", "get_generator", "generate"]


@dataclass(frozen=True)
class Generator:
    name: str
    build: Callable[[Problem], Schedule]
    source: str  # paper and section it follows
    summary: str  # one line: what it promises


_REGISTRY: dict[str, Generator] = {}


def register(name: str, source: str, summary: str):
    def wrap(build: Callable[[Problem], Schedule]) -> Callable[[Problem], Schedule]:
        if name in _REGISTRY:
            raise RuntimeError(f"schedule generator {name!r} registered twice")
        _REGISTRY[name] = Generator(name, build, source, summary)
        return build

    return wrap


def generators() -> tuple[Generator, ...]:
    from . import heuristics  # noqa: F401  (registers every generator)

    return tuple(_REGISTRY.values())


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


def require(condition: bool, reason: str) -> None:
    if not condition:
        raise NotApplicable(reason)
