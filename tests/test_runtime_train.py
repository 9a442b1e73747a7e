"""The training entry point, its trace, and ``optpipe profile``, each run as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optpipe.plan.bytecode import write_plan
from optpipe.plan.lower import lower
from optpipe.core.problem_file import load_problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.runtime.model import CONFIGS
from optpipe.runtime.profile import profile_stages

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=kwargs.pop("env", ENV), **kwargs)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> Path:
    """A problem for one rank with two stages, measured by ``optpipe profile`` (p2p given: one rank)."""
    path = tmp_path_factory.mktemp("profile") / "tiny.toml"
    done = _run(["optpipe.cli", "profile", "--model", "tiny", "--devices", "1", "--chunks", "2",
                 "--microbatches", "3", "--offload", "--p2p", "0", "--repeats", "1", "--device", "cpu",
                 "-o", str(path)])
    assert done.returncode == 0, done.stderr
    return path


def test_profile_writes_the_sizes_the_runtime_counts(profiled):
    problem = load_problem(profiled)
    assert (problem.devices, problem.stages, problem.microbatches) == (1, 2, 3)
    assert problem.offload.enabled and problem.offload.d2h_bandwidth > 0
    measured = profile_stages(CONFIGS["tiny"], 2, repeats=1, warmup=0)
    assert problem.memory.activation == tuple(p.activation for p in measured)
    assert problem.memory.weight_activation == tuple(p.weight_activation for p in measured)
    # the first stage takes token ids: no input gradient, so W needs everything (see split_backward)
    assert problem.memory.weight_activation[0] == problem.memory.activation[0]
    assert problem.memory.weight_activation[1] < problem.memory.activation[1]
    assert all(ms > 0 for ms in problem.costs.forward + problem.costs.backward_input + problem.costs.backward_weight)


def test_train_prints_every_step_and_writes_a_trace_beside_the_prediction(profiled, tmp_path):
    problem = load_problem(profiled)
    ops = [Op(OpKind.F, s, i) for s in (0, 1) for i in range(3)]
    ops.insert(1, Op(OpKind.OFFLOAD, 0, 0))
    ops += [Op(kind, 1, i) for i in range(3) for kind in (OpKind.B, OpKind.W)]
    ops += [Op(OpKind.RELOAD, 0, 0)] + [Op(OpKind.BW, 0, i) for i in range(3)]
    plan, trace = tmp_path / "plan.opb", tmp_path / "trace.json"
    write_plan(plan, lower(problem, Schedule.of("hand-made", [ops])))
    done = _run(["optpipe.runtime.train", "--plan", str(plan), "--steps", "3", "--device", "cpu",
                 "--trace", str(trace), "--problem", str(profiled)])
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["0", "1", "2"]
    losses = [float(line.split()[3]) for line in lines]
    assert all(0 < loss < 10 for loss in losses)
    events = json.loads(trace.read_text())["traceEvents"]
    measured = [e for e in events if e.get("ph") == "X" and e["pid"] >= 1000]
    predicted = [e for e in events if e.get("ph") == "X" and e["pid"] < 1000]
    assert {e["name"] for e in measured} >= {"F0:0", "OFF0:0", "REL0:0", "B1:2", "W1:2", "BW0:2"}
    assert {e["name"] for e in predicted} == {str(op) for op in ops}


def test_train_refuses_a_damaged_plan(tmp_path):
    plan = tmp_path / "broken.opb"
    plan.write_bytes(b"\x89OPB\r\n\x1a\nnot a plan")
    done = _run(["optpipe.runtime.train", "--plan", str(plan), "--device", "cpu"])
    assert done.returncode == 1
    assert "error:" in done.stderr and "broken.opb" in done.stderr
