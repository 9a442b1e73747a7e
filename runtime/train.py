"""Training entry point: a plan over a model from a factory (the built-in GPT by default).

    torchrun --nproc-per-node 4 -m optpipe.runtime.train --plan PLAN.opb --model tiny --steps 20
    torchrun --nproc-per-node 2 -m optpipe.runtime.train --plan PLAN.opb --model examples.reverse:workload

Every rank calls the model factory (``--model tiny``, ``small`` or ``package.module:factory``,
see ``workload.py``), keeps its own stages, and runs them through ``PipelineRank``; the
optimizer (AdamW) steps each rank's parameters. Rank 0 prints ``step N loss X`` for every step
under a ``rich`` progress bar. The options, the plan and the model are checked before the
process group is joined, so a bad option, a damaged plan or a plan for another world size is
one line per rank before any communication. CPU runs use gloo, GPU runs NCCL, with no change
to the command; torchrun's multi-node options work as usual.

Every failure is one line per rank, ``rank R: error: ...``, within ``--timeout``: a bad option,
a taken port or a peer that never arrives (joining is watched by a timer), a peer that dies in
a point-to-point message or in a collective. ``optpipe train`` runs the ranks on this machine
and sums them up in one line (torchrun prints its own ChildFailedError report after them).

``--trace FILE`` writes a Chrome trace of the last step: each rank's measured instructions
and, beside them, the simulator's prediction (for ``--problem`` when given, else for the
costs and sizes measured in this run). ``--improve`` (with ``--problem``) measures op times,
re-solves in the background and switches every rank to a faster plan (``improve.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from optpipe.core.errors import OptpipeError
from optpipe.core.problem import Problem
from optpipe.core.problem_file import load_problem
from optpipe.plan.bytecode import read_plan
from optpipe.plan.program import Program
from optpipe.plan.verify import check_against_problem

from .comm import collective, first_line
from .device import DTYPES, select_device, wants_cuda
from .errors import PipelineAborted
from .improve import OnlineImprover, starting_plan
from .interpreter import InstructionRecord, StepResult, check_plan
from .options import LineParser, add_train_arguments, check
from .pipeline import PipelineRank
from .trace import run_trace
from .workload import Workload, WorkloadRequest, batch_stream, load_workload

__all__ = ["TrainOptions", "RankReport", "train_rank", "main", "DTYPES"]


@dataclass(frozen=True)
class TrainOptions:
    model: str = "tiny"  # tiny, small, or package.module:factory
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
    improve: bool = False  # online improvement (needs the problem)
    improve_after: int = 3  # steps measured
    improve_time_limit: float = 20.0
    improve_min_gain: float = 0.02
    improve_solver: str = "cpsat"
    improve_wait: bool = False


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
    plans: tuple[str, ...] = ()  # per step, the schedule name of the plan it ran
    program: Program | None = None  # the plan of the last step (online improvement may have changed it)


def make_workload(program: Program, options: TrainOptions) -> Workload:
    header = program.header
    return load_workload(options.model, WorkloadRequest(header.stages, header.microbatches, options.seed,
                                                        options.micro_batch_size))


def train_rank(rank: int, world_size: int, program: Program, options: TrainOptions,
               on_step: Callable[[int, StepResult], None] | None = None, local_rank: int | None = None, *,
               workload: Workload | None = None, problem=None, log: Callable[[str], None] | None = None
               ) -> RankReport:
    """Train on this rank of an initialised process group (or alone when ``world_size`` is 1)."""
    if options.dtype not in DTYPES:
        raise OptpipeError(f"--dtype: expected one of {', '.join(DTYPES)}, got {options.dtype!r}")
    device = select_device(options.device, rank if local_rank is None else local_rank)
    workload = workload or make_workload(program, options)
    mine = program.header.stages_on(rank)
    pipe, names = _rank_pipeline(rank, program, options, workload, device)
    improver = _improver(options, problem, log)
    params = list(pipe.parameters())
    try:
        steps = _train_steps(pipe, options, params, batch_stream(workload.batches), names, improver, on_step)
    finally:
        if improver is not None:
            improver.close()
    result = pipe.last
    return RankReport(rank, mine, steps.losses, steps.seconds, steps.peaks, pipe.activation_bytes,
                      result.records if result is not None else (), result.started_ns if result else 0,
                      steps.gradients, steps.plans, pipe.program)


def _rank_pipeline(rank: int, program: Program, options: TrainOptions, workload: Workload,
                   device: torch.device) -> tuple[PipelineRank, dict[int, str]]:
    """This rank's stages of the workload, in ``--dtype``, as a PipelineRank; the rest are dropped."""
    modules = {s: workload.stages[s] for s in program.header.stages_on(rank)}
    if options.dtype != "float32":
        modules = {s: m.to(dtype=DTYPES[options.dtype]) for s, m in modules.items()}
    names = _parameter_names(modules, workload)
    workload.stages = [m if s in modules else None for s, m in enumerate(workload.stages)]  # drop the others
    pipe = PipelineRank(program, modules, workload.loss_fn, device=device, timeout=options.timeout_s)
    if pipe.rank != rank:
        raise OptpipeError(f"train_rank was told rank {rank} but the process group says {pipe.rank}")
    return pipe, names


