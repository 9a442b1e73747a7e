"""The CP-SAT model's data and variables, and the look-ups every constraint family reads.

The first two steps of the model (cpsat_model.py says what it is): the data (durations in grid
units, the window's floors, the horizon) and the variables, each kept by name:
``start[Op]``, ``interval[Op]`` and ``window[Op]`` (the start's domain) for every op the model
places, and per (stage, microbatch) the literals ``offloaded``, ``recomputed`` and ``kept``.
The constraint families (cpsat_model.py, cpsat_memory.py, cpsat_tight.py, cpsat_links.py) read
a ``Variables`` and add to its ``cp``; none of them imports another.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, NamedTuple

from ortools.sat.python import cp_model

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import duration_ms, link, waits

from .bounds import data_paths
from .timegrid import Grid

__all__ = ["Scope", "full_scope", "Floor", "Window", "Variables", "Pair"]

F, B, W, OFF, REL = OpKind.F, OpKind.B, OpKind.W, OpKind.OFFLOAD, OpKind.RELOAD
RC = OpKind.RECOMPUTE
COMPUTE = (F, B, W)
TRANSFERS = (OFF, REL)

Pair = tuple[int, int]  # (stage, microbatch): one activation, kept, offloaded or recomputed


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Scope:
    """What a model decides; the rest of the schedule is given."""

    compute: frozenset[Op]  # F, B, W ops the model orders and times
    open_pairs: frozenset[Pair]  # (stage, microbatch) whose offload the model decides
    offloaded: frozenset[Pair] = frozenset()  # decided outside: offloaded
    transfers: frozenset[Op] = frozenset()  # OFF/REL ops of decided pairs that the model places
    fixed: Mapping[Op, int] = field(default_factory=dict)  # start (units) of ops before the window
    t0: int = 0  # the window's start: fixed memory that ends before it is left out
    rest: tuple[int, ...] = ()  # per device, compute units after the window; empty: minimise makespan
    follow: tuple[tuple[Op, ...], ...] = ()  # per device, ops after the window in list order: re-timed, not reordered
    chains: tuple[tuple[Op, ...], ...] = ()  # compute ops of the window that keep their order: free ops go between
    # (kind, stage) whose ops the schedule runs out of microbatch order (W deferral reorders W
    # passes): a window model leaves those unordered, or it could not hold the schedule it improves
    unordered: frozenset[tuple[OpKind, int]] = frozenset()

    @property
    def window(self) -> bool:
        return bool(self.rest)

    @property
    def following(self) -> frozenset[Op]:
        return frozenset(op for ops in self.follow for op in ops)


def full_scope(problem: Problem) -> Scope:
    pipe = problem.pipeline
    compute = frozenset(Op(k, s, i) for k in COMPUTE for s in range(pipe.stages) for i in range(pipe.microbatches))
    pairs = frozenset((s, i) for s in range(pipe.stages) for i in range(pipe.microbatches))
    return Scope(compute, pairs if problem.offload.enabled else frozenset())


class Floor(NamedTuple):
    """The last fixed op of a device (compute) or of a channel (transfers), and its end (units)."""

    op: Op
    end: int


class Window(NamedTuple):
    """The earliest and the latest start (units) of an op the model places."""

    earliest: int
    latest: int


# --------------------------------------------------------------------------- variables


class Variables:
    """The data and variables of one scope; ``horizon`` bounds every end (units)."""

    def __init__(self, problem: Problem, grid: Grid, scope: Scope, horizon: int):
        self.problem, self.grid, self.scope, self.horizon = problem, grid, scope, horizon
        # data
        pipe = problem.pipeline
        self.S, self.m, self.P = pipe.stages, pipe.microbatches, pipe.devices
        self.device_of = [pipe.device_of(s) for s in range(self.S)]
        self.link = [link(problem, d) for d in range(self.P)]  # shared host links: one channel per group
        self.dur = self._durations()
        self.scope = scope = self._within_horizon(scope)
        self.floor, self.channel_floor = self._floors()
        self.following = scope.following
        # variables
        self.cp = cp_model.CpModel()
        self.start: dict[Op, cp_model.IntVar] = {}
        self.interval: dict[Op, cp_model.IntervalVar] = {}
        self.window: dict[Op, Window] = {}
        self.offloaded: dict[Pair, cp_model.IntVar] = {}
        self.recomputed: dict[Pair, cp_model.IntVar] = {}  # issue 14: keep / offload / recompute
        self.kept: dict[Pair, cp_model.IntVar] = {}
        paths = data_paths(problem)
        self._compute_variables(paths)
        self._following_variables(paths)
        self._offload_variables()
        self._recompute_variables()

    # ------------------------------------------------------------- data

    def _durations(self) -> dict[tuple[OpKind, int], int]:
        """Units per (kind, stage): semantics.duration_ms rounded up (timegrid.py says why; down on a floor grid)."""
        kinds = COMPUTE + (TRANSFERS if self.problem.offload.enabled else ())
        if self.problem.recompute.enabled:
            kinds += (RC,)
        return {(kind, s): self.grid.length(duration_ms(self.problem, Op(kind, s, 0))) for kind in kinds for s in range(self.S)}

    def _within_horizon(self, scope: Scope) -> Scope:
        """The scope without the open pairs whose round trip through the host is longer than the
        horizon: no schedule the model may return offloads them, and their transfers (a terabyte
        over a link of bytes per second, beside microsecond ops) would take OR-Tools past int64."""
        if not scope.open_pairs:
            return scope
        reachable = frozenset(pair for pair in scope.open_pairs
                              if self.dur[(OFF, pair[0])] + self.dur[(REL, pair[0])] <= self.horizon)
        return scope if reachable == scope.open_pairs else replace(scope, open_pairs=reachable)

    def _floors(self) -> tuple[list[Floor | None], dict[tuple[int, OpKind], Floor]]:
        """Per device the last fixed compute op; per (link, kind) channel the last fixed transfer."""
        floor: list[Floor | None] = [None] * self.P
        channel: dict[tuple[int, OpKind], Floor] = {}
        for op, start in self.scope.fixed.items():
            d, end = self.device_of[op.stage], start + self.d(op)
            if op.kind in COMPUTE:
                if floor[d] is None or end > floor[d].end:
                    floor[d] = Floor(op, end)
            elif (self.link[d], op.kind) not in channel or end > channel[(self.link[d], op.kind)].end:
                channel[(self.link[d], op.kind)] = Floor(op, end)
        return floor, channel

    def floor_end(self, device: int) -> int:
        """The end of the device's last fixed compute op, 0 when none."""
        floor = self.floor[device]
        return floor.end if floor is not None else 0

    # ------------------------------------------------------------- variables

    def _compute_variables(self, paths) -> None:
        """F, B, W of the scope, their domains cut by the data paths before and after them."""
        for op in sorted(self.scope.compute):
            d, i = self.d(op), op.microbatch
            earlier = i if self.in_order(op) else 0  # FIFO: i earlier ops of this chain, one device
            head = self.grid.down(paths.head[(op.kind, op.stage)])
            lo = max(head + earlier * d, self.floor_end(self.device_of[op.stage]))
            if self.scope.window:
                hi = self.horizon - d
            else:
                hi = self.horizon - self.grid.down(paths.tail[(op.kind, op.stage)]) - (self.m - i) * d
            self._new(op, lo, max(lo, hi))

    def _following_variables(self, paths) -> None:
        """The ops after a window, re-timed in their list order."""
        for op in sorted(self.following):
            lo = self.floor_end(self.device_of[op.stage])
            if op.kind in COMPUTE:
                lo = max(lo, self.grid.down(paths.head[(op.kind, op.stage)]) + op.microbatch * self.d(op))
            self._new(op, lo, max(lo, self.horizon - self.d(op)))

    def _offload_variables(self) -> None:
        """An ``offloaded`` literal per open pair; an optional OFFLOAD and RELOAD per open or
        decided pair, after F and, when B is in the model, early enough for B."""
        scope = self.scope
        for s, i in sorted(scope.open_pairs):
            self.offloaded[(s, i)] = self.cp.new_bool_var(f"x{s}:{i}")
        transfers = set(scope.transfers)
        for s, i in scope.open_pairs:
            transfers |= {Op(OFF, s, i), Op(REL, s, i)}
        for op in sorted(transfers):
            device = self.device_of[op.stage]
            channel = self.channel_floor.get((self.link[device], op.kind))
            lo = max(self.floor_end(device), channel.end if channel is not None else 0,
                     self._earliest_after(Op(F, op.stage, op.microbatch)))
            hi = self.horizon - self.d(op)
            b = self.start_of(Op(B, op.stage, op.microbatch))
            if op.kind is REL and b is not None and b in self.start:  # before B's latest start
                hi = min(hi, self.window[Op(B, op.stage, op.microbatch)].latest - self.d(op))
            elif op.kind is OFF and b is not None and b in self.start:
                hi = min(hi, self.window[Op(B, op.stage, op.microbatch)].latest - self.d(op)
                         - self.dur[(REL, op.stage)])
            self._new(op, lo, max(lo, hi), self.presence((op.stage, op.microbatch)))

    def _recompute_variables(self) -> None:
        """Issue 14: per (stage, microbatch) of the whole problem (not a window) a literal
        ``recomputed`` with an optional RECOMPUTE interval after F, before B, on the device's
        compute no-overlap. With the offload literal, exactly one of keep, offload, recompute.
        The constraints that tie them are added here, before every other family, as they
        always were: the order of a model's constraints steers CP-SAT's search."""
        if not self.problem.recompute.enabled or self.scope.window:
            return
        for s in range(self.S):
            for i in range(self.m):
                pair = (s, i)
                f, b, rc = Op(F, s, i), Op(B, s, i), Op(RC, s, i)
                if f not in self.start or b not in self.start:
                    continue
                r = self.recomputed[pair] = self.cp.new_bool_var(f"r{s}:{i}")
                keep = self.kept[pair] = self.cp.new_bool_var(f"k{s}:{i}")
                x = self.offloaded.get(pair)
                self.cp.add(keep + r + (x if x is not None else int(pair in self.scope.offloaded)) == 1)
                lo = self.window[f].earliest + self.d(f)
                self._new(rc, lo, max(lo, self.window[b].latest - self.d(rc)), r)
                self.cp.add(self.start[rc] >= self.end_of(f)).only_enforce_if(r)
                self.cp.add(self.start[b] >= self.end_of(rc)).only_enforce_if(r)

    def _earliest_after(self, op: Op) -> int:
        if op in self.window:
            return self.window[op].earliest + self.d(op)
        start = self.scope.fixed.get(op)
        return start + self.d(op) if start is not None else 0

    def _new(self, op: Op, lo: int, hi: int, present=True) -> None:
        self.window[op] = Window(lo, hi)
        self.start[op] = self.cp.new_int_var(lo, hi, str(op))
        if present is True:
            self.interval[op] = self.cp.new_fixed_size_interval_var(self.start[op], self.d(op), f"i{op}")
        else:
            self.interval[op] = self.cp.new_optional_fixed_size_interval_var(self.start[op], self.d(op), present, f"i{op}")

    # ------------------------------------------------------------- look-ups

    def d(self, op: Op) -> int:
        """The op's duration in units."""
        return self.dur[(op.kind, op.stage)]

    def in_order(self, op: Op) -> bool:
        """Whether the model runs ``op``'s chain (its kind, its stage) in microbatch order: the
        symmetry breaking of cpsat_model.py, except where a window's schedule does not."""
        return (op.kind, op.stage) not in self.scope.unordered

    def start_of(self, op: Op):
        """A variable, a constant, or None when the op is outside the model (after the window)."""
        if op in self.start:
            return self.start[op]
        return self.scope.fixed.get(op)

    def end_of(self, op: Op):
        start = self.start_of(op)
        return None if start is None else start + self.d(op)

    def transfer_source(self, op: Op) -> Op:
        """What a transfer waits for: an OFFLOAD its F, a RELOAD its OFFLOAD (semantics.waits)."""
        return self.data_preds(op)[0][0]

    def data_preds(self, op: Op) -> list[tuple[Op, int]]:
        """(predecessor, lag units) that every order must respect: semantics.waits, split backward;
        a B's wait for its reload depends on the offload literal and is added where it is used."""
        return [(wait.op, self.grid.length(wait.lag_ms)) for wait in waits(self.problem, op)]

    def presence(self, pair: Pair):
        """True, False, or the literal of an open pair: is the pair offloaded?"""
        if pair in self.offloaded:
            return self.offloaded[pair]
        return pair in self.scope.offloaded

    def present(self, op: Op):
        """True, False or a literal: is this op in the schedule?"""
        if op.kind is RC:
            return self.recomputed.get((op.stage, op.microbatch), False)
        if op.kind in TRANSFERS:
            return self.presence((op.stage, op.microbatch))
        return True

    def recomputes_on(self, device: int) -> list[Op]:
        return [op for op in self.start if op.kind is RC and self.device_of[op.stage] == device]

    def device_ops(self, device: int, kinds) -> list[Op]:
        """The window's ops (not those that follow it) of some kinds on a device."""
        return [op for op in self.start if op.kind in kinds and self.device_of[op.stage] == device
                and op not in self.following]

    def link_ops(self, device: int, kind: OpKind) -> list[Op]:
        """The window's transfers of one kind on every device that shares ``device``'s host link."""
        return [op for d in range(self.P) if self.link[d] == self.link[device] for op in self.device_ops(d, (kind,))]
