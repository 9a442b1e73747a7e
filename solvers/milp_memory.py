"""The MILP's memory rows: device memory at every F and RELOAD start, host memory at every OFFLOAD start.

Memory grows only at those starts (core/semantics.py), so it is checked there. What compute ops
hold at an F start follows from the device order alone and is written with the ordering
variables; what depends on transfers is counted unless a relief binary claims otherwise
(``Relief`` in milp_model.py), and each claim is tied to the start times it needs. Rows are
written in units of the largest activation.
"""

from __future__ import annotations

import pulp

from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import holds

from .milp_data import lp_name

__all__ = ["MemoryRows"]

_F, _OFF, _REL = OpKind.F, OpKind.OFFLOAD, OpKind.RELOAD


class MemoryRows:
    """The memory family of constraints, mixed into milp_model's builder, which holds the LP, the
    variables, the per-device items, the memory units (``unit``, ``taken``, ``hosted``) and the
    helpers ``before``, ``claim``, ``at_least`` and ``channel_before`` these rows use."""

    def away_at(self, sa: int, ia: int, event: Op, started, ended) -> pulp.LpVariable:
        """A binary that, when 1, counts (sa, ia)'s activation as on the host at ``event``: it is
        offloaded, F has started (``started``) and its backward has not ended (``ended``), its
        OFFLOAD has ended by the event's start and its RELOAD starts after it."""
        off, rel = Op(_OFF, sa, ia), Op(_REL, sa, ia)
        away = self.claim("away", off, event)
        self.lp += away <= self.offload[(sa, ia)]
        if not isinstance(started, int):
            self.lp += away <= started
        if not isinstance(ended, int):
            self.lp += away + ended <= 1
        self.at_least(event, off, self.data.duration[off] + self.margin, 1 - away)
        self.at_least(rel, event, 1 + self.margin, 1 - away)
        return away

    def holds(self, stage: int, microbatch: int) -> list[tuple[float, Op]]:
        """(memory units, the op whose end releases them) of an activation kept on the device
        (semantics.holds: every one is taken at F's start)."""
        return [(hold.bytes / self.unit, hold.ends.op)
                for hold in holds(self.problem, stage, microbatch, fused=not self.data.split)]

    def forward_events(self) -> None:
        """Device memory at every F start: ordering variables for compute, relief for transfers."""
        data, memory = self.data, self.problem.memory
        act = self.taken
        budget = memory.budget / self.unit
        for device in range(self.problem.devices):
            items = self.items_on[device]
            for sb, ib in items:
                event = Op(_F, sb, ib)
                terms, worst = [act[sb]], act[sb]
                pending_claims = []
                for sa, ia in items:
                    if (sa, ia) == (sb, ib):
                        continue
                    fa, back = Op(_F, sa, ia), data.back(sa, ia)
                    held = self.before(fa, event)
                    if isinstance(held, int) and held == 0:
                        continue
                    freed_back = self.before(back, event)
                    for amount, release in self.holds(sa, ia):
                        freed = self.before(release, event)
                        terms += [amount * held, -amount * freed]
                        worst += amount - amount * _fixed(freed)
                    if self.problem.offload.enabled and _fixed(freed_back) == 0:
                        pending_claims.append((sa, ia, held, freed_back))
                if worst <= budget + 1e-9:
                    continue
                for sa, ia, held, freed_back in pending_claims:
                    terms.append(-act[sa] * self.away_at(sa, ia, event, held, freed_back))
                self.lp += pulp.lpSum(terms) <= budget

    def reload_events(self) -> None:
        """Device memory at every RELOAD start (only binding when the item is offloaded)."""
        data, memory = self.data, self.problem.memory
        act = self.taken
        budget = memory.budget / self.unit
        for device in range(self.problem.devices):
            items = self.items_on[device]
            for sr, ir in items:
                event, f_r, back_r = Op(_REL, sr, ir), Op(_F, sr, ir), data.back(sr, ir)
                plan = []
                worst = act[sr]
                for sa, ia in items:
                    if (sa, ia) == (sr, ir):
                        continue
                    fa, chain = Op(_F, sa, ia), list(dict.fromkeys((data.back(sa, ia), data.last(sa, ia))))
                    started = _status(data.order(fa, f_r), data.order(fa, back_r))
                    if started == 0:
                        continue
                    # whether each releasing op (B then W, or BW) has ended by the reload: 1, 0 or open
                    ended = {op: _status(data.order(op, f_r), data.order(op, back_r)) for op in chain}
                    may_be_away = ended[chain[0]] != 1 and not (sa == sr and ia < ir)
                    plan.append((sa, ia, started, chain, ended, may_be_away))
                    worst += sum(amount * (ended[release] != 1) for amount, release in self.holds(sa, ia))
                if worst <= budget + 1e-9:
                    continue
                terms = [act[sr]]
                for sa, ia, started, chain, ended, may_be_away in plan:
                    fa = Op(_F, sa, ia)
                    if started is None:
                        pending = self.claim("pending", fa, event)
                        self.at_least(fa, event, 1 + self.margin, 1 - pending)
                        started = 1 - pending
                    prior = started  # W ends after B, B after F started
                    for op in chain:
                        if ended[op] is None:
                            ended[op] = self.claim("ended", op, event)
                            self.at_least(event, op, data.duration[op] + self.margin, 1 - ended[op])
                            self.lp += ended[op] <= prior
                        prior = ended[op]
                    for amount, release in self.holds(sa, ia):
                        terms += [amount * started, -amount * ended[release]]
                    if may_be_away:
                        terms.append(-act[sa] * self.away_at(sa, ia, event, started, ended[chain[0]]))
                self.lp += pulp.lpSum(terms) <= budget + (worst - budget) * (1 - self.offload[(sr, ir)])

    def host_events(self) -> None:
        """Host memory at every OFFLOAD start, where it grows; skipped when every activation fits."""
        data = self.data
        host_budget = self.problem.offload.host_budget / self.unit
        act = self.hosted
        for device in range(self.problem.devices):
            items = self.items_on[device]
            if sum(act[s] for s, _ in items) <= host_budget + 1e-9:
                continue
            for sb, ib in items:
                event = Op(_OFF, sb, ib)
                terms = [act[sb]]
                for sa, ia in items:
                    if (sa, ia) == (sb, ib):
                        continue
                    off_a, rel_a = Op(_OFF, sa, ia), Op(_REL, sa, ia)
                    earlier = self.channel_before(off_a, event)
                    if isinstance(earlier, int) and earlier == 0:
                        continue
                    if data.order(data.back(sa, ia), Op(_F, sb, ib)) == 1:
                        continue  # a is reloaded and used before b's F
                    back = self.claim("back", rel_a, event)
                    self.at_least(event, rel_a, data.duration[rel_a] + self.margin, 1 - back)
                    held = self.host[(off_a, event)] = self.lp.add_variable(
                        f"h_{lp_name(off_a)}_{lp_name(event)}", lowBound=0, upBound=1)
                    self.lp += held >= self.offload[(sa, ia)] + earlier - 1 - back
                    terms.append(act[sa] * held)
                worst = sum(act[s] for s, _ in items)
                self.lp += pulp.lpSum(terms) <= host_budget + (worst - host_budget) * (1 - self.offload[(sb, ib)])



def _fixed(value) -> int:
    """The value of a fixed 0/1 term; 0 for a variable one (the worst case for a free)."""
    return value if isinstance(value, int) else 0


def _status(before_forward: int | None, before_backward: int | None) -> int | None:
    """Whether an op has happened by a RELOAD start: before F(r) -> yes, after B(r) -> no, else open."""
    if before_forward == 1:
        return 1
    if before_backward == 0:
        return 0
    return None

