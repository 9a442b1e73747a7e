"""A cost-aware list schedule under a memory cap: what the closed forms become at real costs.

The handcrafted schedules (ZB-H1, ZB-H2, ZBV, V-Half, V-Min) are derived on a grid where
F = B = W and p2p = 0; at other costs their fixed order leaves gaps in the warm-up and the
cool-down. This pass builds an order with the problem's real per-stage costs instead, keeping
the schedule's memory limit: it places the ops one at a time, each device running what it
can start earliest, and decides every W with the time it really takes.

Rules (one device, when it is free at time t):

- Candidates are, for each of its stages, the next B (microbatch order) once its F has run and
  the gradient from the stage above has been placed, and the next F once its input has been
  placed and its activation fits under ``cap`` (after running as many waiting Ws as it needs
  to make room). The one that can start first runs; ties go to B (it frees memory and is on
  the critical path), then to the higher stage (closer to the loss).
- With ``reserve``, a microbatch enters a device (F of its lowest stage there) only when the
  cap can hold all its stages' activations on that device, as ``1F1B-capped`` admits them:
  the smallest unfinished microbatch can then always move on, so the order cannot deadlock.
  Without it the order may deadlock; that variant is then dropped.
- Ws wait, in B order, and fill the idle time before the chosen op when they end before it
  can start. With ``partial`` a W also runs when it only shortens the gap (it delays the op by
  the part that does not fit, and saves that W's time at the end); with ``budget`` as well,
  only when waiting would leave this device idle longer than any other device has been (the
  slowest device sets the makespan, so idle time elsewhere is free). The rest run at the end.
- With ``alternate``, once a device has run a B it prefers an F after a B and a B after an F
  (1F1B's rhythm) among the ops it can run, instead of the one that starts first.
- With ``keep_order`` the device runs its F and B in that schedule's order and only the Ws are
  placed as above; ``free_after`` ("last F": from its cool-down, "first B": from its steady
  state) lets it choose freely from that point of the order on.

Ops are committed in order of start time over all devices, so when a device's choice is made
everything that could reach it earlier has been placed: the times computed here are exactly
the simulator's (same rules: device order, data dependencies, p2p between devices).
``cost_aware`` runs these variants next to a paper's schedule and keeps the fastest within its
peak; which variants it tries is what the reference grid showed to matter (KEEP_POLICIES,
POLICIES). ``_greedy_v`` builds V-shape orders round by round instead (one B and one F per
device and round, W at real costs), the way the authors' ZB-V generator does.

``greedy_schedule`` reads top-down: lay out the stages (``_Layout``) and the order to keep
(``_KeptOrder``), then ``_ListRun.schedule`` loops plan (options → timed → fill) and commit;
what is placed so far, and how placing an op changes it, is ``_placed.Placed``.
"""

from __future__ import annotations

from dataclasses import dataclass

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import simulate

from ._deadline import out_of_time, variants_pay
from ._placed import Placed, StageCosts

__all__ = ["GreedyPolicy", "greedy_schedule", "cost_aware", "POLICIES", "KEEP_POLICIES"]

_F, _B, _W = OpKind.F, OpKind.B, OpKind.W


@dataclass(frozen=True)
class GreedyPolicy:
    reserve: bool = True  # admit a microbatch to a device only when all its stages there fit
    partial: bool = False  # run a W in an idle gap shorter than the W
    budget: bool = False  # ... only when idling would leave this device more idle time than any other
    alternate: bool = False  # after its first B a device prefers F after B and B after F (1F1B's rhythm)


# The policies that were ever the fastest on the reference grid (tests/test_heuristics_reference.py):
# with a given order to keep (W placement only, or choosing freely after the warm-up or cool-down
# starts), and for the free list schedule.
KEEP_POLICIES = (GreedyPolicy(False, False), GreedyPolicy(False, True), GreedyPolicy(False, True, True))
POLICIES = (GreedyPolicy(True, True), GreedyPolicy(False, True), GreedyPolicy(False, False, False, True))


def greedy_schedule(name: str, problem: Problem, cap: int, policy: GreedyPolicy,
                    keep_order: Schedule | None = None, free_after: str | None = None) -> Schedule | None:
    """The list schedule for ``cap`` bytes per device, or None when it deadlocks or cannot fit."""
    placed = Placed.empty(problem)
    layout = _Layout.of(problem, placed.costs)
    if policy.reserve and any(f > cap for f in layout.footprint):
        return None
    p = problem.pipeline.devices
    run = _ListRun(cap, policy, placed, layout, _KeptOrder.of(keep_order, free_after, p),
                   last_kind=[None] * p, started=[False] * p, reserved=[0] * p)
    return run.schedule(name)


