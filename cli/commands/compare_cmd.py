"""optpipe compare: every schedule on one problem, judged by the simulator."""

from __future__ import annotations

from optpipe.solvers.compare import compare
from optpipe.cli.commands.common import add_budget_argument, add_problem_argument, check_size, print_json, read_problem
from optpipe.cli.views import print_comparison


def add_parser(sub) -> None:
    parser = sub.add_parser("compare", help="judge every heuristic schedule on a problem")
    add_problem_argument(parser, optional=True)
    add_budget_argument(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(run=run)


def run(args) -> int:
    problem = read_problem(args)
    check_size(problem, "compare")
    entries = compare(problem)
    if args.json:
        print_json([entry.to_json() for entry in entries])
        return 0
    print_comparison(problem, entries)
    return 0
