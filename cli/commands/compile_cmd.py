"""optpipe compile: the fastest schedule that fits the budget, with its lower bound and gap.

While the solver runs, a live line shows the elapsed time, the incumbent, the bound, the gap and
what the search last did (on stderr, and only when stdout is a terminal and not ``--json``, so
piped output stays clean); then a table puts the result beside the best fitting heuristic.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from optpipe.core.errors import InfeasibleError
from optpipe.core.units import format_size
from optpipe.cli.commands.common import (SEED, TIME_LIMIT, WORKERS, add_budget_argument, add_problem_argument, check_size, console,
                     markup_safe, output_path, print_json, read_problem)


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
                        help="solver threads, 1..1024 (default: all cores)")
    parser.add_argument("--schedule-out", metavar="FILE.json", type=output_path("--schedule-out"),
                        help="write the schedule as JSON")
    parser.add_argument("-o", "--plan-out", metavar="PLAN.opb", type=output_path("-o"),
                        help="lower the schedule and write the plan bytecode")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    parser.set_defaults(run=run)


def run(args) -> int:
    problem = read_problem(args)
    check_size(problem, "compile")
    try:
        compiled = compile_live(problem, solver=args.solver, time_limit_s=args.time_limit, seed=args.seed,
                                workers=args.workers, quiet=args.json or not sys.stdout.isatty())
    except InfeasibleError as error:
        if args.json:
            print_json({"solver": args.solver, "status": "infeasible", "message": str(error),
                        "budget_bytes": problem.memory.budget, "smallest_budget_found_bytes": error.smallest_found,
                        "memory_lower_bound_bytes": error.memory_lower_bound})
            return error.exit_code
        raise
    if args.schedule_out:
        from optpipe.core.schedule import dump_schedule

        dump_schedule(compiled.schedule, args.schedule_out)
    if args.plan_out:
        from optpipe.plan.bytecode import write_plan
        from optpipe.plan.lower import lower

        write_plan(args.plan_out, lower(problem, compiled.schedule))
    if args.json:
        print_json(compiled.to_json() | {"note": compiled.note, "warm_start": compiled.start,
                                         "resolution_ms": compiled.resolution_ms})
        return 0
    print_result(compiled)
    for path, what in ((args.schedule_out, "schedule"), (args.plan_out, "plan")):
        if path:
            console.print(f"  {what} written to {markup_safe(path)}")
    return 0


def compile_live(problem, *, solver: str = "cpsat", time_limit_s: float = 60.0, seed: int = 0,
                 workers: int | None = None, quiet: bool = False):
    """compile_problem with the live progress line on stderr (none when ``quiet``)."""
    from optpipe.solvers.compile import compile_problem

    with _live_progress(problem, solver, time_limit_s, quiet) as on_progress:
        return compile_problem(problem, solver=solver, time_limit_s=time_limit_s, seed=seed, workers=workers,
                               on_progress=on_progress)


def print_result(compiled) -> None:
    """The result table and what it means, in words."""
    console.print(result_table(compiled))
    console.print(f"  {compiled.note}; lower bound: {compiled.lower_bound_reason}")
    for warning in compiled.warnings:
        console.print(f"  warning: {warning}")
    if compiled.resolution_ms:
        console.print(f"  the exact model counted time in units of {compiled.resolution_ms:.4g} ms; "
                      f"every reported time is the simulator's")


class _live_progress:
    """A context that yields ``on_progress`` and shows it live on stderr (silent when ``quiet``)."""

    def __init__(self, problem, solver: str, time_limit_s: float, quiet: bool):
        self.problem, self.solver, self.time_limit_s, self.quiet = problem, solver, time_limit_s, quiet
        self.began = time.monotonic()
        self.latest = None
        self.live = None

    def _render(self) -> Text:
        elapsed = time.monotonic() - self.began
        p = self.latest
        # the numbers first, so that an 80-column terminal shows them all; what the search did last after
        text = Text(f"{self.solver} {elapsed:5.1f}s/{self.time_limit_s:g}s", style="bold")
        if p is not None:
            incumbent = f"{p.incumbent_ms:,.1f} ms" if p.incumbent_ms is not None else "-"
            bound = f"{p.bound_ms:,.1f}" if p.bound_ms is not None else "-"
            gap = f"{p.gap:.2%}" if p.gap is not None else "-"
            text.append(f"  best {incumbent}  bound {bound}  gap {gap}  ", style="")
            text.append(p.message, style="dim")
        return text

    def __call__(self, progress) -> None:
        self.latest = progress
        if self.live is not None:
            self.live.update(self._render())

    def __enter__(self):
        if not self.quiet:
            self.live = Live(self._render(), console=Console(stderr=True), refresh_per_second=4, transient=True,
                             get_renderable=self._render)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)


def result_table(compiled) -> Table:
    problem = compiled.problem
    table = Table(title=f"{markup_safe(problem.name)}: {problem.devices} devices, {problem.stages} stages, "
                        f"{problem.microbatches} microbatches, budget {format_size(problem.memory.budget)}")
    for column in ("schedule", "makespan ms", "bubble", "peak memory", "offloaded", "lower bound ms", "gap",
                   "solve s"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    t = compiled.timeline
    table.add_row(f"[bold]{compiled.solver}[/] ({compiled.status.value})", f"{t.makespan:,.1f}",
                  f"{t.bubble_ratio:.1%}", format_size(t.peak), str(compiled.offloaded),
                  f"{compiled.lower_bound_ms:,.1f}", f"{compiled.gap:.2%}", f"{compiled.solve_time_s:.1f}")
    base = compiled.baseline
    if base is not None:
        b = base.timeline
        gap = max(0.0, (b.makespan - compiled.lower_bound_ms) / b.makespan)
        table.add_row(f"{base.name} (best fitting heuristic)", f"{b.makespan:,.1f}", f"{b.bubble_ratio:.1%}",
                      format_size(b.peak), str(len(base.schedule.offloaded)), f"{compiled.lower_bound_ms:,.1f}",
                      f"{gap:.2%}", "-")
    else:
        table.caption = "no heuristic fits this budget"
    return table
