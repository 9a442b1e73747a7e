"""optpipe compare: every schedule on one problem, judged by the simulator."""

from __future__ import annotations

from rich.table import Table

from optpipe.core.units import format_size
from optpipe.cli.commands.common import (add_budget_argument, add_problem_argument, check_size, console, markup_safe, print_json,
                     read_problem)


def add_parser(sub) -> None:
    parser = sub.add_parser("compare", help="judge every heuristic schedule on a problem")
    add_problem_argument(parser, optional=True)
    add_budget_argument(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(run=run)


def run(args) -> int:
    from optpipe.solvers.compare import compare

    problem = read_problem(args)
    check_size(problem, "compare")
    entries = compare(problem)
    if args.json:
        print_json([entry.to_json() for entry in entries])
        return 0
    print_comparison(problem, entries)
    return 0


def print_comparison(problem, entries) -> None:
    """The table of applicable schedules, then one dim line per schedule that does not apply."""
    console.print(comparison_table(problem, entries))
    for entry in entries:
        if not entry.applicable:
            console.print(f"  [bold]{markup_safe(entry.name)}[/] n/a: [dim]{markup_safe(entry.reason)}[/]")


def comparison_table(problem, entries) -> Table:
    budget = problem.memory.budget
    table = Table(title=f"{markup_safe(problem.name)}: {problem.devices} devices, {problem.stages} stages, "
                        f"{problem.microbatches} microbatches, budget {format_size(budget)}")
    for column, justify in (("schedule", "left"), ("makespan ms", "right"), ("bubble", "right"),
                            ("peak memory (device)", "right"), ("host peak", "right"), ("fits", "center"), ("note", "left")):
        table.add_column(column, justify=justify, overflow="fold")
    for entry in entries:
        t = entry.timeline
        if t is None:
            continue
        fits = "[green]yes[/]" if t.fits else "[red]no[/]"
        note = "" if t.fits_budget else f"{t.peak / budget:.2f}x the budget"
        if not t.fits_host:
            note = "over the host budget"
        host = format_size(max(t.host_peak)) if max(t.host_peak) else "-"
        table.add_row(entry.name, f"{t.makespan:,.1f}", f"{t.bubble_ratio:.1%}",
                      f"{format_size(t.peak)} (d{t.peak_device})", host, fits, note)
    return table
