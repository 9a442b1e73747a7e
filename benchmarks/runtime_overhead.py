"""Runtime overhead: optpipe's interpreter against PyTorch's ``torch.distributed.pipelining``.

The same model (the ``small`` GPT split into the same stage modules, same weights) and the same
schedule run on 4 gloo ranks on this machine's CPUs, by both runtimes in the same processes,
alternating (optpipe, PyTorch, PyTorch, optpipe, ...) so that load on the machine falls on
both alike. The schedules are PyTorch's own: ``Schedule1F1B`` (its run order, which is our
1F1B) and ``ScheduleInterleavedZeroBubble`` with 2 stages per rank; for optpipe they are
imported from PyTorch's CSV, lowered and verified. Each step is a forward and backward of
every microbatch; weights are not updated (the optimizer is the same code for both).

Reported, per schedule:

* median step time of each runtime (a step's time is the slowest rank's) and the median
  step-time ratio; the ratio is taken round by round (each round runs both runtimes back to
  back) and its median reported, so that load which drifts over the run cancels out; and the
  CPU time a step costs all ranks together;
* fixed overhead: the same schedules on a model that computes almost nothing, so the step is
  the runtime's own work (dispatch, bookkeeping, gloo latency); per instruction for optpipe
  and per compute action for PyTorch; and the bare dispatch loop of the interpreter;
* the measured step against the simulator's prediction, from costs profiled in one process
  before the run (4 ranks then share 2 cores, so expect the step to take longer) and from the
  op times measured inside the run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
import torch.nn as nn
from rich.table import Table

from optpipe.plan.lower import lower
from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem
from optpipe.core.simulate import simulate
from optpipe.plan.torch_csv import schedule_from_torch_csv

from ._common import console, save
from .torch_interop import torch_csv

__all__ = ["run", "CASES"]

RANKS = 4
MICROBATCHES = 8
MODEL = "small"
ROUNDS = 8  # alternations with the real model
NULL_ROUNDS = 3  # with the model that computes nothing (its steps vary less)
STEPS = 2  # timed steps per runtime per round
# (label, PyTorch schedule class, variant of its order, stages per rank)
CASES = (("1F1B", "Schedule1F1B", "run", 1),
         ("interleaved zero bubble", "ScheduleInterleavedZeroBubble", "declared", 2))


def _shape_problem(chunks: int, costs: Costs | None = None, memory: Memory | None = None) -> Problem:
    stages = RANKS * chunks
    return Problem(
        name=f"{MODEL}-p{RANKS}-v{chunks}-m{MICROBATCHES}",
        pipeline=Pipeline(RANKS, chunks, Placement.INTERLEAVED, MICROBATCHES),
        costs=costs or Costs((1.0,) * stages, (1.0,) * stages, (1.0,) * stages, 0.0),
        memory=memory or Memory((1,) * stages, (1,) * stages, 10**12),
        offload=Offload(),
    )


class _NullStage(nn.Module):
    """Almost no compute: the step time is the runtime's own."""

    def __init__(self, first: bool):
        super().__init__()
        self.first = first
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() if self.first else x) * self.w


def _null_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.mean()


def _stages(null: bool, stages: int, mine: tuple[int, ...]):
    from optpipe.runtime.model import build_stages, config_named, loss_fn

    if null:
        return {s: _NullStage(s == 0) for s in mine}, _null_loss
    return build_stages(config_named(MODEL), stages, mine, seed=0), loss_fn


def _over_ranks(values: list[float], op: str) -> list[float]:
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor.tolist()


