"""The public API, ``PipelineRank``, over the example's own model (examples/reverse.py).

The multi-rank checks train the example with AdamW, a warm-up schedule and gradient clipping
on 2 and 4 gloo ranks and hold every step's loss and the last step's gradients against the
same loop in one process (relative error <= 1e-5). A plan switch in the middle of a run must
change nothing but the order of the work; a rank that cannot load the new plan keeps every
rank on the old one. Single-process checks cover the errors a wrong split gets.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from conftest import uniform_problem
from optpipe.plan.bytecode import encode
from optpipe.core.errors import OptpipeError, PlanError
from optpipe.plan.lower import lower
from optpipe.core.problem import Placement
from optpipe.runtime import PipelineRank
from optpipe.runtime.launch import run_local
from optpipe.runtime.workload import WorkloadRequest
from optpipe.solvers.registry import generate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # examples/ is not installed: import it from the checkout
from examples import reverse  # noqa: E402

SEED = 0
STEPS = 3
MAX_NORM = 0.5  # small enough that clipping acts, so the norm must be the whole model's


def _program(name: str, devices: int, microbatches: int, chunks: int = 1,
             placement: Placement = Placement.INTERLEAVED):
    problem = uniform_problem(devices, microbatches, v=chunks, placement=placement, budget=10**12)
    return lower(problem, generate(name, problem))


def _job(program):
    header = program.header
    return reverse.workload(WorkloadRequest(header.stages, header.microbatches, SEED))


def _optimizer(params):
    optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, reverse.warmup_then_cosine(2, 10))


def train(rank: int, world_size: int, program, steps: int, switch_at: int | None = None, switch_to=None,
          refuse_rank: int | None = None):
    """One rank of the example's loop; returns (losses, last step's gradients by name, plans run)."""
    job = _job(program)
    mine = [job.stages[s] for s in program.header.stages_on(rank)]
    pipe = PipelineRank(program, mine, job.loss_fn, device="cpu", timeout=60)
    if rank == refuse_rank:
        def refuse(data, digest):
            raise PlanError("injected: this rank cannot load the plan")

        pipe._load = refuse
    optimizer, schedule = _optimizer(pipe.parameters())
    losses, plans, switched = [], [], []
    batches = iter(job.batches)
    for step in range(steps):
        if step == switch_at:
            switched.append(pipe.switch_plan(switch_to if rank == 0 else None))
        plans.append(pipe.program.header.schedule_name)
        inputs, targets = next(batches)
        optimizer.zero_grad(set_to_none=True)
        losses.append(pipe.step(inputs, targets))
        pipe.clip_grad_norm_(MAX_NORM)
        if step < steps - 1:
            optimizer.step()
            schedule.step()
    grads = {job.parameter_names[id(p)]: p.grad.numpy().copy() for p in pipe.parameters()}
    return losses, grads, plans, switched


def reference(program, steps: int):
    """The same loop in one process, on the whole model."""
    job = _job(program)
    model = nn.Sequential(*job.stages)
    optimizer, schedule = _optimizer(model.parameters())
    m = program.header.microbatches
    losses = []
    batches = iter(job.batches)
    for step in range(steps):
        inputs, targets = next(batches)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(inputs.chunk(m), targets.chunk(m)):
            loss = job.loss_fn(model(x), y) / m
            loss.backward()
            total += loss.item()
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        if step < steps - 1:
            optimizer.step()
            schedule.step()
    return losses, {job.parameter_names[id(p)]: p.grad.numpy().copy() for p in model.parameters()}


def _assert_same(results, expected_losses, expected_grads, what: str) -> float:
    losses = [next(v for v in step if v is not None) for step in zip(*[r[0] for r in results])]
    assert len(losses) == len(expected_losses)
    for got, want in zip(losses, expected_losses):
        assert abs(got - want) <= 1e-5 * abs(want), f"{what}: loss {got} != {want}"
    loss_error = max(abs(got - want) / abs(want) for got, want in zip(losses, expected_losses))
    seen = {}
    for r in results:
        seen.update(r[1])
    assert set(seen) == set(expected_grads)
    worst = 0.0
    for name, grad in seen.items():
        error = float(np.linalg.norm(grad - expected_grads[name]) / np.linalg.norm(expected_grads[name]))
        worst = max(worst, error)
        assert error <= 1e-5, f"{what}: {name} relative error {error:.2e}"
    print(f"{what}: worst relative error: loss {loss_error:.1e}, gradient {worst:.1e}")
    return worst


def two_rank_runs(rank: int, world_size: int, plan_1f1b, plan_zb, plan_zbv):
    """Everything the 2-rank checks need, in one process group (starting processes is the slow part)."""
    import torch.distributed as dist

    runs = {}
    runs["zbv"] = train(rank, world_size, plan_zbv, STEPS)
    dist.barrier()
    runs["zb"] = train(rank, world_size, plan_zb, STEPS)
    dist.barrier()
    runs["plain"] = train(rank, world_size, plan_1f1b, STEPS)
    dist.barrier()
    runs["switch"] = train(rank, world_size, plan_1f1b, STEPS, switch_at=1, switch_to=encode(plan_zb))
    dist.barrier()
    runs["refused"] = train(rank, world_size, plan_1f1b, STEPS, switch_at=1, switch_to=plan_zb, refuse_rank=1)
    return runs


def _zbv(devices: int, microbatches: int):
    return _program("ZBV", devices, microbatches, chunks=2, placement=Placement.VSHAPE)


@pytest.mark.multirank
def test_the_example_on_2_ranks_equals_one_process_and_a_plan_switch_changes_nothing():
    plan_1f1b, plan_zb, plan_zbv = _program("1F1B", 2, 4), _program("ZB-H1", 2, 4), _zbv(2, 4)
    results = run_local(2, two_rank_runs, (plan_1f1b, plan_zb, plan_zbv), timeout=180.0)
    # a V-shape plan: two stages per rank, the loss on rank 0 (the small form of the 4-rank check below)
    zbv_losses, zbv_grads = reference(plan_zbv, STEPS)
    _assert_same([r["zbv"] for r in results], zbv_losses, zbv_grads, "ZBV on 2 ranks")
    losses, grads = reference(plan_zb, STEPS)
    _assert_same([r["zb"] for r in results], losses, grads, "ZB-H1 on 2 ranks")
    _assert_same([r["plain"] for r in results], losses, grads, "1F1B on 2 ranks")
    # the switch: 1F1B for step 0, ZB-H1 from step 1 on, on every rank
    switched = [r["switch"] for r in results]
    assert all(r[3] == [True] for r in switched)
    assert all(r[2] == ["1F1B", "ZB-H1", "ZB-H1"] for r in switched)
    _assert_same(switched, losses, grads, "1F1B switched to ZB-H1 at step 1")
    plain = {k: v for r in results for k, v in r["plain"][1].items()}
    after = {k: v for r in switched for k, v in r[1].items()}
    assert max(float(np.abs(after[k] - plain[k]).max()) for k in plain) <= 1e-6
    # rank 1 cannot load the plan: both ranks keep 1F1B, and training goes on as before
    refused = [r["refused"] for r in results]
    assert all(r[3] == [False] for r in refused)
    assert all(r[2] == ["1F1B"] * STEPS for r in refused)
    _assert_same(refused, losses, grads, "a refused switch")


@pytest.mark.multirank
@pytest.mark.slow  # four processes that import torch; CI runs ZBV on 2 ranks in the test above
def test_the_example_on_4_ranks_with_a_v_shape_plan_equals_one_process():
    plan = _zbv(4, 8)
    results = run_local(4, train, (plan, STEPS), timeout=180.0)
    losses, grads = reference(plan, STEPS)
    _assert_same(results, losses, grads, "ZBV on 4 ranks")


# --------------------------------------------------------------------------- one process


def _one_rank_plan(microbatches: int = 4):
    return _program("GIS", 1, microbatches, chunks=2)


def test_one_process_with_two_stages_equals_the_whole_model_and_a_switch_changes_nothing():
    plan, other = _one_rank_plan(), _program("GPipe", 1, 4, chunks=2)
    results = [train(0, 1, plan, STEPS, switch_at=1, switch_to=other)]
    assert results[0][2] == ["GIS", "GPipe", "GPipe"]
    losses, grads = reference(plan, STEPS)
    _assert_same(results, losses, grads, "one rank, switched")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here"))])
def test_bf16_autocast_gives_what_autocast_gives_without_the_pipeline(device):
    plan = _one_rank_plan()
    job = _job(plan)
    pipe = PipelineRank(plan, list(job.stages), job.loss_fn, device=device)
    inputs, targets = next(iter(job.batches))
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = pipe.step(inputs, targets)
    whole = _job(plan)
    model = nn.Sequential(*whole.stages).to(device)
    total = 0.0
    with torch.autocast(device, dtype=torch.bfloat16):
        for x, y in zip(inputs.to(device).chunk(4), targets.to(device).chunk(4)):
            part = job.loss_fn(model(x), y) / 4
            part.backward()
            total += part.item()
    assert abs(loss - total) <= 1e-3 * total
    ours = {job.parameter_names[id(p)]: p.grad for p in pipe.parameters()}
    for p in model.parameters():
        name = whole.parameter_names[id(p)]
        error = float((ours[name] - p.grad).norm() / p.grad.norm())
        assert error <= 2e-2, (name, error)  # bf16 matmuls; in fp32 the same check holds to 1e-5


def test_a_wrong_number_of_stage_modules_says_which_stages_this_rank_runs():
    plan = _one_rank_plan()
    job = _job(plan)
    with pytest.raises(PlanError, match=r"runs stages \[0, 1\] on rank 0, but this rank was given 1 stage module; "
                                        r"split the model into 2 stages"):
        PipelineRank(plan, job.stages[0], job.loss_fn)
    with pytest.raises(PlanError, match=r"given modules for stages \[0, 2\]"):
        PipelineRank(plan, {0: job.stages[0], 2: job.stages[1]}, job.loss_fn)


def test_stages_that_do_not_fit_together_name_the_two_stages_and_the_shape():
    plan = _one_rank_plan()
    job = _job(plan)
    wrong = nn.Sequential(nn.Linear(64, 16))  # the first stage gives 32 features per token
    pipe = PipelineRank(plan, [job.stages[0], wrong], job.loss_fn)
    inputs, targets = next(iter(job.batches))
    with pytest.raises(PlanError, match=r"stage 1's module fails on the output of stage 0 \(a torch.float32 tensor of "
                                        r"shape \(8, 8, 32\)\).*does not match between stages 0 and 1"):
        pipe.step(inputs, targets)


def test_a_loss_that_does_not_fit_the_targets_and_a_batch_that_does_not_split_are_one_line_errors():
    plan = _one_rank_plan()
    job = _job(plan)
    pipe = PipelineRank(plan, list(job.stages), job.loss_fn)
    inputs, targets = next(iter(job.batches))
    with pytest.raises(OptpipeError, match="a batch of 30 rows does not split into the plan's 4 microbatches"):
        pipe.step(inputs[:30], targets[:30])
    with pytest.raises(PlanError, match="the loss function fails on the last stage's output"):
        pipe.step(inputs, targets[:, :3])


def test_clip_grad_norm_in_one_process_is_torchs():
    plan = _one_rank_plan()
    job = _job(plan)
    pipe = PipelineRank(plan, list(job.stages), job.loss_fn)
    pipe.step(*next(iter(job.batches)))
    copies = [nn.Parameter(p.detach().clone()) for p in pipe.parameters()]
    for copy, p in zip(copies, pipe.parameters()):
        copy.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(copies, 0.1)
    norm = pipe.clip_grad_norm_(0.1)
    assert abs(float(norm) - float(expected)) <= 1e-5 * float(expected)
    for copy, p in zip(copies, pipe.parameters()):
        assert torch.allclose(copy.grad, p.grad, rtol=1e-5, atol=0)


def test_measured_costs_replace_the_problems_times_and_sizes_and_keep_the_rest():
    from optpipe.runtime.improve import measured_costs

    problem = uniform_problem(2, 4, budget=10**9)
    durations = {("F", 0): [2.0, 4.0, 3.0], ("B", 0): [1.0], ("W", 0): [0.5], ("BW", 1): [6.0, 6.0]}
    measured = measured_costs(problem, durations, {0: (1000, 400), 1: (2000, 2000)})
    assert measured.costs.forward == (3.0, 1.0)  # stage 1 was not timed: the problem's
    assert (measured.costs.backward_input, measured.costs.backward_weight) == ((1.0, 3.0), (0.5, 3.0))
    assert (measured.memory.activation, measured.memory.weight_activation) == ((1000, 2000), (400, 2000))
    assert (measured.pipeline, measured.memory.budget, measured.costs.p2p) == (
        problem.pipeline, problem.memory.budget, problem.costs.p2p)


@pytest.mark.parametrize("spec, message", [
    ("tests.factories:one_stage", "the plan has 2 stages but the factory split the model into 1; return exactly "
                                  "request.stages stage modules"),
    ("tests.factories:not_a_workload", "the factory returned a list; it must return "
                                       "optpipe.runtime.workload.Workload"),
    ("tests.factories:nothing", "tests.factories has no 'nothing'"),
    ("tests.nowhere:build", "cannot import tests.nowhere"),
    ("tiny:", "expected tiny, small or package.module:factory"),
])
def test_a_factory_that_does_not_deliver_is_named_with_what_to_change(spec, message):
    from optpipe.runtime.workload import load_workload

    sys.path.insert(0, str(ROOT))
    with pytest.raises(OptpipeError) as caught:
        load_workload(spec, WorkloadRequest(2, 4))
    assert message in str(caught.value)
    assert str(caught.value).startswith("--model")
