"""How good optpipe compile is: against the best fitting heuristic and against the lower bound.

Per instance (``../shared/instances/``, else ``benchmarks/problems/``): the best fitting
heuristic, the compiled makespan, the lower bound and the gap, the idle time (makespan minus the
busiest device's compute, which no schedule can hide) and how much of it compile removes, and
the solve time. Targets (issue 4): never worse than the best fitting heuristic; a mean idle cut
of at least 30% over the instances with offload and at most 8 devices; a fitting schedule at
least as good as the heuristics on scale-p16-v2-m64.

With ``--grid`` it also runs the generated grid of ``problem_grid.py`` (24 problems, p = 4..32,
v = 1..3, m = p..8p, tight to ample budgets, k = 0.3..3, uneven costs; ``--large`` adds p = 32,
m = 256), at each of the ``--time-limits``, and measures issue 11's targets: the share of problems
within 2% and within 5% of the bound, and the mean idle cut where the best fitting heuristic is
more than 1% above the bound. Every row lists every heuristic's makespan (null where it does not
fit) in the JSON. A 60 s compile is not the same twice (CP-SAT's workers race, the window search is
timed), and single grid runs of one code have put 18 to 20 rows within 2%: ``--repeat N`` compiles
each problem N times (seeds ``--seed`` upwards) and adds how often each row lands within 2%, its
best, median and worst gap (solver_quality_grid_repeat.json); a change is worth keeping when it
moves those, not one run.

With ``--huge`` it runs issue 11's p = 64, v = 2, m = 512 problem instead, at each of the
``--time-limits``: when compile returns against its limit, when it first knew a fitting schedule,
the gap, and the peak memory of the process.

With ``--small N`` it runs N random problems of at most 160 compute ops (``problem_grid.small``)
at ``--time-limit``: how many compile proves optimal, and the gaps of the rest.

    python -m benchmarks.solver_quality [--time-limit S] [--grid] [--time-limits 10,30,60] [--large] [--huge]
    python -m benchmarks.solver_quality --grid --time-limits 60 --only grid02,grid08 --repeat 5
    python -m benchmarks.solver_quality --small 20 --time-limit 20
    python -m benchmarks.solver_quality --grid --time-limits 60 --only grid03 --microbatches 4,6,8,32

With ``--microbatches`` each chosen problem is compiled at those microbatch counts as well, with
a table of what each microbatch more costs the schedule and the bound: where the small counts are
proven optimal and the schedule then grows by the same ms per microbatch, the bound is what is
loose.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from optpipe.core.errors import InfeasibleError
from optpipe.core.problem import Problem
from optpipe.core.problem_file import load_problem
from optpipe.solvers.compare import compare
from optpipe.solvers.compile import compile_problem

from ._common import HERE, console, instances, save

SHARED = HERE.parent.parent / "shared" / "instances"
SCALE = "scale-p16-v2-m64"


def _paths() -> list[Path]:
    shared = sorted(SHARED.glob("*.toml")) if SHARED.is_dir() else []
    return shared or instances()


def _row(problem: Problem, time_limit_s: float, seed: int, on_progress=None) -> dict:
    began = time.monotonic()
    try:
        compiled = compile_problem(problem, time_limit_s=time_limit_s, seed=seed, on_progress=on_progress)
    except InfeasibleError as error:
        return {"problem": problem.name, "status": "infeasible", "message": str(error),
                "offload": problem.offload.enabled, "devices": problem.devices,
                "time_limit_s": time_limit_s, "solve_time_s": time.monotonic() - began}
    base = compiled.baseline.timeline if compiled.baseline else None
    idle = compiled.judged.timeline.idle_time
    base_idle = base.makespan - base.busiest_compute if base else None
    return {
        "problem": problem.name,
        "devices": problem.devices,
        "microbatches": problem.pipeline.microbatches,
        "offload": problem.offload.enabled,
        "baseline": compiled.baseline.name if compiled.baseline else None,
        "baseline_makespan_ms": base.makespan if base else None,
        "makespan_ms": compiled.makespan_ms,
        "lower_bound_ms": compiled.lower_bound_ms,
        "gap": compiled.gap,
        "idle_ms": idle,
        "baseline_idle_ms": base_idle,
        "idle_cut": (1.0 - idle / base_idle) if base_idle else None,
        "status": compiled.status.value,
        "warm_start": compiled.start,
        "offloaded": compiled.offloaded,
        "peak_memory_bytes": compiled.judged.peak,
        "budget_bytes": problem.memory.budget,
        "time_limit_s": time_limit_s,
        "solve_time_s": compiled.solve_time_s,
    }


def _table(rows: list[dict], title: str) -> Table:
    table = Table(title=title)
    for column in ("instance", "limit s", "best heuristic", "heuristic ms", "compiled ms", "lower bound", "gap",
                   "idle cut", "start", "solve s"):
        table.add_column(column, justify="left" if column in ("instance", "best heuristic", "start") else "right")
    for r in rows:
        limit = f"{r['time_limit_s']:g}"
        if r["status"] == "infeasible":
            table.add_row(r["problem"], limit, "-", "-", "-", "-", "-", "-", "[red]infeasible[/]",
                          f"{r['solve_time_s']:.1f}")
            continue
        base = f"{r['baseline_makespan_ms']:,.1f}" if r["baseline_makespan_ms"] else "-"
        cut = f"{r['idle_cut']:.1%}" if r["idle_cut"] is not None else "-"
        table.add_row(r["problem"], limit, r["baseline"] or "[dim]none fits[/]", base, f"{r['makespan_ms']:,.1f}",
                      f"{r['lower_bound_ms']:,.1f}", f"{r['gap']:.2%}", cut, r["warm_start"][:28],
                      f"{r['solve_time_s']:.1f}")
    return table


def grid_summary(rows: list[dict]) -> dict:
    """Issue 11's targets per time limit: gap <= 2% and <= 5% shares, mean idle cut, never worse."""
    out = {}
    for limit in sorted({r["time_limit_s"] for r in rows}):
        mine = [r for r in rows if r["time_limit_s"] == limit]
        solved = [r for r in mine if r["status"] != "infeasible"]
        room = [r for r in solved if r["baseline_makespan_ms"] and r["idle_cut"] is not None
                and r["baseline_makespan_ms"] > 1.01 * r["lower_bound_ms"]]
        out[f"{limit:g}"] = {
            "problems": len(mine),
            "solved": len(solved),
            "within_2_percent": sum(r["gap"] <= 0.02 for r in solved) / len(solved) if solved else None,
            "within_5_percent": sum(r["gap"] <= 0.05 for r in solved) / len(solved) if solved else None,
            "mean_gap": sum(r["gap"] for r in solved) / len(solved) if solved else None,
            "mean_idle_cut_where_heuristic_1pct_above_bound": (sum(r["idle_cut"] for r in room) / len(room)
                                                               if room else None),
            "never_worse_than_heuristic": all(r["baseline_makespan_ms"] is None
                                              or r["makespan_ms"] <= r["baseline_makespan_ms"] + 1e-6
                                              for r in solved),
        }
    return out


