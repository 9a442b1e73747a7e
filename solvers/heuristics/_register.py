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
    # how long it takes to build: 0 an order written down; 1 a list schedule placed op by op;
    # 2 a search over variants (stops at compile's build deadline, _deadline.py). `compare`
    # builds the cheaper ones first, so a time limit that runs out leaves out the costly ones.
    effort: int = 0
    # fits whenever one activation of each stage does (the memory-capped list schedules), and is
    # slow: `compare` builds it last of its effort, and a deadline never leaves it out while
    # nothing built fits (at p = 64, m = 512 PO-H, repaired, is then built in time at 30 s)
    fallback: bool = False


REGISTERED: dict[str, Generator] = {}  # in registration order: the order `compare` lists them


def register(name: str, source: str, summary: str, effort: int = 0, fallback: bool = False):
    def wrap(build: Callable[[Problem], Schedule]) -> Callable[[Problem], Schedule]:
        if name in REGISTERED:
            raise RuntimeError(f"schedule generator {name!r} registered twice")
        REGISTERED[name] = Generator(name, build, source, summary, effort, fallback)
        return build

    return wrap


def require(condition: bool, reason: str) -> None:
    if not condition:
        raise NotApplicable(reason)
