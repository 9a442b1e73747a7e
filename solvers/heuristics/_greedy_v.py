"""V-shape orders built round by round at real costs, the way the authors' ZB-V generator does.

The V-shape block schedules (``_vshape_blocks``: ZBV, V-Half, V-Min) are derived on the grid where
F = B = W and p2p = 0. ``v_rounds`` keeps a block schedule's warm-up and memory limit and builds
the rest in rounds: one B and then one F per device and round, as in the blocks' steady state,
but which chunk's B and F, and where the Ws go, is decided with the real per-stage costs.
``cost_aware_v`` runs it with every ROUND_POLICIES, on the real and on the stage-averaged costs,
and keeps the fastest within the cap. What is placed so far is ``_placed.Placed``, shared with
the list schedule of ``_greedy``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import takewhile

from optpipe.core.problem import Costs, Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import simulate

from ._deadline import out_of_time, variants_pay
from ._placed import Placed

__all__ = ["RoundPolicy", "ROUND_POLICIES", "v_rounds", "cost_aware_v"]

_F, _B = OpKind.F, OpKind.B


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
    rounds = _Rounds(cap, policy, Placed.empty(problem))
    if not rounds.warm_up(warmup):
        return None
    while not rounds.done():
        took_b = rounds.backwards()
        took_f = rounds.forwards()
        if not (took_b or took_f):
            return None
    return rounds.drained(name)


@dataclass(frozen=True)
class _Rounds:
    """One run of ``v_rounds``. Device d holds two chunks: stage d (the first, ``low``) and stage
    2p-1-d (the second, ``high``)."""

    cap: int
    policy: RoundPolicy
    placed: Placed

    @property
    def devices(self) -> range:
        return range(self.placed.problem.pipeline.devices)

    def low(self, d: int) -> int:
        return d

    def high(self, d: int) -> int:
        return 2 * len(self.devices) - 1 - d

    def done(self) -> bool:
        """Whether every F and B is placed."""
        m, placed = self.placed.problem.microbatches, self.placed
        return sum(placed.next_b) >= len(placed.next_b) * m and all(i >= m for i in placed.next_f)

    def ready(self, kind: OpKind, s: int) -> float | None:
        """When the input of stage ``s``'s next ``kind`` arrives, or None while there is none to
        run (all placed, or a B before its F) or its input is not placed."""
        placed = self.placed
        i = (placed.next_f if kind is _F else placed.next_b)[s]
        if i >= placed.problem.microbatches or (kind is _B and i >= placed.next_f[s]):
            return None
        return placed.arrival(kind, s, i)

    def warm_up(self, warmup: Schedule) -> bool:
        """Place each device's forwards before its first B in ``warmup``, as their inputs are
        placed; False when some cannot be (under the cap)."""
        heads = [list(takewhile(lambda op: op.kind is _F, ops)) for ops in warmup.devices]
        position = [0] * len(heads)
        progress = True
        while progress:
            progress = False
            for d in self.devices:
                while position[d] < len(heads[d]):
                    op = heads[d][position[d]]
                    if op.microbatch != self.placed.next_f[op.stage] or not self.run_f(d, op.stage, False):
                        break
                    position[d] += 1
                    progress = True
        return all(position[d] == len(heads[d]) for d in self.devices)

    def backwards(self) -> bool:
        """One B per device, decided on what was placed before this round: the first chunk's (older
        microbatch, on the way out of the pipeline) when its gradient is there, unless the policy
        says otherwise; else the second chunk's. The first chunks' gradients run back up the V
        (device p-1 first), the second chunks' down it (device 0 first). Whether any B ran."""
        low_b = [d for d in self.devices if self.takes_low_b(d)]
        moved = False
        for d in reversed(low_b):
            self.run_b(d, self.low(d), self.ready(_B, self.low(d)))
            moved = True
        for d in self.devices:
            if d in low_b:
                continue
            ready = self.ready(_B, self.high(d))
            if ready is not None:
                self.run_b(d, self.high(d), ready)
                moved = True
        return moved

    def takes_low_b(self, d: int) -> bool:
        """Whether device d's B this round is its first chunk's."""
        lo_ready = self.ready(_B, self.low(d))
        if lo_ready is None:
            return False
        if self.policy.b_by_ready:
            hi_ready = self.ready(_B, self.high(d))
            if hi_ready is not None and hi_ready < lo_ready:
                return False
        return True

    def forwards(self) -> bool:
        """One F per device: the second chunk's when its input is there, else the first chunk's.
        Whether any F ran."""
        moved = False
        for d in self.devices:
            if self.ready(_F, self.high(d)) is not None:
                moved = self.run_f(d, self.high(d), self.policy.idle_f) or moved
            elif self.ready(_F, self.low(d)) is not None:
                moved = self.run_f(d, self.low(d), self.policy.idle_f) or moved
        return moved

    def run_b(self, d: int, s: int, ready: float) -> None:
        self.fill(d, ready, self.policy.idle_b)
        self.run(d, _B, s, ready)

    def run_f(self, d: int, s: int, extra: bool) -> bool:
        """Run stage s's next F on device d, first running as many waiting Ws as the cap needs to
        make room; False when its input is not there or it cannot fit."""
        placed = self.placed
        ready = self.ready(_F, s)
        if ready is None:
            return False
        while placed.held[d] + placed.costs.act[s] > self.cap and placed.waiting[d]:
            self.run_w(d)
        if placed.held[d] + placed.costs.act[s] > self.cap:
            return False
        self.fill(d, ready, extra)
        self.run(d, _F, s, ready)
        return True

    def fill(self, d: int, ready: float, extra: bool) -> None:
        """Run the waiting Ws that end before ``ready``; with ``extra`` one more when waiting would
        leave device d idle longer than the idlest device so far."""
        placed = self.placed
        waiting, free, idle = placed.waiting[d], placed.free, placed.idle
        while waiting and free[d] + placed.costs.wgt[waiting[0][0]] <= ready:
            self.run_w(d)
        if extra and waiting and ready - free[d] > max(idle) - idle[d]:
            self.run_w(d)

    def run_w(self, d: int) -> None:
        s = self.placed.pop_w(d)
        self.placed.free[d] += self.placed.costs.wgt[s]

    def run(self, d: int, kind: OpKind, s: int, ready: float) -> None:
        """Run stage s's next ``kind`` on device d as soon as both are ready."""
        placed = self.placed
        i = (placed.next_f if kind is _F else placed.next_b)[s]
        start = max(placed.free[d], ready)
        if placed.orders[d]:
            placed.idle[d] += start - placed.free[d]
        placed.place(d, Op(kind, s, i), start)

    def drained(self, name: str) -> Schedule:
        """The schedule, once the Ws still waiting have run at the end."""
        for d in self.devices:
            while self.placed.waiting[d]:
                self.run_w(d)
        return Schedule.of(name, self.placed.orders)


