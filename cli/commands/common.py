"""Helpers shared by the subcommands: loading inputs, checked options, size limits, output."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from rich.console import Console
from rich.markup import escape

from optpipe.core.errors import BudgetTooSmall, OptpipeError, printable
from optpipe.core.files import check_writable
from optpipe.core.problem import Problem
from optpipe.core.problem_file import default_problem, load_problem
from optpipe.core.units import format_size, parse_size

console = Console(highlight=False)
if not console.is_terminal and "COLUMNS" not in os.environ:
    console = Console(highlight=False, width=140)  # piped output: don't squeeze tables to 80 columns

# Beyond these sizes `compare`, `show` and `compile` would run for many minutes to hours without
# a word, so they refuse up front and say so. Measured on one core of this 2-core machine: every
# heuristic of a p = 32, v = 2, m = 256 problem (16,384 pairs, 49,152 compute ops) in about 13 s;
# p = 64, v = 2, m = 512 (65,536 pairs) is the largest shape the benchmarks run.
MAX_PAIRS = 2**17  # stages x microbatches
MAX_WORK = 2**24  # stages^2 x microbatches: the per-stage passes that scan every microbatch
MAX_SECONDS = 7 * 24 * 3600.0  # --time-limit: a week


# --------------------------------------------------------------------------- checked options
# argparse ``type=`` functions: a bad value is a usage error (exit 64) that names the option.


def int_in(low: int, high: int):
    """An integer option in low..high."""

    def parse(text: str) -> int:
        text = text.strip()
        if len(text) > 30 or not text.lstrip("+-").isdigit():
            raise argparse.ArgumentTypeError(f"expected an integer {low}..{high}, got {_short(text)}")
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer {low}..{high}, got {_short(text)}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in(low: float, high: float, *, low_open: bool = False, what: str = "number"):
    """A finite number option in low..high (above low when ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text) if len(text) <= 40 else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
            bound = f"more than {low:g}" if low_open else f"at least {low:g}"
            raise argparse.ArgumentTypeError(f"expected a finite {what}, {bound} and at most {high:g}, "
                                             f"got {_short(text)}")
        return value

    parse.__name__ = what
    return parse


def size_option(flag: str):
    """A size option such as "6GiB", checked like memory sizes in problem files."""
    return _checked(flag, parse_size, "size")


def output_path(flag: str):
    """An output file whose folder exists and is writable; checked before any long work starts."""
    return _checked(flag, check_writable, "path")


def _checked(flag: str, check, name: str):
    """An argparse type from ``check(text, flag)``: its error, without the flag argparse adds again."""

    def parse(text: str):
        try:
            return check(text, flag)
        except OptpipeError as error:
            raise argparse.ArgumentTypeError(str(error).removeprefix(f"{flag}: ")) from None

    parse.__name__ = name
    return parse


def _short(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:30]) + f"... ({len(text)} characters)"


TIME_LIMIT = float_in(0.0, MAX_SECONDS, low_open=True, what="number of seconds")
SEED = int_in(0, 2**31 - 1)  # CP-SAT's random_seed is a 32-bit integer
WORKERS = int_in(1, 1024)


# --------------------------------------------------------------------------- problems


def add_problem_argument(parser, optional: bool = False) -> None:
    if optional:
        parser.add_argument("problem", nargs="?", metavar="PROBLEM.toml",
                            help="problem file (default: the built-in 8-device GPT problem)")
    else:
        parser.add_argument("problem", metavar="PROBLEM.toml", help="problem file")


def add_budget_argument(parser) -> None:
    parser.add_argument("--budget", metavar="SIZE", type=size_option("--budget"),
                        help='override memory.budget, e.g. "6GiB"')


def read_problem(args) -> Problem:
    """The problem named on the command line, with ``--budget`` applied when given."""
    path = getattr(args, "problem", None)
    problem = load_problem(path) if path else default_problem()
    budget = getattr(args, "budget", None)
    if budget:
        if isinstance(budget, str):  # a caller that built args by hand
            budget = parse_size(budget, "--budget")
        problem = problem.with_budget(budget)
        largest = max(problem.memory.activation)
        if problem.memory.budget < largest:
            raise BudgetTooSmall(f"--budget: {format_size(problem.memory.budget)} is below one stage's activation "
                                 f"({format_size(largest)}), so no schedule fits; give at least {format_size(largest)}")
    return problem


def check_size(problem: Problem, command: str, limit: int = MAX_PAIRS, work: int | None = MAX_WORK) -> None:
    """Refuse, up front, a problem too large for ``command`` to finish in reasonable time.

    ``limit`` caps stages x microbatches; ``work`` (when given) caps stages^2 x microbatches,
    the growth of the slowest heuristic.
    """
    pipe = problem.pipeline
    pairs = pipe.stages * pipe.microbatches
    if pairs <= limit and (work is None or pipe.stages * pairs <= work):
        return
    largest = max(("devices", pipe.devices), ("chunks_per_device", pipe.chunks_per_device),
                  ("microbatches", pipe.microbatches), key=lambda kv: kv[1])
    if pairs > limit:
        why = (f"{pipe.stages:,} stages x {pipe.microbatches:,} microbatches = {pairs:,} (stage, microbatch) "
               f"pairs, and {command} handles up to {limit:,}")
    else:
        why = (f"{pipe.stages:,} stages^2 x {pipe.microbatches:,} microbatches = {pipe.stages * pairs:,}, and the "
               f"heuristics {command} runs grow with that; it handles up to {work:,}")
    raise OptpipeError(
        f"pipeline.{largest[0]} = {largest[1]:,} is beyond what {command} can judge in reasonable time: {why}; "
        f"use fewer microbatches (a few times the devices show the steady state) or fewer stages")


def print_json(data) -> None:
    """JSON on stdout; NaN or infinity would not be JSON, so they are a bug here, not output."""
    sys.stdout.write(json.dumps(data, indent=2, allow_nan=False) + "\n")


def markup_safe(text: str) -> str:
    """A user-given name for a rich table title or message: no markup, no control characters."""
    return escape(printable(str(text)))
