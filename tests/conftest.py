"""Shared fixtures: the benchmark problems shipped in benchmarks/problems/."""

from __future__ import annotations

from pathlib import Path

import pytest

from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem
from optpipe.core.problem_file import load_problem

ROOT = Path(__file__).resolve().parent.parent
PROBLEM_DIR = ROOT / "benchmarks" / "problems"
INSTANCES = sorted(PROBLEM_DIR.glob("*.toml"))


def uniform_problem(p: int, m: int, *, v: int = 1, f: float = 1.0, b: float = 1.0, w: float = 1.0,
                    p2p: float = 0.0, act: int = 100, keep: int = 50, budget: int | None = None,
                    placement: Placement = Placement.INTERLEAVED, offload: Offload | None = None,
                    name: str = "uniform") -> Problem:
    """A problem with equal stage costs, for closed-form checks."""
    stages = p * v
    return Problem(
        name=name,
        pipeline=Pipeline(p, v, placement, m),
        costs=Costs((f,) * stages, (b,) * stages, (w,) * stages, p2p),
        memory=Memory((act,) * stages, (keep,) * stages, budget if budget is not None else act * m * v),
        offload=offload or Offload(),
    )


@pytest.fixture(params=INSTANCES, ids=lambda p: p.stem)
def instance(request) -> Problem:
    return load_problem(request.param)

# A small valid problem file that tests edit one key at a time.
BASE_PROBLEM = """
name = "t"
[pipeline]
devices = 4
chunks_per_device = 1
placement = "interleaved"
microbatches = 8
[costs]
forward = 20
backward_input = 20
backward_weight = 20
p2p = 0.5
[memory]
activation = "200MiB"
weight_activation = "100MiB"
budget = "1GiB"
[offload]
enabled = true
d2h_bandwidth = "24GB/s"
h2d_bandwidth = "24GB/s"
host_budget = "64GiB"
"""