def cost_aware_v(problem: Problem, base: Schedule, warmup: Schedule, cap: int) -> Schedule:
    """The fastest of ``base`` and ``v_rounds`` (every ROUND_POLICIES, real and stage-averaged costs)
    within ``cap`` bytes per device (the block schedule's peak; ``base`` must fit it). ``warmup``:
    the schedule whose warm-up forwards the rounds start from. Ties keep ``base``; past the build
    deadline (``_deadline.py``) no further round order is tried."""
    timeline = simulate(problem, base)
    best, best_key = base, (timeline.makespan, timeline.peak)
    if not variants_pay(timeline.peak):
        return best
    costs, stages = problem.costs, problem.stages
    views = [problem]
    if any(len(set(values)) > 1 for values in (costs.forward, costs.backward_input, costs.backward_weight)):
        def mean(values: tuple[float, ...]) -> tuple[float, ...]:
            return (sum(values) / stages,) * stages
        views.append(replace(problem, costs=Costs(mean(costs.forward), mean(costs.backward_input),
                                                  mean(costs.backward_weight), costs.p2p)))
    for view in views:
        for policy in ROUND_POLICIES:
            if out_of_time():
                return best
            candidate = v_rounds(base.name, view, cap, warmup, policy)
            if candidate is None:
                continue
            judged = simulate(problem, candidate)
            key = (judged.makespan, judged.peak)
            if judged.peak <= cap and key < best_key:
                best, best_key = candidate, key
    return best
