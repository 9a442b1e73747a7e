"""The MILP's memory rows: device memory at every F, RECOMPUTE and RELOAD start, host memory at every
OFFLOAD start.

Memory grows only at those starts (core/semantics.py), so it is checked there. What compute ops
hold at an F start follows from the device order alone and is written with the ordering
variables; what depends on transfers is counted unless a relief binary claims otherwise
(``Relief`` in milp_model.py), and each claim is tied to the start times it needs. Rows are
written in units of the largest activation.
"""

from __future__ import annotations

import pulp

from optpipe.core.schedule import Op, OpKind
from optpipe.core.errors import InternalError
from optpipe.core.semantics import At, holds

from .milp_data import lp_name

__all__ = ["MemoryRows", "retaken_bytes"]

_F, _OFF, _REL, _RC = OpKind.F, OpKind.OFFLOAD, OpKind.RELOAD, OpKind.RECOMPUTE


class MemoryRows:
    """The memory family of constraints, mixed into milp_model's builder, which holds the LP, the
    variables, the per-device items, the memory units (``unit``, ``taken``, ``hosted``,
    ``retaken``) and the helpers ``before``, ``claim``, ``at_least``, ``channel_before`` and
    ``recomputes_on`` these rows use."""

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
        for device in range(self.problem.devices):
            for sb, ib in self.items_on[device]:
                self.device_row(Op(_F, sb, ib), device, None)

    def recompute_events(self) -> None:
        """Device memory at every RECOMPUTE start (only binding when the item is recomputed)."""
        for device in range(self.problem.devices):
            for rc in self.recomputes_on(device):
                self.device_row(rc, device, self.recompute[(rc.stage, rc.microbatch)])

    def device_row(self, event: Op, device: int, gate) -> None:
        """Memory at the start of compute op ``event`` (an F or a RECOMPUTE, which takes the whole
        activation of its item) is within the budget, when ``gate`` (None or a binary) is 1."""
        data, act = self.data, self.taken
        budget = self.problem.memory.budget / self.unit
        sb, ib = event.stage, event.microbatch
        terms, worst = [act[sb]], act[sb]
        pending_claims, recomputing = [], []
        for sa, ia in self.items_on[device]:
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
            if (sa, ia) in self.recompute and _fixed(freed_back) == 0:
                recomputing.append((sa, ia, held))
        if worst <= budget + 1e-9:
            return
        for sa, ia, held, freed_back in pending_claims:
            terms.append(-act[sa] * self.away_at(sa, ia, event, held, freed_back))
        for sa, ia, held in recomputing:
            later = self.before(event, Op(_RC, sa, ia))  # RECOMPUTE(a) has not started
            if not (isinstance(later, int) and later == 0):
                terms.append(-self.retaken[sa] * self.recomputing_at(sa, ia, event, held, later))
        if gate is None:
            self.lp += pulp.lpSum(terms) <= budget
        else:
            self.lp += pulp.lpSum(terms) <= budget + (worst - budget) * (1 - gate)

    def recomputing_at(self, sa: int, ia: int, event: Op, started, later, ended=None) -> pulp.LpVariable:
        """A binary that, when 1, counts (sa, ia)'s activation as given back at ``event``: it is
        recomputed, its F has ended by the event's start (``started`` for a compute op on its
        device) and its RECOMPUTE starts after it (``later``). ``ended``: its backward's end, at a
        RELOAD, whose timing is claimed like ``away_at``'s."""
        f, rc = Op(_F, sa, ia), Op(_RC, sa, ia)
        claim = self.claim("recomputing", f, event)
        self.lp += claim <= self.recompute[(sa, ia)]
        for term in (started, later):
            if not isinstance(term, int):
                self.lp += claim <= term
        if event.kind is _REL:
            if not isinstance(ended, int):
                self.lp += claim + ended <= 1
            self.at_least(event, f, self.data.duration[f] + self.margin, 1 - claim)
            self.at_least(rc, event, 1 + self.margin, 1 - claim)
        return claim

    def reload_events(self) -> None:
        """Device memory at every RELOAD start (only binding when the item is offloaded)."""
        data, memory = self.data, self.problem.memory
        act = self.taken
        budget = memory.budget / self.unit
        for device in range(self.problem.devices):
            items = self.items_on[device]
            for sr, ir in items:
                event, f_r, back_r = Op(_REL, sr, ir), Op(_F, sr, ir), data.back(sr, ir)
                plan, may_give_back = [], set()
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
                    may_be_away = ended[chain[0]] != 1  # an earlier microbatch's reload may come later
                    if (sa, ia) in self.recompute and ended[chain[0]] != 1:
                        may_give_back.add((sa, ia))
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
                    if (sa, ia) in may_give_back:
                        terms.append(-self.retaken[sa] * self.recomputing_at(sa, ia, event, started, 1,
                                                                             ended[chain[0]]))
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


def retaken_bytes(problem, stage: int, fused: bool) -> int:
    """What a recomputed activation of ``stage`` gives back from F's end to RECOMPUTE's start and
    takes again then (semantics.holds, recomputed). The rows count a recomputed activation as a
    kept one less this much in that span: checked here against semantics.py, hold by hold."""
    kept = holds(problem, stage, 0, fused=fused)
    again = holds(problem, stage, 0, fused=fused, recomputed=True)
    retaken = sum(h.bytes for h in again if h.begins.op.kind is _RC)
    during_f = sum(h.bytes for h in again if h.ends.op.kind is _F and h.ends.at is At.END)
    released = {}
    for sign, group in ((1, kept), (-1, again)):
        for h in group:
            if h.ends.op.kind is not _F:
                released[h.ends.op] = released.get(h.ends.op, 0) + sign * h.bytes
    if during_f != retaken or any(released.values()) or not all(
            h.begins.op.kind in (_F, _RC) and h.begins.at is At.START for h in again):
        raise InternalError(f"the MILP's recompute rows assume a recomputed activation is a kept one that "
                            f"gives back {retaken} bytes from F's end to RECOMPUTE's start; semantics.holds "
                            f"says otherwise for stage {stage}")
    return retaken
