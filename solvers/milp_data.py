"""The MILP's problem data, before PuLP: ops, durations in grid units, forced orders, heads and tails.

Time is counted in integer units of a ``Grid`` (timegrid.py, shared with CP-SAT); every duration
is rounded up to whole units (why that is safe: milp_model.py and timegrid.py). Durations and
waits are the ones of core/semantics.py. ``unit_times`` gives a schedule's start times in the
same units, by the simulator's own rule, for warm starts and for judging a relaxed answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from optpipe.core.errors import ScheduleError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.semantics import duration_ms, waits
from optpipe.core.simulate import start_times

from .timegrid import MILP_MAX_UNITS, Grid, choose_grid

__all__ = ["choose_milp_grid", "ModelData", "prepare", "serial_horizon", "lower_bound", "lp_name", "unit_times"]

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
    duration: dict[Op, int]  # units; compute ops, and OFFLOAD/RELOAD (RECOMPUTE) of every item when enabled
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
    transfers += (OpKind.RECOMPUTE,) if problem.recompute.enabled else ()  # optional ops, like transfers

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

    compute = [op for op in duration if op.kind in kinds]
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


def lp_name(op: Op) -> str:
    """The op as it appears in LP variable names (``F0_3``)."""
    return f"{op.kind.mnemonic}{op.stage}_{op.microbatch}"


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


# --------------------------------------------------------------------------- a schedule in model units


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

