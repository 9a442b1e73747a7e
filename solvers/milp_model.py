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
one channel; "relief" binaries for memory (see ``Relief``). Microbatches are interchangeable
(costs depend on the stage only): renaming each stage's ops by their rank in time keeps every
constraint (the k-th B of a stage still follows the k-th F, the k-th RELOAD the k-th OFFLOAD,
...), so each stage runs F, B, W, OFFLOAD and RELOAD in microbatch order without loss.

Memory is checked where it grows: at every F start and every RELOAD start (and host memory at
every OFFLOAD start). What compute ops hold at an F start is fixed by the device order alone,
so it is written with the ordering variables; what depends on transfers is counted unless a
relief binary claims otherwise, and each claim is tied to the start times it needs.

Two forms. The relaxed one lets an op start later than it could, for instance an F waiting
for an OFFLOAD to free memory; its bound holds for every schedule. The simulator never waits
like that, so the exact one (``asap=True``) adds, per op, binaries choosing what it starts
right after (``Tight``): a compute op after its device predecessor, its data or its RELOAD; a
transfer at the end of a compute op on its device (where the runtime issues it), after its
channel predecessor or after its own dependency. Its timing is the simulator's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import pulp

from optpipe.core.errors import ScheduleError
from optpipe.core.problem import Problem
from optpipe.core.schedule import COMPUTE_KINDS, Op, OpKind, Schedule
from optpipe.core.semantics import Place, duration_ms, holds, waits
from optpipe.core.simulate import start_times

from .timegrid import MILP_MAX_UNITS, Grid, choose_grid

__all__ = [
    "Tight",
    "choose_milp_grid",
    "ModelData",
    "prepare",
    "serial_horizon",
    "lower_bound",
    "Relief",
    "MilpModel",
    "build_model",
    "unit_times",
    "start_values",
]

_F, _B, _W, _BW, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD

# --------------------------------------------------------------------------- time grid


def choose_milp_grid(problem: Problem) -> Grid:
    """The shared grid rule (timegrid.py) with a horizon short enough for big-M rows."""
    return choose_grid(problem, max_units=MILP_MAX_UNITS)


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class ModelData:
    """Everything the model needs before PuLP: ops, unit durations, forced orders, heads and tails."""

    problem: Problem
    grid: Grid
    split: bool  # B and W as two ops (True) or one fused BW
    ops: tuple[Op, ...]  # compute ops in a topological order of ``edges``
    duration: dict[Op, int]  # units; compute ops, and OFFLOAD/RELOAD of every item when offload is enabled
    edges: tuple[tuple[Op, Op, int], ...]  # (earlier, later, lag units): dependencies and microbatch order
    head: dict[Op, int]  # earliest start
    tail: dict[Op, int]  # own duration plus the longest chain that must follow
    reach: dict[Op, int]  # bit set (by ``position``) of the compute ops that must come after
    ancestors: dict[Op, int]  # bit set of the compute ops that must come before
    position: dict[Op, int]

    @property
    def items(self) -> list[tuple[int, int]]:
        """Every (stage, microbatch)."""
        return [(s, i) for s in range(self.problem.stages) for i in range(self.problem.microbatches)]

    def back(self, stage: int, microbatch: int) -> Op:
        """The op whose end frees the activation (all but weight_activation when split)."""
        return Op(_B if self.split else _BW, stage, microbatch)

    def last(self, stage: int, microbatch: int) -> Op:
        """The op whose end frees the rest."""
        return Op(_W if self.split else _BW, stage, microbatch)

    def device(self, op: Op) -> int:
        return self.problem.pipeline.device_of(op.stage)

    def order(self, a: Op, b: Op) -> int | None:
        """1 when the dependencies force a before b, 0 when they force b before a, None when free."""
        if self.reach[a] >> self.position[b] & 1:
            return 1
        if self.reach[b] >> self.position[a] & 1:
            return 0
        return None


