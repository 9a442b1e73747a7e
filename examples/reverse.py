"""A small transformer learns to reverse token sequences, pipelined by a compiled plan.

Your own model, data loader, optimizer, LR schedule and mixed precision, with optpipe only
scheduling the pipeline. Compile a plan for two ranks and train (from the repository root):

    optpipe profile --model examples.reverse:workload --devices 2 --microbatches 4 -o reverse.toml
    optpipe compile reverse.toml -o reverse.opb
    torchrun --standalone --nproc-per-node 2 examples/reverse.py --plan reverse.opb --steps 300

or, with one line when something fails, ``optpipe train --plan reverse.opb --model
examples.reverse:workload`` (the generic entry point with this file's factory). The loss starts
near ln(16) = 2.77 and falls towards 0 as the model learns to read its input backwards.

The model is plain ``torch.nn``: token and position embeddings, pre-norm encoder layers
(``nn.TransformerEncoderLayer``, no dropout so a pipelined run equals a single-process one), a
layer norm and a linear head. ``workload`` is also a factory for ``--model``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from optpipe.runtime.workload import Workload, WorkloadRequest


@dataclass(frozen=True)
class Config:
    vocab: int = 16  # symbols 0..15
    seq_len: int = 8  # T: tokens per sequence
    d_model: int = 32  # C
    heads: int = 2
    layers: int = 4  # encoder layers; more when the plan has more stages than layers + 2
    micro_batch_size: int = 8  # sequences per microbatch
    samples: int = 4096  # sequences in the generated data set


class Embed(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, C)."""

    def __init__(self, config: Config):
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.d_model)
        self.positions = nn.Embedding(config.seq_len, config.d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.size(1), device=ids.device))


class Head(nn.Module):
    """Hidden states (B, T, C) -> logits (B, T, vocab)."""

    def __init__(self, config: Config):
        super().__init__()
        self.norm = nn.LayerNorm(config.d_model)
        self.out = nn.Linear(config.d_model, config.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_model(config: Config, seed: int) -> nn.Sequential:
    """Embedding, encoder layers, head: the whole model, the same on every rank for one seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = [nn.TransformerEncoderLayer(config.d_model, config.heads, 4 * config.d_model, dropout=0.0,
                                             batch_first=True, norm_first=True) for _ in range(config.layers)]
        return nn.Sequential(Embed(config), *layers, Head(config))


def split(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    """``stages`` consecutive pieces of the model, as even as possible."""
    pieces = list(model)
    if stages > len(pieces):
        raise ValueError(f"the model has {len(pieces)} layers, fewer than the {stages} stages asked for")
    base, extra = divmod(len(pieces), stages)
    result, start = [], 0
    for s in range(stages):
        count = base + (1 if s >= stages - extra else 0)  # the extra layers go to the later stages
        result.append(nn.Sequential(*pieces[start:start + count]))
        start += count
    return result


def reversal_data(config: Config, seed: int) -> TensorDataset:
    """Random sequences and the same sequences reversed: learnable, and the loss visibly falls."""
    generator = torch.Generator().manual_seed(seed + 1)
    inputs = torch.randint(0, config.vocab, (config.samples, config.seq_len), generator=generator)
    return TensorDataset(inputs, inputs.flip(1))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of one microbatch; logits (b, T, vocab), targets (b, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def workload(request: WorkloadRequest) -> Workload:
    """The factory: ``--model examples.reverse:workload``."""
    config = Config(layers=max(Config.layers, request.stages - 2),
                    micro_batch_size=request.micro_batch_size or Config.micro_batch_size)
    model = build_model(config, request.seed)
    loader = DataLoader(reversal_data(config, request.seed), batch_size=config.micro_batch_size * request.microbatches,
                        shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(request.seed))
    names = {id(p): n for n, p in model.named_parameters()}
    return Workload(split(model, request.stages), loss_fn, loader, name="reverse", parameter_names=names)


def warmup_then_cosine(warmup: int, total: int):
    """LR multiplier: linear warm-up, then a cosine decay to a tenth."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
    return factor


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from optpipe.core.errors import OptpipeError
    from optpipe.runtime import PipelineRank, stages_of

    parser = argparse.ArgumentParser(description="Pipelined training of a sequence reverser (run under torchrun).")
    parser.add_argument("--plan", required=True, help="plan file from `optpipe compile`")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20, help="warm-up steps of the learning rate")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm limit over the whole model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    try:
        # The plan says how many stages and which ones this rank runs; the factory splits to match.
        from optpipe.plan.bytecode import read_plan

        program = read_plan(args.plan)
        header = program.header
        job = workload(WorkloadRequest(header.stages, header.microbatches, args.seed))
        mine = [job.stages[s] for s in stages_of(program, rank)]
        pipe = PipelineRank(program, mine, job.loss_fn, device=device)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine(args.warmup, args.steps))
        step = 0
        while step < args.steps:
            for inputs, targets in job.batches:  # a DataLoader: every rank draws the same batches
                optimizer.zero_grad(set_to_none=True)
                # bf16 autocast on a GPU; the pipeline runs each forward inside the caller's autocast.
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    loss = pipe.step(inputs, targets)
                pipe.clip_grad_norm_(args.clip)
                optimizer.step()
                schedule.step()
                if loss is not None and (step % args.log_every == 0 or step == args.steps - 1):
                    print(f"step {step} loss {loss:.4f} lr {schedule.get_last_lr()[0]:.2e}", flush=True)
                step += 1
                if step == args.steps:
                    break
    except OptpipeError as error:
        print(f"rank {rank}: error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # As optpipe.runtime.train does: after a clean run, one process in a few still aborted in
    # torch's C++ destructors at interpreter exit ("terminate called without an active exception").
    os._exit(code)