def _rank(rank: int, world_size: int, cases: list, null: bool, rounds: int) -> dict:
    """Both runtimes, alternating; returns the slowest rank's step times per case and runtime."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    from optpipe.runtime.comm import P2P
    from optpipe.runtime.interpreter import Interpreter
    from optpipe.runtime.model import config_named, synthetic_batch
    from optpipe.runtime.train import RankReport

    config = config_named(MODEL)
    batch = synthetic_batch(config, MICROBATCHES, 0, 0)
    inputs, targets = torch.cat(batch.inputs), torch.cat(batch.targets)
    out = {}
    p2p_ms = _p2p_ms(rank, batch) if not null else 0.0
    for label, program, torch_name, _, _ in cases:
        header = program.header
        mine = header.stages_on(rank)
        ours_stages, loss = _stages(null, header.stages, mine)
        interpreter = Interpreter(program, rank, ours_stages, loss, device="cpu",
                                  comm=P2P(header.stages, header.microbatches))
        torch_modules, _ = _stages(null, header.stages, mine)
        pipeline_stages = [PipelineStage(torch_modules[s], s, header.stages, torch.device("cpu")) for s in mine]
        kind = getattr(torch_schedules, torch_name)
        if torch_name == "Schedule1F1B":
            torch_schedule = kind(pipeline_stages[0], MICROBATCHES, loss_fn=loss)
        else:
            torch_schedule = kind(pipeline_stages, MICROBATCHES, loss_fn=loss)
        first, last = 0 in mine, header.stages - 1 in mine

        def ours() -> None:
            for module in ours_stages.values():
                module.zero_grad(set_to_none=True)
            interpreter.step(batch)

        def theirs() -> None:
            for module in torch_modules.values():
                module.zero_grad(set_to_none=True)
            kwargs = {}
            if last:
                kwargs = {"target": targets, "losses": []}
            if first:
                torch_schedule.step(inputs, **kwargs)
            else:
                torch_schedule.step(**kwargs)

        def timed(step) -> tuple[float, float]:
            """Wall time of the step, and this process's CPU time in it (all threads, gloo's too)."""
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            step()
            return time.perf_counter() - t0, time.process_time() - c0

        timed(ours)  # warm-up: shapes, graph analysis, allocator
        timed(theirs)
        times = {"optpipe": [], "pytorch": []}
        cpu = {"optpipe": [], "pytorch": []}
        for r in range(rounds):
            order = (("optpipe", ours), ("pytorch", theirs)) if r % 2 == 0 else (("pytorch", theirs), ("optpipe", ours))
            for name, step in order:
                for _ in range(STEPS):
                    wall, used = timed(step)
                    times[name].append(wall)
                    cpu[name].append(used)
        interpreter.trace = True
        dist.barrier()
        traced = interpreter.step(batch)
        interpreter.trace = False
        out[label] = {
            "p2p_ms": p2p_ms,
            "optpipe": _over_ranks(times["optpipe"], "max"),
            "pytorch": _over_ranks(times["pytorch"], "max"),
            "optpipe_cpu": _over_ranks(cpu["optpipe"], "sum"),
            "pytorch_cpu": _over_ranks(cpu["pytorch"], "sum"),
            "instructions": len(program.ranks[rank]),
            "report": RankReport(rank, mine, (traced.loss,), (traced.seconds,), (traced.peak_activation_bytes,),
                                 dict(interpreter.activation_bytes), traced.records, traced.started_ns),
        }
        dist.barrier()
    return out


def _p2p_ms(rank: int, batch) -> float:
    """Half a round trip of one stage output between ranks 0 and 1 (the others wait)."""
    import torch.distributed as dist

    from optpipe.runtime.model import config_named

    config = config_named(MODEL)
    tensor = torch.zeros(batch.inputs[0].shape + (config.n_embd,))
    samples = []
    for k in range(12):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        elif rank == 1:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        samples.append((time.perf_counter() - t0) / 2 * 1e3)
    return _over_ranks([statistics.median(samples[2:]) if rank == 0 else 0.0], "max")[0]


def _programs() -> list:
    cases = []
    for label, torch_name, variant, chunks in CASES:
        problem = _shape_problem(chunks)
        schedule = schedule_from_torch_csv(torch_csv(torch_name, variant, problem), problem, name=torch_name)
        cases.append((label, lower(problem, schedule), torch_name, chunks, schedule))
    return cases


def _dispatch_ns_per_instruction(program) -> float:
    """The interpreter's loop (``for handler, operand, position in ops: handler(operand)``) with no-op handlers."""
    noop = lambda operand: None  # noqa: E731
    ops = [(noop, ins, k) for k, ins in enumerate(program.ranks[0])]
    best = float("inf")
    for _ in range(50):
        t0 = time.perf_counter_ns()
        for handler, operand, position in ops:
            handler(operand)
        best = min(best, time.perf_counter_ns() - t0)
    return best / len(ops)


