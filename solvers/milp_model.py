"""The MILP model of a problem, built with PuLP: data -> variables -> constraints -> objective.

Time is counted in integer units of a ``Grid`` (timegrid.py, shared with CP-SAT). Every
duration is rounded UP to whole units, so the simulator, which uses the exact durations, never
runs an op later than the model says; in the exact (as-soon-as-possible) model every claim that
an op has ended or not yet started by an allocation keeps ``grid.slack`` units of margin, so the
simulator's memory never exceeds the model's (timegrid.py proves both). Durations, waits and
memory effects are the ones of core/semantics.py.

Variables: a start time per op; per pair of compute ops on one device that the dependencies
do not already order, an ordering binary; per (stage, microbatch) an offload binary with its
OFFLOAD and RELOAD start times, and ordering binaries between transfers of different stages on
one channel; with ``[recompute]`` (issue 14) per (stage, microbatch) a recompute binary (never with
the offload one) with its RECOMPUTE start time, ordered against the other compute ops of its
device; "relief" binaries for memory (see ``Relief``). Microbatches are interchangeable
(costs depend on the stage only): renaming each stage's ops by their rank in time keeps every
constraint (the k-th B of a stage still follows the k-th F, the k-th RELOAD the k-th OFFLOAD,
...), so each stage runs F, B, W, OFFLOAD and RELOAD in microbatch order without loss.

Memory is checked where it grows, at every F and RELOAD start (host memory at every OFFLOAD
start): milp_memory.py; shared host links, served first come first served: milp_links.py. The
data it is built from is milp_data.py; start values that describe a schedule (warm starts) are
milp_start.py.

Two forms. The relaxed one lets an op start later than it could, for instance an F waiting
for an OFFLOAD to free memory; its bound holds for every schedule. The simulator never waits
like that, so the exact one (``asap=True``) adds, per op, binaries choosing what it starts
right after (``Tight``): a compute op (RECOMPUTE too) after its device predecessor, its data or
its RELOAD; a transfer at the end of a compute op on its device (where the runtime issues it), after its
channel predecessor or after its own dependency. Its timing is the simulator's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import pulp

from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import Place, holds, waits

# The data names are re-exported: tests and benchmarks import them from here.
from .milp_data import ModelData, choose_milp_grid, lower_bound, lp_name, prepare, serial_horizon, unit_times
from .milp_links import SharedLinks
from .milp_memory import MemoryRows, retaken_bytes

__all__ = ["Tight", "Relief", "MilpModel", "build_model", "choose_milp_grid", "ModelData", "prepare", "serial_horizon",
           "lower_bound", "unit_times"]

_F, _B, _W, _BW, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD
_RC = OpKind.RECOMPUTE


class Relief(NamedTuple):
    """A binary that lowers the memory counted at ``event``'s start by a claim about ``subject``.

    kind "away": subject OFFLOAD(a) has ended and RELOAD(a) has not started;
    kind "pending": subject F(a) has not started;
    kind "ended": subject B/W/BW(a) has ended;
    kind "back": subject RELOAD(a) has ended (host memory, at an OFFLOAD start);
    kind "recomputing": subject F(a) has ended and RECOMPUTE(a) has not started (a recomputed
    activation gives back all but its resident bytes in between).
    The model ties each claim to the start times; the simulator's timing may still break it
    (it starts every op as early as it can), which the solver's repair loop checks.
    """

    kind: str
    subject: Op
    event: Op


class Tight(NamedTuple):
    """A binary of the ASAP model: ``target`` starts exactly when ``source`` ends (plus ``lag``)."""

    target: Op
    source: Op
    lag: int


@dataclass(frozen=True)
class MilpModel:
    data: ModelData
    horizon: int  # units; no makespan above it is searched
    lp: pulp.LpProblem
    makespan: pulp.LpVariable
    start: dict[Op, pulp.LpVariable]  # compute ops; OFFLOAD and RELOAD of every item when offload is enabled
    offload: dict[tuple[int, int], pulp.LpVariable]
    order: dict[tuple[Op, Op], pulp.LpVariable]  # 1 when the first op runs (or is carried) before the second
    relief: dict[Relief, pulp.LpVariable]
    host: dict[tuple[Op, Op], pulp.LpVariable]  # (OFFLOAD a, OFFLOAD b): a's bytes still on the host at b's start
    tight: dict[Tight, pulp.LpVariable]  # empty unless built with asap=True
    margin: int = 0  # units every relief claim keeps from its event (the grid's slack in the exact model)
    recompute: dict[tuple[int, int], pulp.LpVariable] = field(default_factory=dict)  # 1: RECOMPUTE runs (issue 14)
    # shared host links (milp_links.py): a transfer's ready time, which op's end it is, and
    # (compute op, transfer): the compute op has ended by the transfer's start
    ready: dict[Op, pulp.LpVariable] = field(default_factory=dict)
    ready_is: dict[tuple[Op, Op], pulp.LpVariable] = field(default_factory=dict)
    ended: dict[tuple[Op, Op], pulp.LpVariable] = field(default_factory=dict)


class _Builder(MemoryRows, SharedLinks):
    """Adds variables and constraints group by group; ``build_model`` is the only caller."""

    def __init__(self, data: ModelData, horizon: int, floor: int, integral: bool, margin: int):
        self.data = data
        self.margin = margin
        self.floor = floor
        self.integral = integral
        self.problem = data.problem
        self.horizon = horizon
        self.lp = pulp.LpProblem("optpipe_schedule", pulp.LpMinimize)
        self.start: dict[Op, pulp.LpVariable] = {}
        self.offload: dict[tuple[int, int], pulp.LpVariable] = {}
        self.order: dict[tuple[Op, Op], pulp.LpVariable] = {}
        self.relief: dict[Relief, pulp.LpVariable] = {}
        self.host: dict[tuple[Op, Op], pulp.LpVariable] = {}
        self.tight: dict[Tight, pulp.LpVariable] = {}
        self.recompute: dict[tuple[int, int], pulp.LpVariable] = {}
        self.ready: dict[Op, pulp.LpVariable] = {}
        self.ready_is: dict[tuple[Op, Op], pulp.LpVariable] = {}
        self.ended: dict[tuple[Op, Op], pulp.LpVariable] = {}
        self.items_on = [[(s, i) for s in self.problem.pipeline.stages_on(d) for i in range(self.problem.microbatches)]
                         for d in range(self.problem.devices)]
        self.unit = max(self.problem.memory.activation) or 1  # memory rows in units of the largest activation
        # per stage, in those units: what F (or a reload) takes on the device, what an offload takes
        # on the host (semantics.holds)
        stages = range(self.problem.stages)
        self.taken = [sum(h.bytes for h in holds(self.problem, s, 0, fused=not data.split)) / self.unit for s in stages]
        self.hosted = [sum(h.bytes for h in holds(self.problem, s, 0, offloaded=True) if h.place is Place.HOST)
                       / self.unit for s in stages]
        # per stage: what a recomputed activation gives back from F's end to RECOMPUTE's start
        self.retaken = [retaken_bytes(self.problem, s, fused=not data.split) / self.unit for s in stages] \
            if self.problem.recompute.enabled else []

    # ----------------------------------------------------------------- helpers

    def ub(self, op: Op) -> float:
        return self.start[op].upBound

    def lb(self, op: Op) -> float:
        return self.start[op].lowBound

    def fixed_order(self, a: Op, b: Op) -> int | None:
        """``ModelData.order`` for RECOMPUTE ops too: RECOMPUTE(a) runs after F(a), before a's backward."""
        data = self.data
        if a.kind is not _RC and b.kind is not _RC:
            return data.order(a, b)
        if a.kind is not _RC:
            flipped = self.fixed_order(b, a)
            return None if flipped is None else 1 - flipped
        f, back = Op(_F, a.stage, a.microbatch), data.back(a.stage, a.microbatch)
        if b.kind is _RC:
            if data.order(back, Op(_F, b.stage, b.microbatch)) == 1:
                return 1
            return 0 if data.order(data.back(b.stage, b.microbatch), f) == 1 else None
        if b == back or data.order(back, b) == 1:
            return 1
        return 0 if b == f or data.order(b, f) == 1 else None

    def absent(self, op: Op):
        """0, or for a RECOMPUTE the 0-1 expression that is 1 when it does not run."""
        return 1 - self.recompute[(op.stage, op.microbatch)] if op.kind is _RC else 0

    def recomputes_on(self, device: int) -> list[Op]:
        return [Op(_RC, s, i) for s, i in self.items_on[device] if (s, i) in self.recompute]

    def before(self, a: Op, b: Op):
        """1/0 or a 0-1 expression: compute op a runs before compute op b (same device)."""
        fixed = self.fixed_order(a, b)
        if fixed is not None:
            return fixed
        if (a, b) in self.order:
            return self.order[(a, b)]
        return 1 - self.order[(b, a)]

    def precede(self, a: Op, b: Op, gap: int, off) -> None:
        """start(b) >= end(a) + gap, unless ``off`` (a 0-1 expression; 0 when it must hold) is 1."""
        self.at_least(b, a, self.data.duration[a] + gap, off)

    def claim(self, kind: str, subject: Op, event: Op) -> pulp.LpVariable:
        relief = Relief(kind, subject, event)
        var = self.lp.add_variable(f"r_{kind}_{lp_name(subject)}_at_{lp_name(event)}", cat=pulp.LpBinary)
        self.relief[relief] = var
        return var

    def at_least(self, later: Op, earlier: Op, offset: int, off) -> None:
        """start(later) >= start(earlier) + offset unless ``off`` is 1; big-M from the variables' bounds."""
        if isinstance(off, int) and off == 0:
            self.lp += self.start[later] >= self.start[earlier] + offset
            return
        big = self.ub(earlier) + offset - self.lb(later)
        if big > 0:  # else the bounds already imply it
            self.lp += self.start[later] >= self.start[earlier] + offset - big * off

    def at_most(self, later: Op, earlier: Op, offset: int, off) -> None:
        """start(later) <= start(earlier) + offset unless ``off`` is 1."""
        big = self.ub(later) - self.lb(earlier) - offset
        if big > 0:
            self.lp += self.start[later] <= self.start[earlier] + offset + big * off

    # ----------------------------------------------------------------- groups

    def times(self) -> None:
        data, horizon = self.data, self.horizon
        for op in data.ops:
            self.start[op] = self.lp.add_variable(f"s_{lp_name(op)}", lowBound=data.head[op],
                                                  upBound=max(data.head[op], horizon - data.tail[op]))
        # Integral at every optimum (integer durations); declaring it lets a solver round its bound up.
        self.makespan = self.lp.add_variable("makespan", lowBound=min(max(lower_bound(data), self.floor), horizon),
                                             upBound=horizon,
                                             cat=pulp.LpInteger if self.integral else pulp.LpContinuous)
        self.lp += self.makespan
        for op in data.ops:
            self.lp += self.makespan >= self.start[op] + data.tail[op]
        for a, b, gap in data.edges:
            self.precede(a, b, gap, 0)

    def devices(self) -> None:
        """One compute op at a time: an ordering binary per pair the dependencies leave open."""
        data = self.data
        for device in range(self.problem.devices):
            mine = [op for op in data.ops if data.device(op) == device]
            for n, a in enumerate(mine):
                for b in mine[n + 1:]:
                    if data.order(a, b) is not None:
                        continue
                    y = self.lp.add_variable(f"y_{lp_name(a)}_{lp_name(b)}", cat=pulp.LpBinary)
                    self.order[(a, b)] = y
                    self.precede(a, b, 0, 1 - y)
                    self.precede(b, a, 0, y)

    def transfers(self) -> None:
        """OFFLOAD after F, RELOAD after OFFLOAD and before B, one transfer at a time per channel."""
        data = self.data
        for s, i in data.items:
            x = self.offload[(s, i)] = self.lp.add_variable(f"x_{s}_{i}", cat=pulp.LpBinary)
            f, off, rel, back = Op(_F, s, i), Op(_OFF, s, i), Op(_REL, s, i), data.back(s, i)
            # When offloaded, both fit between F's end and B's start; else they idle right after F.
            d_off, d_rel = data.duration[off], data.duration[rel]
            self.start[off] = self.lp.add_variable(
                f"s_{lp_name(off)}", lowBound=self.lb(f) + data.duration[f],
                upBound=max(self.ub(back) - d_rel - d_off, self.ub(f) + data.duration[f]))
            self.start[rel] = self.lp.add_variable(
                f"s_{lp_name(rel)}", lowBound=self.lb(off) + d_off, upBound=max(self.ub(back) - d_rel, self.ub(off) + d_off))
            self.precede(f, off, 0, 0)
            self.precede(off, rel, 0, 0)
            self.precede(rel, back, 0, 1 - x)
        for device in range(self.problem.devices):
            items = self.items_on[device]
            for kind in (_OFF, _REL):
                for n, (s, i) in enumerate(items):
                    for t, j in items[n + 1:]:
                        a, b = Op(kind, s, i), Op(kind, t, j)
                        both = 2 - self.offload[(s, i)] - self.offload[(t, j)]
                        # one stage too: a later microbatch's transfer may go first (cpsat_tight.py)
                        y = self.lp.add_variable(f"y_{lp_name(a)}_{lp_name(b)}", cat=pulp.LpBinary)
                        self.order[(a, b)] = y
                        self.precede(a, b, 0, both + 1 - y)
                        self.precede(b, a, 0, both + y)
        self.shared_links()

    def recomputes(self) -> None:
        """Issue 14: per (stage, microbatch) a binary choosing recompute (never with offload) and a
        RECOMPUTE op after F, before the backward, one compute op at a time on its device."""
        data = self.data
        for s, i in data.items:
            r = self.recompute[(s, i)] = self.lp.add_variable(f"c_{s}_{i}", cat=pulp.LpBinary)
            if self.problem.offload.enabled:
                self.lp += r + self.offload[(s, i)] <= 1
            f, rc, back = Op(_F, s, i), Op(_RC, s, i), data.back(s, i)
            lo = self.lb(f) + data.duration[f]
            self.start[rc] = self.lp.add_variable(f"s_{lp_name(rc)}", lowBound=lo,
                                                  upBound=max(self.ub(back) - data.duration[rc], lo))
            self.precede(f, rc, 0, 1 - r)
            self.precede(rc, back, 0, 1 - r)
        for device in range(self.problem.devices):
            mine = [op for op in data.ops if data.device(op) == device] + self.recomputes_on(device)
            for n, a in enumerate(mine):
                for b in mine[n + 1:]:
                    if (a.kind is not _RC and b.kind is not _RC) or self.fixed_order(a, b) is not None:
                        continue
                    y = self.lp.add_variable(f"y_{lp_name(a)}_{lp_name(b)}", cat=pulp.LpBinary)
                    self.order[(a, b)] = y
                    gate = self.absent(a) + self.absent(b)
                    self.precede(a, b, 0, gate + 1 - y)
                    self.precede(b, a, 0, gate + y)

    def link_items(self, device: int) -> list[tuple[int, int]]:
        """(stage, microbatch) items of every device that shares ``device``'s host link."""
        offload = self.problem.offload
        mate = offload.link_of(device)
        return [item for d in range(self.problem.devices) if offload.link_of(d) == mate for item in self.items_on[d]]

    def channel_before(self, a: Op, b: Op):
        """A 0-1 expression: transfer a is carried before transfer b on their channel."""
        if (a, b) in self.order:
            return self.order[(a, b)]
        return 1 - self.order[(b, a)]

    def on_time(self, target: Op, source: Op, lag: int, exact: bool):
        """A binary that, when 1, starts ``target`` by ``source``'s end plus ``lag`` (exactly then if ``exact``)."""
        var = self.lp.add_variable(f"t_{lp_name(target)}_after_{lp_name(source)}", cat=pulp.LpBinary)
        self.tight[Tight(target, source, lag)] = var
        offset = self.data.duration[source] + lag
        self.at_most(target, source, offset, 1 - var)
        if exact:
            self.at_least(target, source, offset, 1 - var)
        return var

    def asap(self) -> None:
        """The simulator's timing: every op starts exactly when the last thing it waits for ends.

        Compute ops wait for their device predecessor and their data (and a RELOAD); a transfer
        is issued at the end of some compute op on its device, or waits for its channel or its
        own dependency. Without this the model could hold an op back to wait for memory,
        which the simulator (never idle by choice) would not do.
        """
        data = self.data
        by_device = [[op for op in data.ops if data.device(op) == d] for d in range(self.problem.devices)]
        for x in data.ops:
            self.compute_starts_on_time(x, by_device[data.device(x)])
        for s, i in self.recompute:
            self.recompute_starts_on_time(Op(_RC, s, i), by_device[data.device(Op(_RC, s, i))])
        if self.problem.offload.enabled:
            for s, i in data.items:
                for kind in (_OFF, _REL):
                    self.transfer_starts_on_time(Op(kind, s, i), by_device[data.device(Op(kind, s, i))])

    def compute_starts_on_time(self, x: Op, mine: list[Op]) -> None:
        """Compute op ``x`` starts right after an op before it on its device (``mine``), after data
        from another device, or after its RELOAD."""
        data = self.data
        device, s, i = data.device(x), x.stage, x.microbatch
        mask = sum(1 << data.position[op] for op in mine)
        options = []
        for a in mine:
            fixed = data.order(a, x) if a != x else 0
            if fixed == 0:
                continue
            if fixed == 1 and data.reach[a] & data.ancestors[x] & mask:
                continue  # an op is forced between them, so a is never just before x
            var = self.on_time(x, a, 0, exact=False)
            if fixed is None:
                self.lp += var <= self.before(a, x)
            options.append(var)
        options += self.after_recomputes(x, x)
        for wait in waits(self.problem, x, fused_above=not data.split):
            if data.device(wait.op) != device:
                options.append(self.on_time(x, wait.op, data.grid.up(wait.lag_ms), exact=False))
        if self.problem.offload.enabled and x.kind in (_B, _BW):
            var = self.on_time(x, Op(_REL, s, i), 0, exact=False)
            self.lp += var <= self.offload[(s, i)]
            options.append(var)
        if options:
            self.lp += pulp.lpSum(options) >= 1
        else:  # the very first op
            self.lp += self.start[x] == 0

    def after_recomputes(self, x: Op, anchor: Op) -> list[pulp.LpVariable]:
        """Binaries: ``x`` starts right at the end of a RECOMPUTE on its device that runs before
        ``anchor`` (``x`` itself)."""
        options = []
        for rc in self.recomputes_on(self.data.device(x)):
            if (rc.stage, rc.microbatch) == (x.stage, x.microbatch) and x.kind is _RC:
                continue
            fixed = self.fixed_order(rc, anchor)
            if fixed == 0:
                continue
            var = self.on_time(x, rc, 0, exact=False)
            self.lp += var <= self.recompute[(rc.stage, rc.microbatch)]
            if fixed is None:
                self.lp += var <= self.before(rc, anchor)
            options.append(var)
        return options

    def recompute_starts_on_time(self, rc: Op, mine: list[Op]) -> None:
        """A RECOMPUTE that runs starts right after the compute op before it on its device (its F,
        which it waits for, is one of those)."""
        options = []
        for a in mine:
            fixed = self.fixed_order(a, rc)
            if fixed == 0:
                continue
            var = self.on_time(rc, a, 0, exact=False)
            if fixed is None:
                self.lp += var <= self.before(a, rc)
            options.append(var)
        options += self.after_recomputes(rc, rc)
        self.lp += pulp.lpSum(options) >= self.recompute[(rc.stage, rc.microbatch)]

    def transfer_starts_on_time(self, target: Op, mine: list[Op]) -> None:
        """An OFFLOAD or RELOAD that runs is issued at the end of a compute op on its device
        (``mine``), or starts after its channel predecessor or (a RELOAD) its OFFLOAD."""
        data = self.data
        s, i, kind = target.stage, target.microbatch, target.kind
        f, back = Op(_F, s, i), data.back(s, i)
        options = []
        for c in mine:
            if c == back or (c != f and data.order(c, f) == 1) or data.order(c, back) == 0:
                continue  # ends before F(a) ends, or after B(a) starts: never the issue point
            options.append(self.on_time(target, c, 0, exact=True))
        for rc in self.recomputes_on(data.device(target)):
            if self.fixed_order(rc, f) == 1 or self.fixed_order(rc, back) == 0:
                continue  # before F(a), or after B(a) starts: never the issue point
            var = self.on_time(target, rc, 0, exact=True)
            self.lp += var <= self.recompute[(rc.stage, rc.microbatch)]
            options.append(var)
        for t, j in self.link_items(data.device(target)):
            if (t, j) == (s, i):
                continue
            other = Op(kind, t, j)
            var = self.on_time(target, other, 0, exact=False)
            self.lp += var <= self.offload[(t, j)]
            self.lp += var <= self.channel_before(other, target)
            options.append(var)
        if kind is _REL:
            options.append(self.on_time(target, Op(_OFF, s, i), 0, exact=False))
        self.lp += pulp.lpSum(options) >= self.offload[(s, i)]


def build_model(data: ModelData, horizon: int, *, asap: bool = False, floor: int = 0,
                integral_makespan: bool = True) -> MilpModel:
    """The model, searching makespans from ``floor`` up to ``horizon`` units.

    Without ``asap`` it is a relaxation (ops may wait for memory); with it, exact for the simulator.
    ``integral_makespan`` declares the objective variable integer (it is at every optimum anyway).
    """
    builder = _Builder(data, horizon, floor, integral_makespan, data.grid.slack if asap else 0)
    builder.times()
    builder.devices()
    if data.problem.offload.enabled:
        builder.transfers()
    if data.problem.recompute.enabled:
        builder.recomputes()
    if data.problem.offload.enabled and data.problem.offload.link_groups:
        builder.served_in_order()
    builder.forward_events()
    if data.problem.recompute.enabled:
        builder.recompute_events()
    if data.problem.offload.enabled:
        builder.reload_events()
        builder.host_events()
    if asap:
        builder.asap()
    return MilpModel(data, horizon, builder.lp, builder.makespan, builder.start, builder.offload, builder.order,
                     builder.relief, builder.host, builder.tight, builder.margin, builder.recompute,
                     builder.ready, builder.ready_is, builder.ended)
