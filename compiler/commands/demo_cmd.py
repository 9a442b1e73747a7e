"""optpipe demo: what `make demo` runs, on the built-in problem."""

from __future__ import annotations

from .common import default_problem


def add_parser(sub) -> None:
    parser = sub.add_parser("demo", help="compare schedules on the built-in 8-device GPT problem")
    parser.set_defaults(run=run)


def run(args) -> int:
    from optpipe.solvers.compare import compare

    from .compare_cmd import print_comparison

    problem = default_problem()
    print_comparison(problem, compare(problem))
    return 0
