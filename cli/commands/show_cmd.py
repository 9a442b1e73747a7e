"""optpipe show: draw one schedule as a terminal Gantt chart."""

from __future__ import annotations

from optpipe.core.render import gantt_lines, write_trace
from optpipe.core.simulate import simulate
from optpipe.solvers.registry import generate
from optpipe.cli.commands.common import (add_budget_argument, add_problem_argument, check_size, console, int_in, markup_safe,
                                         output_path, read_problem)
from optpipe.cli.views import timeline_table


def add_parser(sub) -> None:
    parser = sub.add_parser("show", help="draw a schedule as a Gantt chart")
    add_problem_argument(parser, optional=True)
    parser.add_argument("--schedule", required=True, metavar="NAME", help="a heuristic's name (see `optpipe compare`)")
    add_budget_argument(parser)
    parser.add_argument("--width", type=int_in(20, 2000), default=None,
                        help="columns for the chart, 20..2000 (default: the terminal's)")
    parser.add_argument("--trace", metavar="FILE", type=output_path("--trace"),
                        help="also write a Chrome-trace/Perfetto JSON")
    parser.set_defaults(run=run)


def run(args) -> int:
    problem = read_problem(args)
    check_size(problem, "show")
    timeline = simulate(problem, generate(args.schedule, problem))
    width = args.width or max(40, console.width - 6)
    for line in gantt_lines(timeline, width):
        console.print(line, no_wrap=True, overflow="crop")
    console.print(timeline_table(timeline))
    if args.trace:
        write_trace(timeline, args.trace)
        console.print(f"trace written to {markup_safe(args.trace)} (open in ui.perfetto.dev)")
    return 0
