"""The profiler: measured costs and activation sizes of a model's stages, as a problem file.

Each stage runs the way the interpreter runs it: a forward (and, on the last stage, the loss)
under the activation store's capture, B with the weight pass's census, W. The store's counts
are the stage's ``activation`` (bytes the forward saved) and ``weight_activation`` (bytes
still held after B); because they come from the same code, a plan run on this machine holds
exactly what the simulator predicts from them. Times are medians over repeats, in ms.

p2p is the half round trip of one activation between two local gloo processes; the host
link's bandwidths are timed copies of one activation into a host buffer and back (pinned
memory and CUDA streams on a GPU, a memory copy on a CPU).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from optpipe.core.errors import OptpipeError
from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem

from .launch import run_local
from .model import GPTConfig, SyntheticBatches, build_model, loss_fn, split_stages
from .workload import Workload, WorkloadRequest, load_workload
from .split_backward import StageGrad, touch_saved_tensors
from .store import ActivationStore, module_tensors

__all__ = ["StageProfile", "profile_stages", "measure_p2p", "measure_host_link", "profile_problem"]


@dataclass(frozen=True)
class StageProfile:
    forward_ms: float  # forward, and the loss on the last stage
    backward_input_ms: float
    backward_weight_ms: float
    activation: int  # bytes saved by the forward
    weight_activation: int  # bytes still needed by W after B
    output_shape: tuple[int, ...]
    output_dtype: torch.dtype
    input_bytes: int = 0  # the stage input's storage: what a recomputed forward keeps ([recompute] resident)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_stages(model: GPTConfig | str | Workload, stages: int, *, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32, seed: int = 0, repeats: int = 5,
                   warmup: int = 2, microbatches: int = 1,
                   micro_batch_size: int | None = None) -> list[StageProfile]:
    """Per stage: median F, B, W times and the store's byte counts for one microbatch.

    ``model``: a GPT config, a factory name (``tiny``, ``package.module:factory``) or a Workload
    split into ``stages``; its first batch, split into ``microbatches``, gives the microbatch.
    """
    if repeats < 1:
        raise OptpipeError(f"--repeats: expected at least 1, got {repeats}")
    device = torch.device(device)
    workload = _workload(model, stages, microbatches, seed, micro_batch_size, dtype)
    parts = [m.to(device) for m in workload.stages]
    tokens, targets = _first_microbatch(workload, microbatches)
    tokens, targets = tokens.to(device), targets.to(device)
    weights = module_tensors(parts)
    result = []
    x_next: torch.Tensor = tokens
    for s, stage in enumerate(parts):
        runner = _StageRunner(s, StageGrad(stage), ActivationStore(device, exclude=weights), workload.loss_fn,
                              targets, s == stages - 1, device)
        profile, x_next = _profile_stage(runner, x_next, warmup, repeats)
        for p in stage.parameters():
            p.grad = None
        result.append(profile)
    return result


@dataclass(frozen=True)
class _StageRunner:
    """What one stage's trials share: its F/B/W runner, a store of what F saves, the loss on the last stage."""

    stage: int
    grad: StageGrad
    store: ActivationStore
    loss_fn: object
    targets: torch.Tensor
    last: bool
    device: torch.device


@dataclass(frozen=True)
class _Trial:
    ms: tuple[float, float, float]  # F, B, W
    sizes: tuple[int, int]  # bytes F saved, bytes still held for W after B
    keep: frozenset[int]  # which saved tensors W needs
    shape: tuple[int, ...]  # F's output
    dtype: torch.dtype
    output: torch.Tensor | None  # F's output, detached, when asked for: the next stage's input


def _profile_stage(runner: _StageRunner, x_in: torch.Tensor, warmup: int, repeats: int
                   ) -> tuple[StageProfile, torch.Tensor]:
    """Median F, B, W over ``repeats`` trials after ``warmup``; and the next stage's input."""
    times: dict[str, list[float]] = {"F": [], "B": [], "W": []}
    sizes = None
    x_next = x_in
    keep: frozenset[int] | None = None
    for trial in range(warmup + repeats):
        done = _trial(runner, trial, x_in, keep, want_output=trial == 0 and not runner.last)
        keep = done.keep
        if trial >= warmup:
            for kind, ms in zip("FBW", done.ms):
                times[kind].append(ms)
        if sizes is not None and sizes != done.sizes:
            raise OptpipeError(f"stage {runner.stage}: the saved activation changed between microbatches "
                               f"({sizes} then {done.sizes} bytes); the profiler needs a deterministic model")
        sizes = done.sizes
        if done.output is not None:
            x_next = done.output
    profile = StageProfile(statistics.median(times["F"]), statistics.median(times["B"]),
                           statistics.median(times["W"]), sizes[0], sizes[1], done.shape, done.dtype,
                           x_in.numel() * x_in.element_size())
    return profile, x_next


def _trial(runner: _StageRunner, trial: int, x_in: torch.Tensor, keep: frozenset[int] | None,
           want_output: bool) -> _Trial:
    """One timed F, B, W of the stage on a fresh copy of its input, as the interpreter runs them."""
    s, store, device = runner.stage, runner.store, runner.device
    # Fresh copies, as the interpreter makes: the store may empty what the forward saved.
    x = x_in.detach().clone().requires_grad_() if x_in.is_floating_point() else x_in.clone()
    _sync(device)
    t0 = time.perf_counter()
    with store.capture(s, trial):
        fwd = runner.grad.forward(x)
        out = runner.loss_fn(fwd.output, runner.targets.clone()) if runner.last else fwd.output
    _sync(device)
    t1 = time.perf_counter()
    saved = store.entry_bytes(s, trial)
    grad = torch.ones((), device=device) if runner.last else torch.randn_like(out)
    _sync(device)
    t2 = time.perf_counter()
    _, work = runner.grad.backward_input(fwd, [out], [grad])
    _sync(device)
    t3 = time.perf_counter()
    if work.keeps_everything:
        keep = frozenset(range(store.saved_count(s, trial)))
    elif keep is None:
        with store.census() as seen:
            touch_saved_tensors(work.nodes())
        keep = frozenset(seen)
    released = store.forget(s, trial, keep)
    _sync(device)
    t4 = time.perf_counter()
    StageGrad.backward_weight(work)
    _sync(device)
    t5 = time.perf_counter()
    store.drop(s, trial)
    return _Trial(((t1 - t0) * 1e3, (t3 - t2) * 1e3, (t5 - t4) * 1e3), (saved, saved - released), keep,
                  tuple(fwd.output.shape), fwd.output.dtype, fwd.output.detach() if want_output else None)


