"""Shared fixtures (the benchmark problems shipped in benchmarks/problems/) and the two forms of the suite.

CI runs the small form: tests marked ``slow`` are deselected and property tests draw a fixed,
derandomized sample. ``OPTPIPE_FULL_TESTS=1`` (``make test-full``) runs every slow case and the
property tests' full, random example counts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem
from optpipe.core.problem_file import load_problem

ROOT = Path(__file__).resolve().parent.parent
PROBLEM_DIR = ROOT / "benchmarks" / "problems"
if str(ROOT) not in sys.path:  # benchmarks/ and examples/ are not installed: a test file run alone imports them too
    sys.path.insert(0, str(ROOT))
INSTANCES = sorted(PROBLEM_DIR.glob("*.toml"))

FULL_TESTS = os.environ.get("OPTPIPE_FULL_TESTS", "") == "1"

# CI: the same sample every run (a failure reproduces); full: hypothesis's random search, as many
# examples as each test asks for.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("full")
settings.load_profile("full" if FULL_TESTS else "ci")


def examples(full: int, *, ci: int) -> int:
    """A property test's example count: ``full`` in the full form, ``ci`` in CI."""
    return full if FULL_TESTS else ci


def pytest_report_header(config) -> str:
    if FULL_TESTS:
        return "optpipe: the full form (OPTPIPE_FULL_TESTS=1): slow cases run, property tests random"
    return "optpipe: the CI form: slow cases deselected, property tests derandomized; make test-full runs everything"


def pytest_collection_modifyitems(config, items) -> None:
    """The CI form leaves out the slow cases; each has a small form that CI runs."""
    if FULL_TESTS:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


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