def _pct(x: float | None) -> str:
    return f"{x:.0%}" if x is not None else "-"


def _every_heuristic(problem: Problem) -> dict:
    return {e.name: (e.judged.makespan_ms if e.fits else None) for e in compare(problem) if e.applicable}


def _selection(only: str) -> list[str]:
    """``--only``'s parts: the texts a problem's name may contain to be run (none: every problem)."""
    return [part.strip() for part in only.split(",") if part.strip()]


def grid_result_name(seed: int, only: str, *, budgets: bool, microbatches: bool, repeat: bool) -> str:
    """The grid run's JSON name: one record per seed and per selection, so that a run of other
    rows (``--only``) or of another seed never overwrites one kept before."""
    selection = "-".join(word for part in _selection(only) for word in re.split(r"[^A-Za-z0-9.]+", part) if word)
    return ("solver_quality_grid" + ("_budgets" if budgets else "") + (f"_only-{selection}" if selection else "")
            + ("_microbatches" if microbatches else "") + ("_repeat" if repeat else "")
            + (f"_seed{seed}" if seed else ""))


def run_grid(time_limits: list[float], seed: int = 0, large: bool = False, only: str = "",
             budgets: list[float] | None = None, repeat: int = 1, microbatches: list[int] | None = None) -> list[dict]:
    """The generated grid at each time limit: table, targets and JSON (results/solver_quality_grid.json;
    ``grid_result_name`` says what each option adds to it). ``only``: the problems whose names
    contain it, or any of its comma-separated parts; ``budgets``: each problem at each of those
    multiples of its budget instead; ``repeat`` > 1: each compile that many times, compile's seed
    counting up from ``seed`` (the problems stay those of ``seed``), and each row's spread;
    ``microbatches``: each problem at each of those microbatch counts, and what each microbatch
    more costs the schedule and the bound."""
    from .problem_grid import grid, with_budgets, with_microbatches

    rows = []
    wanted = _selection(only) or [""]
    problems = [p for p in grid(seed, large) if any(part in p.name for part in wanted)]
    if budgets:
        problems = [scaled for p in problems for scaled in with_budgets(p, budgets)]
    if microbatches:
        problems = [shorter for p in problems for shorter in with_microbatches(p, microbatches)]
    for problem in problems:
        heuristics = _every_heuristic(problem)
        for limit in time_limits:
            for run in range(repeat):
                again = f" (run {run + 1} of {repeat})" if repeat > 1 else ""
                console.print(f"[dim]{problem.name}: solving for up to {limit:g} s{again} ...[/]")
                rows.append({**_row(problem, limit, seed + run), "heuristics": heuristics, "run": run})
    wide = Console(highlight=False, width=max(console.width, 170))
    wide.print(_table(rows, "optpipe compile on the generated grid against the best fitting heuristic"))
    spread = stability(rows) if repeat > 1 else None
    if spread:
        wide.print(_spread_table(spread))
    ladder = per_microbatch(rows) if microbatches else None
    if ladder:
        wide.print(_ladder_table(ladder))
    totals = grid_summary(rows)
    pct = _pct
    for limit, t in totals.items():
        cut = pct(t["mean_idle_cut_where_heuristic_1pct_above_bound"])
        console.print(f"{limit} s: within 2% of the bound {pct(t['within_2_percent'])} (target 80%), within 5% "
                      f"{pct(t['within_5_percent'])} (target 90%), mean gap {pct(t['mean_gap'])}, mean idle cut "
                      f"where the heuristic is >1% above the bound {cut} (target 50%), never worse than the best "
                      f"heuristic: "
                      f"{'yes' if t['never_worse_than_heuristic'] else 'NO'}")
    name = grid_result_name(seed, only, budgets=bool(budgets), microbatches=bool(microbatches), repeat=repeat > 1)
    save(name, rows, time_limits_s=time_limits, seed=seed, summary=totals, only=only or None,
         budget_factors=budgets or None, runs=repeat, stability=spread, microbatches=microbatches or None,
         per_microbatch=ladder)
    return rows


