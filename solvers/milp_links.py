"""The MILP's shared host links: devices of a ``[offload] link_groups`` group share one D2H and
one H2D channel (core/semantics.py, "Shared host links"), which carries one transfer at a time,
first come first served by ready time, ties to the lower device.

A transfer's ready time is the latest end of what it waits for in the simulator: its data
(semantics.waits), its issue point (the last compute op on its device that has ended by its
start, where decoding lists it) and its device's transfer before it on the channel. Each is a
variable held equal to that maximum by "ended" and "ready is" binaries, and of two transfers of
different devices the one carried first has the smaller (ready, device), as CP-SAT's model has
it: so on an exact grid the simulator serves the channel in the model's order, at its times.
"""

from __future__ import annotations

import pulp

from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import waits

from .milp_data import lp_name

__all__ = ["SharedLinks"]

_F, _OFF, _REL, _RC = OpKind.F, OpKind.OFFLOAD, OpKind.RELOAD, OpKind.RECOMPUTE


class SharedLinks:
    """The shared-channel family of constraints, mixed into milp_model's builder (which holds the
    LP, the variables, ``items_on``, ``precede``, ``at_least``, ``channel_before``, ``fixed_order``
    and ``recomputes_on``)."""

    def shared_links(self) -> None:
        """One transfer at a time across the devices of a group, in an order the solver picks."""
        for group in self.problem.offload.link_groups:
            for _, _, a, b, both in self._shared_pairs(group):
                y = self.lp.add_variable(f"y_{lp_name(a)}_{lp_name(b)}", cat=pulp.LpBinary)
                self.order[(a, b)] = y
                self.precede(a, b, 0, both + 1 - y)
                self.precede(b, a, 0, both + y)

    def _shared_pairs(self, group: tuple[int, ...]):
        """(device a, device b, transfer on a, transfer on b, 0 when both are offloaded) for each
        pair of same-kind transfers on two devices of ``group``, in one fixed order."""
        for n, da in enumerate(group):
            for db in group[n + 1:]:
                for kind in (_OFF, _REL):
                    for s, i in self.items_on[da]:
                        for t, j in self.items_on[db]:
                            both = 2 - self.offload[(s, i)] - self.offload[(t, j)]
                            yield da, db, Op(kind, s, i), Op(kind, t, j), both

    def served_in_order(self) -> None:
        """First come first served: the transfer carried first across two devices of a group is
        the one ready first (the lower device on a tie)."""
        big = self.ready_bound() + 1
        groups = [group for group in self.problem.offload.link_groups if len(group) > 1]
        for group in groups:
            for kind in (_OFF, _REL):
                for device in group:
                    for s, i in self.items_on[device]:
                        self.ready[Op(kind, s, i)] = self.ready_time(Op(kind, s, i))
            for da, db, a, b, both in self._shared_pairs(group):
                y = self.order[(a, b)]
                self.lp += self.ready[a] + int(da > db) <= self.ready[b] + big * (both + 1 - y)
                self.lp += self.ready[b] + int(db > da) <= self.ready[a] + big * (both + y)

    def ready_bound(self) -> int:
        return self.horizon + max(self.data.duration.values())

    def ready_time(self, op: Op) -> pulp.LpVariable:
        """A variable equal to the simulator's ready time of transfer ``op`` when it runs."""
        data, item = self.data, (op.stage, op.microbatch)
        present = self.offload[item]
        big = self.ready_bound() + 1
        ready = self.lp.add_variable(f"q_{lp_name(op)}", lowBound=0, upBound=self.ready_bound())
        (wait,) = waits(self.problem, op)
        lag = data.grid.up(wait.lag_ms)
        terms = [(wait.op, lag, [])]  # (op whose end counts, lag, the 0-1 terms that say it has ended by op's start)
        f, back = Op(_F, *item), data.back(*item)
        for c in [c for c in data.ops if data.device(c) == data.device(op)] + self.recomputes_on(data.device(op)):
            if c in (f, back, Op(_RC, *item)) or self.fixed_order(c, f) == 1 or self.fixed_order(c, back) == 0:
                continue  # ends by F(a)'s end (no later than the data), or starts after B(a) starts
            ended = self.ended[(c, op)] = self.lp.add_variable(f"e_{lp_name(c)}_{lp_name(op)}", cat=pulp.LpBinary)
            gone = self.absent(c)
            if c.kind is _RC:
                self.lp += ended <= 1 - gone
            self.at_least(op, c, data.duration[c], 1 - ended)
            self.at_least(c, op, 1 - data.duration[c], ended + (1 - present) + gone)
            terms.append((c, 0, [ended]))
        for t, j in self.items_on[data.device(op)]:
            if (t, j) != item:  # carried before op, when it runs
                other = Op(op.kind, t, j)
                terms.append((other, 0, [self.offload[(t, j)], self.channel_before(other, op)]))
        tight = []
        for source, gap, ended in terms:
            end = self.start[source] + data.duration[source] + gap
            self.lp += ready >= end - big * pulp.lpSum(1 - term for term in ended)
            is_it = self.ready_is[(op, source)] = self.lp.add_variable(
                f"qi_{lp_name(op)}_{lp_name(source)}", cat=pulp.LpBinary)
            self.lp += ready <= end + big * (1 - is_it)
            for term in ended:
                self.lp += is_it <= term
            tight.append(is_it)
        self.lp += pulp.lpSum(tight) >= present
        return ready
