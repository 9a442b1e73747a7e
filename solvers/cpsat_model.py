"""The CP-SAT model of a scope: the fastest schedule that fits, as the simulator times it.

Built in named steps, as the OR-Tools samples read: data and variables (cpsat_vars.py) ->
constraints (precedence, list order after a window, no-overlap per channel, here; memory,
cpsat_memory.py; tightness, cpsat_tight.py; shared links, cpsat_links.py) -> objective. ``hint``
reads a schedule in, ``values`` a solution out; cpsat.py solves and checks. Handles are kept by
name: ``start[Op]``, ``interval[Op]``, ``offloaded[(s, i)]``, ``tight[Tight(op, after)]``.

The model, in integer units of a ``Grid`` (timegrid.py):

- every F, B, W of every (stage, microbatch) is an interval; the backward is always split (a
  fused BW is the case of W right after B); data dependencies with p2p lags; one no-overlap
  per device;
- per (stage, microbatch) a literal ``offloaded``; when true an OFFLOAD interval after F and a
  RELOAD after it that ends before B; one no-overlap per D2H and per H2D channel; with
  recompute (issue 14) a literal ``recomputed`` and a RECOMPUTE interval after F, before B;
- memory as a cumulative per device over the holds of semantics.holds, one interval each,
  for each fate of the activation (the literals pick one): from F's start to B's end
  (activation - weight part) and to W's end (weight part); offloaded, from F's start to the
  offload's end and from the reload's start to B's and W's ends. Host memory likewise when
  ``host_budget`` could bind;
- ASAP consistency: every op starts at the end of something it waits for (cpsat_tight.py), so
  the simulator reproduces the model's start times exactly;
- shared host links (``[offload] link_groups``): one no-overlap per group's D2H and H2D channel,
  served FIFO by ready time as the simulator serves it (cpsat_links.py), so on an exact grid the
  simulator reproduces the model's times there too; a window model leaves the order free;
- symmetry breaking: every stage runs its F, its B and its W in microbatch order (FIFO); a
  window leaves unordered the chains its schedule runs out of order (``Scope.unordered``).
  Without offload this loses nothing (memory depends only on how many activations of a stage
  are live, so labels can be exchanged); with offload it is the usual restriction, and
  "optimal" means optimal among microbatch-ordered schedules.

What an op waits for, how long it runs and what it holds are core/semantics.py's; the model
only rounds durations up to its grid (down on a floor grid, for bounds: floor_relax.py).

The same model decides a window of a schedule for lns.py: a ``Scope`` names the ops it places;
ops before the window keep their times, the ops of the next few windows keep their list order
but are re-timed, ops after those are left out (what they free is held to the horizon), and
the objective becomes each device's end plus the compute it still has to do.
"""

from __future__ import annotations

from typing import Mapping

from ortools.sat.python import cp_model

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import start_times

from .cpsat_links import add_shared_fifo, hint_shared_fifo
from .cpsat_memory import add_memory, hint_memory
from .cpsat_tight import Reasons, add_tightness, hint_tightness
from .cpsat_vars import COMPUTE, REL, TRANSFERS, B, Pair, Scope, Variables, W, full_scope
from .timegrid import Grid

__all__ = ["Model", "Scope", "full_scope", "model_values"]


