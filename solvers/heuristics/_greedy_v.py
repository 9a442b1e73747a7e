"""V-shape orders built round by round at real costs, the way the authors' ZB-V generator does.

The V-shape block schedules (``_vshape_blocks``: ZBV, V-Half, V-Min) are derived on the grid where
F = B = W and p2p = 0. ``v_rounds`` keeps a block schedule's warm-up and memory limit and builds
the rest in rounds: one B and then one F per device and round, as in the blocks' steady state,
but which chunk's B and F, and where the Ws go, is decided with the real per-stage costs.
``cost_aware_v`` runs it with every ROUND_POLICIES, on the real and on the stage-averaged costs,
and keeps the fastest within the cap.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from optpipe.core.problem import Costs, Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.semantics import lag_ms
from optpipe.core.simulate import simulate

from ._placed import StageCosts

__all__ = ["RoundPolicy", "ROUND_POLICIES", "v_rounds", "cost_aware_v"]

_F, _B, _W = OpKind.F, OpKind.B, OpKind.W


@dataclass(frozen=True)
class RoundPolicy:
    """How ``v_rounds`` decides, once per device and round, which B, which F and where W go.

    ``b_by_ready``: a device whose two chunks both have a B it may run takes the one whose
    gradient arrives first (ties: the first chunk's); otherwise the first chunk's whenever its
    gradient is there (the older microbatch, about to leave the pipeline). ``idle_b`` /
    ``idle_f``: before a B / an F whose input arrives later than a W would take, run a W anyway
    when waiting would leave this device idle longer than the idlest device so far (idle time
    on the device that sets the makespan is what counts; idle time elsewhere is free), besides
    the Ws that end before the input arrives.
    """

    b_by_ready: bool = False
    idle_b: bool = True
    idle_f: bool = True


# The policies that were ever needed on the reference grid (tests/test_heuristics_reference.py); the
# other combinations were never faster than one of these.
ROUND_POLICIES = (RoundPolicy(False, True, False), RoundPolicy(True, True, False))


def v_rounds(name: str, problem: Problem, cap: int, warmup: Schedule, policy: RoundPolicy) -> Schedule | None:
    """A V-shape order built round by round at real costs, or None when it cannot go on under ``cap``.

    Each device first runs ``warmup``'s forwards before its first B (the block schedule's warm-up,
    which already fills the pipeline under the cap). Then every round gives each device one B and
    then one F, as in the steady state of the V blocks (F B W of each chunk per microbatch), but
    which chunk's B and F, and where the W go, is decided with the real per-stage costs and p2p:
    B of the first chunk (stage d) when its gradient is there, else of the second (stage
    2p-1-d; ``policy`` may prefer the one whose gradient comes first); F of the second chunk
    when its input is there, else of the first; W fill idle time before an op when
    they end before its input arrives (and by ``policy``), and run when the cap needs the room
    for an F. An F that does not fit even after every waiting W waits for a later round.

    Times are exact (each device's order is built front to back, an op only after what it needs),
    so ``problem``'s costs steer the decisions; ``cost_aware_v`` also runs it on the costs
    averaged over stages, as the authors' generator sees them, which on uneven stages sometimes
    decides better. O(ops): quick at any size.
    """
    pipe = problem.pipeline
    p, m, stages = pipe.devices, pipe.microbatches, pipe.stages
    last = stages - 1
    costs = StageCosts.of(problem)
    act, keep, fwd, bwd, wgt = costs.act, costs.keep, costs.fwd, costs.bwd, costs.wgt
    low = list(range(p))  # chunk 0 of device d: stage d; chunk 1: stage 2p-1-d
    high = [2 * p - 1 - d for d in range(p)]
    f_end: list[dict[int, float]] = [{} for _ in range(stages)]
    b_end: list[dict[int, float]] = [{} for _ in range(stages)]
    next_f = [0] * stages
    next_b = [0] * stages
    free = [0.0] * p
    idle = [0.0] * p
    held = [0] * p
    waiting: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
    orders: list[list[Op]] = [[] for _ in range(p)]

    def ready_of(kind: OpKind, s: int) -> float | None:
        i = (next_f if kind is _F else next_b)[s]
        if i >= m or (kind is _B and i >= next_f[s]):
            return None
        if kind is _F:
            if s == 0:
                return 0.0
            end = f_end[s - 1].get(i)
            source = s - 1
        elif s == last:
            end, source = f_end[s].get(i), s
        else:
            end, source = b_end[s + 1].get(i), s + 1
        if end is None:
            return None
        return end + lag_ms(problem, source, s)

    def run_w(d: int) -> None:
        s, i = waiting[d].popleft()
        orders[d].append(Op(_W, s, i))
        free[d] += wgt[s]
        held[d] -= keep[s]

    def fill(d: int, ready: float, extra: bool) -> None:
        while waiting[d] and free[d] + wgt[waiting[d][0][0]] <= ready:
            run_w(d)
        if extra and waiting[d] and ready - free[d] > max(idle) - idle[d]:
            run_w(d)

    def run(d: int, kind: OpKind, s: int, ready: float) -> None:
        i = (next_f if kind is _F else next_b)[s]
        start = max(free[d], ready)
        if orders[d]:
            idle[d] += start - free[d]
        end = start + (fwd if kind is _F else bwd)[s]
        orders[d].append(Op(kind, s, i))
        free[d] = end
        if kind is _F:
            f_end[s][i] = end
            next_f[s] += 1
            held[d] += act[s]
        else:
            b_end[s][i] = end
            next_b[s] += 1
            held[d] -= act[s] - keep[s]
            waiting[d].append((s, i))

    def run_f(d: int, s: int, extra: bool) -> bool:
        ready = ready_of(_F, s)
        if ready is None:
            return False
        while held[d] + act[s] > cap and waiting[d]:
            run_w(d)
        if held[d] + act[s] > cap:
            return False
        fill(d, ready, extra)
        run(d, _F, s, ready)
        return True

    # Warm-up: each device's forwards before its first B, placed as their inputs are placed.
    heads = []
    for ops in warmup.devices:
        head = []
        for op in ops:
            if op.kind is not _F:
                break
            head.append(op)
        heads.append(head)
    position = [0] * p
    progress = True
    while progress:
        progress = False
        for d in range(p):
            while position[d] < len(heads[d]):
                op = heads[d][position[d]]
                if op.microbatch != next_f[op.stage] or not run_f(d, op.stage, False):
                    break
                position[d] += 1
                progress = True
    if any(position[d] < len(heads[d]) for d in range(p)):
        return None

    total_b = stages * m
    placed_b = sum(next_b)
    while placed_b < total_b or any(next_f[s] < m for s in range(stages)):
        # One B per device, decided on what was placed before this round: the first chunk's
        # (older microbatch, on the way out of the pipeline) when its gradient is there, unless
        # the policy says otherwise; else the second chunk's. The first chunks' gradients run
        # back up the V (device p-1 first), the second chunks' down it (device 0 first).
        low_b: list[int] = []
        for d in range(p):
            lo_ready = ready_of(_B, low[d])
            if lo_ready is None:
                continue
            if policy.b_by_ready:
                hi_ready = ready_of(_B, high[d])
                if hi_ready is not None and hi_ready < lo_ready:
                    continue
            low_b.append(d)
        moved = False
        for d in reversed(low_b):
            ready = ready_of(_B, low[d])
            fill(d, ready, policy.idle_b)
            run(d, _B, low[d], ready)
            moved = True
        took_low = set(low_b)
        for d in range(p):
            if d in took_low:
                continue
            ready = ready_of(_B, high[d])
            if ready is not None:
                fill(d, ready, policy.idle_b)
                run(d, _B, high[d], ready)
                moved = True
        placed_b = sum(next_b)
        # One F per device: the second chunk's when its input is there, else the first chunk's.
        for d in range(p):
            if ready_of(_F, high[d]) is not None:
                moved = run_f(d, high[d], policy.idle_f) or moved
            elif ready_of(_F, low[d]) is not None:
                moved = run_f(d, low[d], policy.idle_f) or moved
        if not moved:
            return None
    for d in range(p):
        while waiting[d]:
            run_w(d)
    return Schedule.of(name, orders)


def cost_aware_v(problem: Problem, base: Schedule, warmup: Schedule, cap: int) -> Schedule:
    """The fastest of ``base`` and ``v_rounds`` (every ROUND_POLICIES, real and stage-averaged costs)
    within ``cap`` bytes per device (the block schedule's peak; ``base`` must fit it). ``warmup``:
    the schedule whose warm-up forwards the rounds start from. Ties keep ``base``."""
    timeline = simulate(problem, base)
    best, best_key = base, (timeline.makespan, timeline.peak)
    costs, stages = problem.costs, problem.stages
    views = [problem]
    if any(len(set(values)) > 1 for values in (costs.forward, costs.backward_input, costs.backward_weight)):
        def mean(values: tuple[float, ...]) -> tuple[float, ...]:
            return (sum(values) / stages,) * stages
        views.append(replace(problem, costs=Costs(mean(costs.forward), mean(costs.backward_input),
                                                  mean(costs.backward_weight), costs.p2p)))
    for view in views:
        for policy in ROUND_POLICIES:
            candidate = v_rounds(base.name, view, cap, warmup, policy)
            if candidate is None:
                continue
            judged = simulate(problem, candidate)
            key = (judged.makespan, judged.peak)
            if judged.peak <= cap and key < best_key:
                best, best_key = candidate, key
    return best
