"""Everything that turns a Problem into a Schedule: heuristics, exact solvers, lower bounds."""

from .registry import Generator, generate, generators, get_generator

__all__ = ["Generator", "generate", "generators", "get_generator"]
