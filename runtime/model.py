"""A small GPT in plain torch (nanoGPT's shape) and its split into pipeline stages.

The model is deliberately ordinary: token and position embeddings, pre-norm blocks of causal
self-attention and a GELU MLP, a final layer norm and a linear head. No dropout, so a pipelined
run and a single-process run compute the same function and can be compared gradient for
gradient. The head is not tied to the token embedding: in a pipeline they live on different
ranks, and tying them would need an extra all-reduce that is not part of any schedule here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from optpipe.core.errors import OptpipeError

from .workload import Workload

__all__ = [
    "GPTConfig",
    "CONFIGS",
    "config_named",
    "GPT",
    "Stage",
    "build_model",
    "split_stages",
    "build_stages",
    "layers_per_stage",
    "loss_fn",
    "synthetic_batch",
    "Batch",
    "SyntheticBatches",
    "tiny",
    "small",
]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # tokens 0..vocab_size-1
    seq_len: int = 32  # T: tokens per sequence (nanoGPT's block_size)
    n_layer: int = 8  # transformer blocks; a pipeline of S stages needs n_layer >= S
    n_head: int = 2
    n_embd: int = 32  # C
    micro_batch_size: int = 2  # sequences per microbatch
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise OptpipeError(f"model: n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")


CONFIGS = {
    # Fast enough for multi-process tests on two CPU cores: milliseconds per microbatch.
    "tiny": GPTConfig(),
    # Big enough that compute dominates the interpreter's own overhead on a CPU.
    "small": GPTConfig(vocab_size=512, seq_len=64, n_layer=8, n_head=4, n_embd=128, micro_batch_size=4),
}


def config_named(name: str, **overrides) -> GPTConfig:
    if name not in CONFIGS:
        raise OptpipeError(f"--model: unknown model {name!r}; choose one of {', '.join(CONFIGS)}")
    return replace(CONFIGS[name], **overrides) if overrides else CONFIGS[name]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads side by side
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, C)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Head(nn.Module):
    """Hidden states (B, T, C) -> logits (B, T, vocab)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head = Head(config)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Stage(nn.Module):
    """A contiguous run of the model's layers; its parameters are the model's own objects.

    ``global_names`` maps each parameter's name here to its name in the whole ``GPT``, so a
    pipelined gradient can be matched with the single-process one.
    """

    def __init__(self, index: int, layers: list[nn.Module], global_names: dict[str, str]):
        super().__init__()
        self.index = index
        self.layers = nn.ModuleList(layers)
        self.global_names = global_names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def layers_per_stage(n_layer: int, stages: int) -> list[int]:
    """Blocks per stage, as even as possible, extra blocks to the middle-to-last stages.

    The first stage also holds the embedding and the last the head, so the extra blocks go to
    the stages without either when the division is uneven.
    """
    if stages < 1:
        raise OptpipeError(f"a pipeline needs at least one stage, got {stages}")
    if n_layer < stages:
        raise OptpipeError(
            f"the model has {n_layer} blocks but the plan has {stages} stages; every stage needs at least "
            f"one block: use a model with more layers or a plan with fewer stages"
        )
    base, extra = divmod(n_layer, stages)
    counts = [base] * stages
    order = list(range(1, stages - 1)) + [stages - 1, 0] if stages > 2 else list(range(stages))[::-1]
    for s in order[:extra]:
        counts[s] += 1
    return counts


def build_model(config: GPTConfig, seed: int, dtype: torch.dtype = torch.float32) -> GPT:
    """The whole model, initialised from ``seed`` alone: every rank builds the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    return model.to(dtype=dtype)


def split_stages(model: GPT, stages: int) -> list[Stage]:
    """Cut ``model`` into ``stages`` consecutive stages that share its parameters."""
    counts = layers_per_stage(len(model.blocks), stages)
    names = {id(p): n for n, p in model.named_parameters()}
    result, block = [], 0
    for s, count in enumerate(counts):
        layers: list[nn.Module] = [model.embed] if s == 0 else []
        layers += list(model.blocks[block:block + count])
        block += count
        if s == stages - 1:
            layers.append(model.head)
        stage = Stage(s, layers, {})
        stage.global_names = {local: names[id(p)] for local, p in stage.named_parameters()}
        result.append(stage)
    return result


def build_stages(config: GPTConfig, stages: int, keep: tuple[int, ...], seed: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> dict[int, Stage]:
    """The stages this rank runs, on its device; the others are dropped after the split."""
    model = build_model(config, seed, dtype)
    parts = split_stages(model, stages)
    return {s: parts[s].to(device) for s in keep}


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of one microbatch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


@dataclass(frozen=True)
class Batch:
    """One training step's data: per microbatch, token ids and next-token targets, (b, T) each."""

    inputs: tuple[torch.Tensor, ...]
    targets: tuple[torch.Tensor, ...]

    @property
    def microbatches(self) -> int:
        return len(self.inputs)


def synthetic_batch(config: GPTConfig, microbatches: int, step: int, seed: int) -> Batch:
    """Learnable synthetic tokens: each sequence follows one fixed random permutation of the vocabulary.

    The next token is a function of the current one, so the loss falls within tens of steps; the
    data depend only on (seed, step), so every rank draws the same batch without talking.
    """
    successor = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(seed))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    rows = microbatches * config.micro_batch_size
    tokens = torch.empty(rows, config.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, config.vocab_size, (rows,), generator=generator)
    for t in range(config.seq_len):
        tokens[:, t + 1] = successor[tokens[:, t]]
    inputs = tuple(c.contiguous() for c in tokens[:, :-1].split(config.micro_batch_size))
    targets = tuple(c.contiguous() for c in tokens[:, 1:].split(config.micro_batch_size))
    return Batch(inputs, targets)


class SyntheticBatches:
    """``synthetic_batch`` for steps 0, 1, 2, ... as whole batches ``(inputs, targets)``, without end."""

    def __init__(self, config: GPTConfig, microbatches: int, seed: int):
        self.config, self.microbatches, self.seed = config, microbatches, seed

    def __iter__(self):
        step = 0
        while True:
            batch = synthetic_batch(self.config, self.microbatches, step, self.seed)
            yield torch.cat(batch.inputs), torch.cat(batch.targets)
            step += 1


def _gpt_workload(name: str, request):
    overrides = {"micro_batch_size": request.micro_batch_size} if request.micro_batch_size else {}
    config = config_named(name, **overrides)
    stages = split_stages(build_model(config, request.seed), request.stages)
    return Workload(stages, loss_fn, SyntheticBatches(config, request.microbatches, request.seed), name=name)


def tiny(request):
    """The built-in factory ``--model tiny``: the tiny GPT on synthetic tokens."""
    return _gpt_workload("tiny", request)


def small(request):
    """The built-in factory ``--model small``."""
    return _gpt_workload("small", request)
