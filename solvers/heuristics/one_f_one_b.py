"""1F1B (PipeDream-Flush; Narayanan et al., 2021, section 2.2 of the Megatron-LM PP paper).

Device d runs min(p-d-1, m) warm-up forwards, then alternates one forward and one fused
backward, then drains the remaining backwards. Promises: bubble (p-1)(F+B+W) per device with
equal costs, and at most p activations in flight on device 0 (p-d on device d).
"""

from __future__ import annotations

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule

from ._register import register, require


def one_f_one_b_order(warmup: int, microbatches: int) -> list[tuple[str, int]]:
    """The classic order as (kind, microbatch): ``warmup`` forwards, then F/B pairs, then Bs."""
    warmup = min(warmup, microbatches)
    order = [("F", i) for i in range(warmup)]
    backward = 0
    for i in range(warmup, microbatches):
        order.append(("F", i))
        order.append(("B", backward))
        backward += 1
    order.extend(("B", i) for i in range(backward, microbatches))
    return order


@register("1F1B", "Narayanan et al., Megatron-LM PP (arXiv 2104.04473), section 2.2.1", "p-d in flight on device d")
def one_f_one_b(problem: Problem) -> Schedule:
    pipe = problem.pipeline
    require(pipe.chunks_per_device == 1,
            f"1F1B runs one stage per device; this problem has {pipe.chunks_per_device} chunks per device (use 1F1B-I)")
    p, m = pipe.devices, pipe.microbatches
    devices = []
    for device in range(p):
        (stage,) = pipe.stages_on(device)
        ops = [Op(OpKind.F if kind == "F" else OpKind.BW, stage, i)
               for kind, i in one_f_one_b_order(p - stage - 1, m)]
        devices.append(ops)
    return Schedule.of("1F1B", devices)
