"""Whole training jobs as a user starts them: the example under torchrun, a factory named on the
command line (``optpipe profile`` and ``optpipe train``), online improvement, and two torchrun
launchers joined by a c10d rendezvous as two nodes would be.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import uniform_problem
from optpipe.plan.bytecode import write_plan
from optpipe.plan.lower import lower
from optpipe.core.problem_file import dumps_problem, load_problem
from optpipe.runtime.launcher import free_port
from optpipe.solvers.registry import generate

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_NUM_THREADS="1")
STEP = re.compile(r"^step (\d+) loss (\S+)")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A 2-rank problem (fixed costs) with its GPipe and 1F1B plans."""
    path = tmp_path_factory.mktemp("jobs")
    problem = uniform_problem(2, 4, budget=10**12, name="p2")
    (path / "p2.toml").write_text(dumps_problem(problem))
    problem = load_problem(path / "p2.toml")  # the plans name the problem file's hash
    for name in ("GPipe", "1F1B"):
        write_plan(path / f"{name.lower()}.opb", lower(problem, generate(name, problem)))
    return path


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=ENV)


def _losses(stdout: str) -> list[float]:
    return [float(m.group(2)) for m in map(STEP.match, stdout.splitlines()) if m]


def test_the_example_trains_on_two_gloo_ranks_under_torchrun(folder):
    done = _run("torch.distributed.run", "--standalone", "--nproc-per-node", "2", "examples/reverse.py",
                "--plan", str(folder / "1f1b.opb"), "--steps", "100", "--log-every", "20")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1]) for line in lines] == [0, 20, 40, 60, 80, 99]
    losses = [float(line.split()[3]) for line in lines]
    assert losses[0] > 2.5 and losses[-1] < 1.0, losses  # ln(16) = 2.77 at the start: it learns to reverse


def test_profile_measures_a_model_named_by_its_factory(folder):
    out = folder / "reverse.toml"
    done = _run("optpipe.cli", "profile", "--model", "examples.reverse:workload", "--devices", "2",
                "--microbatches", "4", "--p2p", "0.1", "--repeats", "1", "--device", "cpu", "-o", str(out))
    assert done.returncode == 0, done.stderr
    problem = load_problem(out)
    assert (problem.name, problem.stages, problem.microbatches) == ("reverse-p2-v1-m4", 2, 4)
    assert all(size > 0 for size in problem.memory.activation)
    bad = _run("optpipe.cli", "profile", "--model", "examples.nowhere:workload", "--devices", "2",
               "--microbatches", "4", "-o", str(folder / "x.toml"))
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert "cannot import examples.nowhere" in bad.stderr


def _single_process_losses(microbatches: int, steps: int, lr: float) -> list[float]:
    """The example trained as ``optpipe train`` trains it (AdamW, no weight decay), in one process."""
    import torch

    sys.path.insert(0, str(ROOT))  # examples/ is not installed: import it from the checkout
    from examples import reverse
    from optpipe.runtime.workload import WorkloadRequest

    job = reverse.workload(WorkloadRequest(2, microbatches, 0))
    model = torch.nn.Sequential(*job.stages)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, batches = [], iter(job.batches)
    for _ in range(steps):
        inputs, targets = next(batches)
        optimizer.zero_grad()
        total = 0.0
        for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
            loss = job.loss_fn(model(x), y) / microbatches
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return losses


def test_online_improvement_switches_every_rank_and_changes_no_loss(folder):
    improved = _run("optpipe.cli", "train", "--plan", str(folder / "gpipe.opb"), "--model",
                    "examples.reverse:workload", "--steps", "7", "--device", "cpu", "--lr", "1e-3", "--timeout", "30",
                    "--problem", str(folder / "p2.toml"), "--improve", "--improve-after", "2",
                    "--improve-time-limit", "2", "--improve-min-gain", "0.01", "--improve-wait")
    assert improved.returncode == 0, improved.stderr
    switch = [line for line in improved.stdout.splitlines() if "switched" in line]
    assert len(switch) == 1, improved.stdout
    assert re.match(r"improve: before step 4: every rank switched from GPipe to \S+ \(plan [0-9a-f]{12}\); "
                    r"predicted [\d.]+ -> [\d.]+ ms per step with the measured costs \([\d.]+% faster\)", switch[0])
    assert any(re.match(r"improve: measured on rank 0: [\d.]+ ms per step before the switch, [\d.]+ ms over the 2 "
                        r"steps since \([\d.]+% (faster|slower)\)", line) for line in improved.stdout.splitlines())
    # GPipe for steps 0-3, the new plan after: the losses are one process's (printed to 6 decimals)
    expected, got = _single_process_losses(4, 7, 1e-3), _losses(improved.stdout)
    assert len(got) == 7
    assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-5, (got, expected)


def test_two_torchrun_launchers_join_as_two_nodes_and_train(folder):
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "optpipe-two-nodes",
               "-m", "optpipe.runtime.train", "--plan", str(folder / "1f1b.opb"), "--steps", "3", "--device", "cpu",
               "--timeout", "30"]
    nodes = [subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=150) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    losses = [_losses(out) for out, _ in outputs]
    assert sorted(len(l) for l in losses) == [0, 3]  # rank 0, on whichever node it landed, prints each step


def test_online_improvement_starts_on_the_best_fitting_heuristic():
    from optpipe.runtime.improve import starting_plan
    from optpipe.solvers.compare import best_fitting, compare

    problem = uniform_problem(2, 4, budget=10**12)
    assert starting_plan(problem).header.schedule_name == best_fitting(compare(problem)).name


def test_the_readme_training_script_runs_as_written(folder, tmp_path):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Use it in your training job"):]
    script = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_job.py").write_text(script)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "my_job.py", str(folder / "1f1b.opb")], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(line.split()[3]) for line in done.stdout.splitlines() if line.startswith("epoch ")]
    assert len(losses) == 3 and losses[-1] < losses[0], done.stdout
