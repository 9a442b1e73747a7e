"""Shared host links (issue 14): what a plan that ignores them promises, and what it gets.

Two GPUs behind one PCIe switch share its bandwidth (``[offload] link_groups``). A schedule
compiled as if each had its own link is timed again with the sharing: its transfers queue
behind the neighbour's, backwards wait for reloads and offloads free memory later. The aware
compile (the same solver on the problem with its link groups) is the answer.
"""

from __future__ import annotations

from dataclasses import replace

from rich.table import Table

from optpipe.core.problem_file import load_problem
from optpipe.core.simulate import simulate
from optpipe.core.units import format_size
from optpipe.solvers.compile import compile_problem

from ._common import PROBLEMS, console, save

GROUPS = ((0, 1), (2, 3))
TIME_LIMIT_S = 10.0


def _problem(k: float, budget_fraction: float):
    base = load_problem(PROBLEMS / "balanced-p4-m8-tight.toml")  # k = 0.5 at 24 GB/s
    bandwidth = base.offload.d2h_bandwidth * 0.5 / k
    budget = int(base.memory.budget * budget_fraction)
    own = replace(base, name=f"balanced-p4-m8-k{k:g}", offload=replace(base.offload, d2h_bandwidth=bandwidth,
                                                                      h2d_bandwidth=bandwidth)).with_budget(budget)
    return own, replace(own, offload=replace(own.offload, link_groups=GROUPS))


def run(time_limit_s: float = TIME_LIMIT_S) -> list[dict]:
    rows = []
    for k, budget_fraction in ((1.0, 1.5), (1.0, 1.75), (1.5, 1.25), (1.5, 1.5)):  # budgets in 2-activation units
        own, shared = _problem(k, budget_fraction)
        ignorant = compile_problem(own, time_limit_s=time_limit_s, workers=1)
        truth = simulate(shared, ignorant.judged.schedule)
        aware = compile_problem(shared, time_limit_s=time_limit_s, workers=1)
        rows.append({
            "k": k, "budget_bytes": own.memory.budget,
            "ignoring_planned_ms": ignorant.makespan_ms, "ignoring_planned_peak": ignorant.judged.peak,
            "ignoring_actual_ms": truth.makespan, "ignoring_actual_peak": truth.peak, "ignoring_fits": truth.fits,
            "ignoring_offloaded": len(ignorant.judged.schedule.offloaded),
            "aware_ms": aware.makespan_ms, "aware_peak": aware.judged.peak, "aware_fits": aware.judged.fits,
            "aware_offloaded": len(aware.judged.schedule.offloaded), "aware_lower_bound_ms": aware.lower_bound_ms,
        })
    table = Table(title=f"p = 4, m = 8, link groups {GROUPS}: compiled ignoring the sharing vs aware of it "
                        f"(CP-SAT, {time_limit_s:g} s)")
    for column in ("k", "budget", "ignoring: planned ms", "actual ms", "actual peak", "fits",
                   "aware ms", "aware peak", "fits", "bound ms"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(f"{r['k']:g}", format_size(r["budget_bytes"]), f"{r['ignoring_planned_ms']:.1f}",
                      f"{r['ignoring_actual_ms']:.1f}", format_size(r["ignoring_actual_peak"]),
                      "yes" if r["ignoring_fits"] else "[red]no[/]", f"{r['aware_ms']:.1f}",
                      format_size(r["aware_peak"]), "yes" if r["aware_fits"] else "[red]no[/]",
                      f"{r['aware_lower_bound_ms']:.1f}")
    console.print(table)
    save("shared_links", rows, time_limit_s=time_limit_s, link_groups=[list(g) for g in GROUPS])
    return rows


if __name__ == "__main__":
    run()
