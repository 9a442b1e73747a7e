"""optpipe simulate: time a schedule file on a problem."""

from __future__ import annotations

from rich.table import Table

from optpipe.core.schedule import load_schedule
from optpipe.core.simulate import simulate
from optpipe.core.units import format_size
from optpipe.cli.commands.common import add_budget_argument, check_size, console, markup_safe, output_path, print_json, read_problem

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
        from optpipe.core.render import write_trace

        write_trace(timeline, args.trace)
    if args.json:
        print_json(timeline.summary())
        return 0
    console.print(timeline_table(timeline))
    if args.trace:
        console.print(f"trace written to {markup_safe(args.trace)} (open in ui.perfetto.dev)")
    return 0


def timeline_table(timeline) -> Table:
    problem = timeline.problem
    table = Table(title=f"{markup_safe(timeline.schedule_name)} on {markup_safe(problem.name)}: makespan {timeline.makespan:,.2f} ms, "
                        f"bubble {timeline.bubble_ratio:.1%}, "
                        + ("[green]fits[/]" if timeline.fits else "[red]does not fit[/]")
                        + f" {format_size(problem.memory.budget)}")
    for column in ("device", "compute ms", "idle ms", "peak memory", "at ms", "host peak"):
        table.add_column(column, justify="right")
    for d in range(problem.devices):
        table.add_row(str(d), f"{timeline.busy[d]:,.1f}", f"{timeline.makespan - timeline.busy[d]:,.1f}",
                      format_size(timeline.peak_memory[d]), f"{timeline.peak_time[d]:,.1f}",
                      format_size(timeline.host_peak[d]) if timeline.host_peak[d] else "-")
    return table