class Model(Variables):
    """Variables, constraints and objective of one scope; ``horizon`` bounds every end (units)."""

    def __init__(self, problem: Problem, grid: Grid, scope: Scope, horizon: int, lower: int = 0):
        super().__init__(problem, grid, scope, horizon)  # data, variables
        # constraints, in the order CP-SAT has always been given them (it steers its search)
        self._precedence()
        self._chains()
        self.follow_preds = self._follow_order()
        self._no_overlap()
        memory = add_memory(self)
        self.memory_exact, self.segments = memory.exact, memory.segments
        self.tight = add_tightness(self, self.follow_preds)
        # on a floor grid (a relaxation, floor_relax.py) ready times round together: no ready order
        self.fifo = [] if grid.floor else add_shared_fifo(self)
        # objective
        self.device_end: list[cp_model.IntVar] = []
        self._objective(lower)

    # ------------------------------------------------------------- constraints

    def _precedence(self) -> None:
        """Data dependencies with their lags, FIFO per chain, and a transfer between its F and B."""
        for op, var in self.start.items():
            if op.kind is OpKind.RECOMPUTE:  # cpsat_vars.Variables._recompute_variables
                continue
            if op.kind in COMPUTE:
                for pred, lag in self.data_preds(op):
                    self.cp.add(var >= self.end_of(pred) + lag)
                if op.microbatch > 0 and self.in_order(op):  # FIFO
                    earlier = self.end_of(Op(op.kind, op.stage, op.microbatch - 1))
                    if earlier is not None:
                        self.cp.add(var >= earlier)
                continue
            present = self.presence((op.stage, op.microbatch))
            pred_end = self.end_of(self.transfer_source(op))
            rules = [var >= pred_end] if pred_end is not None else []
            b = self.start_of(Op(B, op.stage, op.microbatch))
            if op.kind is REL and b is not None:
                rules.append(var + self.d(op) <= b)
            for rule in rules:
                constraint = self.cp.add(rule)
                if present is not True:
                    constraint.only_enforce_if(present)

    def _chains(self) -> None:
        """Window ops held in their list order (a neighbourhood that frees only some microbatches):
        each starts after the one before it ends; the free ops may go anywhere between them."""
        for chain in self.scope.chains:
            for before, after in zip(chain, chain[1:]):
                self.cp.add(self.start[after] >= self.end_of(before))

    def _follow_order(self) -> dict[Op, Reasons]:
        """Ops after the window keep their list order: each waits for its device predecessor, its
        issue point and its channel predecessor; the first ones wait for every window op there.
        Returns what each waited for, which tightness needs too."""
        follow_preds: dict[Op, Reasons] = {}
        for d, ops in enumerate(self.scope.follow):
            floor = [self.floor[d].op] if self.floor[d] is not None else []
            last_compute: list[Op] = self.device_ops(d, COMPUTE) + floor
            last_channel = {kind: self.device_ops(d, (kind,)) + self._channel_floor_op(d, kind) for kind in TRANSFERS}
            for op in ops:
                before = list(last_compute)
                if op.kind not in COMPUTE:
                    before += last_channel[op.kind]
                for pred in before:
                    present = True if pred.kind in COMPUTE else self.presence((pred.stage, pred.microbatch))
                    if present is False:
                        continue
                    constraint = self.cp.add(self.start[op] >= self.end_of(pred))
                    if present is not True:
                        constraint.only_enforce_if(present)
                follow_preds[op] = [(pred, 0) for pred in before]
                if op.kind in COMPUTE:
                    last_compute = [op]
                else:
                    last_channel[op.kind] = [op]
        return follow_preds

    def _channel_floor_op(self, device: int, kind: OpKind) -> list[Op]:
        floor = self.channel_floor.get((self.link[device], kind))
        return [floor.op] if floor is not None else []

    def _no_overlap(self) -> None:
        """One compute op at a time per device; one transfer at a time per host-link channel (a
        link group's devices share one D2H and one H2D channel)."""
        for d in range(self.P):
            intervals = [self.interval[op] for op in self.device_ops(d, COMPUTE) + self.recomputes_on(d)]
            if len(intervals) > 1:
                self.cp.add_no_overlap(intervals)
            if self.link[d] != d:
                continue
            for kind in TRANSFERS:
                intervals = [self.interval[op] for op in self.link_ops(d, kind)]
                if len(intervals) > 1:
                    self.cp.add_no_overlap(intervals)

    # ------------------------------------------------------------- objective

    def _objective(self, lower: int) -> None:
        if not self.scope.window:
            self.makespan = self.cp.new_int_var(min(lower, self.horizon), self.horizon, "makespan")
            for op in self.start:
                if op.kind is W and op.microbatch == self.m - 1:  # FIFO: every other op ends before
                    self.cp.add(self.makespan >= self.start[op] + self.d(op))
            self.cp.minimize(self.makespan)
            return
        # A window: each device's end of the window, and the latest device end plus the
        # compute still to come after the window; the latter dominates, the sum breaks ties.
        self.makespan = self.cp.new_int_var(0, self.horizon + max(self.scope.rest), "tail")
        for d in range(self.P):
            ops = [op for op in self.start if self.device_of[op.stage] == d]
            end = self.cp.new_int_var(self.floor_end(d), self.horizon, f"end{d}")
            for op in ops:
                present = True if op.kind in COMPUTE else self.presence((op.stage, op.microbatch))
                constraint = self.cp.add(end >= self.start[op] + self.d(op))
                if present is not True:
                    constraint.only_enforce_if(present)
            self.cp.add(self.makespan >= end + self.scope.rest[d])
            self.device_end.append(end)
        self.cp.minimize((self.P + 1) * self.makespan + sum(self.device_end))

    def require_both(self) -> None:
        """Only schedules that offload one pair and recompute another: compile searches the mixes
        on their own once each pure strategy is solved, as from a pure answer CP-SAT rarely
        leaves it (issue 14). The model's bound is then a mix's only."""
        self.cp.add(sum(self.offloaded.values()) >= 1)
        self.cp.add(sum(self.recomputed.values()) >= 1)

    # ------------------------------------------------------------- hints

    def hint(self, starts: Mapping[Op, int], offloaded: frozenset[Pair]) -> None:
        """A complete hint: starts, fate literals, tightness literals, memory lengths, shared-link
        order and objective terms."""
        for op, var in self.start.items():
            self.cp.add_hint(var, starts.get(op, self.window[op].earliest))
        for pair, x in self.offloaded.items():
            self.cp.add_hint(x, pair in offloaded)
        recomputed = {(op.stage, op.microbatch) for op in starts if op.kind is OpKind.RECOMPUTE}
        for pair, r in self.recomputed.items():
            self.cp.add_hint(r, pair in recomputed)
            self.cp.add_hint(self.kept[pair], pair not in recomputed and pair not in offloaded)
        ends = {op: t + self.d(op) for op, t in starts.items()}
        ends.update({op: t + self.d(op) for op, t in self.scope.fixed.items()})
        hint_tightness(self, self.tight, starts, ends)
        begins = dict(self.scope.fixed)
        begins.update(starts)
        hint_memory(self, self.segments, begins, ends, offloaded, recomputed)
        hint_shared_fifo(self, self.fifo, starts, ends)
        self._hint_objective(ends)

    def _hint_objective(self, ends: Mapping[Op, int]) -> None:
        if not self.scope.window:
            self.cp.add_hint(self.makespan, max(ends[op] for op in self.start if op in ends and op.kind is W))
            return
        tail = 0
        for d, end in enumerate(self.device_end):
            value = max([ends[op] for op in self.start if op in ends and self.device_of[op.stage] == d]
                        + [self.floor_end(d)])
            self.cp.add_hint(end, value)
            tail = max(tail, value + self.scope.rest[d])
        self.cp.add_hint(self.makespan, tail)

    # ------------------------------------------------------------- read back

    def values(self, solver: cp_model.CpSolver) -> dict[Op, int]:
        """Start (units) of every op the solution keeps: compute ops and present transfers."""
        out = {}
        for op, var in self.start.items():
            if op.kind not in COMPUTE:
                present = self.present(op)
                if present is not True and not solver.boolean_value(present):
                    continue
            out[op] = solver.value(var)
        return out


# --------------------------------------------------------------------------- schedules in model terms


def model_values(problem: Problem, grid: Grid, schedule: Schedule) -> tuple[dict[Op, int], frozenset[Pair]]:
    """A schedule in model terms: its starts in units, timed by the simulator's rule with the
    model's (rounded up) durations, so that the values satisfy the model's waits; its offloads."""
    starts = {op: int(t) for op, t in start_times(problem, schedule.with_split_backwards(), grid.length).items()}
    return starts, schedule.offloaded
