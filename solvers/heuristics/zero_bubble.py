"""Zero Bubble handcrafted schedules ZB-H1 and ZB-H2 (Qi et al., arXiv 2401.10241, section 2, figure 3).

Both split the backward into B (gradient for the stage's input, on the critical path) and W
(gradient for its weights, free to move anywhere after its B), and place W to fill bubbles.
They are defined for one stage per device (v = 1); we build them in closed form, not by search.

ZB-H1 (section 2.1, "memory efficient"): 1F1B's warm-up (p-1-d forwards on device d), then
F/B pairs; device d holds back its first d W passes, so every device has p microbatches in
flight (F started, W not yet done), and the held-back Ws fill the tail that 1F1B leaves idle.
Promises with p2p = 0, m >= p and W <= min(F, B) (the paper's F = B = W included): makespan
m(F+B+W) + (p-1)(F+B-W), a third of 1F1B's bubble when F = B = W. Peak on device 0 is p
activations, the same as 1F1B; device d holds p-d activations and d ``weight_activation``s,
never more than device 0. A p2p > 0 adds 4(p-1)·p2p (measured for m > p, p2p <= F/2): the
first B reaches device 0 after a round trip of 2(p-1) hops, and in the cool-down each of device
0's last p-1 backwards waits one hop down and one back.

ZB-H2 (section 2.2, "zero bubble"): device d runs 2(p-1-d)+1 warm-up forwards, exactly the
slots between its first F and the moment the first B reaches it, then repeats B, W, F. Once
device 0 has run out of forwards, every device switches to B, F and holds its Ws back, then
ends with them: the paper's reordered tail, which turns 1F1B's trapezoid into a parallelogram.
Promises with F = B = W: makespan m(F+B+W) + (p-1)(F+p2p), the time the first forward needs
to reach the last device plus that device's work, which no schedule beats (exact for
p2p = 0 and m >= p, and measured for p2p <= F/2 with m >= 2p-1). With p2p = 0 and m >= 2p-1
every device computes without a gap from its first op to its last, the paper's zero bubble
(it measures each stage from its own start). Peak on device 0 is 2p-1 activations (capped at
m); device d holds 2p-1-2d activations and 2d ``weight_activation``s.

Both are derived for F = B = W and p2p = 0, where they are returned as the closed form. At other
costs the generator also builds cost-aware orders under the closed form's peak memory (the
closed form's F/B order with W placed at real costs, and list schedules that place warm-up
forwards and W with real costs; ``_greedy``) and returns the fastest; so it is never slower than
the closed form, and measured against the authors' generator in ``tests/test_heuristics_reference.py``.
"""

from __future__ import annotations

from optpipe.core.problem import Placement, Problem
from optpipe.core.schedule import Op, OpKind, Schedule

from ._register import register, require
from ._greedy import cost_aware

__all__ = ["zb_h1", "zb_h2", "zb_h1_order", "zb_h2_order"]


def zb_h1_order(devices: int, microbatches: int, device: int) -> list[tuple[OpKind, int]]:
    """ZB-H1 on one device as (kind, microbatch): 1F1B with W(j) run after B(j + device)."""
    warmup = min(devices - 1 - device, microbatches)
    order = [(OpKind.F, i) for i in range(warmup)]
    next_weight = 0

    def backward(j: int) -> None:
        nonlocal next_weight
        order.append((OpKind.B, j))
        if j >= device:  # device d holds back its first d Ws
            order.append((OpKind.W, next_weight))
            next_weight += 1

    for i in range(warmup, microbatches):
        order.append((OpKind.F, i))
        backward(i - warmup)
    for j in range(microbatches - warmup, microbatches):
        backward(j)
    order.extend((OpKind.W, j) for j in range(next_weight, microbatches))
    return order


def zb_h2_order(devices: int, microbatches: int, device: int) -> list[tuple[OpKind, int]]:
    """ZB-H2 on one device as (kind, microbatch).

    Warm-up: 2(p-1-d)+1 forwards. Then one B per step: while device 0 still has forwards
    (the first m-2p+1 steps) every device runs B, W, F; after that it runs B, F (holding W
    back, the paper's reordered tail) until its forwards run out, then B, W; the held-back Ws
    close the device's row.
    """
    p, m = devices, microbatches
    warmup = min(2 * (p - 1 - device) + 1, m)
    steady = max(0, m - (2 * p - 1))  # steps in which every device still has a forward to run
    order = [(OpKind.F, i) for i in range(warmup)]
    next_forward, next_weight = warmup, 0
    for j in range(m):
        order.append((OpKind.B, j))
        if j < steady:
            order.append((OpKind.W, next_weight))
            next_weight += 1
        if next_forward < m:
            order.append((OpKind.F, next_forward))
            next_forward += 1
        elif j < m - 1:
            order.append((OpKind.W, next_weight))
            next_weight += 1
    order.extend((OpKind.W, j) for j in range(next_weight, m))
    return order


def _require_one_chunk(name: str, problem: Problem) -> None:
    pipe = problem.pipeline
    require(pipe.chunks_per_device == 1,
            f"{name} is defined for one stage per device (v = 1); this problem has "
            f"{pipe.chunks_per_device} chunks per device (use 1F1B-I, or a V-shape schedule for v = 2)")
    require(pipe.placement is Placement.INTERLEAVED,
            f'{name} needs placement = "interleaved"; this problem uses "{pipe.placement.value}"')


def _build(name: str, problem: Problem, order) -> Schedule:
    """The closed form, or a cost-aware order within its peak memory when that is faster (``_greedy``)."""
    _require_one_chunk(name, problem)
    p, m = problem.devices, problem.microbatches
    closed = Schedule.of(name, [[Op(kind, d, i) for kind, i in order(p, m, d)] for d in range(p)])
    return cost_aware(problem, closed)


@register("ZB-H1", "Qi et al., Zero Bubble PP (arXiv 2401.10241), section 2.1, figure 3 top",
          "split B/W, 1F1B memory (p in flight); bubble (p-1)(F+B-W), a third of 1F1B's", effort=2)
def zb_h1(problem: Problem) -> Schedule:
    return _build("ZB-H1", problem, zb_h1_order)


@register("ZB-H2", "Qi et al., Zero Bubble PP (arXiv 2401.10241), section 2.2, figure 3 bottom",
          "split B/W, 2p-1 in flight; no gap on any device from its first op to its last", effort=2)
def zb_h2(problem: Problem) -> Schedule:
    return _build("ZB-H2", problem, zb_h2_order)
