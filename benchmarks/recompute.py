"""Keep, offload or recompute (issue 14): the solver's mix against each pure strategy.

One pipeline (p = 4, m = 8, F = B = W = 20 ms, 229 MiB activations) with a tight budget, and a
host link from k = 0.5 (a round trip takes half a stage's F + B) to k = 3. Each strategy is the
same compile (CP-SAT from the best fitting heuristic) on the problem with only its choices
enabled: keep-only has neither offload nor recompute, offload-only no recompute, recompute-only
no offload, the mix both, each with compile's default workers (both cores here: CP-SAT's large
neighbourhood search needs two). A recompute re-runs the whole forward (20 ms) and keeps the
stage input (5% of the activation) in between.

Budgets of 2.5 and 3 activations: room for the activation in use plus one and a half or two more,
so 1F1B (which holds up to four on the first device) does not fit. (At exactly 2 an offload's
transfers need the whole spare activation while no recomputed input, 5% each, waits on the
device, so a mix gains little over recompute-only there.)

CP-SAT on two workers is not repeatable to the millisecond: the same compile varies by a few
percent from run to run. Each cell is the median of RUNS compiles, with every run's makespan in
the JSON, so that a difference the table shows is one the solver makes, not the noise.

20 s a compile keeps the whole table near 13 minutes; compile's own default is 60 s, and
``--time-limit 60 --budgets 2.5,3 --ks 2,3`` runs the rows where the link is slow at it (about
36 minutes, saved to recompute_part.json). The mix's search is the one that gains from the
longer limit: at 2.5 activations, k = 3, it finds its 585 ms in some 20 s runs and in every 60 s
run so far.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from rich.table import Table

from optpipe.core.errors import InfeasibleError
from optpipe.core.problem import Recompute
from optpipe.core.problem_file import load_problem
from optpipe.solvers.compile import compile_problem

from ._common import PROBLEMS, console, save

TIME_LIMIT_S = 20.0
KS = (0.5, 1.0, 2.0, 3.0)
BUDGETS = (2.5, 3.0)  # in activations
RUNS = 3


def _problem(k: float, activations: float):
    base = load_problem(PROBLEMS / "balanced-p4-m8-tight.toml")  # k = 0.5 at 24 GB/s
    act = base.memory.activation
    bandwidth = base.offload.d2h_bandwidth * 0.5 / k
    return replace(base, name=f"balanced-p4-m8-k{k:g}-b{activations:g}",
                   offload=replace(base.offload, d2h_bandwidth=bandwidth, h2d_bandwidth=bandwidth),
                   recompute=Recompute(True, base.costs.forward, tuple(a // 20 for a in act))
                   ).with_budget(int(activations * act[0]))


def _compile(problem, time_limit_s):
    """The median of RUNS compiles (by makespan), with every run's makespan."""
    runs = []
    for seed in range(RUNS):
        try:
            result = compile_problem(problem, time_limit_s=time_limit_s, seed=seed)
        except InfeasibleError:
            return None
        runs.append({"makespan_ms": result.makespan_ms, "lower_bound_ms": result.lower_bound_ms,
                     "offloaded": len(result.judged.schedule.offloaded),
                     "recomputed": len(result.judged.schedule.recomputed),
                     "peak": result.judged.peak, "fits": result.judged.fits})
    runs.sort(key=lambda run: run["makespan_ms"])
    return {**runs[len(runs) // 2], "runs_ms": [run["makespan_ms"] for run in runs]}


def run(time_limit_s: float = TIME_LIMIT_S, budgets: tuple[float, ...] = BUDGETS, ks: tuple[float, ...] = KS) -> list[dict]:
    rows = []
    for activations in budgets:
        fixed = {}
        for k in ks:
            problem = _problem(k, activations)
            if not fixed:  # keep-only and recompute-only do not use the link
                fixed["keep"] = _compile(problem.without_offload().without_recompute(), time_limit_s)
                fixed["recompute"] = _compile(problem.without_offload(), time_limit_s)
            row = {"k": k, "budget_activations": activations, "budget_bytes": problem.memory.budget,
                   "keep": fixed["keep"], "offload": _compile(problem.without_recompute(), time_limit_s),
                   "recompute": fixed["recompute"], "mix": _compile(problem, time_limit_s)}
            rows.append(row)
    table = Table(title=f"p = 4, m = 8, F = B = W = 20 ms: makespan (ms) by strategy, median of {RUNS} "
                        f"(CP-SAT, {time_limit_s:g} s each; offloaded / recomputed pairs)")
    for column in ("budget", "k", "keep only", "offload only", "recompute only", "mix", "mix bound"):
        table.add_column(column, justify="right")

    def cell(entry):
        if entry is None:
            return "[red]no fit[/]"
        return f"{entry['makespan_ms']:.1f} ({entry['offloaded']}/{entry['recomputed']})"

    for r in rows:
        best_pure = min((r[s]["makespan_ms"] for s in ("keep", "offload", "recompute") if r[s]), default=None)
        mix = cell(r["mix"])
        if r["mix"] and best_pure and r["mix"]["makespan_ms"] < best_pure - 1e-6:
            mix = f"[bold green]{mix}[/]"
        table.add_row(f"{r['budget_activations']:g} act", f"{r['k']:g}", cell(r["keep"]), cell(r["offload"]),
                      cell(r["recompute"]), mix, f"{r['mix']['lower_bound_ms']:.1f}" if r["mix"] else "-")
    console.print(table)
    whole = time_limit_s == TIME_LIMIT_S and budgets == BUDGETS and ks == KS
    save("recompute" if whole else "recompute_part", rows, time_limit_s=time_limit_s, runs=RUNS)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recompute", description=__doc__.split("\n")[0])
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, metavar="S",
                        help=f"seconds per compile (default {TIME_LIMIT_S:g}; compile's own default is 60)")
    parser.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS), metavar="A,A",
                        help="budgets in activations (default %(default)s)")
    parser.add_argument("--ks", default=",".join(f"{k:g}" for k in KS), metavar="K,K",
                        help="offload ratios (default %(default)s)")
    args = parser.parse_args(argv)
    floats = lambda text: tuple(float(x) for x in text.split(",") if x)  # noqa: E731
    run(args.time_limit, floats(args.budgets), floats(args.ks))  # a part of the table saves to recompute_part.json


if __name__ == "__main__":
    main()