@dataclass(frozen=True)
class _Layout:
    """Where the stages are, as the list schedule reads it."""

    device_of: list[int]  # per stage
    mine: list[list[int]]  # per device, its stages, higher stage first (closer to the loss)
    entry: list[int]  # per device, its lowest stage: where a microbatch enters it
    footprint: list[int]  # per device, one microbatch's activations on all its stages

    @classmethod
    def of(cls, problem: Problem, costs: StageCosts) -> _Layout:
        pipe = problem.pipeline
        p = pipe.devices
        return cls([pipe.device_of(s) for s in range(pipe.stages)],
                   [sorted(pipe.stages_on(d), reverse=True) for d in range(p)],
                   [min(pipe.stages_on(d)) for d in range(p)],
                   [sum(costs.act[s] for s in pipe.stages_on(d)) for d in range(p)])


@dataclass(frozen=True)
class _KeptOrder:
    """With ``keep_order``, each device's F/B order, the position past which it chooses freely
    (``free_after``), and how far it has got (``cursor``, which only grows)."""

    fixed: list[list[Op]] | None  # None: choose freely from the start
    switch: list[int]
    cursor: list[int]

    @classmethod
    def of(cls, keep_order: Schedule | None, free_after: str | None, p: int) -> _KeptOrder:
        fixed = None if keep_order is None else [[op for op in ops if op.kind in (_F, _B)]
                                                 for ops in keep_order.devices]
        switch = [len(ops) for ops in fixed or [[]] * p]
        if fixed is not None and free_after == "last F":  # from its cool-down
            switch = [max((k for k, op in enumerate(ops) if op.kind is _F), default=-1) for ops in fixed]
        elif fixed is not None and free_after == "first B":  # from its steady state
            switch = [min((k for k, op in enumerate(ops) if op.kind is _B), default=len(ops)) - 1
                      for ops in fixed]
        return cls(fixed, switch, [0] * p)

    def choosing(self, d: int) -> bool:
        """Whether device ``d`` chooses among all its stages' next F and B (past its kept order)."""
        return self.fixed is None or self.cursor[d] > self.switch[d]


