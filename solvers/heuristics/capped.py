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
          "never starts a forward the budget cannot hold; any placement")
def one_f_one_b_capped(problem: Problem) -> Schedule:
    pipe, memory = problem.pipeline, problem.memory
    p, m = pipe.devices, pipe.microbatches
    device_of = [pipe.device_of(s) for s in range(pipe.stages)]
    size = [_device_bytes(problem, s) for s in range(pipe.stages)]
    end_of: dict[Op, float] = {}
    next_forward = [0] * pipe.stages
    next_backward = [0] * pipe.stages
    free_at = [0.0] * p
    held = [0] * p  # activation bytes allocated on each device
    reserved = [0] * p  # bytes admitted microbatches will still allocate there
    footprint = [sum(size[s] for s in pipe.stages_on(d)) for d in range(p)]
    first_on = [min(pipe.stages_on(d)) for d in range(p)]
    for d in range(p):
        require(footprint[d] <= memory.budget,
                f"one microbatch holds {format_size(footprint[d])} of activations on device {d} (all its stages "
                f"there are live at once) but the budget is {format_size(memory.budget)}; no schedule without "
                f"offload fits, so raise the budget or enable offload")
    orders: list[list[Op]] = [[] for _ in range(p)]

    def ready(op: Op) -> float | None:
        """When the data ``op`` waits for has arrived; None while a wait has not been placed."""
        at = 0.0
        for wait in waits(problem, op, fused_above=True):
            end = end_of.get(wait.op)
            if end is None:
                return None
            at = max(at, end + wait.lag_ms)
        return at

    def candidates(device: int):
        for s in pipe.stages_on(device):
            i = next_backward[s]
            if i < next_forward[s]:
                op = Op(OpKind.BW, s, i)
                arrived = ready(op)
                if arrived is not None:
                    yield max(free_at[device], arrived), 0, op
            i = next_forward[s]
            admits = s != first_on[device] or held[device] + reserved[device] + footprint[device] <= memory.budget
            if i < m and admits:
                op = Op(OpKind.F, s, i)
                arrived = ready(op)
                if arrived is not None:
                    yield max(free_at[device], arrived), 1, op

    # Each device's earliest candidate, recomputed only for the devices a commit can change: its
    # own (clock, memory, next ops) and those of the neighbouring stages (ops that waited on it).
    # The minimum over devices is the minimum over all candidates, so the order is the same as
    # scanning every device each step, in O(ops) rather than O(ops x devices) steps.
    best = [min(candidates(d), default=None) for d in range(p)]
    remaining = 2 * pipe.stages * m
    while remaining:
        heap = [c for c in best if c is not None]
        if not heap:  # cannot happen for a valid problem (see the docstring); say so if it does
            raise InternalError("1F1B-capped: no op can start; the memory-capped order deadlocked")
        start, _, op = min(heap)
        s, d = op.stage, device_of[op.stage]
        end_of[op] = end = start + duration_ms(problem, op)
        if op.kind is OpKind.F:
            next_forward[s] += 1
            held[d] += size[s]
            if s == first_on[d]:
                reserved[d] += footprint[d]
            reserved[d] -= size[s]
        else:
            next_backward[s] += 1
            held[d] -= size[s]
        free_at[d] = end
        orders[d].append(op)
        remaining -= 1
        for touched in {d} | {device_of[n] for n in (s - 1, s + 1) if 0 <= n < pipe.stages}:
            best[touched] = min(candidates(touched), default=None)
    return Schedule.of("1F1B-capped", orders)
