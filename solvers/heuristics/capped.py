"""1F1B-capped: a memory-capped list schedule, the baseline that fits any budget.

Not a paper's schedule but what practitioners reach for when 1F1B runs out of memory (the
memory-limited baselines of the OptPipe paper): never start a forward that would push the
device past its budget. With several stages on a device, a microbatch is admitted to the device
only when the budget can hold all of its stages' activations there (they are live at once,
after its last forward on the device), so admitted microbatches can always finish. Built as a list schedule: repeatedly commit, over all devices, the op
that can start earliest, where a device's candidates are, for each of its stages, the next
fused backward and the next forward (microbatch order) if its activation still fits; ties go
to the backward, which frees memory. Committing in start order means the simulator reproduces
the times exactly, and every device keeps within the budget by construction.

Promises: fits whenever one microbatch's activations fit on each device; any
placement and any number of chunks; with memory to spare it runs like 1F1B, (m+p-1)(F+B+W)
with equal costs; it cannot deadlock, because the last stage always drains and every device
runs forwards and backwards of a stage in microbatch order.
"""

from __future__ import annotations

from optpipe.core.errors import InternalError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.semantics import Place, duration_ms, holds, waits
from optpipe.core.units import format_size

from ._register import register, require

__all__ = ["one_f_one_b_capped"]


def _device_bytes(problem: Problem, stage: int) -> int:
    """What one activation of ``stage`` takes on its device while kept there (a fused backward)."""
    return sum(h.bytes for h in holds(problem, stage, 0, fused=True) if h.place is Place.DEVICE)


@register("1F1B-capped", "memory-capped list schedule (the memory-limited 1F1B baseline)",
          "never starts a forward the budget cannot hold; any placement", effort=1, fallback=True)
def one_f_one_b_capped(problem: Problem) -> Schedule:
    state = _Capped(problem)
    # Each device's earliest candidate, recomputed only for the devices a commit can change: its
    # own (clock, memory, next ops) and those of the neighbouring stages (ops that waited on it).
    # The minimum over devices is the minimum over all candidates, so the order is the same as
    # scanning every device each step, in O(ops) rather than O(ops x devices) steps.
    best = [min(state.candidates(d), default=None) for d in range(problem.devices)]
    remaining = 2 * problem.stages * problem.microbatches
    while remaining:
        heap = [c for c in best if c is not None]
        if not heap:  # cannot happen for a valid problem (see the docstring); say so if it does
            raise InternalError("1F1B-capped: no op can start; the memory-capped order deadlocked")
        start, _, op = min(heap)
        state.commit(op, start)
        remaining -= 1
        for touched in state.touched_by(op):
            best[touched] = min(state.candidates(touched), default=None)
    return Schedule.of("1F1B-capped", state.orders)


class _Capped:
    """The list schedule's state: per stage the next forward and backward, per device when it is
    free, the activation bytes it holds and those admitted microbatches will still allocate."""

    def __init__(self, problem: Problem):
        pipe, memory = problem.pipeline, problem.memory
        p = pipe.devices
        self.problem = problem
        self.device_of = [pipe.device_of(s) for s in range(pipe.stages)]
        self.size = [_device_bytes(problem, s) for s in range(pipe.stages)]
        self.end_of: dict[Op, float] = {}
        self.next_forward = [0] * pipe.stages
        self.next_backward = [0] * pipe.stages
        self.free_at = [0.0] * p
        self.held = [0] * p  # activation bytes allocated on each device
        self.reserved = [0] * p  # bytes admitted microbatches will still allocate there
        self.footprint = [sum(self.size[s] for s in pipe.stages_on(d)) for d in range(p)]
        self.first_on = [min(pipe.stages_on(d)) for d in range(p)]
        for d in range(p):
            require(self.footprint[d] <= memory.budget,
                    f"one microbatch holds {format_size(self.footprint[d])} of activations on device {d} (all its "
                    f"stages there are live at once) but the budget is {format_size(memory.budget)}; no schedule "
                    f"without offload fits, so raise the budget or enable offload")
        self.orders: list[list[Op]] = [[] for _ in range(p)]

    def ready(self, op: Op) -> float | None:
        """When the data ``op`` waits for has arrived; None while a wait has not been placed."""
        at = 0.0
        for wait in waits(self.problem, op, fused_above=True):
            end = self.end_of.get(wait.op)
            if end is None:
                return None
            at = max(at, end + wait.lag_ms)
        return at

    def candidates(self, device: int):
        """(start, 0 for a backward and 1 for a forward, op) of each op the device could run next."""
        pipe, budget = self.problem.pipeline, self.problem.memory.budget
        for s in pipe.stages_on(device):
            i = self.next_backward[s]
            if i < self.next_forward[s]:
                op = Op(OpKind.BW, s, i)
                arrived = self.ready(op)
                if arrived is not None:
                    yield max(self.free_at[device], arrived), 0, op
            i = self.next_forward[s]
            admits = s != self.first_on[device] or \
                self.held[device] + self.reserved[device] + self.footprint[device] <= budget
            if i < pipe.microbatches and admits:
                op = Op(OpKind.F, s, i)
                arrived = self.ready(op)
                if arrived is not None:
                    yield max(self.free_at[device], arrived), 1, op

    def touched_by(self, op: Op) -> set[int]:
        """The devices whose candidates a commit of ``op`` can change: its own and its neighbours'."""
        s, stages = op.stage, self.problem.stages
        return {self.device_of[s]} | {self.device_of[n] for n in (s - 1, s + 1) if 0 <= n < stages}

    def commit(self, op: Op, start: float) -> None:
        """Run ``op`` from ``start`` and account for the memory it takes or frees."""
        s, d = op.stage, self.device_of[op.stage]
        self.end_of[op] = end = start + duration_ms(self.problem, op)
        if op.kind is OpKind.F:
            self.next_forward[s] += 1
            self.held[d] += self.size[s]
            if s == self.first_on[d]:
                self.reserved[d] += self.footprint[d]
            self.reserved[d] -= self.size[s]
        else:
            self.next_backward[s] += 1
            self.held[d] -= self.size[s]
        self.free_at[d] = end
        self.orders[d].append(op)