@dataclass(frozen=True)
class _ListRun:
    """One run of ``greedy_schedule``: its limits, what is placed, and per device the kind of its
    last op, whether it has run a B, and (with ``reserve``) the bytes its admitted microbatches
    will still take."""

    cap: int
    policy: GreedyPolicy
    placed: Placed
    layout: _Layout
    kept: _KeptOrder
    last_kind: list[OpKind | None]
    started: list[bool]
    reserved: list[int]

    def schedule(self, name: str) -> Schedule | None:
        """Commit the op that starts first over all devices, one at a time, so that everything
        that could reach a device earlier is placed before it chooses; None on a deadlock."""
        placed = self.placed
        p = len(placed.free)
        plans = [self.plan(d) for d in range(p)]
        remaining = 2 * placed.problem.stages * placed.problem.microbatches
        while remaining:
            choices = [(pl[0], d) for d, pl in enumerate(plans) if pl is not None]
            if not choices:
                return None  # deadlock: every device waits for another
            start, d = min(choices)
            _, fills, op = plans[d]
            self.commit(d, fills, op, start)
            remaining -= 1
            for e in self.touched(d, op):
                plans[e] = self.plan(e)
        for d in range(p):
            placed.orders[d].extend(Op(_W, s, i) for s, i in placed.waiting[d])
        return Schedule.of(name, placed.orders)

    def touched(self, d: int, op: Op) -> set[int]:
        """The devices whose choice ``op`` on ``d`` can change: ``d``, and the one its output goes to."""
        touched, s = {d}, op.stage
        if op.kind is _F and s < len(self.layout.device_of) - 1:
            touched.add(self.layout.device_of[s + 1])
        if op.kind is _B and s > 0:
            touched.add(self.layout.device_of[s - 1])
        return touched

    def options(self, d: int) -> list[Op]:
        """The F and B device d may run next: its order's next op, or each stage's next F and B."""
        placed, kept, m = self.placed, self.kept, self.placed.problem.microbatches
        next_f, next_b = placed.next_f, placed.next_b
        if kept.choosing(d):
            return [Op(kind, s, i) for s in self.layout.mine[d] for kind, i in ((_B, next_b[s]), (_F, next_f[s]))
                    if i < (next_f[s] if kind is _B else m)]
        if kept.cursor[d] >= len(kept.fixed[d]):
            return []
        op = kept.fixed[d][kept.cursor[d]]
        in_turn = op.microbatch == (next_f if op.kind is _F else next_b)[op.stage]
        return [op] if in_turn and (op.kind is _F or op.microbatch < next_f[op.stage]) else []

    def plan(self, d: int) -> tuple[float, int, Op] | None:
        """(start, Ws to run first, op) for device d, or None while it has nothing it can run."""
        known = [k for k in (self.timed(d, op) for op in self.options(d)) if k is not None]
        if not known:
            return None
        if self.policy.alternate and self.started[d]:
            turn = [k for k in known if (k[-1].kind is _F) == (self.last_kind[d] is _B)]
            known = turn or known
        *_, ready, forced, op = min(known)
        t, fills = self.fill(d, ready, forced)
        return (max(t, ready), fills, op)

    def timed(self, d: int, op: Op) -> tuple | None:
        """``op`` as a candidate on ``d``, as a key that sorts what starts first first (ties: B, then
        the higher stage), ending in its input's arrival, the Ws that must run first to make room
        for an F, and ``op``; None while its input is not placed or an F cannot fit."""
        placed, s = self.placed, op.stage
        ready = placed.arrival(op.kind, s, op.microbatch)
        if ready is None:
            return None
        forced, t = 0, placed.free[d]
        if op.kind is _F:
            need = placed.costs.act[s]
            if self.policy.reserve:
                need = self.reserved[d] + self.layout.footprint[d] if s == self.layout.entry[d] else 0
            room = placed.held[d]
            waiting = placed.waiting[d]
            while room + need > self.cap and forced < len(waiting):
                ws, _ = waiting[forced]
                room -= placed.costs.keep[ws]
                t += placed.costs.wgt[ws]
                forced += 1
            if room + need > self.cap:
                return None
        return (max(t, ready), 0 if op.kind is _B else 1, -s, ready, forced, op)

    def fill(self, d: int, ready: float, forced: int) -> tuple[float, int]:
        """(when device d is free, how many waiting Ws it runs) before an op whose input arrives at
        ``ready``: the ``forced`` ones, then those that end before ``ready`` or, by the policy, that
        shorten the gap."""
        placed, policy = self.placed, self.policy
        waiting, wgt, free, idle = placed.waiting[d], placed.costs.wgt, placed.free[d], placed.idle
        t = self.after_ws(d, forced)
        fills = forced
        while fills < len(waiting):
            took = wgt[waiting[fills][0]]
            over = t - free + idle[d] + ready - t > max(idle)  # waiting makes d the idlest device
            if t + took <= ready or (policy.partial and t < ready and (over or not policy.budget)):
                t += took
                fills += 1
            else:
                break
        return t, fills

    def after_ws(self, d: int, n: int) -> float:
        """When device d is free after its first ``n`` waiting Ws."""
        placed = self.placed
        return placed.free[d] + sum(placed.costs.wgt[placed.waiting[d][k][0]] for k in range(n))

    def commit(self, d: int, fills: int, op: Op, start: float) -> None:
        """Run ``fills`` waiting Ws and then ``op`` at ``start`` on device d."""
        placed = self.placed
        t = self.after_ws(d, fills)
        if placed.orders[d]:
            placed.idle[d] += start - t
        for _ in range(fills):
            placed.pop_w(d)
        placed.place(d, op, start)
        self.kept.cursor[d] += 1
        self.last_kind[d] = op.kind
        self.started[d] = self.started[d] or op.kind is _B
        if op.kind is _F and self.policy.reserve:
            if op.stage == self.layout.entry[d]:
                self.reserved[d] += self.layout.footprint[d]
            self.reserved[d] -= placed.costs.act[op.stage]


def _uniform(problem: Problem) -> bool:
    """F = B = W on every stage and p2p = 0: the grid the closed forms are derived on."""
    costs = problem.costs
    values = set(costs.forward) | set(costs.backward_input) | set(costs.backward_weight)
    return len(values) == 1 and costs.p2p == 0


def cost_aware(problem: Problem, base: Schedule, search: bool = True) -> Schedule:
    """The fastest of ``base`` and its cost-aware variants that keeps ``base``'s peak memory.

    Variants: ``base``'s F/B order with every W placed again at real costs (``keep_order``),
    and, with ``search``, the free list schedules of every policy. On the closed forms' own grid
    (F = B = W, p2p = 0) ``base`` is returned as it is. Ties keep ``base``. Past the build
    deadline (``_deadline.py``) no further variant is tried, and none past its peak cap.
    """
    if _uniform(problem):
        return base
    timeline = simulate(problem, base)
    cap = timeline.peak
    if not variants_pay(cap):
        return base
    best, best_key = base, (timeline.makespan, cap)
    builds = [lambda policy=policy, after=after: greedy_schedule(base.name, problem, cap, policy, keep_order=base,
                                                                 free_after=after)
              for policy in KEEP_POLICIES for after in (None, "last F", "first B")]
    if search:
        builds += [lambda policy=policy: greedy_schedule(base.name, problem, cap, policy) for policy in POLICIES]
    seen = {base.devices}  # variants often give the same order: time each order once
    for build in builds:
        if out_of_time():
            break
        candidate = build()
        if candidate is None or candidate.devices in seen:
            continue
        seen.add(candidate.devices)
        judged = simulate(problem, candidate)
        key = (judged.makespan, judged.peak)
        if judged.peak <= cap and key < best_key:
            best, best_key = candidate, key
    return best
