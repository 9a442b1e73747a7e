"""DualPipeV: DeepSeek's DualPipe folded onto a V, as PyTorch's ``ScheduleDualPipeV`` runs it.

Placement is the V of ZBV (device d holds stage d and stage 2p-1-d; ``placement = "vshape"``).
Each device runs, with chunk 0 = its stage d and chunk 1 = its stage 2p-1-d:

1. 2(p-1-d) forwards of chunk 0;
2. d+1 pairs: forward of chunk 0, forward of chunk 1;
3. p-1-d times: B of chunk 1, the oldest waiting W, forward of chunk 1 (zero-bubble style);
4. the main phase, m - 2p + d + 1 times: (F chunk 0 + BW chunk 1), then (F chunk 1 + BW chunk 0),
   each pair overlapped in DualPipe (the last device runs its very first pair one after the other);
5. p-1-d times: BW of chunk 1, then (F chunk 1 + BW chunk 0);
6. d+1 times: backwards of chunk 1 then chunk 0, fused (BW) in the first half and split (B, W held
   back) from the middle on;
7. p-1-d times: the oldest waiting W, then a backward of chunk 0 (split once step 6 split);
8. the Ws still waiting.

What is approximated: DualPipe overlaps the forward of one microbatch with the backward of
another on the same device so that each one's communication hides behind the other's
compute. Our semantics run one compute op at a time, with p2p as a latency between devices, so
a pair is the forward followed by the fused backward: its time is F + B + W instead of about
max(F, B + W) plus overlap losses, and the pair's memory is that of F before BW. The makespan
here is therefore what DualPipeV costs without the overlap; the order, and hence the memory
(about 2p + 1 chunk activations on device 0 at F = B = W), is PyTorch's.
Needs m >= 2p (every device must reach the main phase).
"""

from __future__ import annotations

from optpipe.core.problem import Placement, Problem
from optpipe.core.schedule import Op, OpKind, Schedule

from ._register import register, require

__all__ = ["dualpipe_v", "dualpipe_v_order"]

_F, _B, _W, _BW = OpKind.F, OpKind.B, OpKind.W, OpKind.BW


def dualpipe_v_order(devices: int, microbatches: int, device: int) -> list[Op]:
    """Device ``device``'s ops in order (see the module docstring for the steps)."""
    p, m, d = devices, microbatches, device
    stage = (d, 2 * p - 1 - d)  # chunk 0, chunk 1
    forwards, backwards = [0, 0], [0, 0]
    waiting: list[Op] = []
    order: list[Op] = []

    def forward(chunk: int) -> None:
        order.append(Op(_F, stage[chunk], forwards[chunk]))
        forwards[chunk] += 1

    def backward(chunk: int, split: bool) -> None:
        i = backwards[chunk]
        backwards[chunk] += 1
        if split:
            order.append(Op(_B, stage[chunk], i))
            waiting.append(Op(_W, stage[chunk], i))
        else:
            order.append(Op(_BW, stage[chunk], i))

    def weight() -> None:
        if waiting:
            order.append(waiting.pop(0))

    for _ in range(2 * (p - 1 - d)):  # 1
        forward(0)
    for _ in range(d + 1):  # 2
        forward(0)
        forward(1)
    for _ in range(p - 1 - d):  # 3
        backward(1, split=True)
        weight()
        forward(1)
    for _ in range(m - 2 * p + d + 1):  # 4: two overlapped pairs per step
        forward(0)
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    for _ in range(p - 1 - d):  # 5
        backward(1, split=False)
        forward(1)
        backward(0, split=False)
    split = False
    for k in range(d + 1):  # 6: split from the middle on (chunk 1 first on odd devices)
        if k == (d + 1) // 2 and d % 2 == 1:
            split = True
        backward(1, split)
        if k == (d + 1) // 2 and d % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(p - 1 - d):  # 7
        weight()
        backward(0, split)
    while waiting:  # 8
        weight()
    return order


@register("DualPipeV", "DeepSeek-V3 DualPipe (arXiv 2412.19437) on a V; PyTorch ScheduleDualPipeV",
          "V-shape, F+B pairs (overlapped in DualPipe, run in turn here); needs m >= 2p")
def dualpipe_v(problem: Problem) -> Schedule:
    pipe = problem.pipeline
    p, m = pipe.devices, pipe.microbatches
    require(pipe.placement is Placement.VSHAPE and pipe.chunks_per_device == 2,
            f'DualPipeV needs placement = "vshape" with chunks_per_device = 2; this problem has '
            f'"{pipe.placement.value}" with {pipe.chunks_per_device} chunk(s) per device')
    require(m >= 2 * p, f"DualPipeV needs at least 2p = {2 * p} microbatches (every device must reach its "
                        f"main phase); this problem has {m}")
    return Schedule.of("DualPipeV", [dualpipe_v_order(p, m, d) for d in range(p)])
