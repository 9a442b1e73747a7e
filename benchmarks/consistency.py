"""Does any solver or heuristic disagree with the simulator? Random problems, every schedule source.

    python -m benchmarks consistency      (or python -m benchmarks.consistency [--count 300] [--seconds 0.2])

Each problem is drawn from a seed (``random_problem``): per-stage costs that are no grid's
multiples (or, one time in three, decimals, so exact grids are covered too), p2p from 0 to
0.3 ms, offload with a round trip of k = 0.3 to 3 times a stage's F + B, device budgets from one
activation to ample and host budgets that bind; about three in ten with shared host links
(neighbouring devices in pairs) and three in ten with recompute allowed. Every schedule is re-simulated and compared:

- every registered heuristic, and every warm start (heuristics with W filled and offloads
  added): the timeline it came with must be the simulator's;
- CP-SAT on the whole problem and the MILP (HiGHS): the simulated makespan equals the model's
  objective on an exact grid and is no worse otherwise, and the schedule fits; an exact MILP
  round whose answer breaks the budget counts too; the window search (lns.py): fits;
- the plan lowered from the CP-SAT schedule: the verifier's prediction is the simulator's.

It prints how many problems had a disagreement (0 is the only good answer) and saves the rows
to benchmarks/results/consistency.json.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from optpipe.core.errors import InternalError
from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem, Recompute
from optpipe.core.semantics import TOLERANCE_MS
from optpipe.core.simulate import simulate

from ._common import console, save

__all__ = ["random_problem", "disagreements", "run"]


def random_problem(rng: random.Random, name: str = "random") -> Problem:
    """A small problem (the full CP-SAT model applies) with the awkward numbers of issue 9."""
    p = rng.choice((2, 3, 4))
    v = rng.choice((1, 1, 2)) if p <= 3 else 1
    placement = Placement.VSHAPE if v == 2 and rng.random() < 0.5 else Placement.INTERLEAVED
    m = rng.randint(2, 6 if v == 1 else 3)
    stages = p * v
    decimal = rng.random() < 1 / 3

    def cost(lo: float, hi: float) -> float:
        value = rng.uniform(lo, hi)
        return round(value, 1) if decimal else value

    forward = tuple(cost(0.5, 2.0) for _ in range(stages))
    backward = tuple(cost(0.05, 2.0) for _ in range(stages))
    weight = tuple(cost(0.3, 1.5) for _ in range(stages))
    p2p = 0.0 if rng.random() < 0.2 else cost(0.01, 0.3)
    activation = tuple(rng.randint(100_000, 400_000) for _ in range(stages))
    keep = tuple(int(a * rng.uniform(0.2, 0.8)) for a in activation)
    ample = m * max(sum(activation[s] for s in range(stages) if s % p == d) for d in range(p))
    budget = int(max(activation) + (ample - max(activation)) * rng.random() ** 2)
    offload = Offload()
    if rng.random() < 0.7:
        k = rng.uniform(0.3, 3.0)  # a round trip takes k x (F + B) of a mean stage
        one_way = k * (sum(forward) + sum(backward)) / stages / 2
        bandwidth = sum(activation) / stages * 1e3 / one_way
        host = 2**40 if rng.random() < 0.6 else rng.randint(max(activation), max(activation) * m)
        offload = Offload(True, bandwidth * rng.uniform(0.8, 1.25), bandwidth, host)
    # Drawn last, so the problems above stay what they were for the same seed (issue 14).
    if offload.enabled and p >= 2 and rng.random() < 0.3:  # neighbouring devices share a host link
        groups = tuple((d, d + 1) for d in range(0, p - 1, 2))
        offload = replace(offload, link_groups=groups)
    recompute = Recompute()
    if rng.random() < 0.3:  # a forward may run again before its backward, keeping a resident part
        again = tuple(round(f * rng.uniform(0.8, 1.2), 1) if decimal else f * rng.uniform(0.8, 1.2)
                      for f in forward)
        recompute = Recompute(True, again, tuple(int(a * rng.uniform(0.0, 0.3)) for a in activation))
    return Problem(name, Pipeline(p, v, placement, m), Costs(forward, backward, weight, p2p),
                   Memory(activation, keep, budget), offload, recompute)


def _same(a, b) -> bool:
    return abs(a.makespan - b.makespan) <= TOLERANCE_MS * max(1.0, a.makespan) and a.peak_memory == b.peak_memory \
        and a.host_peak == b.host_peak


def disagreements(problem: Problem, seconds: float, seed: int = 0) -> list[str]:
    """Every way the schedule sources disagree with the simulator on one problem, in words."""
    from optpipe.plan.lower import lower
    from optpipe.plan.verify import predict
    from optpipe.solvers.compare import applicable, compare
    from optpipe.solvers.cpsat import solve_cpsat
    from optpipe.solvers.lns import improve
    from optpipe.solvers.milp import solve_milp
    from optpipe.solvers.timegrid import choose_grid
    from optpipe.solvers.result import fastest_fitting
    from optpipe.solvers.warmstart import warm_starts

    found: list[str] = []
    entries = compare(problem)
    for judged in applicable(entries):
        if not _same(judged.timeline, simulate(problem, judged.schedule)):
            found.append(f"heuristic {judged.name}: its timeline is not the simulator's")
    candidates = warm_starts(problem, entries)
    for candidate in candidates:
        if not _same(candidate.timeline, simulate(problem, candidate.schedule)):
            found.append(f"warm start {candidate.name}: its timeline is not the simulator's")
    start = fastest_fitting(candidates)
    hint = start.schedule if start is not None else None
    try:
        result = solve_cpsat(problem, time_limit_s=seconds, hint=hint, workers=1, seed=seed)
    except InternalError as error:
        found.append(f"cpsat: {error}")
        result = None
    if result is not None and result.schedule is not None:
        found += _judge("cpsat", problem, result, choose_grid(problem).exact)
        program = lower(problem, result.schedule)
        if not _same(predict(program, problem), result.timeline):
            found.append("lowered plan: the verifier's prediction is not the simulator's")
    exact_rounds = []

    def watch(progress) -> None:
        if "exact" in progress.message:
            exact_rounds.append(True)
        elif exact_rounds and "breaks the budget" in progress.message:
            found.append(f"milp-highs: an exact round broke the budget ({progress.message})")

    try:
        milp = solve_milp(problem, backend="highs", time_limit_s=seconds, hint=hint, seed=seed, on_progress=watch)
    except InternalError as error:
        found.append(f"milp-highs: {error}")
        milp = None
    if milp is not None and milp.schedule is not None:
        from optpipe.solvers.milp_model import choose_milp_grid

        found += _judge("milp-highs", problem, milp, choose_milp_grid(problem).exact)
    if start is not None:
        search = improve(problem, start.schedule, time_limit_s=seconds, workers=1, seed=seed)
        again = simulate(problem, search.best.schedule)
        if not again.fits or not _same(again, search.best.timeline):
            found.append("window search: its schedule does not re-simulate as reported within budget")
    return found


def _judge(name: str, problem: Problem, result, exact: bool) -> list[str]:
    again = simulate(problem, result.schedule)
    out = []
    if not again.fits:
        out.append(f"{name}: re-simulates over a budget")
    if not _same(again, result.timeline):
        out.append(f"{name}: its timeline is not the simulator's")
    if result.objective_ms is not None:
        over = again.makespan - result.objective_ms
        tolerance = TOLERANCE_MS * max(1.0, result.objective_ms)
        if over > tolerance or (exact and -over > tolerance):
            out.append(f"{name}: simulated {again.makespan:.9f} ms against the model's {result.objective_ms:.9f} ms")
    return out


def run(count: int = 300, seconds: float = 0.2, seed: int = 9) -> int:
    """Check ``count`` problems; the number that disagree (0 is the only good answer)."""
    rows, bad = [], 0
    began = time.perf_counter()
    columns = (TextColumn("[bold]consistency"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[bad]} disagree"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("problems", total=count, bad=0)
        for n in range(count):
            problem = random_problem(random.Random(seed * 100_003 + n), f"random-{n}")
            found = disagreements(problem, seconds, seed=n)
            bad += bool(found)
            for line in found:
                progress.console.print(f"[red]random-{n}: {line}[/]")
            rows.append({"problem": problem.name, "devices": problem.devices, "stages": problem.stages,
                         "microbatches": problem.microbatches, "offload": problem.offload.enabled,
                         "disagreements": found})
            progress.update(task, advance=1, bad=bad)
    elapsed = time.perf_counter() - began
    colour = "green" if bad == 0 else "red"
    console.print(f"[{colour}]{bad} of {count} problems disagree with the simulator[/] ({elapsed:.0f} s, "
                  f"{seconds:g} s per solver per problem)")
    save("consistency", rows, problems=count, disagreeing=bad, seconds=elapsed, per_solver_limit_s=seconds)
    if bad:  # `python -m benchmarks` reports a benchmark that raises as failed
        raise InternalError(f"{bad} of {count} random problems disagree with the simulator")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.consistency", description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=0.2, help="time limit per solver per problem")
    args = parser.parse_args(argv)
    try:
        run(args.count, args.seconds)
    except InternalError:
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
