"""Tables the commands print: one home for each, so commands share them without importing each other.

``compare`` and ``demo`` print the comparison; ``compile`` and ``demo`` the compile result;
``simulate``, ``show`` and ``verify --problem`` a timeline's per-device figures.
"""

from __future__ import annotations

from rich.table import Table

from optpipe.core.idle import idle_phases
from optpipe.core.units import format_size
from optpipe.solvers.result import gap
from optpipe.cli.commands.common import console, markup_safe

__all__ = ["print_comparison", "comparison_table", "print_result", "result_table", "timeline_table"]


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
        if entry.judged is None:
            continue
        t = entry.judged.timeline
        fits = "[green]yes[/]" if t.fits else "[red]no[/]"
        note = "" if t.fits_budget else f"{t.peak / budget:.2f}x the budget"
        if not t.fits_host:
            note = "over the host budget"
        host = format_size(max(t.host_peak)) if max(t.host_peak) else "-"
        table.add_row(entry.name, f"{t.makespan:,.1f}", f"{t.bubble_ratio:.1%}",
                      f"{format_size(t.peak)} (d{t.peak_device})", host, fits, note)
    return table


def print_result(compiled) -> None:
    """The result table and what it means, in words."""
    console.print(result_table(compiled))
    console.print(f"  {compiled.note} ({compiled.solve_time_s:.1f} s)")
    console.print(f"  lower bound {compiled.lower_bound_ms:,.1f} ms: {compiled.lower_bound_reason}")
    for warning in compiled.warnings:
        console.print(f"  warning: {warning}")
    if compiled.resolution_ms:
        console.print(f"  the exact model counted time in units of {compiled.resolution_ms:.4g} ms; "
                      f"every reported time is the simulator's")


def result_table(compiled) -> Table:
    """The answer and the best fitting heuristic, each a row whose second line says which it is;
    the bound and the solve time, one figure each, are the lines under it (print_result), so the
    table reads whole at 80 columns."""
    problem = compiled.problem
    table = Table(title=f"{markup_safe(problem.name)}: {problem.devices} devices, {problem.stages} stages, "
                        f"{problem.microbatches} microbatches, budget {format_size(problem.memory.budget)}")
    table.add_column("schedule", justify="left", no_wrap=True)
    for column in ("makespan ms", "bubble", "peak memory", "offloaded", "gap"):
        table.add_column(column, justify="right")
    t = compiled.judged.timeline
    table.add_row(f"[bold]{markup_safe(compiled.judged.name)}[/]\n[dim]{compiled.solver} ({compiled.status.value})[/]",
                  f"{t.makespan:,.1f}", f"{t.bubble_ratio:.1%}", format_size(t.peak), str(compiled.offloaded),
                  f"{compiled.gap:.2%}")
    base = compiled.baseline
    if base is not None:
        b = base.timeline
        table.add_row(f"{markup_safe(base.name)}\n[dim]best fitting heuristic[/]", f"{b.makespan:,.1f}",
                      f"{b.bubble_ratio:.1%}", format_size(b.peak), str(len(base.schedule.offloaded)),
                      f"{gap(b.makespan, compiled.lower_bound_ms):.2%}")
    else:
        table.caption = "no heuristic fits this budget"
    return table


def timeline_table(timeline) -> Table:
    problem = timeline.problem
    table = Table(title=f"{markup_safe(timeline.schedule_name)} on {markup_safe(problem.name)}: makespan {timeline.makespan:,.2f} ms, "
                        f"bubble {timeline.bubble_ratio:.1%}, "
                        + ("[green]fits[/]" if timeline.fits else "[red]does not fit[/]")
                        + f" {format_size(problem.memory.budget)}")
    for column in ("device", "compute ms", "idle ms", "in fill", "peak memory", "at ms", "host peak"):
        table.add_column(column, justify="right")
    table.caption = "in fill: idle before the first backward, the wait for the first op included"
    for d, idle in enumerate(idle_phases(timeline)):
        table.add_row(str(d), f"{timeline.busy[d]:,.1f}", f"{timeline.makespan - timeline.busy[d]:,.1f}",
                      f"{idle.head + idle.fill:,.1f}",
                      format_size(timeline.peak_memory[d]), f"{timeline.peak_time[d]:,.1f}",
                      format_size(timeline.host_peak[d]) if timeline.host_peak[d] else "-")
    return table
