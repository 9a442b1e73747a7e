"""Online improvement: train on a heuristic plan while the solver finds a better one with measured costs.

    improver = OnlineImprover(problem, measure_steps=3, time_limit_s=20)
    for step in range(steps):
        improver.before_step(pipe, step)
        ... loss = pipe.step(inputs, targets) ...
        improver.after_step(pipe, step)       # a collective: every rank calls it after every step

1. Steps 1..measure_steps run with instruction timing on (step 0 also learns the shapes and
   warms up, so it is not measured).
2. After the last of them the ranks send their op times and activation sizes to rank 0, which
   builds the problem again with them (the pipeline, budget, p2p time and host link stay the
   user's) and starts the solver in a background process, so training does not wait.
3. At every step boundary after that rank 0 says whether the solver is still running; when it
   has finished, rank 0 compares the new plan with the current one, both timed by the
   simulator on the measured costs, and proposes it when it is faster by more than
   ``min_gain`` (``wait=True`` makes the first boundary wait for the solver, for a switch at a
   known step). ``PipelineRank.switch_plan`` moves every rank to it at that boundary, or, if
   any rank cannot load it, none. A plan only reorders the same operations, so losses and
   gradients do not change at the switch.

Rank 0 logs each stage of this with the step and the predicted gain, and, once the new plan
has run as many steps as were measured, its own step time before and after the switch.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

from optpipe.core.errors import InfeasibleError, OptpipeError
from optpipe.plan.lower import lower
from optpipe.core.problem import Costs, Memory, Problem
from optpipe.plan.program import TRACE_KIND, Program
from optpipe.solvers.compare import best_fitting, compare

from .comm import collective, first_line
from .pipeline import PipelineRank
from .resolve import resolve

__all__ = ["OnlineImprover", "Switch", "starting_plan", "measured_costs"]

_PENDING, _PROPOSE, _DONE = 0, 1, 2


@dataclass(frozen=True)
class Switch:
    """What happened at the decision: a switch (``switched``) or why not."""

    step: int  # the plan changed before this step
    switched: bool
    old_name: str
    new_name: str
    predicted_old_ms: float
    predicted_new_ms: float
    note: str = ""

    @property
    def gain(self) -> float:
        return 1 - self.predicted_new_ms / self.predicted_old_ms if self.predicted_old_ms > 0 else 0.0


def starting_plan(problem: Problem) -> Program:
    """The best fitting heuristic of ``problem``, lowered: where online improvement starts."""
    entry = best_fitting(compare(problem))
    if entry is None:
        raise InfeasibleError(f"no heuristic schedule fits the budget of {problem.name}; compile a plan with "
                              f"`optpipe compile` (it can offload) and pass it with --plan")
    return lower(problem, entry.schedule)


def measured_costs(problem: Problem, durations: dict[tuple[str, int], list[float]],
                   sizes: dict[int, tuple[int, int]]) -> Problem:
    """``problem`` with the measured median F, B, W per stage and the measured activation sizes.

    A fused backward's time is split evenly between B and W; a stage without measurements keeps
    the problem's numbers. The pipeline, budget, p2p time and host link are the problem's.
    """
    costs = problem.costs
    forward, backward_input, backward_weight = list(costs.forward), list(costs.backward_input), \
        list(costs.backward_weight)
    for s in range(problem.stages):
        f = durations.get(("F", s))
        b, w, bw = durations.get(("B", s)), durations.get(("W", s)), durations.get(("BW", s))
        if f:
            forward[s] = max(statistics.median(f), 1e-6)
        if b and w:
            backward_input[s], backward_weight[s] = max(statistics.median(b), 1e-6), max(statistics.median(w), 1e-6)
        elif bw:
            backward_input[s] = backward_weight[s] = max(statistics.median(bw) / 2, 1e-6)
    memory = problem.memory
    activation, kept = list(memory.activation), list(memory.weight_activation)
    for s, (saved, held) in sizes.items():
        if saved > 0:
            activation[s], kept[s] = saved, min(held, saved)
    return replace(problem, name=f"{problem.name} (measured)",
                   costs=Costs(tuple(forward), tuple(backward_input), tuple(backward_weight), costs.p2p),
                   memory=Memory(tuple(activation), tuple(kept), memory.budget))


class OnlineImprover:
    """Measure, re-solve in the background, switch plans; see the module's docstring.

    ``problem`` is the problem the starting plan was made for (its pipeline must be the plan's).
    ``log`` gets rank 0's lines (default: print).
    """

    def __init__(self, problem: Problem, *, measure_steps: int = 3, time_limit_s: float = 20.0,
                 min_gain: float = 0.02, solver: str = "cpsat", wait: bool = False,
                 log: Callable[[str], None] | None = None):
        if measure_steps < 1:
            raise OptpipeError(f"measure_steps: expected at least 1, got {measure_steps}")
        self.problem = problem
        self.measure_steps = measure_steps
        self.time_limit_s = time_limit_s
        self.min_gain = min_gain
        self.solver = solver
        self.wait = wait  # decide at the first boundary after measuring, waiting for the solver there
        self.log = log or (lambda line: print(line, flush=True))
        self.durations: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.switches: list[Switch] = []
        self.finished = False
        self._future: concurrent.futures.Future | None = None
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._solving = False
        self._measured: Problem | None = None
        self._seconds: dict[int, float] = {}  # step -> its wall time on this rank, untraced steps only
        self._switched_before: int | None = None  # the step the new plan began with

    # ----------------------------------------------------------------- per step

    def before_step(self, pipe: PipelineRank, step: int) -> None:
        pipe.trace = not self.finished and 1 <= step <= self.measure_steps

    def after_step(self, pipe: PipelineRank, step: int) -> None:
        """Collective: every rank calls it after every step, with the same ``step``."""
        if pipe.last is not None and not pipe.trace and step > 0:
            self._seconds[step] = pipe.last.seconds
        if self.finished:
            self._compare_step_times(pipe, step)
            return
        if 1 <= step <= self.measure_steps and pipe.last is not None:
            self._record(pipe)
        if step == self.measure_steps:
            self._start(pipe)
        elif step > self.measure_steps:
            self._decide(pipe, step + 1)

    def _compare_step_times(self, pipe: PipelineRank, step: int) -> None:
        """Once the new plan has run as many steps as were measured: rank 0's step times before and after."""
        start = self._switched_before
        if start is None or step + 1 - start != self.measure_steps:
            return
        before = [t for k, t in self._seconds.items() if k < start][-self.measure_steps:]
        after = [t for k, t in self._seconds.items() if k >= start]
        if pipe.rank == 0 and before and after:
            old, new = statistics.median(before) * 1e3, statistics.median(after) * 1e3
            gain = 1 - new / old
            self.log(f"improve: measured on rank 0: {old:.3f} ms per step before the switch, {new:.3f} ms over the "
                     f"{len(after)} steps since ({100 * abs(gain):.1f}% {'faster' if gain >= 0 else 'slower'})")

    def close(self) -> None:
        if self._pool is not None:
            processes = list((getattr(self._pool, "_processes", None) or {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                if process.is_alive():
                    process.kill()  # a solver still running: its answer is no longer wanted
            self._pool = None

    # ----------------------------------------------------------------- measuring

    def _record(self, pipe: PipelineRank) -> None:
        per_op: dict[tuple[str, int, int], float] = defaultdict(float)
        for record in pipe.last.records:
            kind = TRACE_KIND.get(record.opcode)
            if kind is not None:  # the loss counts as part of the last stage's forward
                per_op[(kind, record.stage, record.microbatch)] += (record.end_ns - record.start_ns) / 1e6
        for (kind, stage, _), ms in per_op.items():
            self.durations[(kind, stage)].append(ms)

    def _start(self, pipe: PipelineRank) -> None:
        mine = (dict(self.durations), pipe.activation_bytes)
        gathered: list = [None] * pipe.world_size
        if pipe.world_size > 1:
            collective("gathering the measured op times", dist.all_gather_object, gathered, mine)
        else:
            gathered = [mine]
        if pipe.rank != 0:
            return
        durations: dict = defaultdict(list)
        sizes: dict = {}
        for times, held in gathered:
            for key, values in times.items():
                durations[key].extend(values)
            sizes.update(held)
        self._measured = measured_costs(self.problem, durations, sizes)
        costs = self._measured.costs
        self.log(f"improve: measured steps 1-{self.measure_steps}: F {_ms(costs.forward)}, B "
                 f"{_ms(costs.backward_input)}, W {_ms(costs.backward_weight)} ms per stage; re-solving with "
                 f"{self.solver} for up to {self.time_limit_s:g} s in the background")
        context = mp.get_context("spawn")
        self._pool = concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context)
        self._future = self._pool.submit(resolve, self._measured, pipe.program, self.solver, self.time_limit_s)

    # ----------------------------------------------------------------- deciding

    def _decide(self, pipe: PipelineRank, next_step: int) -> None:
        status, candidate, decision = _PENDING, None, None
        if pipe.rank == 0:
            status, candidate, decision = self._ready(pipe, next_step)
        if pipe.world_size > 1:
            flag = torch.tensor([status], dtype=torch.int64,
                                device=pipe.device if dist.get_backend() == "nccl" else "cpu")
            collective("the plan-improvement broadcast", dist.broadcast, flag, 0)
            status = int(flag.item())
        if status == _PENDING:
            return
        self.finished = True
        self.close()
        if status == _DONE:
            return
        switched = pipe.switch_plan(candidate)
        if switched:
            self._switched_before = next_step
        if pipe.rank != 0:
            return
        if switched:
            decision = replace(decision, switched=True)
            self.log(f"improve: before step {next_step}: every rank switched from {decision.old_name} to "
                     f"{decision.new_name} (plan {pipe.digest.hex()[:12]}); predicted {decision.predicted_old_ms:.3f} "
                     f"-> {decision.predicted_new_ms:.3f} ms per step with the measured costs "
                     f"({100 * decision.gain:.1f}% faster)")
        else:
            refused = ", ".join(map(str, pipe.refused_by))
            decision = replace(decision, note=f"rank {refused} could not load it")
            self.log(f"improve: before step {next_step}: rank {refused} could not load the new plan "
                     f"{decision.new_name}; every rank keeps {decision.old_name}")
        self.switches.append(decision)

    def _ready(self, pipe: PipelineRank, next_step: int) -> tuple[int, bytes | None, Switch | None]:
        if self._future is not None and self.wait:
            concurrent.futures.wait([self._future])
        if self._future is None or not self._future.done():
            return _PENDING, None, None
        old_name = pipe.program.header.schedule_name
        try:
            data, name, new_ms, old_ms = self._future.result()
        except Exception as error:  # the solver process failed: training goes on as it was
            self.log(f"improve: the re-solve failed ({type(error).__name__}: {first_line(error)}); "
                     f"keeping {old_name}")
            return _DONE, None, None
        decision = Switch(next_step, False, old_name, name, old_ms, new_ms)
        if new_ms < old_ms * (1 - self.min_gain) and new_ms < old_ms:
            return _PROPOSE, data, decision
        self.log(f"improve: the re-solve found nothing faster than {old_name} by more than "
                 f"{100 * self.min_gain:g}% (predicted {old_ms:.3f} ms, best {name} {new_ms:.3f} ms); keeping it")
        self.switches.append(decision)
        return _DONE, None, None


def _ms(values) -> str:
    return "/".join(f"{v:.2f}" for v in values)

