"""optpipe demo: what `make demo` runs, on the built-in problem."""

from __future__ import annotations

from optpipe.core.problem_file import default_problem
from optpipe.solvers.compare import compare
from optpipe.cli.live import compile_live
from optpipe.cli.views import print_comparison, print_result


def add_parser(sub) -> None:
    parser = sub.add_parser("demo", help="compare schedules on the built-in 8-device GPT problem, then compile it")
    parser.add_argument("--time-limit", type=float, default=20.0, metavar="S", help="seconds for the solver (default 20)")
    parser.set_defaults(run=run)


def run(args) -> int:
    problem = default_problem()
    print_comparison(problem, compare(problem))
    # The built-in budget is one the plain schedules miss: compile finds what fits.
    print_result(compile_live(problem, time_limit_s=args.time_limit))
    return 0
