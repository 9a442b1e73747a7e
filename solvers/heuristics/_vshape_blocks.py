"""V-shape building blocks and the passes that turn one into a schedule.

Qi et al., "Pipeline Parallelism with Controllable Memory" (arXiv 2405.15362). Section 3: a
schedule is a building block (the passes of one microbatch on every device) repeated at a fixed
interval, then squeezed, then reordered in the warm-up and cool-down; the peak activation memory
is set by the block's lifespan (first F to last B/W on a device) over the interval. Section 4: on
a V-shape placement device d holds chunk 0 (stage d) and chunk 1 (stage 2p-1-d), so a long
lifespan of one chunk pairs with a short one of the other and every device holds about the same;
the offsets between the passes of neighbouring devices control how much.

Time here is in unit slots, as in the paper's figures (T_F = T_B = T_W): per microbatch a device
runs F and B of both chunks and two W, so the block repeats every ``INTERVAL`` = 6 slots and the
steady state has no idle slot. The slot plan only decides each device's order; the simulator
then times that order with the problem's real costs, which is the paper's squeezing step.
Memory depends only on a device's order (compute runs one op at a time; F allocates at its
start, B and W free at their end), so the plan's peak is exactly the simulated one.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

from optpipe.core.problem import Costs, Memory, Pipeline, Placement, Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.semantics import kept_bytes

__all__ = ["INTERVAL", "VBlock", "Reorder", "REORDERS", "v_schedule"]

INTERVAL = 6  # slots per microbatch and device: F, B, W of two chunks

_F, _B, _W = OpKind.F, OpKind.B, OpKind.W
_Plan = list[dict[Op, int]]  # per device: op -> slot


@dataclass(frozen=True)
class VBlock:
    """The shape of a V-shape building block, in unit slots.

    ``offsets``: slots from a pass on one device to the same pass on the next device along the V,
    for F of chunk 0 (device 0 to p-1), F of chunk 1 (p-1 to 0), B of chunk 1 (0 to p-1), B of
    chunk 0 (p-1 to 0). ``turns``: slots between the two passes at each bend of the V: F0 to F1
    on device p-1, F1 to B1 on device 0 (the loss), B1 to B0 on device p-1.
    """

    offsets: tuple[int, int, int, int]
    turns: tuple[int, int, int]

    def slots(self, devices: int) -> tuple[tuple[int, int, int, int], ...]:
        """Microbatch 0's (F0, F1, B1, B0) slots on each device.

        The backward half is delayed by the smallest gap that lets the block repeat every
        INTERVAL slots without two passes of a device falling into the same slot (the paper's
        "repeat without a collision"); the gap fills with W passes.
        """
        for gap in range(INTERVAL):  # a gap of INTERVAL or more repeats a smaller one mod INTERVAL
            slots = self._slots(devices, gap)
            if all(len({slot % INTERVAL for slot in device}) == 4 for device in slots):
                return slots
        raise ValueError(f"block {self} collides with itself on {devices} devices for every gap")

    def _slots(self, p: int, gap: int) -> tuple[tuple[int, int, int, int], ...]:
        f0, f1, b1, b0 = self.offsets
        turn_forward, turn_loss, turn_backward = self.turns
        first_f1 = f0 * (p - 1) + turn_forward  # F1 on device p-1
        first_b1 = first_f1 + f1 * (p - 1) + turn_loss + gap  # B1 on device 0
        first_b0 = first_b1 + b1 * (p - 1) + turn_backward  # B0 on device p-1
        return tuple(
            (f0 * d, first_f1 + f1 * (p - 1 - d), first_b1 + b1 * d, first_b0 + b0 * (p - 1 - d))
            for d in range(p)
        )


@dataclass(frozen=True)
class Reorder:
    """How the warm-up and cool-down are reordered (the paper fixes the idea, not these details).

    ``upper_first``: a free slot takes the W of the second chunk's oldest B before the first
    chunk's (that chunk's B is on the critical path down the V; otherwise oldest B first).
    ``whole_until_w``: moves are checked counting each activation as held until its W, as if B
    freed nothing (the paper's count; stricter than docs/design.md "Memory holds" if weight_activation <
    activation). ``warmup_twice``: the second pass (B before W) reorders the warm-up again, not
    only the cool-down. ``squeeze``: after each pass the slots are squeezed (every op moved to
    the earliest slot its device and what it needs allow, in the same order, W included) before
    the next step, so the second pass and the final W see the gaps the first pass closed.
    """

    upper_first: bool = False
    whole_until_w: bool = False
    warmup_twice: bool = True
    squeeze: bool = False


REORDERS = tuple(Reorder(u, s, t, q) for q in (False, True) for t in (True, False) for s in (False, True)
                 for u in (False, True))


def v_schedule(name: str, problem: Problem, block: VBlock, how: Reorder = Reorder()) -> Schedule:
    """Repeat ``block`` for every microbatch, fill in W, reorder warm-up and cool-down.

    Reordering moves a pass of the warm-up or cool-down into an earlier free slot once what it
    needs is done, and only if the device's peak stays at most the repeated block's peak: the
    steady state is kept as the block made it. A first pass does this with W at their filled
    slots (the warm-up gets its forwards early); a second pass takes W out and lets B move first,
    with W refilling the free slots afterwards (the cool-down's critical path is the chain of B).
    ``how`` picks the details (``Reorder``); the default is the first of ``REORDERS``.
    Only the shape and the memory sizes matter (not the costs), so orders are cached by those.
    """
    pipe = problem.pipeline
    taken, after_b = zip(*(kept_bytes(problem, s) for s in range(problem.stages)))
    keep = taken if how.whole_until_w else after_b
    p, m = pipe.devices, pipe.microbatches
    short = _short(p)
    orders = None
    if m > short:
        try:
            orders = _extend(_orders(block, p, short, taken, keep, how), m - short)
        except ValueError:  # no steady state found in the shorter order (not seen): reorder them all
            orders = None
    if orders is None:
        orders = _orders(block, p, m, taken, keep, how)
    return Schedule.of(name, orders)


def _short(p: int) -> int:
    """Microbatches beyond which an order is its steady state repeated (see ``_extend``)."""
    return 2 * p + 8


def _extend(orders: tuple[tuple[Op, ...], ...], extra: int) -> tuple[tuple[Op, ...], ...]:
    """``orders`` with ``extra`` more microbatches: the steady state repeated ``extra`` more times.

    Reordering only moves passes of the warm-up and cool-down, whose length does not depend on
    the number of microbatches, and the steady state repeats one microbatch's six passes per
    device (each one microbatch on from the last). So the order for m microbatches is the one
    for fewer with more repeats in the middle, and computing that is O(ops) instead of the
    reordering's O(ops x slots); tests/test_heuristics_v.py checks it against the direct order.
    """
    def shift(op: Op, by: int) -> Op:
        return Op(op.kind, op.stage, op.microbatch + by)

    extended = []
    for ops in orders:
        n, period = len(ops), INTERVAL
        middle = n // 2 - period
        window = None
        for a in sorted(range(period, n - 3 * period), key=lambda k: abs(k - middle)):
            if all(ops[k + period] == shift(ops[k], 1) for k in range(a - period, a + 2 * period)):
                window = a
                break
        if window is None:
            raise ValueError("no steady state to repeat")
        head, repeat, tail = ops[:window + period], ops[window:window + period], ops[window + period:]
        extended.append(head + tuple(shift(op, t) for t in range(1, extra + 1) for op in repeat)
                        + tuple(shift(op, extra) for op in tail))
    return tuple(extended)


@lru_cache(maxsize=256)
def _orders(block: VBlock, p: int, m: int, activation: tuple[int, ...], keep: tuple[int, ...],
            how: Reorder) -> tuple[tuple[Op, ...], ...]:
    stages = 2 * p
    problem = Problem("v-block", Pipeline(p, 2, Placement.VSHAPE, m), Costs((1.0,) * stages, (1.0,) * stages,
                      (1.0,) * stages, 0.0), Memory(activation, keep, 0))
    fill = partial(_fill_weights, upper=p if how.upper_first else None)
    repeated = _repeat(block.slots(p), p, m)
    with_weights = [fill(device) for device in repeated]
    cap = max(_peak(problem, device) for device in with_weights)
    warmup_end = repeated[0][Op(_B, 0, 0)]  # device 0's first backward of stage 0
    cooldown_start = repeated[0][Op(_F, 0, m - 1)]  # device 0's last forward of stage 0

    def movable(slot: int) -> bool:
        return slot < warmup_end or slot > cooldown_start

    def cooldown(slot: int) -> bool:
        return slot > cooldown_start

    first = _reorder(problem, with_weights, cap, movable, fill=None)
    if how.squeeze:
        first = _squeeze(first, stages - 1)
        warmup_end = first[0][Op(_B, 0, 0)]
        cooldown_start = first[0][Op(_F, 0, m - 1)]
    without_weights = [{op: slot for op, slot in device.items() if op.kind is not _W} for device in first]
    if all(_peak(problem, fill(device)) <= cap for device in without_weights):
        second = _reorder(problem, without_weights, cap, movable if how.warmup_twice else cooldown, fill=fill)
        if how.squeeze:
            second = _squeeze([_fill_weights(device) for device in second], stages - 1)
            second = [{op: slot for op, slot in device.items() if op.kind is not _W} for device in second]
        final = [fill(device) for device in second]
    else:
        # Refilling W in B's order would already pass the cap (possible only when stages keep
        # different weight_activation and the first pass reordered B across stages; not seen in
        # the tests): keep the first pass's W, which never pass it.
        final = first
    return tuple(tuple(_in_order(device)) for device in final)


def _repeat(slots: tuple[tuple[int, int, int, int], ...], p: int, m: int) -> _Plan:
    """F and B of every microbatch at the block's slots plus INTERVAL slots per microbatch."""
    plan: _Plan = []
    for d, (f0, f1, b1, b0) in enumerate(slots):
        first, second = d, 2 * p - 1 - d  # chunk 0 and chunk 1 of device d
        device: dict[Op, int] = {}
        for i in range(m):
            shift = INTERVAL * i
            device[Op(_F, first, i)] = f0 + shift
            device[Op(_F, second, i)] = f1 + shift
            device[Op(_B, second, i)] = b1 + shift
            device[Op(_B, first, i)] = b0 + shift
        plan.append(device)
    return plan


def _fill_weights(device: dict[Op, int], upper: int | None = None) -> dict[Op, int]:
    """Each free slot takes the W of the oldest B still waiting for one (F and B stay put).

    With ``upper``, Ws of stages >= ``upper`` (the second chunk) go before the others.
    """
    by_slot = {slot: op for op, slot in device.items()}
    filled = dict(device)
    waiting: list[tuple[int, int, Op]] = []  # (0 for the chunk that goes first, arrival, W)
    slot, last = min(by_slot), max(by_slot)
    while slot <= last or waiting:
        op = by_slot.get(slot)
        if op is not None:
            if op.kind is _B:
                first = upper is not None and op.stage >= upper
                heapq.heappush(waiting, (0 if first else 1, slot, Op(_W, op.stage, op.microbatch)))
        elif waiting:
            filled[heapq.heappop(waiting)[2]] = slot
        slot += 1
    return filled


def _squeeze(plan: _Plan, last_stage: int) -> _Plan:
    """Every op at the earliest slot its device's order and what it needs allow (one slot each)."""
    device_of = {op: d for d, device in enumerate(plan) for op in device}
    end: dict[Op, int] = {}
    free = [0] * len(plan)
    squeezed: _Plan = [{} for _ in plan]
    for slot, d, op in sorted((slot, d, op) for d, device in enumerate(plan) for op, slot in device.items()):
        start = max([free[d]] + [end[need] for need in _needs(op, last_stage) if need in device_of])
        squeezed[d][op] = start
        end[op] = free[d] = start + 1
    return squeezed


def _in_order(device: dict[Op, int]) -> list[Op]:
    return [op for op, _ in sorted(device.items(), key=lambda item: item[1])]


def _peak(problem: Problem, device: dict[Op, int]) -> int:
    """Peak activation memory of a device that runs these ops in slot order (one op per slot).
    ``problem`` is _orders' block problem, whose memory v_schedule wrote as the real problem's
    kept_bytes: read directly (through kept_bytes it was 3/4 of ZBV's time at p = 16)."""
    act, keep = problem.memory.activation, problem.memory.weight_activation
    size = max(device.values()) + 1
    change = [0] * size  # F allocates at its start; B and W free at their end
    starts = [False] * size
    for op, slot in device.items():
        s = op.stage
        if op.kind is _F:
            change[slot] = act[s]
            starts[slot] = True
        elif op.kind is _B:
            change[slot] = keep[s] - act[s]
        else:
            change[slot] = -keep[s]
    held = peak = 0
    for slot in range(size):
        held += change[slot]
        if starts[slot] and held > peak:
            peak = held
    return peak


def _needs(op: Op, last_stage: int) -> list[Op]:
    """What must run before ``op``: its data dependency and the stage's previous microbatch."""
    s, i = op.stage, op.microbatch
    if op.kind is _F:
        needs = [Op(_F, s - 1, i)] if s > 0 else []
    elif op.kind is _B:
        needs = [Op(_B, s + 1, i) if s < last_stage else Op(_F, s, i)]
    else:
        needs = [Op(_B, s, i)]
    if i > 0:
        needs.append(Op(op.kind, s, i - 1))
    return needs


def _reorder(problem: Problem, plan: _Plan, cap: int, movable: Callable[[int], bool],
             fill: Callable[[dict[Op, int]], dict[Op, int]] | None) -> _Plan:
    """Move each movable op, in slot order, to the earliest free slot after what it needs.

    With ``fill`` the plan holds no W: ``fill`` puts them in the free slots, and the memory check
    counts them there. Returns a new plan; ``plan`` is not changed.
    """
    pipe = problem.pipeline
    last_stage = pipe.stages - 1
    device_of = [pipe.device_of(s) for s in range(pipe.stages)]
    current = [dict(device) for device in plan]
    used = [set(device.values()) for device in plan]
    placed: _Plan = [{} for _ in plan]
    queue = sorted((slot, d, op) for d, device in enumerate(plan) for op, slot in device.items())
    for slot, d, op in queue:
        if movable(slot):
            ready = max((placed[device_of[need.stage]][need] + 1 for need in _needs(op, last_stage)), default=0)
            for earlier in range(ready, slot):
                if earlier in used[d]:
                    continue
                trial = {**current[d], op: earlier}
                # Without refilled W, moving a B or W earlier only frees memory earlier.
                frees = fill is None and op.kind is not _F
                if frees or _peak(problem, fill(trial) if fill else trial) <= cap:
                    current[d] = trial
                    used[d].discard(slot)
                    used[d].add(earlier)
                    break
        placed[d][op] = current[d][op]
    return current
