"""How fast the simulator judges a large schedule (target: 49,152 compute ops in under 2 s)."""

from __future__ import annotations

import argparse
import statistics
import time

from rich.table import Table

from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem
from optpipe.core.schedule import Schedule
from optpipe.core.simulate import simulate
from optpipe.solvers.heuristics.gpipe import gpipe

from ._common import console, save


def large_problem(p: int = 32, v: int = 2, m: int = 256) -> Problem:
    stages = p * v
    return Problem("sim-speed", Pipeline(p, v, Placement.INTERLEAVED, m),
                   Costs((1.0,) * stages, (1.0,) * stages, (1.0,) * stages, 0.1),
                   Memory((100,) * stages, (50,) * stages, 10**12), Offload())


def split_backward_schedule(problem: Problem) -> Schedule:
    """GPipe with its backwards split: all forwards by stage, then each stage's B and W in turn,
    3 compute ops per (stage, microbatch)."""
    return gpipe(problem).with_split_backwards().renamed("split-gpipe")


def run(repeats: int = 3) -> list[dict]:
    problem = large_problem()
    schedule = split_backward_schedule(problem)
    ops = sum(len(d) for d in schedule.devices)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        timeline = simulate(problem, schedule)
        times.append(time.perf_counter() - start)
    row = {"devices": problem.devices, "chunks": problem.pipeline.chunks_per_device,
           "microbatches": problem.microbatches, "compute_ops": ops, "best_s": min(times),
           "median_s": statistics.median(times), "target_s": 2.0, "makespan_ms": timeline.makespan}
    table = Table(title="simulator speed")
    for key in row:
        table.add_column(key, justify="right")
    table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()))
    console.print(table)
    save("simulator_speed", [row])
    return [row]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    run(parser.parse_args().repeats)