def _improver(options: TrainOptions, problem, log) -> OnlineImprover | None:
    if not options.improve:
        return None
    if problem is None:
        raise OptpipeError("--improve needs --problem: the problem the plan was compiled for")
    return OnlineImprover(problem, measure_steps=options.improve_after, time_limit_s=options.improve_time_limit,
                          min_gain=options.improve_min_gain, solver=options.improve_solver,
                          wait=options.improve_wait, log=log)


@dataclass(frozen=True)
class _Steps:
    """What the steps measured, per step (``gradients``: the last step's, when asked for)."""

    losses: tuple[float | None, ...]
    seconds: tuple[float, ...]
    peaks: tuple[int, ...]
    plans: tuple[str, ...]
    gradients: dict[str, object]


def _train_steps(pipe: PipelineRank, options: TrainOptions, params: list, batches, names: dict[int, str],
                 improver: OnlineImprover | None, on_step) -> _Steps:
    """The training loop: batch, (improve), step, (gradients), optimizer, report; ``options.steps`` times."""
    optimizer = _optimizer(options, params)
    losses, seconds, peaks, plans = [], [], [], []
    gradients: dict[str, object] = {}
    for step in range(options.steps):
        inputs, targets = _next_batch(batches, step)
        if improver is not None:
            improver.before_step(pipe, step)
        pipe.trace = pipe.trace or (options.trace and step == options.steps - 1)
        plans.append(pipe.program.header.schedule_name)
        for p in params:
            p.grad = None
        pipe.step(inputs, targets)
        result = pipe.last
        if options.gradients and step == options.steps - 1:
            for p in params:
                gradients[names[id(p)]] = p.grad.detach().float().cpu().numpy().copy()
        if optimizer is not None:
            optimizer.step()
        losses.append(result.loss)
        seconds.append(result.seconds)
        peaks.append(result.peak_activation_bytes)
        if on_step is not None:
            on_step(step, result)
        if improver is not None:
            improver.after_step(pipe, step)
        pipe.trace = False
    return _Steps(tuple(losses), tuple(seconds), tuple(peaks), tuple(plans), gradients)


def _parameter_names(modules: dict, workload: Workload) -> dict[int, str]:
    """id(parameter) -> its name in the whole model (for comparing gradients with one process)."""
    names = {}
    for s, module in modules.items():
        global_names = getattr(module, "global_names", None) or {}
        for local, p in module.named_parameters():
            given = (workload.parameter_names or {}).get(id(p))
            names[id(p)] = given or global_names.get(local) or f"stage{s}.{local}"
    return names


def _next_batch(batches, step: int):
    batch = next(batches)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise OptpipeError(f"step {step}: the workload's batch source yielded a {type(batch).__name__}; "
                           f"each batch must be a pair (inputs, targets)")
    return batch


def _optimizer(options: TrainOptions, params: list) -> torch.optim.Optimizer | None:
    if options.optimizer == "none":
        return None  # also spares importing torch._dynamo, which torch.optim does on first use
    if options.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=options.lr, weight_decay=0.0)
    if options.optimizer == "sgd":
        return torch.optim.SGD(params, lr=options.lr)
    raise OptpipeError(f"--optimizer: expected adamw, sgd or none, got {options.optimizer!r}")


# --------------------------------------------------------------------------- command line


def _parser() -> LineParser:
    parser = LineParser(prog="python -m optpipe.runtime.train",
                        description="Train a model with a compiled pipeline plan (launch with torchrun or "
                                    "`optpipe train`, one process per plan rank).")
    add_train_arguments(parser)
    return parser


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise OptpipeError(f"environment {name}={value!r}: expected an integer (set by torchrun)") from None


