"""Training entry point: a small GPT on synthetic tokens, pipelined by a compiled plan.

    torchrun --nproc-per-node 4 -m optpipe.runtime.train --plan PLAN.opb --model tiny --steps 20

Every rank builds the same model from the seed, keeps its own stages, and runs the plan's
instruction stream once per step; the optimizer (AdamW) steps each rank's parameters. Rank 0
prints ``step N loss X`` for every step under a ``rich`` progress bar. The plan is read and
checked against the world size before the process group is even joined, so a plan for
another world size is refused before any communication. CPU runs use gloo, GPU runs NCCL,
with no change to the command; torchrun's multi-node options work as usual.

``--trace FILE`` writes a Chrome trace of the last step: each rank's measured instructions
and, beside them, the simulator's prediction (for ``--problem`` when given, else for the
costs and sizes measured in this run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from optpipe.compiler.bytecode import read_plan
from optpipe.compiler.errors import OptpipeError
from optpipe.compiler.program import Program

from .comm import P2P
from .interpreter import InstructionRecord, Interpreter, StepResult, check_plan
from .model import build_stages, config_named, loss_fn, synthetic_batch

__all__ = ["TrainOptions", "RankReport", "train_rank", "main", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TrainOptions:
    model: str = "tiny"
    steps: int = 10
    seed: int = 0
    lr: float = 1e-2
    optimizer: str = "adamw"  # adamw, sgd, or none (gradients computed, weights left as they are)
    dtype: str = "float32"
    micro_batch_size: int | None = None  # default: the model's
    device: str = "auto"  # auto: CUDA when there is one, else CPU
    trace: bool = False  # record every instruction's time in the last step
    gradients: bool = False  # report the last step's gradients (before the update)
    timeout_s: float = 60.0  # a wait on a peer longer than this is an error, not a hang


@dataclass(frozen=True)
class RankReport:
    """What one rank saw; plain data, so it crosses process boundaries."""

    rank: int
    stages: tuple[int, ...]
    losses: tuple[float | None, ...]  # per step (on the last stage's rank)
    step_seconds: tuple[float, ...]
    peak_activation_bytes: tuple[int, ...]  # per step, from the activation store
    activation_bytes: dict[int, tuple[int, int]]  # stage -> (saved by F, still needed by W after B)
    records: tuple[InstructionRecord, ...] = ()  # last step, when tracing
    step_started_ns: int = 0  # host clock at the start of the last step
    gradients: dict[str, object] = field(default_factory=dict)  # global parameter name -> numpy array


def _device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise OptpipeError("--device cuda: this machine has no CUDA device; use --device cpu")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if choice not in ("auto", "cpu"):
        raise OptpipeError(f"--device: expected auto, cpu or cuda, got {choice!r}")
    return torch.device("cpu")


def train_rank(rank: int, world_size: int, program: Program, options: TrainOptions,
               on_step: Callable[[int, StepResult], None] | None = None, local_rank: int | None = None) -> RankReport:
    """Train on this rank of an initialised process group (or alone when ``world_size`` is 1)."""
    if options.dtype not in DTYPES:
        raise OptpipeError(f"--dtype: expected one of {', '.join(DTYPES)}, got {options.dtype!r}")
    device = _device(options.device, rank if local_rank is None else local_rank)
    overrides = {"micro_batch_size": options.micro_batch_size} if options.micro_batch_size else {}
    config = config_named(options.model, **overrides)
    header = program.header
    mine = header.stages_on(rank)
    stages = build_stages(config, header.stages, mine, options.seed, device, DTYPES[options.dtype])
    comm = P2P(header.stages, header.microbatches, timedelta(seconds=options.timeout_s)) if world_size > 1 else None
    interpreter = Interpreter(program, rank, stages, loss_fn, device=device, comm=comm, trace=False)
    params = [p for s in mine for p in stages[s].parameters()]
    optimizer = _optimizer(options, params)
    losses, seconds, peaks = [], [], []
    gradients: dict[str, object] = {}
    result = None
    for step in range(options.steps):
        batch = synthetic_batch(config, header.microbatches, step, options.seed)
        interpreter.trace = options.trace and step == options.steps - 1
        for p in params:
            p.grad = None
        result = interpreter.step(batch)
        if options.gradients and step == options.steps - 1:
            for s in mine:
                for local, p in stages[s].named_parameters():
                    gradients[stages[s].global_names[local]] = p.grad.detach().float().cpu().numpy().copy()
        if optimizer is not None:
            optimizer.step()
        losses.append(result.loss)
        seconds.append(result.seconds)
        peaks.append(result.peak_activation_bytes)
        if on_step is not None:
            on_step(step, result)
    return RankReport(rank, mine, tuple(losses), tuple(seconds), tuple(peaks), dict(interpreter.activation_bytes),
                      result.records if result is not None else (), result.started_ns if result else 0, gradients)


def _optimizer(options: TrainOptions, params: list) -> torch.optim.Optimizer | None:
    if options.optimizer == "none":
        return None  # also spares importing torch._dynamo, which torch.optim does on first use
    if options.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=options.lr, weight_decay=0.0)
    if options.optimizer == "sgd":
        return torch.optim.SGD(params, lr=options.lr)
    raise OptpipeError(f"--optimizer: expected adamw, sgd or none, got {options.optimizer!r}")


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m optpipe.runtime.train",
                                     description="Train a small GPT on synthetic tokens with a compiled pipeline plan "
                                                 "(launch with torchrun, one process per plan rank).")
    parser.add_argument("--plan", required=True, metavar="PLAN.opb", help="plan file from `optpipe compile`")
    parser.add_argument("--model", default="tiny", help="tiny or small (default tiny)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the synthetic data")
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate (default 1e-2)")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd", "none"),
                        help="none computes the gradients and leaves the weights (default adamw)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameter and activation dtype")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="sequences per microbatch")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--trace", metavar="FILE",
                        help="write a Chrome trace of the last step (measured and predicted)")
    parser.add_argument("--problem", metavar="PROBLEM.toml", help="the problem the plan was compiled for, "
                                                                   "for the predicted half of the trace")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a rank waits on a peer before it "
                                                                    "gives up with an error (default 60)")
    return parser


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise OptpipeError(f"environment {name}={value!r}: expected an integer (set by torchrun)") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    try:
        if args.steps < 1:
            raise OptpipeError(f"--steps: expected at least 1, got {args.steps}")
        program = read_plan(args.plan)
        # Everything about the plan is checked here, before joining the process group.
        config = config_named(args.model)
        check_plan(program, rank, world_size, {s: None for s in program.header.stages_on(rank)})
        from .model import layers_per_stage

        layers_per_stage(config.n_layer, program.header.stages)
        problem = None
        if args.problem:
            from optpipe.compiler.problem import load_problem
            from optpipe.compiler.verify import check_against_problem

            problem = load_problem(args.problem)
            check_against_problem(program, problem)
    except OptpipeError as error:
        print(f"rank {rank}: error: {error}", file=sys.stderr)
        return error.exit_code

    options = TrainOptions(model=args.model, steps=args.steps, seed=args.seed, lr=args.lr, optimizer=args.optimizer,
                           dtype=args.dtype,
                           micro_batch_size=args.micro_batch_size, device=args.device, trace=bool(args.trace),
                           timeout_s=args.timeout)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if world_size > 1:
        if use_cuda:
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    try:
        report = _run(rank, world_size, local_rank, program, options, use_cuda)
        if args.trace:
            _write_trace(args.trace, rank, world_size, program, report, problem)
    except OptpipeError as error:
        print(f"rank {rank}: error: {error}", file=sys.stderr, flush=True)
        os._exit(error.exit_code)  # the peers see the connection drop and stop too
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if world_size > 1:
        dist.destroy_process_group()
    return 0


def _run(rank: int, world_size: int, local_rank: int, program: Program, options: TrainOptions,
         use_cuda: bool) -> RankReport:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    progress = Progress(TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                        console=console, disable=rank != 0, transient=True)
    task = progress.add_task("train", total=options.steps, loss="-")
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")

    def on_step(step: int, result: StepResult) -> None:
        value = result.loss if result.loss is not None else 0.0
        if world_size > 1:  # the loss lives on the last stage's rank; everyone else adds zero
            tensor = torch.tensor([value], dtype=torch.float64, device=device)
            dist.all_reduce(tensor)
            value = float(tensor.item())
        if rank == 0:
            progress.update(task, advance=1, loss=f"{value:.4f}")
            print(f"step {step} loss {value:.6f}", flush=True)

    with progress:
        return train_rank(rank, world_size, program, options, on_step, local_rank)


def _write_trace(path: str, rank: int, world_size: int, program: Program, report: RankReport, problem) -> None:
    from .trace import run_trace

    reports = [report]
    if world_size > 1:
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, report)
        reports = gathered
    if rank == 0:
        Path(path).write_text(json.dumps(run_trace(program, reports, problem)))
        print(f"trace written to {path} (open in ui.perfetto.dev)", flush=True)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: after every rank had finished and destroyed its process group,
    # one in a few runs still aborted there ("terminate called without an active exception",
    # in torch's C++ threads), failing a run that had trained every step.
    os._exit(code)
