"""Interleaved 1F1B (Narayanan et al., Megatron-LM PP, arXiv 2104.04473, section 2.2.2).

Each device holds v model chunks (stage s on device s % p). Forwards walk the chunks in
groups of microbatches: a group of microbatches through chunk 0, the same group through
chunk 1, ..., then the next group; backwards walk the chunks in reverse. Device d runs
(v-1)·g + 2(p-1-d) warm-up forwards (Megatron's count with g = p), then alternates one forward
and one fused backward, then drains the backwards.

Microbatches that are not a multiple of p are grouped the way PyTorch's
ScheduleInterleaved1F1B does: r = max(1, m // p) rounds of g = m / r microbatches, which needs
m % r == 0 (so 10 microbatches on 4 devices run in 2 groups of 5; 9 on 4 is not applicable).

Promises, with equal stage costs, p2p = 0 and m >= p: bubble per device (makespan minus busy)
of (p-1)(F+B+W) in stage costs. A device's whole share of the model costs t_f = vF forward and
t_b = v(B+W) backward, so this is Megatron's (p-1)(t_f+t_b)/v, 1/v of 1F1B's. A p2p > 0 adds
2(vp-1)·p2p when groups hold exactly p microbatches (the first microbatch crosses vp-1 device
boundaries going down and as many coming back, against 2(p-1) for 1F1B), less when groups are
larger (their slack absorbs the hops at each chunk switch); this holds while p2p is small
against a stage's cost, beyond that the steady state itself waits. Device d holds at most
warm-up + 1 stage activations (the forward of the first steady step runs before its backward),
(v-1)p + 2p - 1 on device 0: a factor 1 + (p-1)/(vp) over 1F1B's p whole-device activations.
With m < p the groups hold fewer microbatches than there are devices and the bubble is larger.
"""

from __future__ import annotations

from optpipe.core.problem import Placement, Problem
from optpipe.core.schedule import Op, OpKind, Schedule

from ._register import register, require

__all__ = ["interleaved_one_f_one_b", "interleaved_group", "interleaved_warmup", "require_interleaved_rounds"]


def interleaved_group(devices: int, microbatches: int) -> int:
    """Microbatches per group: p when m is a multiple of p, else m / max(1, m // p) (PyTorch's rule)."""
    rounds = max(1, microbatches // devices)
    return microbatches // rounds


def interleaved_warmup(devices: int, chunks: int, microbatches: int, device: int) -> int:
    """Forwards device ``device`` runs before its first backward (Megatron's count, capped at v·m)."""
    group = interleaved_group(devices, microbatches)
    return min((chunks - 1) * group + 2 * (devices - 1 - device), chunks * microbatches)


def _device_order(devices: int, chunks: int, microbatches: int, device: int) -> list[Op]:
    """Warm-up forwards, then forward/backward pairs, then the remaining backwards."""
    group = interleaved_group(devices, microbatches)
    total = chunks * microbatches
    warmup = interleaved_warmup(devices, chunks, microbatches, device)
    next_forward = [0] * chunks  # per chunk, the next microbatch to run forward
    next_backward = [0] * chunks

    def forward(k: int) -> Op:
        chunk = (k // group) % chunks
        op = Op(OpKind.F, chunk * devices + device, next_forward[chunk])
        next_forward[chunk] += 1
        return op

    def backward(k: int) -> Op:
        chunk = chunks - 1 - (k // group) % chunks
        op = Op(OpKind.BW, chunk * devices + device, next_backward[chunk])
        next_backward[chunk] += 1
        return op

    order = [forward(k) for k in range(warmup)]
    for k in range(warmup, total):
        order.append(forward(k))
        order.append(backward(k - warmup))
    order.extend(backward(k) for k in range(total - warmup, total))
    return order


def require_interleaved_rounds(problem: Problem, name: str, fewer_chunks: str) -> None:
    """The shape every Megatron-style interleaved schedule needs: v >= 2, interleaved, whole rounds."""
    pipe = problem.pipeline
    p, v, m = pipe.devices, pipe.chunks_per_device, pipe.microbatches
    require(v >= 2, f"{name} interleaves v >= 2 model chunks per device; this problem has {v} ({fewer_chunks})")
    require(pipe.placement is Placement.INTERLEAVED,
            f'{name} needs placement = "interleaved" (stage s on device s % p); this problem uses '
            f'"{pipe.placement.value}"')
    rounds = max(1, m // p)
    require(m % rounds == 0,
            f"{name} groups microbatches in {rounds} equal rounds (max(1, m // p), as PyTorch's interleaved "
            f"schedules do), but {m} microbatches do not split into {rounds}; "
            f"use a multiple of {p} microbatches or one that {rounds} divides")


@register("1F1B-I", "Narayanan et al., Megatron-LM PP (arXiv 2104.04473), section 2.2.2",
          "v chunks per device; bubble (p-1)(F+B+W) in stage costs, 1/v of 1F1B's for the same model")
def interleaved_one_f_one_b(problem: Problem) -> Schedule:
    require_interleaved_rounds(problem, "1F1B-I", "use 1F1B, or set pipeline.chunks_per_device >= 2")
    pipe = problem.pipeline
    p, v, m = pipe.devices, pipe.chunks_per_device, pipe.microbatches
    return Schedule.of("1F1B-I", [_device_order(p, v, m, d) for d in range(p)])
