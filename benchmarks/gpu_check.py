"""GPU check of activation offload: copies overlap compute, pinned buffers are reused, step time.

Runs on one CUDA device, one rank: a GPT stage pipeline of ``STAGES`` stages on that device
(p = 1, v = STAGES), every microbatch's activation offloaded after its forward and reloaded
before its backward (GPipe order: all forwards, then all backwards, which is when offload pays),
against the same order without offload. Reports

* overlap: the share of the copy engines' busy time (D2H and H2D memcpy kernels, from the
  CUDA profiler) during which a compute kernel also ran;
* the pinned host pool: buffers allocated once, then handed out again on later steps;
* step time with and without offload, and peak device memory of each (``max_memory_allocated``)
  next to the store's count of resident activation bytes.

Without CUDA it says so and exits 0: ``python -m benchmarks.gpu_check``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from optpipe.plan.lower import lower
from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem
from optpipe.core.schedule import Op, OpKind, Schedule

__all__ = ["run", "offload_schedule"]

STAGES = 2
MICROBATCHES = 8
STEPS = 5


def _problem() -> Problem:
    return Problem(
        name="gpu-check",
        pipeline=Pipeline(1, STAGES, Placement.INTERLEAVED, MICROBATCHES),
        costs=Costs((1.0,) * STAGES, (1.0,) * STAGES, (1.0,) * STAGES, 0.0),
        memory=Memory((1,) * STAGES, (1,) * STAGES, 10**15),
        offload=Offload(True, 1e9, 1e9, 2**50),
    )


def offload_schedule(offload: bool) -> Schedule:
    """All forwards (each offloaded right after it), then all backwards (each reloaded just before)."""
    ops = []
    for s in range(STAGES):
        for i in range(MICROBATCHES):
            ops.append(Op(OpKind.F, s, i))
            if offload and s < STAGES - 1:  # the last stage's backward follows at once: nothing to hide
                ops.append(Op(OpKind.OFFLOAD, s, i))
    for s in reversed(range(STAGES)):
        for i in range(MICROBATCHES):
            if offload and s < STAGES - 1:
                ops.append(Op(OpKind.RELOAD, s, i))
            ops.append(Op(OpKind.BW, s, i))
    return Schedule.of("offload-all" if offload else "no-offload", [ops])


def _overlap(profiler) -> float | None:
    """Share of memcpy time that overlaps some compute kernel, from the profiler's device events."""
    copies, kernels = [], []
    for event in profiler.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (event.time_range.start, event.time_range.end)
        (copies if "Memcpy" in event.name else kernels).append(span)
    if not copies:
        return None
    kernels.sort()
    merged: list[list[float]] = []
    for start, end in kernels:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = sum(end - start for start, end in copies)
    covered = 0.0
    for start, end in copies:
        for k_start, k_end in merged:
            covered += max(0.0, min(end, k_end) - max(start, k_start))
    return covered / total if total > 0 else None


def _measure(program, config, device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from optpipe.runtime.interpreter import Interpreter
    from optpipe.runtime.model import build_stages, loss_fn, synthetic_batch

    stages = build_stages(config, STAGES, tuple(range(STAGES)), seed=0, device=device)
    interpreter = Interpreter(program, 0, stages, loss_fn, device=device, comm=None)
    batch = synthetic_batch(config, MICROBATCHES, 0, 0)
    interpreter.step(batch)  # warm-up: allocator, pinned pool, graph analysis
    torch.cuda.reset_peak_memory_stats(device)
    times, peaks = [], []
    for _ in range(STEPS):
        for module in stages.values():
            module.zero_grad(set_to_none=True)
        start = time.perf_counter()
        result = interpreter.step(batch)
        times.append(time.perf_counter() - start)
        peaks.append(result.peak_activation_bytes)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        interpreter.step(batch)
    stats = interpreter.store.stats()
    return {
        "step_ms": statistics.median(times) * 1e3,
        "store_peak_activation_bytes": max(peaks),
        "device_peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "copy_compute_overlap": _overlap(profiler),
        "pinned_buffers_allocated": stats.host_buffers_allocated,
        "pinned_buffers_reused": stats.host_buffers_reused,
        "pinned_bytes": stats.host_bytes_allocated,
    }


def run() -> list[dict]:
    from ._common import console, save

    if not torch.cuda.is_available():
        console.print("[yellow]gpu_check: skipped: no CUDA device on this machine (torch.cuda.is_available() "
                      "is False); run it where a GPU is[/]")
        return []
    from optpipe.runtime.model import GPTConfig

    device = torch.device("cuda", torch.cuda.current_device())
    # Large enough that a copy takes long enough to see beside a kernel; about 10 GB of activations.
    config = GPTConfig(vocab_size=8192, seq_len=512, n_layer=8, n_head=16, n_embd=1024, micro_batch_size=4)
    problem = _problem()
    rows = []
    for offload in (False, True):
        program = lower(problem, offload_schedule(offload))
        row = {"plan": "offload every activation" if offload else "no offload", **_measure(program, config, device)}
        rows.append(row)
        torch.cuda.empty_cache()
    plain, moved = rows
    for row in rows:
        overlap = row["copy_compute_overlap"]
        console.print(f"{row['plan']:>26}: step {row['step_ms']:8.1f} ms, store peak "
                      f"{row['store_peak_activation_bytes'] / 2**30:6.2f} GiB, device peak "
                      f"{row['device_peak_allocated_bytes'] / 2**30:6.2f} GiB"
                      + (f", copies overlapped by compute {overlap:.0%}" if overlap is not None else "")
                      + (f", pinned buffers {row['pinned_buffers_allocated']} made, {row['pinned_buffers_reused']} "
                         f"reused" if row["pinned_buffers_allocated"] else ""))
    console.print(f"offload costs {moved['step_ms'] / plain['step_ms'] - 1:+.1%} step time and saves "
                  f"{1 - moved['device_peak_allocated_bytes'] / plain['device_peak_allocated_bytes']:.0%} of peak "
                  f"device memory on {torch.cuda.get_device_name(device)}")
    save("gpu_check", rows, device=torch.cuda.get_device_name(device))
    return rows


if __name__ == "__main__":
    run()
    sys.exit(0)
