"""ZB-I: zero bubble on interleaved placement, as PyTorch's ``ScheduleInterleavedZeroBubble`` runs it.

ZB-H1's idea (Qi et al., arXiv 2401.10241, section 2.1: split the backward, hold W back to fill
the bubble) on Megatron's interleaved placement (stage c*p + d on device d, v >= 2 chunks).
Microbatches are grouped as in 1F1B-I (g = m / max(1, m // p), needs m % (m // p) == 0);
forwards walk the chunks group by group, backwards walk them in reverse.

Device d runs (v-1)g + (p-1-d) warm-up forwards: one per hop below the last device, not
1F1B-I's two, because a B alone (not B + W) is what the device above waits for. Then it
alternates F and B and, like ZB-H1, holds back its first d Ws: after its j-th B it runs the
oldest waiting W only once j >= d; the rest close the row. Device 0 then holds (v-1)g + p
stage activations, g - 1 fewer than 1F1B-I's (v-1)g + 2p - 1 with g = p.

The order is the one PyTorch builds (its compute-only CSV imports to the same ops); at costs
other than F = B = W with p2p = 0 the generator also places W with the real costs within the
same peak memory (``_greedy.cost_aware``) and keeps whichever is faster.
"""

from __future__ import annotations

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule

from ._register import register
from ._greedy import cost_aware
from .interleaved import interleaved_group, require_interleaved_rounds

__all__ = ["zb_interleaved", "zb_interleaved_warmup"]


def zb_interleaved_warmup(devices: int, chunks: int, microbatches: int, device: int) -> int:
    """Forwards device ``device`` runs before its first backward (capped at v·m)."""
    group = interleaved_group(devices, microbatches)
    return min((chunks - 1) * group + devices - 1 - device, chunks * microbatches)


def _device_order(p: int, v: int, m: int, d: int) -> list[Op]:
    group = interleaved_group(p, m)
    total = v * m
    warmup = zb_interleaved_warmup(p, v, m, d)
    next_forward, next_backward = [0] * v, [0] * v
    waiting: list[Op] = []

    def forward(k: int) -> Op:
        chunk = (k // group) % v
        next_forward[chunk] += 1
        return Op(OpKind.F, chunk * p + d, next_forward[chunk] - 1)

    def backward(j: int) -> list[Op]:
        chunk = v - 1 - (j // group) % v
        next_backward[chunk] += 1
        op = Op(OpKind.B, chunk * p + d, next_backward[chunk] - 1)
        waiting.append(Op(OpKind.W, op.stage, op.microbatch))
        return [op, waiting.pop(0)] if j >= d else [op]  # device d holds back its first d Ws

    order = [forward(k) for k in range(warmup)]
    for k in range(warmup, total):
        order.append(forward(k))
        order.extend(backward(k - warmup))
    for j in range(total - warmup, total):
        order.extend(backward(j))
    return order + waiting


@register("ZB-I", "Qi et al., Zero Bubble PP (arXiv 2401.10241) ZB-H1 on interleaved placement; "
                  "PyTorch ScheduleInterleavedZeroBubble",
          "v >= 2 chunks, split B/W, W held back to fill the bubble; (v-1)g + p activations on device 0", effort=2)
def zb_interleaved(problem: Problem) -> Schedule:
    require_interleaved_rounds(problem, "ZB-I", "use ZB-H1 for one chunk per device")
    pipe = problem.pipeline
    p, v, m = pipe.devices, pipe.chunks_per_device, pipe.microbatches
    return cost_aware(problem, Schedule.of("ZB-I", [_device_order(p, v, m, d) for d in range(p)]))
