"""``@register``: how a heuristic family puts its generators in the one table, by name.

It sits below both the families (which call it) and ``solvers.registry`` (which imports the
families and looks names up), so neither of those has to import the other to get it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from optpipe.core.errors import NotApplicable
from optpipe.core.problem import Problem
from optpipe.core.schedule import Schedule

__all__ = ["Generator", "register", "require", "REGISTERED"]


@dataclass(frozen=True)
class Generator:
    name: str
    build: Callable[[Problem], Schedule]
    source: str  # paper and section it follows
    summary: str  # one line: what it promises


REGISTERED: dict[str, Generator] = {}  # in registration order: the order `compare` lists them


def register(name: str, source: str, summary: str):
    def wrap(build: Callable[[Problem], Schedule]) -> Callable[[Problem], Schedule]:
        if name in REGISTERED:
            raise RuntimeError(f"schedule generator {name!r} registered twice")
        REGISTERED[name] = Generator(name, build, source, summary)
        return build

    return wrap


def require(condition: bool, reason: str) -> None:
    if not condition:
        raise NotApplicable(reason)