def _workload(model, stages: int, microbatches: int, seed: int, micro_batch_size: int | None,
              dtype: torch.dtype) -> Workload:
    if isinstance(model, GPTConfig):
        parts = split_stages(build_model(model, seed, dtype), stages)
        return Workload(parts, loss_fn, SyntheticBatches(model, microbatches, seed), name="gpt")
    workload = model if isinstance(model, Workload) else load_workload(
        model, WorkloadRequest(stages, microbatches, seed, micro_batch_size))
    if len(workload.stages) != stages:
        raise OptpipeError(f"the workload has {len(workload.stages)} stages, the profile asks for {stages}")
    if dtype != torch.float32:
        workload.stages = [m.to(dtype=dtype) for m in workload.stages]
    return workload


def _first_microbatch(workload: Workload, microbatches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first microbatch of the workload's first batch (the runtime splits batches the same way)."""
    try:
        batch = next(iter(workload.batches))
    except StopIteration:
        raise OptpipeError(f"{workload.name}: the batch source yielded no batch") from None
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise OptpipeError(f"{workload.name}: a batch must be a pair (inputs, targets), got {type(batch).__name__}")
    inputs, targets = batch
    for what, tensor in (("inputs", inputs), ("targets", targets)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[0] % microbatches:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise OptpipeError(f"{workload.name}: the batch's {what} ({shape}) do not split into {microbatches} "
                               f"microbatches along the first dimension")
    return inputs.chunk(microbatches)[0], targets.chunk(microbatches)[0]


def _ping_pong(rank: int, world_size: int, shape: tuple[int, ...], dtype: torch.dtype, rounds: int) -> float:
    tensor = torch.zeros(shape, dtype=dtype)
    peer = 1 - rank
    samples = []
    for k in range(rounds + 2):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
        else:
            dist.recv(tensor, peer)
            dist.send(tensor, peer)
        if k >= 2:
            samples.append((time.perf_counter() - t0) / 2 * 1e3)
    return statistics.median(samples)


def measure_p2p(shape: tuple[int, ...], dtype: torch.dtype, rounds: int = 20) -> float:
    """Milliseconds for one activation between two local gloo processes (half a round trip)."""
    times = run_local(2, _ping_pong, (shape, dtype, rounds), timeout=120.0)
    return times[0]


def measure_host_link(nbytes: int, device: torch.device | str, rounds: int = 10) -> tuple[float, float]:
    """(device-to-host, host-to-device) bytes per second for one activation's copy."""
    device = torch.device(device)
    nbytes = max(int(nbytes), 1)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    d2h, h2d = [], []
    for k in range(rounds + 2):
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(source, non_blocking=pinned)
        _sync(device)
        t1 = time.perf_counter()
        source.copy_(host, non_blocking=pinned)
        _sync(device)
        t2 = time.perf_counter()
        if k >= 2:
            d2h.append(t1 - t0)
            h2d.append(t2 - t1)
    return nbytes / max(statistics.median(d2h), 1e-9), nbytes / max(statistics.median(h2d), 1e-9)


def profile_problem(model: GPTConfig | str | Workload, *, devices: int, chunks: int, microbatches: int,
                    placement: Placement = Placement.INTERLEAVED, budget: int | None = None,
                    offload: bool = False, p2p_ms: float | None = None, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, seed: int = 0, repeats: int = 5,
                    name: str = "profiled", micro_batch_size: int | None = None) -> Problem:
    """A problem whose costs and sizes were measured on this machine.

    ``budget`` defaults to what holding every microbatch's activation at once needs (nothing
    is tight); ``p2p_ms`` None measures it with two local processes.
    """
    pipeline = Pipeline(devices, chunks, placement, microbatches)
    if placement is Placement.VSHAPE and chunks != 2:
        raise OptpipeError('--placement vshape needs --chunks 2')
    stages = pipeline.stages
    profiles = profile_stages(model, stages, device=device, dtype=dtype, seed=seed, repeats=repeats,
                              microbatches=microbatches, micro_batch_size=micro_batch_size)
    if p2p_ms is None:
        boundary = profiles[0]
        p2p_ms = measure_p2p(boundary.output_shape, boundary.output_dtype) if stages > 1 else 0.0
    costs = Costs(tuple(p.forward_ms for p in profiles), tuple(p.backward_input_ms for p in profiles),
                  tuple(p.backward_weight_ms for p in profiles), float(p2p_ms))
    activation = tuple(p.activation for p in profiles)
    weight_activation = tuple(p.weight_activation for p in profiles)
    if budget is None:
        budget = max(sum(activation[s] for s in pipeline.stages_on(d)) for d in range(devices)) * microbatches
    memory = Memory(activation, weight_activation, int(budget))
    link = Offload()
    if offload:
        d2h, h2d = measure_host_link(max(activation), device)
        link = Offload(True, d2h, h2d, host_budget=2**40)
    return Problem(name, pipeline, costs, memory, link)
