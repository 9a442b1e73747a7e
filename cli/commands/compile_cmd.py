"""optpipe compile: the fastest schedule that fits the budget, with its lower bound and gap.

While the solver runs, a live line shows the elapsed time, the incumbent, the bound, the gap and
what the search last did (on stderr, and only when stdout is a terminal and not ``--json``, so
piped output stays clean); then a table puts the result beside the best fitting heuristic.
"""

from __future__ import annotations

import sys

from optpipe.core.errors import InfeasibleError
from optpipe.core.schedule import dump_schedule, load_schedule
from optpipe.plan.bytecode import write_plan
from optpipe.plan.lower import lower
from optpipe.cli.commands.common import (SEED, TIME_LIMIT, WORKERS, add_budget_argument, add_problem_argument, check_size,
                                         console, markup_safe, output_path, print_json, read_problem)
from optpipe.cli.live import compile_live
from optpipe.cli.views import print_result


def add_parser(sub) -> None:
    parser = sub.add_parser("compile", help="solve for the fastest schedule that fits the memory budget")
    add_problem_argument(parser)
    add_budget_argument(parser)
    parser.add_argument("--solver", default="cpsat", metavar="NAME",
                        help="cpsat (default), milp-highs, milp-cbc, or heuristic:NAME (e.g. heuristic:ZB-H1)")
    parser.add_argument("--time-limit", type=TIME_LIMIT, default=60.0, metavar="S",
                        help="seconds for the solver (default 60)")
    parser.add_argument("--seed", type=SEED, default=0,
                        help="random seed 0..2147483647, for reproducible runs (default 0)")
    parser.add_argument("--workers", type=WORKERS, default=None, metavar="N",
                        help="solver threads, 1..1024 (default: all cores); from 2 on, searches of 10 s "
                             "or more run as two processes that trade incumbents")
    parser.add_argument("--schedule-out", metavar="FILE.json", type=output_path("--schedule-out"),
                        help="write the schedule as JSON")
    parser.add_argument("-o", "--plan-out", metavar="PLAN.opb", type=output_path("-o"),
                        help="lower the schedule and write the plan bytecode")
    parser.add_argument("--start", metavar="FILE.json", action="append", default=[],
                        help="also start from this schedule (e.g. one compiled earlier, or for a smaller budget); "
                             "repeatable")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    parser.set_defaults(run=run)


def run(args) -> int:
    problem = read_problem(args)
    check_size(problem, "compile")
    starts = [load_schedule(path) for path in args.start]
    try:
        compiled = compile_live(problem, solver=args.solver, time_limit_s=args.time_limit, seed=args.seed,
                                workers=args.workers, quiet=args.json or not sys.stdout.isatty(), starts=starts)
    except InfeasibleError as error:
        if args.json:
            print_json({"solver": args.solver, "status": "infeasible", "message": str(error),
                        "budget_bytes": problem.memory.budget, "smallest_budget_found_bytes": error.smallest_found,
                        "memory_lower_bound_bytes": error.memory_lower_bound})
            return error.exit_code
        raise
    if args.schedule_out:
        dump_schedule(compiled.judged.schedule, args.schedule_out)
    if args.plan_out:
        write_plan(args.plan_out, lower(problem, compiled.judged.schedule))
    if args.json:
        print_json(compiled.to_json() | {"note": compiled.note, "warm_start": compiled.start,
                                         "resolution_ms": compiled.resolution_ms})
        return 0
    print_result(compiled)
    for path, what in ((args.schedule_out, "schedule"), (args.plan_out, "plan")):
        if path:
            console.print(f"  {what} written to {markup_safe(path)}")
    return 0
