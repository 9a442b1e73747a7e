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

import heapq

from optpipe.compiler.problem import Problem
from optpipe.compiler.schedule import Op, OpKind, Schedule

from optpipe.compiler.units import format_size

from ..registry import register, require

__all__ = ["one_f_one_b_capped"]


@register("1F1B-capped", "memory-capped list schedule (the memory-limited 1F1B baseline)",
          "never starts a forward the budget cannot hold; any placement")
def one_f_one_b_capped(problem: Problem) -> Schedule:
    pipe, costs, memory = problem.pipeline, problem.costs, problem.memory
    p, m, last = pipe.devices, pipe.microbatches, pipe.stages - 1
    device_of = [pipe.device_of(s) for s in range(pipe.stages)]
    forward_end: dict[tuple[int, int], float] = {}
    backward_end: dict[tuple[int, int], float] = {}
    next_forward = [0] * pipe.stages
    next_backward = [0] * pipe.stages
    free_at = [0.0] * p
    held = [0] * p  # activation bytes allocated on each device
    reserved = [0] * p  # bytes admitted microbatches will still allocate there
    footprint = [sum(memory.activation[s] for s in pipe.stages_on(d)) for d in range(p)]
    first_on = [min(pipe.stages_on(d)) for d in range(p)]
    for d in range(p):
        require(footprint[d] <= memory.budget,
                f"one microbatch holds {format_size(footprint[d])} of activations on device {d} (all its stages "
                f"there are live at once) but the budget is {format_size(memory.budget)}; no schedule without "
                f"offload fits, so raise the budget or enable offload")
    orders: list[list[Op]] = [[] for _ in range(p)]

    def arrival(stage: int, source: int, end: float) -> float:
        return end + (costs.p2p if device_of[source] != device_of[stage] else 0.0)

    def candidates(device: int):
        for s in pipe.stages_on(device):
            i = next_backward[s]
            if i < next_forward[s]:
                ready = forward_end.get((s, i)) if s == last else backward_end.get((s + 1, i))
                if ready is not None:
                    source = s if s == last else s + 1
                    yield max(free_at[device], arrival(s, source, ready)), 0, s, OpKind.BW, i
            i = next_forward[s]
            admits = s != first_on[device] or held[device] + reserved[device] + footprint[device] <= memory.budget
            if i < m and admits:
                ready = 0.0 if s == 0 else forward_end.get((s - 1, i))
                if ready is not None:
                    yield max(free_at[device], arrival(s, s - 1, ready) if s else 0.0), 1, s, OpKind.F, i

    remaining = 2 * pipe.stages * m
    while remaining:
        heap = [c for d in range(p) for c in candidates(d)]
        if not heap:  # cannot happen for a valid problem (see the docstring); say so if it does
            raise RuntimeError("1F1B-capped: no op can start; the memory-capped order deadlocked")
        start, _, s, kind, i = heapq.nsmallest(1, heap)[0]
        d = device_of[s]
        if kind is OpKind.F:
            end = start + costs.forward[s]
            forward_end[(s, i)] = end
            next_forward[s] += 1
            held[d] += memory.activation[s]
            if s == first_on[d]:
                reserved[d] += footprint[d]
            reserved[d] -= memory.activation[s]
        else:
            end = start + costs.backward(s)
            backward_end[(s, i)] = end
            next_backward[s] += 1
            held[d] -= memory.activation[s]
        free_at[d] = end
        orders[d].append(Op(kind, s, i))
        remaining -= 1
    return Schedule.of("1F1B-capped", orders)