def prepare(problem: Problem, grid: Grid, split: bool = True) -> ModelData:
    """Ops, durations (semantics.duration_ms rounded up), the waits of semantics.waits as edges
    (a B's wait for its reload depends on the offload binary: ``transfers`` adds it), and the
    microbatch order of each stage's ops (the symmetry rule of the module docstring)."""
    pipe = problem.pipeline
    stages, microbatches = pipe.stages, pipe.microbatches
    kinds = (_F, _B, _W) if split else (_F, _BW)
    transfers = (_OFF, _REL) if problem.offload.enabled else ()

    duration: dict[Op, int] = {}
    for s in range(stages):
        for kind in kinds + transfers:
            units = grid.up(duration_ms(problem, Op(kind, s, 0)))
            for i in range(microbatches):
                duration[Op(kind, s, i)] = units

    edges: list[tuple[Op, Op, int]] = []
    for s in range(stages):
        for i in range(microbatches):
            for kind in kinds:
                op = Op(kind, s, i)
                edges.extend((wait.op, op, grid.up(wait.lag_ms))
                             for wait in waits(problem, op, fused_above=not split))
                if i > 0:
                    edges.append((Op(kind, s, i - 1), op, 0))

    compute = [op for op in duration if op.kind in COMPUTE_KINDS]
    succs: dict[Op, list[tuple[Op, int]]] = {op: [] for op in compute}
    indegree = {op: 0 for op in compute}
    for a, b, gap in edges:
        succs[a].append((b, gap))
        indegree[b] += 1
    order = [op for op in compute if indegree[op] == 0]
    for op in order:  # Kahn's algorithm; the list grows while we walk it
        for nxt, _ in succs[op]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                order.append(nxt)
    position = {op: n for n, op in enumerate(order)}
    head = {op: 0 for op in order}
    for op in order:
        for nxt, gap in succs[op]:
            head[nxt] = max(head[nxt], head[op] + duration[op] + gap)
    tail: dict[Op, int] = {}
    reach: dict[Op, int] = {}
    for op in reversed(order):
        tail[op] = duration[op] + max((gap + tail[nxt] for nxt, gap in succs[op]), default=0)
        bits = 0
        for nxt, _ in succs[op]:
            bits |= reach[nxt] | (1 << position[nxt])
        reach[op] = bits
    ancestors: dict[Op, int] = {op: 0 for op in order}
    for op in order:
        for nxt, _ in succs[op]:
            ancestors[nxt] |= ancestors[op] | (1 << position[op])
    return ModelData(problem, grid, split, tuple(order), duration, tuple(edges), head, tail, reach, ancestors,
                     position)


def serial_horizon(data: ModelData) -> int:
    """A makespan every valid schedule beats: all durations and all lags one after another."""
    lags = sum(gap for _, _, gap in data.edges)
    return sum(data.duration.values()) + lags


def lower_bound(data: ModelData) -> int:
    """Longest chain, and each device's work after its earliest possible start."""
    chain = max(data.head[op] + data.tail[op] for op in data.ops)
    load = 0
    for device in range(data.problem.devices):
        mine = [op for op in data.ops if data.device(op) == device]
        after = min(data.tail[op] - data.duration[op] for op in mine)
        load = max(load, min(data.head[op] for op in mine) + sum(data.duration[op] for op in mine) + after)
    return max(chain, load)


# --------------------------------------------------------------------------- model


