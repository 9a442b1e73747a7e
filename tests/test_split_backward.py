"""Split backward: B then W gives exactly the gradients of one ordinary backward, for any module."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from optpipe.runtime.model import CONFIGS, build_model, loss_fn, split_stages, synthetic_batch
from optpipe.runtime.split_backward import StageGrad

torch.set_num_threads(1)

CONFIG = CONFIGS["tiny"]
MICROBATCHES = 3


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _stage_inputs(stages, batch):
    """Each stage's input per microbatch, from a plain forward of the stages before it."""
    inputs = {s: [] for s in range(len(stages))}
    with torch.no_grad():
        for i in range(batch.microbatches):
            x = batch.inputs[i]
            for s, stage in enumerate(stages):
                inputs[s].append(x)
                x = stage(x)
    return inputs


def _run_stage(stage, inputs, batch, last: bool, split: bool, weight_order=None):
    """Forward and backward of one stage over the microbatches; returns the input gradients."""
    runner = StageGrad(stage)
    torch.manual_seed(1)
    input_grads, works = [], []
    for i, x in enumerate(inputs):
        x = x.clone().requires_grad_() if x.is_floating_point() else x
        fwd = runner.forward(x)
        out = loss_fn(fwd.output, batch.targets[i]) / MICROBATCHES if last else fwd.output
        grad = None if last else torch.randn_like(out)
        if split:
            dx, work = runner.backward_input(fwd, [out], [grad])
            works.append(work)
        else:
            dx = runner.backward(fwd, [out], [grad])
        input_grads.append(dx[0].clone() if dx else None)
    if split:
        for i in weight_order or range(len(works)):
            StageGrad.backward_weight(works[i])
    return input_grads


@pytest.mark.parametrize("weight_order", [[0, 1, 2], [2, 0, 1]], ids=["W in order", "W reordered"])
@pytest.mark.parametrize("stage_index", [0, 1, 3], ids=["first (embedding)", "middle", "last (head + loss)"])
def test_split_equals_fused_for_every_gpt_stage(stage_index, weight_order):
    """In order, B/W adds the same numbers in the same order as the fused backward: bit-equal.
    Reordered Ws add the microbatches' contributions in another order: equal to rounding."""
    batch = synthetic_batch(CONFIG, MICROBATCHES, step=0, seed=3)
    fused_model, split_model = build_model(CONFIG, seed=5), build_model(CONFIG, seed=5)
    fused_stages, split_stages_ = split_stages(fused_model, 4), split_stages(split_model, 4)
    inputs = _stage_inputs(fused_stages, batch)[stage_index]
    last = stage_index == 3
    fused_dx = _run_stage(fused_stages[stage_index], inputs, batch, last, split=False)
    split_dx = _run_stage(split_stages_[stage_index], inputs, batch, last, split=True, weight_order=weight_order)
    expected, got = _grads(fused_stages[stage_index]), _grads(split_stages_[stage_index])
    assert set(got) == set(expected) == {n for n, _ in split_stages_[stage_index].named_parameters()}
    for name in expected:
        if weight_order == sorted(weight_order):
            assert torch.equal(got[name], expected[name]), name
        else:
            assert _relative_error(got[name], expected[name]) <= 1e-6, name
    for a, b in zip(fused_dx, split_dx):
        if a is None:
            assert b is None
        else:
            assert torch.equal(b, a)


