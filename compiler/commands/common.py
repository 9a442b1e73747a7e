"""Helpers shared by the subcommands: loading inputs, budgets, output."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rich.console import Console

from ..errors import OptpipeError
from ..problem import Problem, load_problem, loads_problem
from ..units import parse_size

console = Console(highlight=False)
if not console.is_terminal and "COLUMNS" not in os.environ:
    console = Console(highlight=False, width=140)  # piped output: don't squeeze tables to 80 columns

DEFAULT_PROBLEM = Path(__file__).resolve().parent.parent / "data" / "default.toml"


def add_problem_argument(parser, optional: bool = False) -> None:
    if optional:
        parser.add_argument("problem", nargs="?", metavar="PROBLEM.toml",
                            help="problem file (default: the built-in 8-device GPT problem)")
    else:
        parser.add_argument("problem", metavar="PROBLEM.toml", help="problem file")


def add_budget_argument(parser) -> None:
    parser.add_argument("--budget", metavar="SIZE", help='override memory.budget, e.g. "6GiB"')


def read_problem(args) -> Problem:
    """The problem named on the command line, with ``--budget`` applied when given."""
    path = getattr(args, "problem", None)
    problem = load_problem(path) if path else default_problem()
    budget = getattr(args, "budget", None)
    if budget:
        problem = problem.with_budget(parse_size(budget, "--budget"))
        largest = max(problem.memory.activation)
        if problem.memory.budget < largest:
            from ..units import format_size

            raise OptpipeError(f"--budget: {format_size(problem.memory.budget)} is below one stage's activation "
                               f"({format_size(largest)}); give at least {format_size(largest)}")
    return problem


def default_problem() -> Problem:
    return loads_problem(DEFAULT_PROBLEM.read_text(), default_name="default")


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