class Relief(NamedTuple):
    """A binary that lowers the memory counted at ``event``'s start by a claim about ``subject``.

    kind "away": subject OFFLOAD(a) has ended and RELOAD(a) has not started;
    kind "pending": subject F(a) has not started;
    kind "ended": subject B/W/BW(a) has ended;
    kind "back": subject RELOAD(a) has ended (host memory, at an OFFLOAD start).
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


def _name(op: Op) -> str:
    return f"{op.kind.mnemonic}{op.stage}_{op.microbatch}"


class _Builder:
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
        self.items_on = [[(s, i) for s in self.problem.pipeline.stages_on(d) for i in range(self.problem.microbatches)]
                         for d in range(self.problem.devices)]
        self.unit = max(self.problem.memory.activation) or 1  # memory rows in units of the largest activation
        # per stage, in those units: what F (or a reload) takes on the device, what an offload takes
        # on the host (semantics.holds)
        stages = range(self.problem.stages)
        self.taken = [sum(h.bytes for h in holds(self.problem, s, 0, fused=not data.split)) / self.unit for s in stages]
        self.hosted = [sum(h.bytes for h in holds(self.problem, s, 0, offloaded=True) if h.place is Place.HOST)
                       / self.unit for s in stages]

    # ----------------------------------------------------------------- helpers

    def ub(self, op: Op) -> float:
        return self.start[op].upBound

    def lb(self, op: Op) -> float:
        return self.start[op].lowBound

    def before(self, a: Op, b: Op):
        """1/0 or a 0-1 expression: compute op a runs before compute op b (same device)."""
        fixed = self.data.order(a, b)
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
        var = self.lp.add_variable(f"r_{kind}_{_name(subject)}_at_{_name(event)}", cat=pulp.LpBinary)
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
            self.start[op] = self.lp.add_variable(f"s_{_name(op)}", lowBound=data.head[op],
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
                    y = self.lp.add_variable(f"y_{_name(a)}_{_name(b)}", cat=pulp.LpBinary)
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
                f"s_{_name(off)}", lowBound=self.lb(f) + data.duration[f],
                upBound=max(self.ub(back) - d_rel - d_off, self.ub(f) + data.duration[f]))
            self.start[rel] = self.lp.add_variable(
                f"s_{_name(rel)}", lowBound=self.lb(off) + d_off, upBound=max(self.ub(back) - d_rel, self.ub(off) + d_off))
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
                        if s == t:  # one stage: microbatch order
                            first, second = (a, b) if i < j else (b, a)
                            self.precede(first, second, 0, both)
                            continue
                        y = self.lp.add_variable(f"y_{_name(a)}_{_name(b)}", cat=pulp.LpBinary)
                        self.order[(a, b)] = y
                        self.precede(a, b, 0, both + 1 - y)
                        self.precede(b, a, 0, both + y)
        self.shared_links()

    def shared_links(self) -> None:
        """Devices of a link group share one D2H and one H2D channel (semantics.py): one transfer
        at a time across them. The order is the solver's; the simulator's FIFO judges."""
        for group in self.problem.offload.link_groups:
            for n, da in enumerate(group):
                for db in group[n + 1:]:
                    for kind in (_OFF, _REL):
                        for s, i in self.items_on[da]:
                            for t, j in self.items_on[db]:
                                a, b = Op(kind, s, i), Op(kind, t, j)
                                both = 2 - self.offload[(s, i)] - self.offload[(t, j)]
                                y = self.lp.add_variable(f"y_{_name(a)}_{_name(b)}", cat=pulp.LpBinary)
                                self.order[(a, b)] = y
                                self.precede(a, b, 0, both + 1 - y)
                                self.precede(b, a, 0, both + y)

    def link_items(self, device: int) -> list[tuple[int, int]]:
        """(stage, microbatch) items of every device that shares ``device``'s host link."""
        offload = self.problem.offload
        mate = offload.link_of(device)
        return [item for d in range(self.problem.devices) if offload.link_of(d) == mate for item in self.items_on[d]]

    def channel_before(self, a: Op, b: Op):
        """1/0 or a 0-1 expression: transfer a is carried before transfer b on their channel."""
        if a.stage == b.stage:
            return 1 if a.microbatch < b.microbatch else 0
        if (a, b) in self.order:
            return self.order[(a, b)]
        return 1 - self.order[(b, a)]

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
        data, memory = self.data, self.problem.memory
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
                        f"h_{_name(off_a)}_{_name(event)}", lowBound=0, upBound=1)
                    self.lp += held >= self.offload[(sa, ia)] + earlier - 1 - back
                    terms.append(act[sa] * held)
                worst = sum(act[s] for s, _ in items)
                self.lp += pulp.lpSum(terms) <= host_budget + (worst - host_budget) * (1 - self.offload[(sb, ib)])

    def on_time(self, target: Op, source: Op, lag: int, exact: bool):
        """A binary that, when 1, starts ``target`` by ``source``'s end plus ``lag`` (exactly then if ``exact``)."""
        var = self.lp.add_variable(f"t_{_name(target)}_after_{_name(source)}", cat=pulp.LpBinary)
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
        data, pipe = self.data, self.problem.pipeline
        offload = self.problem.offload.enabled
        by_device = [[op for op in data.ops if data.device(op) == d] for d in range(self.problem.devices)]
        mask = [sum(1 << data.position[op] for op in ops) for ops in by_device]
        for x in data.ops:
            device, s, i = data.device(x), x.stage, x.microbatch
            options = []
            for a in by_device[device]:
                fixed = data.order(a, x) if a != x else 0
                if fixed == 0:
                    continue
                if fixed == 1 and data.reach[a] & data.ancestors[x] & mask[device]:
                    continue  # an op is forced between them, so a is never just before x
                var = self.on_time(x, a, 0, exact=False)
                if fixed is None:
                    self.lp += var <= self.before(a, x)
                options.append(var)
            for wait in waits(self.problem, x, fused_above=not data.split):
                if data.device(wait.op) != device:
                    options.append(self.on_time(x, wait.op, data.grid.up(wait.lag_ms), exact=False))
            if offload and x.kind in (_B, _BW):
                var = self.on_time(x, Op(_REL, s, i), 0, exact=False)
                self.lp += var <= self.offload[(s, i)]
                options.append(var)
            if options:
                self.lp += pulp.lpSum(options) >= 1
            else:  # the very first op
                self.lp += self.start[x] == 0
        if not offload:
            return
        for s, i in data.items:
            device = pipe.device_of(s)
            f, back, x_item = Op(_F, s, i), data.back(s, i), self.offload[(s, i)]
            for kind in (_OFF, _REL):
                target = Op(kind, s, i)
                options = []
                for c in by_device[device]:
                    if c == back or (c != f and data.order(c, f) == 1) or data.order(c, back) == 0:
                        continue  # ends before F(a) ends, or after B(a) starts: never the issue point
                    options.append(self.on_time(target, c, 0, exact=True))
                for t, j in self.link_items(device):
                    if (t, j) == (s, i):
                        continue
                    other = Op(kind, t, j)
                    earlier = self.channel_before(other, target)
                    if isinstance(earlier, int) and earlier == 0:
                        continue
                    var = self.on_time(target, other, 0, exact=False)
                    self.lp += var <= self.offload[(t, j)]
                    if not isinstance(earlier, int):
                        self.lp += var <= earlier
                    options.append(var)
                if kind is _REL:
                    options.append(self.on_time(target, Op(_OFF, s, i), 0, exact=False))
                self.lp += pulp.lpSum(options) >= x_item


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
    builder.forward_events()
    if data.problem.offload.enabled:
        builder.reload_events()
        builder.host_events()
    if asap:
        builder.asap()
    return MilpModel(data, horizon, builder.lp, builder.makespan, builder.start, builder.offload, builder.order,
                     builder.relief, builder.host, builder.tight, builder.margin)