def test_stages_together_equal_the_whole_model():
    """B/W over all microbatches and stages = one backward of the mean loss of the whole model."""
    batch = synthetic_batch(CONFIG, MICROBATCHES, step=1, seed=0)
    reference = build_model(CONFIG, seed=0)
    for i in range(MICROBATCHES):
        (loss_fn(reference(batch.inputs[i]), batch.targets[i]) / MICROBATCHES).backward()
    model = build_model(CONFIG, seed=0)
    stages = split_stages(model, 4)
    runners = [StageGrad(s) for s in stages]
    works = []
    for i in range(MICROBATCHES):
        x, fwds = batch.inputs[i], []
        for runner in runners:
            fwd = runner.forward(x)
            fwds.append(fwd)
            x = fwd.output.detach().requires_grad_()
        out, grad = loss_fn(fwds[-1].output, batch.targets[i]) / MICROBATCHES, None
        for s in reversed(range(4)):
            dx, work = runners[s].backward_input(fwds[s], [out], [grad])
            works.append(work)
            if s:
                out, grad = fwds[s - 1].output, dx[0]
    assert all(p.grad is None for p in model.parameters()), "B must not touch parameter gradients"
    for work in reversed(works):
        StageGrad.backward_weight(work)
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():  # per-microbatch shapes are the reference's: same sums
        assert _relative_error(p.grad, expected[name].grad) <= 1e-6, name


def test_a_stage_without_an_input_gradient_leaves_everything_to_w():
    """The first stage takes token ids: B has nothing to compute, W runs the whole backward."""
    model = build_model(CONFIG, seed=0)
    stage = split_stages(model, 2)[0]
    runner = StageGrad(stage)
    batch = synthetic_batch(CONFIG, 1, step=0, seed=0)
    fwd = runner.forward(batch.inputs[0])
    assert fwd.inputs == []
    dx, work = runner.backward_input(fwd, [fwd.output], [torch.ones_like(fwd.output)])
    assert dx == [] and work.keeps_everything
    assert all(p.grad is None for p in stage.parameters())
    StageGrad.backward_weight(work)
    assert all(p.grad is not None for p in stage.parameters())


class _Scale(torch.autograd.Function):
    """A custom autograd function with a saved tensor, as user stage code may have."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(dim=0)


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16))
        self.shared = nn.Linear(16, 16)  # applied twice: one parameter group, two intermediates
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.norm = nn.LayerNorm(16)
        self.emb = nn.Embedding(10, 16)

    def forward(self, x):
        ids = torch.arange(x.size(1)) % 10
        x = x + self.emb(ids)  # a parameter branch that joins the input path mid-way
        x = _Scale.apply(x, self.w)
        x = torch.nn.functional.gelu(self.shared(self.shared(x)))
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.norm(x)


@pytest.mark.parametrize("module_factory", [
    lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16)),
    _Custom,
], ids=["mlp", "shared-weights-attention-custom-function"])
def test_any_module(module_factory):
    torch.manual_seed(0)
    fused, split = module_factory(), module_factory()
    split.load_state_dict(fused.state_dict())
    xs = [torch.randn(2, 5, 16) for _ in range(3)]
    dys = [torch.randn(2, 5, 16) for _ in range(3)]
    fused_runner, split_runner = StageGrad(fused), StageGrad(split)
    works, fused_dx, split_dx = [], [], []
    for x, dy in zip(xs, dys):
        f = fused_runner.forward(x.clone().requires_grad_())
        fused_dx.append(fused_runner.backward(f, [f.output], [dy])[0])
        s = split_runner.forward(x.clone().requires_grad_())
        dx, work = split_runner.backward_input(s, [s.output], [dy])
        split_dx.append(dx[0])
        works.append(work)
    assert all(p.grad is None for p in split.parameters())
    for work in works:
        StageGrad.backward_weight(work)
    expected = dict(fused.named_parameters())
    for name, p in split.named_parameters():
        assert _relative_error(p.grad, expected[name].grad) <= 1e-6, name
    for a, b in zip(fused_dx, split_dx):
        assert _relative_error(b, a) <= 1e-6


def test_graph_analysis_is_done_once_per_stage():
    model = build_model(CONFIG, seed=0)
    runner = StageGrad(split_stages(model, 4)[1])
    plans = []
    for _ in range(3):
        x = torch.randn(CONFIG.micro_batch_size, CONFIG.seq_len, CONFIG.n_embd, requires_grad=True)
        fwd = runner.forward(x)
        _, work = runner.backward_input(fwd, [fwd.output], [torch.ones_like(fwd.output)])
        StageGrad.backward_weight(work)
        plans.append(runner._plan)
    assert plans[0] is not None and plans[0] is plans[1] is plans[2]
