"""How good optpipe compile is: against the best fitting heuristic and against the lower bound.

Per instance (``../shared/instances/``, else ``benchmarks/problems/``): the best fitting
heuristic, the compiled makespan, the lower bound and the gap, the idle time (makespan minus the
busiest device's compute, which no schedule can hide) and how much of it compile removes, and
the solve time. Targets (issue 4): never worse than the best fitting heuristic; a mean idle cut
of at least 30% over the instances with offload and at most 8 devices; a fitting schedule at
least as good as the heuristics on scale-p16-v2-m64.

    python -m benchmarks.solver_quality [--time-limit S]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from optpipe.compiler.errors import InfeasibleError
from optpipe.compiler.problem import load_problem
from optpipe.solvers.compile import compile_problem

from ._common import HERE, console, instances, save

SHARED = HERE.parent.parent / "shared" / "instances"
SCALE = "scale-p16-v2-m64"


def _paths() -> list[Path]:
    shared = sorted(SHARED.glob("*.toml")) if SHARED.is_dir() else []
    return shared or instances()


def _row(path: Path, time_limit_s: float, seed: int) -> dict:
    problem = load_problem(path)
    began = time.monotonic()
    try:
        compiled = compile_problem(problem, time_limit_s=time_limit_s, seed=seed)
    except InfeasibleError as error:
        return {"problem": problem.name, "status": "infeasible", "message": str(error),
                "offload": problem.offload.enabled, "devices": problem.devices,
                "solve_time_s": time.monotonic() - began}
    base = compiled.baseline.timeline if compiled.baseline else None
    idle = compiled.timeline.idle_time
    base_idle = base.makespan - base.busiest_compute if base else None
    return {
        "problem": problem.name,
        "devices": problem.devices,
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
        "peak_memory_bytes": compiled.timeline.peak,
        "budget_bytes": problem.memory.budget,
        "solve_time_s": compiled.solve_time_s,
    }


def _table(rows: list[dict], time_limit_s: float) -> Table:
    table = Table(title=f"optpipe compile (cpsat) against the best fitting heuristic, {time_limit_s:g} s per instance")
    for column in ("instance", "best heuristic", "heuristic ms", "compiled ms", "lower bound", "gap",
                   "idle cut", "status", "solve s"):
        table.add_column(column, justify="left" if column in ("instance", "best heuristic", "status") else "right")
    for r in rows:
        if r["status"] == "infeasible":
            table.add_row(r["problem"], "-", "-", "-", "-", "-", "-", "[red]infeasible[/]", f"{r['solve_time_s']:.1f}")
            continue
        base = f"{r['baseline_makespan_ms']:,.1f}" if r["baseline_makespan_ms"] else "-"
        cut = f"{r['idle_cut']:.1%}" if r["idle_cut"] is not None else "-"
        table.add_row(r["problem"], r["baseline"] or "[dim]none fits[/]", base, f"{r['makespan_ms']:,.1f}",
                      f"{r['lower_bound_ms']:,.1f}", f"{r['gap']:.2%}", cut, r["status"], f"{r['solve_time_s']:.1f}")
    return table


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
        rows.append(_row(path, time_limit_s, seed))
    wide = Console(highlight=False, width=max(console.width, 150))  # the table has nine columns
    wide.print(_table(rows, time_limit_s))
    totals = summary(rows)
    mean = totals["mean_idle_cut_offload_le8"]
    console.print(f"never worse than the best fitting heuristic: {'yes' if totals['never_worse_than_heuristic'] else 'NO'}; "
                  f"mean idle cut over {totals['instances_in_mean']} offload instances with <= 8 devices: "
                  + (f"{mean:.1%}" if mean is not None else "-") + " (target 30%); "
                  f"{SCALE} fits and is not worse: {'yes' if totals['scale_fits_and_not_worse'] else 'NO'}")
    save("solver_quality", rows, time_limit_s=time_limit_s, seed=seed, summary=totals)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.solver_quality", description=__doc__.split("\n")[0])
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="seconds per instance (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run(args.time_limit, args.seed)


if __name__ == "__main__":
    main()
