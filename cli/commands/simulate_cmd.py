"""optpipe simulate: time a schedule file on a problem."""

from __future__ import annotations

from dataclasses import asdict

from optpipe.core.idle import idle_phases
from optpipe.core.render import write_trace
from optpipe.core.schedule import load_schedule
from optpipe.core.simulate import simulate
from optpipe.cli.commands.common import add_budget_argument, check_size, console, markup_safe, output_path, print_json, read_problem
from optpipe.cli.views import timeline_table

# Simulating a given schedule is near-linear, so it takes far larger problems than compare.
SIMULATE_PAIRS = 2**19  # about 20 s and 1 GB of memory at the limit


def add_parser(sub) -> None:
    parser = sub.add_parser("simulate", help="simulate a schedule (JSON) on a problem")
    parser.add_argument("problem", metavar="PROBLEM.toml")
    parser.add_argument("schedule", metavar="SCHEDULE.json")
    add_budget_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--trace", metavar="FILE", type=output_path("--trace"),
                        help="write a Chrome-trace/Perfetto JSON")
    parser.set_defaults(run=run)


def run(args) -> int:
    problem = read_problem(args)
    check_size(problem, "simulate", SIMULATE_PAIRS, work=None)
    timeline = simulate(problem, load_schedule(args.schedule))
    if args.trace:
        write_trace(timeline, args.trace)
    if args.json:
        print_json({**timeline.summary(), "idle_ms": [asdict(phases) for phases in idle_phases(timeline)]})
        return 0
    console.print(timeline_table(timeline))
    if args.trace:
        console.print(f"trace written to {markup_safe(args.trace)} (open in ui.perfetto.dev)")
    return 0
