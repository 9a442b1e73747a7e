"""The CP-SAT model: the fastest schedule that fits, as the simulator times it, with a proof.

Skeleton (OR-Tools samples): data -> variables -> constraints -> objective -> solve -> read
back -> check. Handles are kept by name: ``start[Op]``, ``interval[Op]``, ``offloaded[(s, i)]``,
``tight[(Op, reason)]``.

The model, in integer units of a ``Grid`` (timegrid.py):

- every F, B, W of every (stage, microbatch) is an interval; the backward is always split (a
  fused BW is the case of W right after B); data dependencies with p2p lags; one no-overlap
  per device;
- per (stage, microbatch) a literal ``offloaded``; when true an OFFLOAD interval after F and a
  RELOAD after it that ends before B; one no-overlap per D2H and per H2D channel;
- memory as a cumulative per device over the holds of semantics.holds, one interval each,
  for both offload cases (the literal picks one): from F's start to B's end (activation -
  weight part) and to W's end (weight part); offloaded, from F's start to the offload's end
  and from the reload's start to B's and W's ends. Host memory likewise when ``host_budget``
  could bind;
- ASAP consistency. The simulator starts every op as soon as its dependencies, its device's
  previous op and its issue point allow; it never waits for memory. A solution that delays an
  F on purpose (to let an offload free memory first) would re-simulate with an earlier F and
  a higher peak. So every op must be *tight*: it starts at the end of a data predecessor (plus
  lag), or of a compute op on its device (which is then its device predecessor or issue
  point), or of a transfer on its channel, or at 0. With every op tight the start times are
  the least fixed point of the simulator's recurrence for the decoded order: the simulator
  reproduces them exactly;
- shared host links (``[offload] link_groups``): one no-overlap per group's D2H and H2D channel,
  served FIFO by ready time as the simulator serves it (``_shared_fifo``), so on an exact grid the
  simulator reproduces the model's times there too; a window model leaves the order free;
- symmetry breaking: every stage runs its F, its B and its W in microbatch order (FIFO).
  Without offload this loses nothing (memory depends only on how many activations of a stage
  are live, so labels can be exchanged); with offload it is the usual restriction, and
  "optimal" means optimal among microbatch-ordered schedules.

What an op waits for, how long it runs and what it holds are core/semantics.py's; the
model only rounds durations up to its grid. On an exact grid (timegrid.py) the simulator
reproduces the model's times to the last digit. On a rounded one the simulator runs no op
later than the model and none earlier by more than the grid's slack, and a transfer's release
is held that much longer in the cumulative: the simulated makespan is at most the objective
and the simulated peak at most the model's (timegrid.py proves both). That margin makes the
solver's bound unsafe, so it is reported only for exact grids. ``check_solution`` re-simulates
every answer and raises ``InternalError`` if the two ever disagree.

The same model decides a window of a schedule for lns.py: a ``Scope`` names the ops it places;
ops before the window keep their times, the ops of the next few windows keep their list order
but are re-timed, ops after those are left out (what they free is held to the horizon), and
the objective becomes each device's end plus the compute it still has to do.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ortools.sat.python import cp_model

from optpipe.core.errors import InternalError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule, parse_op
from optpipe.core.semantics import TOLERANCE_MS, At, Place, duration_ms, holds, link, waits
from optpipe.core.simulate import Timeline, simulate, start_times

from .bounds import data_paths, makespan_lower_bound
from .decode import schedule_from_starts
from .result import Progress, SolveResult, SolveStatus
from .timegrid import Grid, choose_grid

__all__ = ["Scope", "Model", "solve_cpsat", "solve_model", "check_solution", "model_values", "full_scope"]

_F, _B, _W, _BW, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD
_RC = OpKind.RECOMPUTE
_COMPUTE = (_F, _B, _W)
_OVERFLOW = 2**62  # keep capacity x horizon of the cumulatives below this (int64 with headroom)


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Scope:
    """What a model decides; the rest of the schedule is given."""

    compute: frozenset[Op]  # F, B, W ops the model orders and times
    open_pairs: frozenset[tuple[int, int]]  # (stage, microbatch) whose offload the model decides
    offloaded: frozenset[tuple[int, int]] = frozenset()  # decided outside: offloaded
    transfers: frozenset[Op] = frozenset()  # OFF/REL ops of decided pairs that the model places
    fixed: Mapping[Op, int] = field(default_factory=dict)  # start (units) of ops before the window
    t0: int = 0  # the window's start: fixed memory that ends before it is left out
    rest: tuple[int, ...] = ()  # per device, compute units after the window; empty: minimise makespan
    follow: tuple[tuple[Op, ...], ...] = ()  # per device, ops after the window in list order: re-timed, not reordered

    @property
    def window(self) -> bool:
        return bool(self.rest)

    @property
    def following(self) -> frozenset[Op]:
        return frozenset(op for ops in self.follow for op in ops)


def full_scope(problem: Problem) -> Scope:
    pipe = problem.pipeline
    compute = frozenset(Op(k, s, i) for k in _COMPUTE for s in range(pipe.stages) for i in range(pipe.microbatches))
    pairs = frozenset((s, i) for s in range(pipe.stages) for i in range(pipe.microbatches))
    return Scope(compute, pairs if problem.offload.enabled else frozenset())


# --------------------------------------------------------------------------- the model


class Model:
    """Variables and constraints of one scope; ``horizon`` bounds every end (units)."""

    def __init__(self, problem: Problem, grid: Grid, scope: Scope, horizon: int, lower: int = 0):
        self.problem, self.grid, self.scope, self.horizon = problem, grid, scope, horizon
        pipe = problem.pipeline
        self.S, self.m, self.P = pipe.stages, pipe.microbatches, pipe.devices
        self.device_of = [pipe.device_of(s) for s in range(self.S)]
        self.link = [link(problem, d) for d in range(self.P)]  # shared host links: one channel per group
        self.dur = self._durations()
        self.cp = cp_model.CpModel()
        self.start: dict[Op, cp_model.IntVar] = {}
        self.interval: dict[Op, cp_model.IntervalVar] = {}
        self.offloaded: dict[tuple[int, int], cp_model.IntVar] = {}
        self.recomputed: dict[tuple[int, int], cp_model.IntVar] = {}  # issue 14: keep / offload / recompute
        self.kept: dict[tuple[int, int], cp_model.IntVar] = {}
        self.tight: dict[tuple[Op, str], cp_model.IntVar] = {}
        self.window: dict[Op, tuple[int, int]] = {}
        self.device_end: list = []
        self.sizes: list = []  # (size variable, start endpoint, end endpoint or None, presence) for hints
        self.floor, self.channel_floor = self._floors()
        self.following = scope.following
        self.follow_preds: dict[Op, list[tuple[Op, int]]] = {}
        self._variables()
        self._recompute_variables()
        self._precedence()
        self._follow_order()
        self._no_overlap()
        self._memory()
        self._tightness()
        self.fifo: list[tuple] = []  # (literal or ready variable, how to read it off a solution), for hints
        self._shared_fifo()
        self._objective(lower)

    # ------------------------------------------------------------- data helpers

    def _durations(self) -> dict[tuple[OpKind, int], int]:
        """Units per (kind, stage): semantics.duration_ms rounded up (timegrid.py says why)."""
        kinds = _COMPUTE + ((_OFF, _REL) if self.problem.offload.enabled else ())
        if self.problem.recompute.enabled:
            kinds += (_RC,)
        return {(kind, s): self.grid.up(duration_ms(self.problem, Op(kind, s, 0))) for kind in kinds for s in range(self.S)}

    def d(self, op: Op) -> int:
        return self.dur[(op.kind, op.stage)]

    def _floors(self) -> tuple[list[tuple[Op, int] | None], dict[tuple[int, OpKind], tuple[Op, int]]]:
        """Per device the last fixed compute op and its end; per channel the last fixed transfer."""
        floor: list[tuple[Op, int] | None] = [None] * self.P
        channel: dict[tuple[int, OpKind], tuple[Op, int]] = {}
        for op, start in self.scope.fixed.items():
            d, end = self.device_of[op.stage], start + self.d(op)
            if op.kind in _COMPUTE:
                if floor[d] is None or end > floor[d][1]:
                    floor[d] = (op, end)
            elif (self.link[d], op.kind) not in channel or end > channel[(self.link[d], op.kind)][1]:
                channel[(self.link[d], op.kind)] = (op, end)
        return floor, channel

    def start_of(self, op: Op):
        """A variable, a constant, or None when the op is outside the model (after the window)."""
        if op in self.start:
            return self.start[op]
        return self.scope.fixed.get(op)

    def end_of(self, op: Op):
        start = self.start_of(op)
        return None if start is None else start + self.d(op)

    def data_preds(self, op: Op) -> list[tuple[Op, int]]:
        """(predecessor, lag units) that every order must respect: semantics.waits, split backward;
        a B's wait for its reload depends on the offload literal and is added where it is used."""
        return [(wait.op, self.grid.up(wait.lag_ms)) for wait in waits(self.problem, op)]

    def presence(self, pair: tuple[int, int]):
        """True, False, or the literal of an open pair."""
        if pair in self.offloaded:
            return self.offloaded[pair]
        return pair in self.scope.offloaded

    # ------------------------------------------------------------- variables

    def _variables(self) -> None:
        scope, m = self.scope, self.m
        paths = data_paths(self.problem)
        for op in sorted(scope.compute):
            d, i = self.d(op), op.microbatch
            head = self.grid.down(paths.head[(op.kind, op.stage)])
            lo = head + i * self.dur[(op.kind, op.stage)]  # FIFO: i earlier ops of this chain, one device
            floor = self.floor[self.device_of[op.stage]]
            if floor is not None:
                lo = max(lo, floor[1])
            if scope.window:
                hi = self.horizon - d
            else:
                hi = self.horizon - self.grid.down(paths.tail[(op.kind, op.stage)]) - (m - i) * d
            self._new(op, lo, max(lo, hi))
        for op in sorted(self.following):
            device = self.device_of[op.stage]
            lo = self.floor[device][1] if self.floor[device] else 0
            if op.kind in _COMPUTE:
                lo = max(lo, self.grid.down(paths.head[(op.kind, op.stage)]) + op.microbatch * self.d(op))
            self._new(op, lo, max(lo, self.horizon - self.d(op)))
        for pair in sorted(scope.open_pairs):
            self.offloaded[pair] = self.cp.new_bool_var(f"x{pair[0]}:{pair[1]}")
        transfers = set(scope.transfers)
        for s, i in scope.open_pairs:
            transfers |= {Op(_OFF, s, i), Op(_REL, s, i)}
        for op in sorted(transfers):
            device = self.device_of[op.stage]
            lo = max(self.floor[device][1] if self.floor[device] else 0,
                     self.channel_floor[(self.link[device], op.kind)][1]
                     if (self.link[device], op.kind) in self.channel_floor else 0,
                     self._earliest_after(Op(_F, op.stage, op.microbatch)))
            hi = self.horizon - self.d(op)
            b = self.start_of(Op(_B, op.stage, op.microbatch))
            if op.kind is _REL and b is not None and b in self.start:  # before B's latest start
                hi = min(hi, self.window[Op(_B, op.stage, op.microbatch)][1] - self.d(op))
            elif op.kind is _OFF and b is not None and b in self.start:
                hi = min(hi, self.window[Op(_B, op.stage, op.microbatch)][1] - self.d(op)
                         - self.dur[(_REL, op.stage)])
            self._new(op, lo, max(lo, hi), self.presence((op.stage, op.microbatch)))

    def _recompute_variables(self) -> None:
        """Issue 14: per (stage, microbatch) of the whole problem (not a window) a literal
        ``recomputed`` with an optional
        RECOMPUTE interval after F, before B, on the device's compute no-overlap. With the offload
        literal, at most one; ``kept`` is neither."""
        if not self.problem.recompute.enabled or self.scope.window:
            return
        for s in range(self.S):
            for i in range(self.m):
                pair = (s, i)
                f, b, rc = Op(_F, s, i), Op(_B, s, i), Op(_RC, s, i)
                if f not in self.start or b not in self.start:
                    continue
                r = self.recomputed[pair] = self.cp.new_bool_var(f"r{s}:{i}")
                keep = self.kept[pair] = self.cp.new_bool_var(f"k{s}:{i}")
                x = self.offloaded.get(pair)
                self.cp.add(keep + r + (x if x is not None else int(pair in self.scope.offloaded)) == 1)
                lo = self.window[f][0] + self.d(f)
                self._new(rc, lo, max(lo, self.window[b][1] - self.d(rc)), r)
                self.cp.add(self.start[rc] >= self.end_of(f)).only_enforce_if(r)
                self.cp.add(self.start[b] >= self.end_of(rc)).only_enforce_if(r)

    def _present(self, op: Op):
        """True, False or a literal: is this op in the schedule?"""
        if op.kind is _RC:
            return self.recomputed.get((op.stage, op.microbatch), False)
        if op.kind in (_OFF, _REL):
            return self.presence((op.stage, op.microbatch))
        return True

    def _recomputes_on(self, device: int) -> list[Op]:
        return [op for op in self.start if op.kind is _RC and self.device_of[op.stage] == device]

    def _earliest_after(self, op: Op) -> int:
        if op in self.window:
            return self.window[op][0] + self.d(op)
        start = self.scope.fixed.get(op)
        return start + self.d(op) if start is not None else 0

    def _new(self, op: Op, lo: int, hi: int, present=True) -> None:
        self.window[op] = (lo, hi)
        self.start[op] = self.cp.new_int_var(lo, hi, str(op))
        if present is True:
            self.interval[op] = self.cp.new_fixed_size_interval_var(self.start[op], self.d(op), f"i{op}")
        else:
            self.interval[op] = self.cp.new_optional_fixed_size_interval_var(self.start[op], self.d(op), present, f"i{op}")

    # ------------------------------------------------------------- constraints

    def _precedence(self) -> None:
        for op, var in self.start.items():
            if op.kind is _RC:  # _recompute_variables
                continue
            if op.kind in _COMPUTE:
                for pred, lag in self.data_preds(op):
                    self.cp.add(var >= self.end_of(pred) + lag)
                if op.microbatch > 0:  # FIFO
                    earlier = self.end_of(Op(op.kind, op.stage, op.microbatch - 1))
                    if earlier is not None:
                        self.cp.add(var >= earlier)
                continue
            present = self.presence((op.stage, op.microbatch))
            pred_end = self.end_of(self.data_preds(op)[0][0])
            rules = [var >= pred_end] if pred_end is not None else []
            b = self.start_of(Op(_B, op.stage, op.microbatch))
            if op.kind is _REL and b is not None:
                rules.append(var + self.d(op) <= b)
            for rule in rules:
                constraint = self.cp.add(rule)
                if present is not True:
                    constraint.only_enforce_if(present)

    def _follow_order(self) -> None:
        """Ops after the window keep their list order: each waits for its device predecessor, its
        issue point and its channel predecessor; the first ones wait for every window op there."""
        for d, ops in enumerate(self.scope.follow):
            window = self._device_ops(d, _COMPUTE)
            floor = [self.floor[d][0]] if self.floor[d] else []
            last_compute: list[Op] = window + floor
            last_channel = {kind: self._device_ops(d, (kind,)) + ([self.channel_floor[(self.link[d], kind)][0]]
                                                                 if (self.link[d], kind) in self.channel_floor else [])
                            for kind in (_OFF, _REL)}
            for op in ops:
                before = list(last_compute)
                if op.kind not in _COMPUTE:
                    before += last_channel[op.kind]
                for pred in before:
                    present = True if pred.kind in _COMPUTE else self.presence((pred.stage, pred.microbatch))
                    if present is False:
                        continue
                    constraint = self.cp.add(self.start[op] >= self.end_of(pred))
                    if present is not True:
                        constraint.only_enforce_if(present)
                self.follow_preds[op] = [(pred, 0) for pred in before]
                if op.kind in _COMPUTE:
                    last_compute = [op]
                else:
                    last_channel[op.kind] = [op]

    def _device_ops(self, device: int, kinds) -> list[Op]:
        """The window's ops (not those that follow it) of some kinds on a device."""
        return [op for op in self.start if op.kind in kinds and self.device_of[op.stage] == device
                and op not in self.following]

    def _link_ops(self, device: int, kind: OpKind) -> list[Op]:
        """The window's transfers of one kind on every device that shares ``device``'s host link."""
        return [op for d in range(self.P) if self.link[d] == self.link[device] for op in self._device_ops(d, (kind,))]

    def _no_overlap(self) -> None:
        """One compute op at a time per device; one transfer at a time per host-link channel (a
        link group's devices share one D2H and one H2D channel)."""
        for d in range(self.P):
            intervals = [self.interval[op] for op in self._device_ops(d, _COMPUTE) + self._recomputes_on(d)]
            if len(intervals) > 1:
                self.cp.add_no_overlap(intervals)
            if self.link[d] != d:
                continue
            for kind in (_OFF, _REL):
                intervals = [self.interval[op] for op in self._link_ops(d, kind)]
                if len(intervals) > 1:
                    self.cp.add_no_overlap(intervals)

    def _memory_scale(self) -> tuple[int, bool]:
        """Bytes per memory unit: the gcd of all sizes, coarser (rounding safely) if products could overflow."""
        memory = self.problem.memory
        sizes = [memory.budget, *memory.activation, *(k for k in memory.weight_activation if k)]
        sizes += [a - k for a, k in zip(memory.activation, memory.weight_activation) if a > k]
        if self.recomputed:  # the holds of a recomputed activation (semantics.holds)
            sizes += [hold.bytes for s in range(self.S) for hold in holds(self.problem, s, 0, recomputed=True)]
            sizes += [hold.bytes for s in range(self.S) for hold in holds(self.problem, s, 0, fused=True, recomputed=True)]
        scale = math.gcd(*sizes)
        exact = True
        while (memory.budget // scale) * self.horizon > _OVERFLOW:
            scale *= 2
            exact = False
        return scale, exact

    def _segment(self, name: str, start: tuple[Op, bool], end: tuple[Op, bool], present, when=None):
        """An interval from one op's start or end to another's (variables or constants).

        ``(op, True)`` is op's end, ``(op, False)`` its start. None when it lies before the
        window or its start is after it; an end after the window is the horizon. ``when`` says
        for the hint when the segment exists: always (None), or when its pair is (True) or is
        not (False) offloaded.
        """
        first = self.end_of(start[0]) if start[1] else self.start_of(start[0])
        last = self.end_of(end[0]) if end[1] else self.start_of(end[0])
        if first is None or present is False:
            return None
        if last is not None and end[1] and end[0].kind in (_OFF, _REL):
            last = last + self.grid.slack  # a transfer's release is kept late enough for any rounding (timegrid.py)
        if last is None:
            last, end = self.horizon, None
        if isinstance(first, int) and isinstance(last, int):
            if last <= self.scope.t0 or last <= first:
                return None
            size = last - first
        else:
            size = self.cp.new_int_var(0, self.horizon + self.grid.slack, f"len_{name}")
            self.sizes.append((size, start, end, (start[0].stage, start[0].microbatch), when))
        if present is True:
            return self.cp.new_interval_var(first, size, last, name)
        return self.cp.new_optional_interval_var(first, size, last, present, name)

    def _memory(self) -> None:
        """Per device a cumulative over every hold of semantics.holds, in both offload cases."""
        problem, memory = self.problem, self.problem.memory
        act = memory.activation
        scale, self.memory_exact = self._memory_scale()
        up = lambda b: -(-b // scale)  # noqa: E731  (demands round up, capacity down: safe)
        host_binds = problem.offload.enabled and any(
            self.m * sum(act[s] for s in problem.pipeline.stages_on(d)) > problem.offload.host_budget
            for d in range(self.P))
        for d in range(self.P):
            used = {Place.DEVICE: ([], []), Place.HOST: ([], [])}
            for s in problem.pipeline.stages_on(d):
                for i in range(self.m):
                    if self.start_of(Op(_F, s, i)) is None:
                        continue
                    x = self.presence((s, i))
                    never = True if x is False else (False if x is True else ~x)
                    cases = [(False, never, False), (True, x, False)]
                    if (s, i) in self.recomputed:
                        cases = [(False, self.kept[(s, i)], False), (True, x, False),
                                 (False, self.recomputed[(s, i)], True)]
                    for offloaded, present, again in cases:
                        if offloaded and not problem.offload.enabled:
                            continue
                        for n, hold in enumerate(holds(problem, s, i, offloaded=offloaded, recomputed=again)):
                            if hold.place is Place.HOST and not host_binds:
                                continue
                            segment = self._segment(f"{'oxr'[offloaded + 2 * again]}{n}_{s}:{i}",
                                                    (hold.begins.op, hold.begins.at is At.END),
                                                    (hold.ends.op, hold.ends.at is At.END), present,
                                                    "rc" if again else offloaded)
                            if segment is not None:
                                used[hold.place][0].append(segment)
                                used[hold.place][1].append(up(hold.bytes))
            for place, capacity in ((Place.DEVICE, memory.budget), (Place.HOST, problem.offload.host_budget)):
                intervals, demands = used[place]
                if intervals:
                    self.cp.add_cumulative(intervals, demands, capacity // scale)

    def _tightness(self) -> None:
        """Every op starts at the end of something it waits for (see the module docstring)."""
        for d in range(self.P):
            recomputes = self._recomputes_on(d)
            compute = self._device_ops(d, _COMPUTE) + recomputes
            floor = self.floor[d]
            for op in recomputes:  # right after its F or another compute op on the device
                reasons = list(self.data_preds(op))
                reasons += [(other, 0) for other in compute if other != op and self._may_end_at(other, op)]
                if floor is not None:
                    reasons.append((floor[0], 0))
                self._require_tight(op, reasons, False, self._present(op))
            for op in compute:
                if op.kind is _RC:
                    continue
                reasons = list(self.data_preds(op))
                pair = (op.stage, op.microbatch)
                if op.kind is _B and self.presence(pair) is not False:
                    reasons.append((Op(_REL, *pair), 0))
                if op.kind is _B and pair in self.recomputed:
                    reasons.append((Op(_RC, *pair), 0))
                reasons += [(other, 0) for other in compute if other != op and self._may_end_at(other, op)]
                if floor is not None:
                    reasons.append((floor[0], 0))
                zero = op.kind is _F and op.stage == 0 and floor is None
                self._require_tight(op, reasons, zero, True)
            for kind in (_OFF, _REL):
                channel = self._link_ops(d, kind)
                for op in channel:
                    reasons = [(other, 0) for other in compute if self._may_end_at(other, op)]
                    if floor is not None:
                        reasons.append((floor[0], 0))
                    reasons += self.data_preds(op)
                    reasons += [(other, 0) for other in channel if other != op and self._may_end_at(other, op)]
                    if (self.link[d], kind) in self.channel_floor:
                        reasons.append((self.channel_floor[(self.link[d], kind)][0], 0))
                    self._require_tight(op, reasons, False, self.presence((op.stage, op.microbatch)))
        for op, before in self.follow_preds.items():
            pair = (op.stage, op.microbatch)
            if op.kind in _COMPUTE:
                reasons = list(self.data_preds(op)) + before
                if op.kind is _B and self.presence(pair) is not False:
                    reasons.append((Op(_REL, *pair), 0))
            else:
                reasons = list(self.data_preds(op)) + before
            self._require_tight(op, reasons, False, True)

    def _may_end_at(self, before: Op, op: Op) -> bool:
        """Can ``before`` end exactly when ``op`` starts, given their windows and FIFO?"""
        if before.stage == op.stage and before.kind == op.kind and before.microbatch > op.microbatch:
            return False
        lo, hi = self.window[before]
        a, b = self.window[op]
        return lo + self.d(before) <= b and hi + self.d(before) >= a

    def _require_tight(self, op: Op, reasons: list[tuple[Op, int]], zero: bool, present) -> None:
        literals = []
        start = self.start[op]
        for pred, lag in dict.fromkeys(reasons):
            pred_end = self.end_of(pred)
            if pred_end is None:
                continue
            t = self.cp.new_bool_var(f"t{op}<{pred}")
            self.cp.add(start == pred_end + lag).only_enforce_if(t)
            if pred.kind in (_OFF, _REL, _RC):
                pred_present = self._present(pred)
                if pred_present is False:
                    self.cp.add_bool_or([~t])
                elif pred_present is not True:
                    self.cp.add_implication(t, pred_present)
            self.tight[(op, str(pred))] = t
            literals.append(t)
        if zero:
            t = self.cp.new_bool_var(f"t{op}<0")
            self.cp.add(start == 0).only_enforce_if(t)
            self.tight[(op, "0")] = t
            literals.append(t)
        if present is not True:
            literals.append(~present)
        self.cp.add_bool_or(literals)

    # ------------------------------------------------------------- shared host links

    def _shared_fifo(self) -> None:
        """A shared channel carries its transfers FIFO by ready time, ties to the lower device
        (semantics.py, "Shared host links"): each transfer's ``ready`` is the latest end of what it
        waits for in the simulator (its data, its issue point: the last compute op on its device
        that ended by its start, where decoding lists it, and its device's transfer before it on
        the channel), and of two transfers of different devices the one served first has the
        smaller (ready, device). With that the simulator reproduces the model's order and times.
        The full model only: a window's shared channels stay a relaxation (lns.py re-simulates)."""
        if self.scope.window or not self.problem.offload.enabled:
            return
        for group in self.problem.offload.link_groups:
            if len(group) < 2:
                continue
            for kind in (_OFF, _REL):
                ops = [op for d in group for op in self._device_ops(d, (kind,))]
                ready = {op: self._ready(op, kind) for op in ops}
                for x, a in enumerate(ops):
                    for b in ops[x + 1:]:
                        da, db = self.device_of[a.stage], self.device_of[b.stage]
                        if da == db:
                            continue
                        both = self._both(a, b)
                        if both is None:
                            continue
                        first = self.cp.new_bool_var(f"fifo{a}<{b}")  # a is served before b
                        self.cp.add(self.end_of(a) <= self.start[b]).only_enforce_if([first] + both)
                        self.cp.add(self.end_of(b) <= self.start[a]).only_enforce_if([~first] + both)
                        # the lower device wins a tie
                        if da < db:
                            self.cp.add(ready[a] <= ready[b]).only_enforce_if([first] + both)
                            self.cp.add(ready[b] < ready[a]).only_enforce_if([~first] + both)
                        else:
                            self.cp.add(ready[a] < ready[b]).only_enforce_if([first] + both)
                            self.cp.add(ready[b] <= ready[a]).only_enforce_if([~first] + both)
                        self.fifo.append((first, "before", a, b))

    def _both(self, a: Op, b: Op) -> list | None:
        """The presence literals of two transfers (None when one is absent for sure)."""
        out = []
        for op in (a, b):
            present = self._present(op)
            if present is False:
                return None
            if present is not True:
                out.append(present)
        return out

    def _ready(self, op: Op, kind: OpKind):
        """A variable equal to the simulator's ready time of a transfer on a shared channel."""
        d = self.device_of[op.stage]
        present = self._present(op)
        when = [] if present is True else [present]
        ready = self.cp.new_int_var(0, self.horizon, f"ready{op}")
        start = self.start[op]
        terms = [(self.end_of(self.data_preds(op)[0][0]), None)]
        for other in self._device_ops(d, _COMPUTE) + self._recomputes_on(d) + self._device_ops(d, (kind,)):
            if other == op:
                continue
            other_present = self._present(other)
            if other_present is False:
                continue
            by = self.cp.new_bool_var(f"by{other}<{op}")  # ended by op's start (listed before it)
            guard = [] if other_present is True else [other_present]
            if other_present is not True:
                self.cp.add_implication(by, other_present)
            self.cp.add(self.end_of(other) <= start).only_enforce_if([by] + when)
            if other.kind in _COMPUTE or other.kind is _RC:
                self.cp.add(self.end_of(other) > start).only_enforce_if([~by] + guard + when)
            else:  # one channel: one of the two runs first
                self.cp.add(self.end_of(op) <= self.start[other]).only_enforce_if([~by] + guard + when)
            terms.append((self.end_of(other), by))
            self.fifo.append((by, "ended", other, op))
        tight = [] if present is True else [~present]
        for n, (end, by) in enumerate(terms):
            self.cp.add(ready >= end).only_enforce_if(([by] if by is not None else []) + when)
            t = self.cp.new_bool_var(f"rt{op}#{n}")
            self.cp.add(ready == end).only_enforce_if(t)
            if by is not None:
                self.cp.add_implication(t, by)
            tight.append(t)
            self.fifo.append((t, "ready-is", op, n, end))
        self.cp.add_bool_or(tight)
        self.fifo.append((ready, "ready", op, terms))
        return ready

    # ------------------------------------------------------------- objective

    def _objective(self, lower: int) -> None:
        if not self.scope.window:
            self.makespan = self.cp.new_int_var(min(lower, self.horizon), self.horizon, "makespan")
            for op in self.start:
                if op.kind is _W and op.microbatch == self.m - 1:  # FIFO: every other op ends before
                    self.cp.add(self.makespan >= self.start[op] + self.d(op))
            self.cp.minimize(self.makespan)
            return
        # A window: each device's end of the window, and the latest device end plus the
        # compute still to come after the window; the latter dominates, the sum breaks ties.
        self.makespan = self.cp.new_int_var(0, self.horizon + max(self.scope.rest), "tail")
        for d in range(self.P):
            ops = [op for op in self.start if self.device_of[op.stage] == d]
            floor = self.floor[d][1] if self.floor[d] else 0
            end = self.cp.new_int_var(floor, self.horizon, f"end{d}")
            for op in ops:
                present = True if op.kind in _COMPUTE else self.presence((op.stage, op.microbatch))
                constraint = self.cp.add(end >= self.start[op] + self.d(op))
                if present is not True:
                    constraint.only_enforce_if(present)
            self.cp.add(self.makespan >= end + self.scope.rest[d])
            self.device_end.append(end)
        self.cp.minimize((self.P + 1) * self.makespan + sum(self.device_end))

    # ------------------------------------------------------------- hints

    def hint(self, starts: Mapping[Op, int], offloaded: frozenset[tuple[int, int]]) -> None:
        """A complete hint: starts, offload literals, tightness literals and objective terms."""
        for op, var in self.start.items():
            self.cp.add_hint(var, starts.get(op, self.window[op][0]))
        for pair, x in self.offloaded.items():
            self.cp.add_hint(x, pair in offloaded)
        recomputed = {(op.stage, op.microbatch) for op in starts if op.kind is _RC}
        for pair, r in self.recomputed.items():
            self.cp.add_hint(r, pair in recomputed)
            self.cp.add_hint(self.kept[pair], pair not in recomputed and pair not in offloaded)
        ends = {op: t + self.d(op) for op, t in starts.items()}
        ends.update({op: t + self.d(op) for op, t in self.scope.fixed.items()})
        lags = {}
        for (op, reason), literal in self.tight.items():
            value = False
            if op in starts:
                if reason == "0":
                    value = starts[op] == 0
                else:
                    pred = parse_op(reason)
                    if op not in lags:
                        lags[op] = dict(self.data_preds(op))
                    value = pred in ends and ends[pred] + lags[op].get(pred, 0) == starts[op]
            self.cp.add_hint(literal, value)
        begins = dict(self.scope.fixed)
        begins.update(starts)
        for size, (first, at_end), last, pair, when in self.sizes:
            value = 0
            if when == "rc":
                matches = pair in recomputed
            elif when is False:
                matches = pair not in offloaded and pair not in recomputed
            else:
                matches = when is None or pair in offloaded
            if matches:
                a = ends.get(first) if at_end else begins.get(first)
                z = self.horizon if last is None else (ends.get(last[0]) if last[1] else begins.get(last[0]))
                if z is not None and last is not None and last[1] and last[0].kind in (_OFF, _REL):
                    z += self.grid.slack
                value = z - a if a is not None and z is not None else 0
            self.cp.add_hint(size, max(0, value))
        self._hint_fifo(starts, ends)
        if not self.scope.window:
            self.cp.add_hint(self.makespan, max(ends[op] for op in self.start if op in ends and op.kind is _W))
            return
        tail = 0
        for d, end in enumerate(self.device_end):
            value = max([ends[op] for op in self.start if op in ends and self.device_of[op.stage] == d]
                        + [self.floor[d][1] if self.floor[d] else 0])
            self.cp.add_hint(end, value)
            tail = max(tail, value + self.scope.rest[d])
        self.cp.add_hint(self.makespan, tail)

    def _hint_fifo(self, starts: Mapping[Op, int], ends: Mapping[Op, int]) -> None:
        """The shared-channel literals and ready times of the hinted schedule."""
        if not self.fifo:
            return
        ready: dict[Op, int] = {}
        for entry in self.fifo:
            if entry[1] == "ready":
                op, terms = entry[2], entry[3]
                if op not in starts:
                    ready[op] = 0
                    continue
                values = [ends[self.data_preds(op)[0][0]]]
                values += [ends[o] for o in self._ready_others(op) if o in ends and ends[o] <= starts[op]]
                ready[op] = max(values)
        for entry in self.fifo:
            var, what = entry[0], entry[1]
            if what == "ready":
                self.cp.add_hint(var, ready[entry[2]])
            elif what == "before":
                a, b = entry[2], entry[3]
                self.cp.add_hint(var, a in starts and b in starts and starts[a] < starts[b])
            elif what == "ended":
                other, op = entry[2], entry[3]
                self.cp.add_hint(var, other in ends and op in starts and ends[other] <= starts[op])
        chosen: set = set()  # one equality literal per ready: the first term that attains it
        for entry in self.fifo:
            if entry[1] != "ready-is":
                continue
            var, op, n = entry[0], entry[2], entry[3]
            value = False
            if op in starts and op not in chosen:
                terms = self._ready_terms(op)
                term, by = terms[n]
                if by is None or (by in ends and ends[by] <= starts[op]):
                    end = ends[self.data_preds(op)[0][0]] if by is None else ends[by]
                    value = end == ready[op]
            if value:
                chosen.add(op)
            self.cp.add_hint(var, value)

    def _ready_others(self, op: Op) -> list[Op]:
        d = self.device_of[op.stage]
        return [o for o in self._device_ops(d, _COMPUTE) + self._recomputes_on(d) + self._device_ops(d, (op.kind,))
                if o != op]

    def _ready_terms(self, op: Op) -> list[tuple[None, Op | None]]:
        """The terms of ``_ready`` in its order: the data wait, then each other op it may follow."""
        return [(None, None)] + [(None, o) for o in self._ready_others(op) if self._present(o) is not False]

    # ------------------------------------------------------------- read back

    def values(self, solver: cp_model.CpSolver) -> dict[Op, int]:
        """Start (units) of every op the solution keeps: compute ops and present transfers."""
        out = {}
        for op, var in self.start.items():
            if op.kind not in _COMPUTE:
                present = self._present(op)
                if present is not True and not solver.boolean_value(present):
                    continue
            out[op] = solver.value(var)
        return out


# --------------------------------------------------------------------------- values of schedules


def split_backwards(schedule: Schedule) -> Schedule:
    """The schedule in the model's form: every fused BW becomes B then W, in place."""
    rows = []
    for ops in schedule.devices:
        row: list[Op] = []
        for op in ops:
            if op.kind is _BW:
                row += [Op(_B, op.stage, op.microbatch), Op(_W, op.stage, op.microbatch)]
            else:
                row.append(op)
        rows.append(row)
    return Schedule.of(schedule.name, rows)


def model_values(problem: Problem, grid: Grid, schedule: Schedule) -> tuple[dict[Op, int], frozenset]:
    """A schedule in model terms: its starts in units, timed by the simulator's rule with the
    model's (rounded up) durations, so that the values satisfy the model's waits; its offloads."""
    starts = {op: int(t) for op, t in start_times(problem, split_backwards(schedule), grid.up).items()}
    return starts, schedule.offloaded


# --------------------------------------------------------------------------- solve


class _Progress(cp_model.CpSolverSolutionCallback):
    def __init__(self, grid: Grid, began: float, on_progress, floor_ms: float, proves: bool):
        super().__init__()
        self.grid, self.began, self.on_progress = grid, began, on_progress
        self.floor, self.proves = floor_ms, proves

    def on_solution_callback(self) -> None:
        if self.on_progress is None:
            return
        bound = self.floor
        if self.proves:
            bound = max(bound, self.grid.ms(self.best_objective_bound))
        self.on_progress(Progress(time.monotonic() - self.began, self.grid.ms(self.objective_value), bound,
                                  "cp-sat: new incumbent"))


def solve_model(model: Model, *, time_limit_s: float, seed: int, workers: int | None,
                callback: cp_model.CpSolverSolutionCallback | None = None,
                light_presolve: bool = False, deterministic_s: float | None = None) -> tuple[cp_model.CpSolver, int]:
    """Solve; ``light_presolve`` skips probing, which on window models costs seconds and buys nothing.

    ``deterministic_s`` also stops the search after that much of CP-SAT's deterministic time:
    with one worker and a fixed seed the answer is then the same on any machine, loaded or not.
    """
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, time_limit_s)
    if deterministic_s is not None:
        solver.parameters.max_deterministic_time = deterministic_s
    solver.parameters.num_workers = workers or os.cpu_count() or 1
    solver.parameters.random_seed = seed
    if light_presolve:
        solver.parameters.cp_model_probing_level = 0
    code = solver.solve(model.cp, callback)
    if code == cp_model.MODEL_INVALID:
        raise InternalError(f"the CP-SAT model is invalid ({model.cp.validate()})")
    return solver, code


def solve_cpsat(problem: Problem, *, time_limit_s: float = 60.0, hint: Schedule | None = None,
                seed: int = 0, workers: int | None = None, resolution_ms: float | None = None,
                on_progress: Callable[[Progress], None] | None = None) -> SolveResult:
    """Minimise the makespan over the whole problem; returns what the simulator says of the result.

    A fitting hint (the best fitting heuristic, usually) is given to CP-SAT complete and bounds
    the horizon, so the search only looks at schedules at least as fast.
    """
    began = time.monotonic()
    # data
    grid = choose_grid(problem, resolution_ms)
    analytic = makespan_lower_bound(problem).value
    hinted = simulate(problem, hint) if hint is not None else None
    values = model_values(problem, grid, hint) if hinted is not None and hinted.fits else None
    horizon = _safe_horizon(problem, grid)
    if values is not None:
        horizon = max(t + grid.up(duration_ms(problem, op)) for op, t in values[0].items()) + 1
    lower = grid.up(analytic) if grid.exact else 0
    # variables, constraints, objective
    model = Model(problem, grid, full_scope(problem), horizon, lower)
    if values is not None:
        model.hint(*values)
    proves = grid.exact and model.memory_exact
    # solve
    callback = _Progress(grid, began, on_progress, analytic, proves)
    # Probing pays for proofs; a rounded grid proves nothing, and its long horizons make probing
    # take seconds before the first solution (even a complete hint's).
    solver, code = solve_model(model, time_limit_s=time_limit_s - (time.monotonic() - began), seed=seed,
                               workers=workers, callback=callback, light_presolve=not proves)
    elapsed = time.monotonic() - began
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        proven_empty = code == cp_model.INFEASIBLE and hinted is None and proves
        status = SolveStatus.INFEASIBLE if proven_empty else SolveStatus.NO_IMPROVEMENT
        return SolveResult("cpsat", status, None, None, None, analytic, elapsed, grid.resolution_ms)
    # read back
    starts = {op: grid.ms(t) for op, t in model.values(solver).items()}
    schedule = schedule_from_starts(problem, "cpsat", starts, lambda op: grid.ms(model.d(op)))
    timeline = simulate(problem, schedule)
    objective = grid.ms(solver.objective_value)
    # check
    if problem.offload.enabled and problem.offload.link_groups and not grid.exact:
        # The model orders a shared channel FIFO by ready time (Model._shared_fifo) in its own
        # units; on a rounded grid two ready times the simulator tells apart may round together,
        # so there the simulator is the judge: its bound stands, its times are re-simulated.
        if not timeline.fits:
            return SolveResult("cpsat", SolveStatus.NO_IMPROVEMENT, None, None, None, analytic, elapsed,
                               grid.resolution_ms)
        objective = timeline.makespan
        code = cp_model.FEASIBLE if timeline.makespan > grid.ms(solver.best_objective_bound) + TOLERANCE_MS else code
    else:
        check_solution(problem, grid, timeline, objective)
    bound = max(analytic, grid.ms(solver.best_objective_bound)) if proves else analytic
    status = SolveStatus.OPTIMAL if code == cp_model.OPTIMAL and proves else SolveStatus.FEASIBLE
    return SolveResult("cpsat", status, schedule, timeline, objective, min(bound, timeline.makespan),
                       elapsed, grid.resolution_ms)


def check_solution(problem: Problem, grid: Grid, timeline: Timeline, objective_ms: float) -> None:
    """The simulator must agree with the model (timegrid.py): the same makespan on an exact grid,
    no more than the objective on a rounded one, and within both budgets."""
    tolerance = TOLERANCE_MS * max(1.0, objective_ms)
    over = timeline.makespan - objective_ms
    if over > tolerance or (grid.exact and -over > tolerance):
        raise InternalError(f"the CP-SAT schedule re-simulates to {timeline.makespan:.9f} ms, not the "
                            f"model's {objective_ms:.9f} ms ({grid.describe()})")
    if not timeline.fits:
        raise InternalError(f"the CP-SAT schedule re-simulates over the memory budget (peak {timeline.peak} "
                            f"bytes, budget {problem.memory.budget}; host peak {max(timeline.host_peak)}); "
                            f"{grid.describe()}")


def _safe_horizon(problem: Problem, grid: Grid) -> int:
    """Everything one after another, in the model's units: no schedule needs longer."""
    kinds = _COMPUTE + ((_OFF, _REL) if problem.offload.enabled else ()) + ((_RC,) if problem.recompute.enabled else ())
    total = sum(grid.up(duration_ms(problem, Op(kind, s, 0))) for kind in kinds for s in range(problem.stages))
    return problem.microbatches * (total + 2 * problem.stages * grid.up(problem.costs.p2p)) + 1
