"""V-shape schedules ZBV, V-Half and V-Min (Qi et al., arXiv 2405.15362, sections 3-4).

Each device holds two model chunks placed in a V (stage s on device s if s < p, else 2p-1-s), so
device 0 runs the first and the last stage, the hand-off at the bottom of the V stays on one
device, and backward is split into B and W. Each schedule is one building block (``VBlock``: the
slots between a pass on one device and the same pass on the next, and at the bends of the V)
repeated every 6 unit slots, with W filling the free slots and the warm-up and cool-down
reordered under the steady state's memory peak (see ``_vshape_blocks``).

Memory unit below: one chunk activation (``memory.activation`` of one stage). 1F1B on the same
model holds p activations of a whole device's share, 2p chunk activations on device 0. With
equal costs (F = B = W per stage, p2p = 0) a device computes 6m stage-units; 1F1B on the same
model needs 6m + 6(p-1).

- ZBV: offsets 4, 2, 4, 2; the two lifespans on a device add up to 12p-4 slots, about 2p
  intervals: 1F1B's memory, 2p chunk activations on every device. The steady state has no idle
  slot; the only idle time left is the pipeline fill, makespan 6m + (p-1) for m >= p (the first
  forward reaches device p-1 after p-1 slots). The paper counts this as zero bubble.
- V-Half: offsets 2, 1, 2, 1; lifespans about 6p slots, p intervals: half of 1F1B's memory as p
  grows. Peak: the paper's (p+2)//2 whole-device activations, 2((p+2)//2) chunk activations
  (3/4 of 1F1B's at p = 4, 5/8 at p = 8). Idle time about half of 1F1B's (the paper's bubble
  rate ~p/2m against ~p/m); measured 3p-7 for even p, 3p-4 for odd (below).
- V-Min: offsets 1, 1, 1, 1; lifespans about 4p slots, 2p/3 intervals: a third of 1F1B's memory
  as p grows. Peak: the paper's (p+4)//3 whole-device activations (1/2 of 1F1B's at p = 4 and
  8, 5/12 at p = 12). Idle time about two thirds of 1F1B's (the paper's ~2p/3m against ~p/m);
  measured 4p-5, or 4p-7 when 3 divides p (below).

Measured idle times are for 3 <= p <= 16, m >= 2p, F = B = W, p2p = 0 and weight_activation =
activation/2 (tests/test_heuristics_v.py checks p up to 8); they do not grow with m.

The peaks above are exact when B frees nothing until W (weight_activation = activation, how the
reference code counts); when B frees part of it (docs/design.md, "Memory holds") V-Min can hold
one chunk activation less (7 instead of 8 at p = 8) and the others hold the same.

All of the above is for F = B = W and p2p = 0, where the block schedule is returned as it is. At
other costs the generator also tries cost-aware orders under the block schedule's peak memory
(``_greedy.cost_aware``: the block's F/B order with every W placed at real costs, and list
schedules; ``_greedy_v.cost_aware_v``: a round-based V order that decides each device's next B, F
and W at real costs, as the authors' zbv.py does for ZB-V) and returns the fastest. On the
reference grid (tests/test_heuristics_reference.py) none of the three is slower than the
authors' generators at no more peak.
"""

from __future__ import annotations

from optpipe.core.problem import Placement, Problem
from optpipe.core.schedule import Schedule
from optpipe.core.simulate import simulate

from ._deadline import out_of_time, variants_pay
from ._register import register, require
from ._greedy import _uniform, cost_aware
from ._greedy_v import cost_aware_v
from ._vshape_blocks import REORDERS, VBlock, v_schedule

__all__ = ["ZBV_BLOCK", "V_HALF_BLOCK", "V_MIN_BLOCK", "zbv", "v_half", "v_min"]

_SOURCE = "Qi et al., Pipeline Parallelism with Controllable Memory (arXiv 2405.15362), sections 3-4"

# ZB-V's steady state (Zero Bubble PP, arXiv 2401.10241, section 6) read as a building block:
# on each device F0 B0 W0 F1 B1 W1 with no idle slot; the bends wait 3 slots so that they do.
ZBV_BLOCK = VBlock(offsets=(4, 2, 4, 2), turns=(3, 1, 3))
# The paper's V-Half block: forwards and backwards down the V take 2 slots, up the V 1.
V_HALF_BLOCK = VBlock(offsets=(2, 1, 2, 1), turns=(1, 1, 2))
# The paper's V-Min block: every pass follows the one it needs at once.
V_MIN_BLOCK = VBlock(offsets=(1, 1, 1, 1), turns=(1, 1, 1))


def _fastest(name: str, problem: Problem, block: VBlock) -> Schedule:
    """The fastest reordering of ``block`` (``REORDERS``) within the default one's peak, made cost-aware.

    The default reordering sets the memory limit (the paper's peak, as counted above); the
    others differ in how W fill the free slots and which moves the memory check allows, and at
    real costs one or another is faster. At costs other than F = B = W, p2p = 0 the round-based
    orders (``cost_aware_v``) under the same limit are tried too. Past the build deadline
    (``_deadline.py``) each of these stops with the fastest it has.
    """
    default = v_schedule(name, problem, block)
    first = simulate(problem, default)
    cap = first.peak
    best, best_key = default, None
    seen = {}  # several reorderings often give the same order: time each order once
    for how in REORDERS:
        if out_of_time() or not variants_pay(cap):
            break
        candidate = default if how == REORDERS[0] else v_schedule(name, problem, block, how)
        if candidate.devices in seen:
            continue
        timeline = seen[candidate.devices] = first if candidate is default else simulate(problem, candidate)
        key = (timeline.makespan, timeline.peak)
        if timeline.peak <= cap and (best_key is None or key < best_key):
            best, best_key = candidate, key
    best = cost_aware(problem, best)
    if _uniform(problem):
        return best
    return cost_aware_v(problem, best, default, cap)


def _require_vshape(name: str, problem: Problem) -> None:
    pipe = problem.pipeline
    require(
        pipe.placement is Placement.VSHAPE and pipe.chunks_per_device == 2,
        f'{name} needs placement = "vshape" with chunks_per_device = 2 (its blocks pair a long-lived and a '
        f'short-lived chunk on each device); this problem has "{pipe.placement.value}" with '
        f"{pipe.chunks_per_device} chunk(s) per device",
    )


@register("ZBV", _SOURCE + "; ZB-V of arXiv 2401.10241 section 6",
          "V-shape, split backward; 1F1B's memory (2p chunk activations), idle only p-1 slots of pipeline fill",
          effort=2)
def zbv(problem: Problem) -> Schedule:
    _require_vshape("ZBV", problem)
    return _fastest("ZBV", problem, ZBV_BLOCK)


@register("V-Half", _SOURCE, "V-shape, split backward; about half of 1F1B's memory and of its bubble", effort=2)
def v_half(problem: Problem) -> Schedule:
    _require_vshape("V-Half", problem)
    return _fastest("V-Half", problem, V_HALF_BLOCK)


@register("V-Min", _SOURCE, "V-shape, split backward; about a third of 1F1B's memory, two thirds of its bubble",
          effort=2)
def v_min(problem: Problem) -> Schedule:
    _require_vshape("V-Min", problem)
    return _fastest("V-Min", problem, V_MIN_BLOCK)