# --------------------------------------------------------------------------- warm start


def _model_form(data: ModelData, schedule: Schedule) -> list[list[Op]]:
    """The schedule's lists with backwards in the model's form (BW split into B, W or B, W fused)."""
    rows = []
    for ops in schedule.devices:
        row: list[Op] = []
        for op in ops:
            if data.split and op.kind is _BW:
                row += [Op(_B, op.stage, op.microbatch), Op(_W, op.stage, op.microbatch)]
            elif not data.split and op.kind is _B:
                row.append(Op(_BW, op.stage, op.microbatch))
            elif not data.split and op.kind is _W:
                continue
            else:
                row.append(op)
        rows.append(row)
    return rows


def unit_times(data: ModelData, schedule: Schedule) -> dict[Op, int] | None:
    """Start times (units) of the schedule under the model's durations, as the simulator would run it
    (the simulator's own rule, with rounded-up durations). None when the lists cannot run."""
    try:
        times = start_times(data.problem, Schedule.of(schedule.name, _model_form(data, schedule)), data.grid.up)
    except ScheduleError:
        return None
    return {op: int(t) for op, t in times.items()}


def start_values(model: MilpModel, schedule: Schedule) -> dict[pulp.LpVariable, float] | None:
    """Values for every variable that describe ``schedule``, or None when it cannot run.

    Relief claims are set where the schedule's unit times make them true; the caller checks
    the values against the constraints (a hint may break the budget at unit times).
    """
    data = model.data
    times = unit_times(data, schedule)
    if times is None:
        return None
    offloaded = schedule.offloaded
    values: dict[pulp.LpVariable, float] = {}
    for op in data.ops:
        values[model.start[op]] = times[op]
    for (s, i), x in model.offload.items():
        off, rel, f = Op(_OFF, s, i), Op(_REL, s, i), Op(_F, s, i)
        chosen = (s, i) in offloaded
        values[x] = 1.0 if chosen else 0.0
        o = times[off] if chosen else times[f] + data.duration[f]
        values[model.start[off]] = o
        values[model.start[rel]] = times[rel] if chosen else o + data.duration[off]
    start = {op: values[var] for op, var in model.start.items()}
    for (a, b), y in model.order.items():
        values[y] = 1.0 if start[a] < start[b] or (start[a] == start[b] and a < b) else 0.0

    def end(op: Op) -> float:
        return start[op] + data.duration[op]

    for relief, var in model.relief.items():
        kind, subject, event = relief
        t = start[event]
        margin = model.margin
        if kind == "away":
            rel = Op(_REL, subject.stage, subject.microbatch)
            true = (subject.stage, subject.microbatch) in offloaded and end(subject) + margin <= t \
                and start[rel] >= t + 1 + margin
        elif kind == "pending":
            true = start[subject] >= t + 1 + margin
        else:  # "ended" and "back"
            true = end(subject) + margin <= t
        values[var] = 1.0 if true else 0.0
    for (off_a, event), var in model.host.items():
        a = (off_a.stage, off_a.microbatch)
        earlier = start[off_a] < start[event] or (start[off_a] == start[event] and off_a < event)
        back = model.relief[Relief("back", Op(_REL, *a), event)]
        values[var] = max(0.0, values[model.offload[a]] + (1.0 if earlier else 0.0) - 1.0 - values[back])
    for (target, source, lag), var in model.tight.items():
        values[var] = 1.0 if start[target] == end(source) + lag else 0.0
        if source.kind in (_OFF, _REL) and (source.stage, source.microbatch) not in offloaded:
            values[var] = 0.0
    values[model.makespan] = max(end(op) for op in data.ops)
    return values