def stability(rows: list[dict]) -> list[dict]:
    """Per problem and time limit, over its runs: how many ended within 2% of the bound, and the
    best, median and worst gap (the median of an even count is the lower middle one: a run that
    happened)."""
    runs: dict[tuple[str, float], list[float]] = {}
    for r in rows:
        if r["status"] != "infeasible":
            runs.setdefault((r["problem"], r["time_limit_s"]), []).append(r["gap"])
    out = []
    for (problem, limit), gaps in runs.items():
        gaps = sorted(gaps)
        out.append({"problem": problem, "time_limit_s": limit, "runs": len(gaps),
                    "within_2_percent": sum(g <= 0.02 for g in gaps), "best_gap": gaps[0],
                    "median_gap": gaps[(len(gaps) - 1) // 2], "worst_gap": gaps[-1]})
    return out


def per_microbatch(rows: list[dict]) -> list[dict]:
    """Per problem and time limit, between each two microbatch counts run (``--microbatches``):
    what each microbatch more added to the compiled makespan and to the lower bound, and whether
    the smaller count was proven optimal. A schedule that grows by the same ms per microbatch
    from proven optima on, while its bound grows by less, has a gap that is the bound's. With
    ``--repeat``, each run's counts are compared with the same run's."""
    runs: dict[tuple[str, float, int], list[dict]] = {}
    for r in rows:
        if r["status"] != "infeasible":
            runs.setdefault((r["problem"].rsplit("@m", 1)[0], r["time_limit_s"], r.get("run", 0)), []).append(r)
    out = []
    for (problem, limit, _), ladder in runs.items():
        ladder.sort(key=lambda r: r["microbatches"])
        for low, high in zip(ladder, ladder[1:]):
            more = high["microbatches"] - low["microbatches"]
            if more <= 0:
                continue
            out.append({"problem": problem, "time_limit_s": limit, "from": low["microbatches"],
                        "to": high["microbatches"], "proven_at_from": low["status"] == "optimal",
                        "makespan_ms_per_microbatch": (high["makespan_ms"] - low["makespan_ms"]) / more,
                        "bound_ms_per_microbatch": (high["lower_bound_ms"] - low["lower_bound_ms"]) / more})
    return out


def _per_problem_table(title: str, columns: tuple[str, ...]) -> Table:
    """A table whose first column names the problem and whose others are figures."""
    table = Table(title=title)
    for k, column in enumerate(columns):
        table.add_column(column, justify="right" if k else "left")
    return table


def _ladder_table(ladder: list[dict]) -> Table:
    table = _per_problem_table("what one microbatch more costs: the schedule against its bound", (
        "problem", "limit s", "microbatches", "optimal at the first", "compiled ms / mb", "bound ms / mb"))
    for step in ladder:
        table.add_row(step["problem"], f"{step['time_limit_s']:g}", f"{step['from']} -> {step['to']}",
                      "yes" if step["proven_at_from"] else "no", f"{step['makespan_ms_per_microbatch']:,.2f}",
                      f"{step['bound_ms_per_microbatch']:,.2f}")
    return table


def _spread_table(spread: list[dict]) -> Table:
    table = _per_problem_table("the same compiles, run again: how often each row lands within 2% of its bound",
                               ("problem", "limit s", "within 2%", "best gap", "median gap", "worst gap"))
    for s in spread:
        mark = "green" if s["within_2_percent"] == s["runs"] else "red" if not s["within_2_percent"] else "yellow"
        table.add_row(s["problem"], f"{s['time_limit_s']:g}", f"[{mark}]{s['within_2_percent']} of {s['runs']}[/]",
                      f"{s['best_gap']:.2%}", f"{s['median_gap']:.2%}", f"{s['worst_gap']:.2%}")
    return table


def run_huge(time_limits: list[float], seed: int = 0) -> list[dict]:
    """Issue 11's p = 64, v = 2, m = 512 row: compile within its time limit returns the best
    heuristic it can repair, with the bound (results/solver_quality_huge.json). Its comparison
    column is compile's own baseline: building every heuristic there takes over a minute."""
    from .problem_grid import huge

    problem = huge(seed)
    rows = []
    for limit in time_limits:
        console.print(f"[dim]{problem.name}: solving for up to {limit:g} s ...[/]")
        first: list[float] = []  # when a fitting schedule was first known

        def seen(progress, first=first) -> None:
            if progress.incumbent_ms is not None and not first:
                first.append(progress.elapsed_s)

        began = time.monotonic()
        row = _row(problem, limit, seed, on_progress=seen)
        rows.append({**row, "wall_s": time.monotonic() - began, "first_fitting_s": first[0] if first else None,
                     "peak_rss_mib": _peak_rss_mib()})
    wide = Console(highlight=False, width=max(console.width, 170))
    wide.print(_table(rows, "optpipe compile at p = 64, v = 2, m = 512 (issue 11: the best heuristic, quickly, "
                            "with the bound)"))
    for r in rows:
        first = f"{r['first_fitting_s']:.1f} s" if r["first_fitting_s"] is not None else "never"
        console.print(f"{r['time_limit_s']:g} s limit: returned after {r['wall_s']:.1f} s, a fitting schedule known "
                      f"after {first}, gap {r.get('gap', float('nan')):.2%}, peak memory {r['peak_rss_mib']:,} MiB")
    save("solver_quality_huge", rows, time_limits_s=time_limits, seed=seed)
    return rows


def run_small(count: int, time_limit_s: float, seed: int = 0) -> list[dict]:
    """Random small problems (results/solver_quality_small.json): the share proved optimal."""
    from .problem_grid import small

    rows = []
    for problem in small(count, seed):
        console.print(f"[dim]{problem.name}: solving for up to {time_limit_s:g} s ...[/]")
        rows.append(_row(problem, time_limit_s, seed))
    wide = Console(highlight=False, width=max(console.width, 170))
    wide.print(_table(rows, f"optpipe compile on {count} random problems of at most 160 compute ops"))
    optimal = sum(r["status"] == "optimal" for r in rows)
    totals = grid_summary(rows)
    for t in totals.values():
        console.print(f"proved optimal: {optimal} of {len(rows)}; within 2% of the bound {_pct(t['within_2_percent'])}, "
                      f"within 5% {_pct(t['within_5_percent'])}, mean gap {_pct(t['mean_gap'])}")
    save("solver_quality_small", rows, time_limit_s=time_limit_s, seed=seed, optimal=optimal, summary=totals)
    return rows


def _peak_rss_mib() -> int:
    import resource  # Unix only, as the benchmarks are
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def summary(rows: list[dict]) -> dict:
    """The three targets, measured."""
    solved = [r for r in rows if r["status"] != "infeasible"]
    never_worse = all(r["baseline_makespan_ms"] is None or r["makespan_ms"] <= r["baseline_makespan_ms"] + 1e-6
                      for r in solved)
    cuts = [r["idle_cut"] for r in solved if r["offload"] and r["devices"] <= 8 and r["idle_cut"] is not None]
    scale = next((r for r in solved if r["problem"] == SCALE), None)
    return {
        "never_worse_than_heuristic": never_worse,
        "mean_idle_cut_offload_le8": sum(cuts) / len(cuts) if cuts else None,
        "instances_in_mean": len(cuts),
        "scale_fits_and_not_worse": scale is not None and (scale["baseline_makespan_ms"] is None
                                                           or scale["makespan_ms"] <= scale["baseline_makespan_ms"]),
    }


def run(time_limit_s: float = 60.0, seed: int = 0) -> list[dict]:
    rows = []
    for path in _paths():
        console.print(f"[dim]{path.stem}: solving for up to {time_limit_s:g} s ...[/]")
        rows.append(_row(load_problem(path), time_limit_s, seed))
    wide = Console(highlight=False, width=max(console.width, 170))  # the table has ten columns
    title = f"optpipe compile (cpsat) against the best fitting heuristic, {time_limit_s:g} s per instance"
    wide.print(_table(rows, title))
    totals = summary(rows)
    mean = totals["mean_idle_cut_offload_le8"]
    console.print(f"never worse than the best fitting heuristic: {'yes' if totals['never_worse_than_heuristic'] else 'NO'}; "
                  f"mean idle cut over {totals['instances_in_mean']} offload instances with <= 8 devices: "
                  + (f"{mean:.1%}" if mean is not None else "-") + " (target 30%); "
                  f"{SCALE} fits and is not worse: {'yes' if totals['scale_fits_and_not_worse'] else 'NO'}")
    save("solver_quality", rows, time_limit_s=time_limit_s, seed=seed, summary=totals)
    return rows


def _positives(text: str) -> list[float]:
    """A comma-separated list of positive numbers (seconds, budget factors), for argparse."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers separated by commas, e.g. 1,1.5,2") from None
    if not values or any(not 0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive numbers separated by commas, e.g. 1,1.5,2")
    return values


def _count(text: str) -> int:
    """A whole number of at least 1, for argparse."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number, e.g. 3") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected at least 1")
    return value


def _counts(text: str) -> list[int]:
    """A comma-separated list of whole numbers of at least 1 (microbatch counts), for argparse."""
    return [_count(part) for part in text.split(",") if part.strip()] or [_count(text)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.solver_quality", description=__doc__.split("\n")[0])
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="seconds per instance (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grid", action="store_true", help="run the generated grid instead of the instances")
    parser.add_argument("--time-limits", type=_positives, default=[10.0, 30.0, 60.0], metavar="S,S,...",
                        help="with --grid: seconds per problem, one run each unless --repeat (default 10,30,60)")
    parser.add_argument("--large", action="store_true", help="with --grid: add the p = 32, m = 256 problem")
    parser.add_argument("--only", default="", metavar="TEXT",
                        help="with --grid: only the problems whose names contain TEXT (for example p8-v3, or "
                             "grid02,grid08: any of them)")
    parser.add_argument("--budgets", type=_positives, default=None, metavar="F,F,...",
                        help="with --grid: each problem at these multiples of its budget (for example 1,1.5,2): "
                             "a gap that closes as memory grows is the budget's")
    parser.add_argument("--microbatches", type=_counts, default=None, metavar="M,M,...",
                        help="with --grid: each problem at these microbatch counts (for example 4,6,8,32): a "
                             "gap that grows by the same ms a microbatch from proven optima on is the bound's")
    parser.add_argument("--repeat", type=_count, default=1, metavar="N",
                        help="with --grid: compile each problem N times (seeds counting up) and show how often "
                             "each row lands within 2%% of its bound")
    parser.add_argument("--huge", action="store_true",
                        help="run the p = 64, v = 2, m = 512 problem at each of --time-limits instead")
    parser.add_argument("--small", type=int, default=0, metavar="N",
                        help="run N random problems of at most 160 compute ops at --time-limit instead")
    args = parser.parse_args(argv)
    if args.budgets and not args.grid:
        parser.error("--budgets scales the generated grid's problems: add --grid")
    if args.microbatches and not args.grid:
        parser.error("--microbatches changes the generated grid's problems: add --grid")
    if args.repeat > 1 and not args.grid:
        parser.error("--repeat runs the generated grid's compiles again: add --grid")
    if args.small:
        run_small(args.small, args.time_limit, args.seed)
    elif args.huge:
        run_huge(args.time_limits, args.seed)
    elif args.grid:
        run_grid(args.time_limits, args.seed, args.large, args.only, args.budgets, args.repeat, args.microbatches)
    else:
        run(args.time_limit, args.seed)


if __name__ == "__main__":
    main()