def _say(rank: int | str, error: BaseException) -> None:
    """``rank R: error: ...`` on one line, without the rank twice."""
    message = str(error).strip()
    prefix = f"rank {rank}: "
    while message.startswith(prefix):
        message = message[len(prefix):]
    message = message.splitlines()[0] if message else type(error).__name__
    print(f"rank {rank}: error: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class _Job:
    """One rank's checked inputs: what main has before it joins the process group."""

    args: argparse.Namespace
    options: TrainOptions
    problem: Problem | None
    program: Program
    workload: Workload
    use_cuda: bool


def main(argv: list[str] | None = None) -> int:
    rank: int | str = os.environ.get("RANK", "0")  # for the messages until it is known to be a number
    try:
        rank = _env_int("RANK", 0)
        world_size = _env_int("WORLD_SIZE", 1)
        local_rank = _env_int("LOCAL_RANK", rank)
        job = _prepare(_parser().parse_args(argv), rank, world_size)
    except OptpipeError as error:
        _say(rank, error)
        return error.exit_code

    try:
        _execute(job, rank, world_size, local_rank)
    except OptpipeError as error:
        _say(rank, error)
        return error.exit_code  # the caller leaves with os._exit: the peers see the connection drop
    except KeyboardInterrupt:
        print(f"rank {rank}: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as error:  # a bug in optpipe (or in the user's code outside a step): say so, then show it
        print(f"rank {rank}: internal error: {type(error).__name__}: {first_line(error)} (the traceback "
              f"follows; if it is in optpipe, please report it)", file=sys.stderr, flush=True)
        traceback.print_exc()
        return 1
    return 0


def _prepare(args: argparse.Namespace, rank: int, world_size: int) -> _Job:
    """Everything about the options, the plan and the model, checked before joining the process group."""
    check(args)
    options = TrainOptions(model=args.model, steps=args.steps, seed=args.seed, lr=args.lr,
                           optimizer=args.optimizer, dtype=args.dtype, micro_batch_size=args.micro_batch_size,
                           device=args.device, trace=bool(args.trace), timeout_s=args.timeout,
                           improve=args.improve, improve_after=args.improve_after,
                           improve_time_limit=args.improve_time_limit, improve_min_gain=args.improve_min_gain,
                           improve_solver=args.improve_solver, improve_wait=args.improve_wait)
    problem = load_problem(args.problem) if args.problem else None
    program = read_plan(args.plan) if args.plan else starting_plan(problem)
    check_plan(program, rank, world_size, {s: None for s in program.header.stages_on(rank)})
    if problem is not None:
        check_against_problem(program, problem)
    workload = make_workload(program, options)
    return _Job(args, options, problem, program, workload, wants_cuda(args.device))


def _execute(job: _Job, rank: int, world_size: int, local_rank: int) -> None:
    """Join the job, train, write the trace, and leave the process group cleanly."""
    args, program, problem = job.args, job.program, job.problem
    if world_size > 1:
        if job.use_cuda:
            torch.cuda.set_device(local_rank % torch.cuda.device_count())
        _join("nccl" if job.use_cuda else "gloo", rank, args.timeout)
    if rank == 0 and not args.plan:
        print(f"improve: starting on {program.header.schedule_name}, the best fitting heuristic of "
              f"{problem.name}", flush=True)
    report = _run(rank, world_size, local_rank, program, job.options, job.use_cuda, job.workload, problem)
    if args.trace:
        _write_trace(args.trace, rank, world_size, report.program or program, report, problem)
    if world_size > 1:
        collective("the final barrier", dist.barrier)
        dist.destroy_process_group()  # a clean teardown: no gloo thread left for exit to trip on


def _join(backend: str, rank: int, timeout: float) -> None:
    """init_process_group, bounded by ``timeout`` even where torch's own wait is not."""
    joined = threading.Event()
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"

    def watchdog() -> None:
        if not joined.wait(timeout):
            print(f"rank {rank}: error: could not join the job at {where} within {timeout:g} s (--timeout): not "
                  f"every rank arrived; look for another rank's error, check the address, and that no other "
                  f"program holds the port", file=sys.stderr, flush=True)
            os._exit(1)

    threading.Thread(target=watchdog, name="optpipe-join-watchdog", daemon=True).start()
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    except Exception as error:  # DistNetworkError, DistStoreError, ValueError from a bad environment
        text = first_line(error)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise PipelineAborted(f"cannot start the job at {where}: the port is taken by another program; "
                                  f"choose another (torchrun --master-port PORT, or --rdzv-endpoint HOST:PORT)"
                                  ) from None
        raise PipelineAborted(f"could not join the job at {where}: {text}") from None
    finally:
        joined.set()


def _run(rank: int, world_size: int, local_rank: int, program: Program, options: TrainOptions,
         use_cuda: bool, workload: Workload, problem) -> RankReport:
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
            collective("the loss all-reduce", dist.all_reduce, tensor)
            value = float(tensor.item())
        if rank == 0:
            progress.update(task, advance=1, loss=f"{value:.4f}")
            print(f"step {step} loss {value:.6f}", flush=True)

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    with progress:
        return train_rank(rank, world_size, program, options, on_step, local_rank, workload=workload,
                          problem=problem, log=log)


def _write_trace(path: str, rank: int, world_size: int, program: Program, report: RankReport, problem) -> None:
    reports = [report]
    if world_size > 1:
        gathered: list = [None] * world_size
        collective("gathering the trace", dist.all_gather_object, gathered, report)
        reports = gathered
    if rank == 0:
        Path(path).write_text(json.dumps(run_trace(program, reports, problem)))
        print(f"trace written to {path} (open in ui.perfetto.dev)", flush=True)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # past torch's C++ destructors, which may abort ("terminate called ...") at exit
