"""How the compiled schedule degrades as the budget shrinks (issue 11, "degrades smoothly").

On the 7B-like problem (``problems/models/gpt7b-p8-v2-m32.toml``), budgets from 0.6x to 1.0x of
PO-H's peak: per budget, the compiled makespan, the lower bound, the warm start compile began
from, what 1F1B-capped (the old fallback) takes, and the peak. Budgets go from the smallest up,
and each compile also starts from the schedule compiled for the budget below (``compile
--start``), as a user sweeping the budget would: it fits, so search noise between two runs
cannot make more memory give a slower answer. Two checks: no budget gives a
slower schedule than one found at a smaller budget (monotone), and between neighbouring points
the time lost per 1% of memory (the issue asks for at most a few percent).

    python -m benchmarks budget_sweep [--time-limit S] [--points N] [--problem FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from optpipe.core.errors import InfeasibleError
from optpipe.core.problem_file import load_problem
from optpipe.core.units import format_size
from optpipe.solvers.compare import compare
from optpipe.solvers.compile import compile_problem

from ._common import PROBLEMS, console, save

PROBLEM = PROBLEMS / "models" / "gpt7b-p8-v2-m32.toml"
LOW, HIGH = 0.6, 1.0


def _factors(points: int) -> list[float]:
    return [round(LOW + (HIGH - LOW) * k / (points - 1), 4) for k in range(points)]


def _point(problem, factor: float, peak: int, time_limit_s: float, seed: int, starts: list) -> tuple[dict, object]:
    """One budget's row, and the schedule compiled for it (None when nothing fits)."""
    budget = int(peak * factor)
    at = problem.with_budget(budget)
    capped = next(e for e in compare(at, ["1F1B-capped"]))
    row = {"factor": factor, "budget_bytes": budget,
           "capped_ms": capped.judged.makespan_ms if capped.fits else None}
    try:
        compiled = compile_problem(at, time_limit_s=time_limit_s, seed=seed, starts=starts)
    except InfeasibleError as error:
        return {**row, "status": "infeasible", "message": str(error)}, None
    return {**row, "status": compiled.status.value, "makespan_ms": compiled.makespan_ms,
            "lower_bound_ms": compiled.lower_bound_ms, "gap": compiled.gap, "start": compiled.start,
            "peak_memory_bytes": compiled.judged.peak, "offloaded": compiled.offloaded,
            "solve_time_s": compiled.solve_time_s}, compiled.judged.schedule


def checks(rows: list[dict]) -> dict:
    """Monotone in the budget, and the worst time lost per 1% of memory between neighbours."""
    solved = sorted((r for r in rows if r.get("makespan_ms")), key=lambda r: r["factor"])
    best, monotone = float("inf"), True
    for r in solved:
        if r["makespan_ms"] > best + 1e-6:
            monotone = False
        best = min(best, r["makespan_ms"])
    slope = 0.0
    for small, large in zip(solved, solved[1:]):
        memory = (large["factor"] - small["factor"]) / large["factor"] * 100  # % less memory
        lost = (small["makespan_ms"] - large["makespan_ms"]) / large["makespan_ms"] * 100  # % more time
        if memory > 0:
            slope = max(slope, lost / memory)
    return {"monotone": monotone, "worst_percent_time_per_percent_memory": slope}


def _curve(rows: list[dict], reference: float) -> Table:
    table = Table(title="compiled makespan against the budget (x PO-H's peak)")
    for column in ("budget", "", "compiled ms", "vs PO-H", "bound", "gap", "1F1B-capped ms", "start", "solve s"):
        table.add_column(column, justify="left" if column in ("", "start") else "right")
    worst = max((r.get("makespan_ms") or 0 for r in rows), default=1.0) or 1.0
    for r in rows:
        label = f"{r['factor']:.2f}x {format_size(r['budget_bytes'])}"
        capped = f"{r['capped_ms']:,.0f}" if r["capped_ms"] else "-"
        if r["status"] == "infeasible":
            table.add_row(label, "", "[red]infeasible[/]", "-", "-", "-", capped, "-", "-")
            continue
        bar = "█" * max(1, round(30 * r["makespan_ms"] / worst))
        table.add_row(label, bar, f"{r['makespan_ms']:,.1f}", f"{r['makespan_ms'] / reference:.3f}x",
                      f"{r['lower_bound_ms']:,.1f}", f"{r['gap']:.1%}", capped, r["start"],
                      f"{r['solve_time_s']:.1f}")
    return table


def run(time_limit_s: float = 10.0, points: int = 9, path: Path = PROBLEM, seed: int = 0) -> list[dict]:
    problem = load_problem(path)
    po_h = next(e for e in compare(problem, ["PO-H"]))
    peak, reference = po_h.judged.peak, po_h.judged.makespan_ms
    console.print(f"{problem.name}: PO-H takes {reference:,.1f} ms at a peak of {format_size(peak)}; "
                  f"{points} budgets from {LOW}x to {HIGH}x of that, {time_limit_s:g} s each")
    rows, found = [], []
    for factor in _factors(points):  # smallest budget first: what fits it fits every larger one
        console.print(f"[dim]{factor:.2f}x ...[/]")
        row, schedule = _point(problem, factor, peak, time_limit_s, seed, found[-1:])
        rows.append(row)
        found += [schedule] if schedule is not None else []
    Console(highlight=False, width=max(console.width, 150)).print(_curve(rows, reference))
    verdict = checks(rows)
    console.print(f"monotone in the budget: {'yes' if verdict['monotone'] else 'NO'}; worst time lost per 1% "
                  f"less memory between neighbours: {verdict['worst_percent_time_per_percent_memory']:.2f}%")
    save("budget_sweep", rows, problem=problem.name, po_h_ms=reference, po_h_peak_bytes=peak,
         time_limit_s=time_limit_s, checks=verdict)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.budget_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--time-limit", type=float, default=10.0, metavar="S", help="seconds per budget (default 10)")
    parser.add_argument("--points", type=int, default=9, help="budgets between 0.6x and 1.0x (default 9)")
    parser.add_argument("--problem", type=Path, default=PROBLEM, help="a problem file with offload")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run(args.time_limit, max(2, args.points), args.problem, args.seed)


if __name__ == "__main__":
    main()