def run() -> list[dict]:
    from optpipe.runtime.launch import run_local
    from optpipe.runtime.model import config_named
    from optpipe.runtime.profile import profile_stages
    from optpipe.runtime.trace import measured_problem

    cases = _programs()
    config = config_named(MODEL)
    started = time.perf_counter()
    real = run_local(RANKS, _rank, (cases, False, ROUNDS), timeout=600.0)
    null = run_local(RANKS, _rank, (cases, True, NULL_ROUNDS), timeout=300.0)
    rows = []
    for label, program, torch_name, chunks, schedule in cases:
        p2p_ms = real[0][label]["p2p_ms"]
        ours = statistics.median(real[0][label]["optpipe"])
        theirs = statistics.median(real[0][label]["pytorch"])
        paired = [statistics.median(real[0][label]["optpipe"][r * STEPS:(r + 1) * STEPS])
                  / statistics.median(real[0][label]["pytorch"][r * STEPS:(r + 1) * STEPS]) for r in range(ROUNDS)]
        null_ours = statistics.median(null[0][label]["optpipe"])
        null_theirs = statistics.median(null[0][label]["pytorch"])
        instructions = max(r[label]["instructions"] for r in null)
        actions = max(sum(1 for ins in stream if ins.opcode.name in ("FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT",
                                                                   "BACKWARD")) for stream in program.ranks)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each rank runs
        try:
            profiles = profile_stages(config, RANKS * chunks, repeats=3)
        finally:
            torch.set_num_threads(threads)
        profiled = _shape_problem(chunks, Costs(tuple(p.forward_ms for p in profiles),
                                               tuple(p.backward_input_ms for p in profiles),
                                               tuple(p.backward_weight_ms for p in profiles), p2p_ms))
        predicted = simulate(profiled, schedule).makespan
        in_run_problem = measured_problem(program, [r[label]["report"] for r in real])
        in_run_costs = replace(in_run_problem.costs, p2p=p2p_ms)
        in_run = simulate(replace(in_run_problem, costs=in_run_costs), schedule).makespan
        rows.append({
            "schedule": label, "torch_class": torch_name, "model": MODEL, "ranks": RANKS, "stages": RANKS * chunks,
            "microbatches": MICROBATCHES, "p2p_ms": p2p_ms,
            "optpipe_step_ms": ours * 1e3, "pytorch_step_ms": theirs * 1e3,
            "ratio_optpipe_over_pytorch": statistics.median(paired), "ratio_per_round": paired,
            "ratio_of_medians": ours / theirs,
            "optpipe_cpu_ms_per_step": statistics.median(real[0][label]["optpipe_cpu"]) * 1e3,
            "pytorch_cpu_ms_per_step": statistics.median(real[0][label]["pytorch_cpu"]) * 1e3,
            "optpipe_steps_ms": [t * 1e3 for t in real[0][label]["optpipe"]],
            "pytorch_steps_ms": [t * 1e3 for t in real[0][label]["pytorch"]],
            "null_model_optpipe_step_ms": null_ours * 1e3, "null_model_pytorch_step_ms": null_theirs * 1e3,
            "instructions_per_rank": instructions, "compute_actions_per_rank": actions,
            "optpipe_overhead_us_per_instruction": null_ours * 1e6 / instructions,
            "pytorch_overhead_us_per_action": null_theirs * 1e6 / actions,
            "dispatch_loop_ns_per_instruction": _dispatch_ns_per_instruction(program),
            "predicted_step_ms_profiled_costs": predicted,
            "predicted_step_ms_in_run_costs": in_run,
            "measured_over_predicted_profiled": ours * 1e3 / predicted,
            "measured_over_predicted_in_run": ours * 1e3 / in_run,
        })
    _print(rows, time.perf_counter() - started)
    save("runtime_overhead", rows, rounds=ROUNDS, null_rounds=NULL_ROUNDS, steps_per_round=STEPS,
         note="4 gloo ranks on this machine's CPUs; a step's time is the slowest rank's; medians")
    return rows


def _print(rows: list[dict], seconds: float) -> None:
    table = Table(title=f"runtime overhead: optpipe vs torch.distributed.pipelining ({RANKS} gloo ranks, "
                        f"{MODEL} GPT, {MICROBATCHES} microbatches; {seconds:.0f} s)")
    for column in ("schedule", "optpipe ms", "PyTorch ms", "ratio", "overhead µs/instr (PyTorch µs/action)",
                   "dispatch ns/instr", "predicted ms (profiled | in-run)"):
        table.add_column(column, justify="right" if column != "schedule" else "left")
    for row in rows:
        table.add_row(row["schedule"], f"{row['optpipe_step_ms']:.1f}", f"{row['pytorch_step_ms']:.1f}",
                      f"{row['ratio_optpipe_over_pytorch']:.3f}",
                      f"{row['optpipe_overhead_us_per_instruction']:.0f} ({row['pytorch_overhead_us_per_action']:.0f})",
                      f"{row['dispatch_loop_ns_per_instruction']:.0f}",
                      f"{row['predicted_step_ms_profiled_costs']:.1f} | {row['predicted_step_ms_in_run_costs']:.1f}")
    console.print(table)


if __name__ == "__main__":
    run()
