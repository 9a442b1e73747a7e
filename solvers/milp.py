"""The MILP schedule solver: PuLP with HiGHS or CBC, judged by the simulator.

The simulator starts every op as soon as the lists allow and never waits for memory, so a
solution that fits only because an op waited is no schedule. The solver works in stages:

1. With offload enabled, first without it (30% of the time): that model is small, and exact
   (without transfers, memory depends only on each device's order, which the simulator keeps).
   If it reaches the memory-free lower bound it is optimal with offload too; else it becomes
   the warm start and sets the horizon for what follows.
2. The relaxed model (milp_model.py; ops may wait), at most half the time left when stage 3
   may follow. Its bound holds for every schedule. Its solution is decoded and re-simulated;
   if that fits and is proven optimal, done.
3. Otherwise the exact model, which adds the simulator's timing (every op starts when the last
   thing it waits for ends), warm-started from the best fitting schedule so far. Durations
   rounded up to the resolution can still flip a tie between a transfer and an allocation:
   then the memory claims the simulated timing breaks at the overflowing allocations are
   forbidden and the model is solved again (each round forbids at least one more claim, so
   the loop ends); bounds only count from models no claim was forbidden in.

Times are whole units of the shared grid (timegrid.py) with durations rounded up: objectives
are exact for those durations and the simulated makespan (exact durations) is never above the
model's; the reported lower bound is the model's shrunk by the largest rounding, so it holds
for the exact durations. On a rounded grid the exact model keeps a margin around every memory
claim, so its bound is no proof: only the relaxed model's counts then.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from optpipe.core.errors import InternalError, SolverError
from optpipe.core.problem import Problem
from optpipe.core.schedule import TRANSFER_KINDS, Op, OpKind, Schedule
from optpipe.core.semantics import TOLERANCE_MS, At, Place, effects, instant
from optpipe.core.simulate import Timeline, simulate

from .compare import best_fitting, compare
from .decode import schedule_from_starts
from .result import Progress, SolveResult, SolveStatus

__all__ = ["solve_milp"]

_BACKENDS = ("highs", "cbc")
_MIN_SOLVE_S = 0.05  # below this much time left, another solve cannot help
_PLAIN_SHARE = 0.3  # of the time limit, for the stage without offload
_RELAXED_SHARE = 0.5  # of the time left, for the relaxed model when the exact one may follow
_MAX_ROUNDS = 50
_TOLERANCE = 1e-5  # in model units (time units; memory in largest activations)


def solve_milp(problem: Problem, *, backend: str = "highs", time_limit_s: float = 60.0,
               hint: Schedule | None = None, seed: int = 0,
               on_progress: Callable[[Progress], None] | None = None,
               threads: int = 1, split_backward: bool = True) -> SolveResult:
    """The makespan-optimal schedule for ``problem`` within ``time_limit_s`` (wall clock, all stages).

    ``hint`` warm-starts the solver and is what comes back when nothing better is found in time
    (by default the best fitting registered heuristic). ``split_backward`` schedules B and W as
    separate ops (never slower, never more memory); False schedules fused BW ops.
    """
    if backend not in _BACKENDS:
        raise SolverError(f"unknown MILP backend {backend!r}; expected one of {', '.join(_BACKENDS)} "
                          f"(HiGHS through highspy, or the CBC binary bundled with PuLP)")
    if hint is not None and hint.recomputed:  # the MILP decides keep or offload only (issue 14: CP-SAT recomputes)
        hint = None
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) \
            or not math.isfinite(time_limit_s) or time_limit_s <= 0:
        raise SolverError(f"time limit: expected a positive number of seconds like 60, got {time_limit_s!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SolverError(f"threads: expected a positive integer like 1, got {threads!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SolverError(f"seed: expected a non-negative integer like 0, got {seed!r}")
    try:
        # lazy: PuLP and highspy load here, when a MILP is solved, not when milp is imported
        from . import milp_model  # noqa: F401
        from . import milp_backend  # noqa: F401
    except ImportError as error:
        raise SolverError(f"the MILP solver needs PuLP and highspy ({error}); install them with "
                          f"pip install pulp highspy") from None
    began = time.perf_counter()
    if hint is None:
        hint = _default_hint(problem)
    search = _Search(problem, backend, began + time_limit_s, seed, threads, split_backward, began, on_progress)
    return search.run(hint)


class _Search:
    """One call of solve_milp: the stages, the best schedule so far and the proven bound."""

    def __init__(self, problem, backend, deadline, seed, threads, split, began, on_progress, label=""):
        from . import milp_model as mm  # lazy: imports PuLP

        self.mm = mm
        self.problem = problem
        self.backend = backend
        self.deadline = deadline
        self.seed = seed
        self.threads = threads
        self.split = split
        self.began = began
        self.on_progress = on_progress
        self.label = label
        self.solver = f"milp-{backend}"
        self.data = mm.prepare(problem, mm.choose_milp_grid(problem), split=split)
        self.unit = self.data.grid.resolution_ms
        self.bound: int | None = None  # units, proven for every schedule

    # ----------------------------------------------------------------- reporting

    def report(self, incumbent_ms: float | None, message: str, bound_units: float | None = None) -> None:
        if self.on_progress is None:
            return
        bound = self.bound if bound_units is None else bound_units
        self.on_progress(Progress(time.perf_counter() - self.began, incumbent_ms,
                                  None if bound is None else bound * self.unit, self.label + message))

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    # ----------------------------------------------------------------- stages

    def run(self, hint: Schedule | None) -> SolveResult:
        problem = self.problem
        hint_timeline = simulate(problem, hint) if hint is not None else None
        floor = self.mm.lower_bound(self.data)  # memory-free: no schedule beats it
        if problem.offload.enabled:
            plain = self.without_offload(hint)
            if plain is not None and plain.timeline.fits:
                timeline = simulate(problem, plain.schedule)
                if timeline.makespan <= floor * self.unit + TOLERANCE_MS * max(1.0, timeline.makespan):
                    self.bound = floor
                    return self.result(SolveStatus.OPTIMAL, plain.schedule, timeline, plain.objective_ms)
                if hint_timeline is None or not hint_timeline.fits or timeline.makespan < hint_timeline.makespan:
                    hint, hint_timeline = plain.schedule, timeline
        outcome = self.rounds(hint, hint_timeline)
        return self.finish(outcome, hint, hint_timeline, floor)

    def without_offload(self, hint: Schedule | None) -> SolveResult | None:
        """Stage 1: the same problem without offload, in a share of the time."""
        plain_hint = hint if hint is not None and not any(op.kind in TRANSFER_KINDS for _, op in hint.ops()) else None
        share = min(self.left(), (self.deadline - self.began) * _PLAIN_SHARE)
        if share < _MIN_SOLVE_S:
            return None
        stage = _Search(self.problem.without_offload(), self.backend, time.perf_counter() + share, self.seed,
                        self.threads, self.split, self.began, self.on_progress, label="without offload: ")
        result = stage.run(plain_hint)
        return result if result.schedule is not None else None

    def rounds(self, hint: Schedule | None, hint_timeline: Timeline | None):
        """Stages 2 and 3: ("infeasible", None), ("found", (schedule, timeline, objective_ms)) or None."""
        from .milp_backend import run_backend  # lazy: imports PuLP

        problem, mm = self.problem, self.mm
        if self.left() < _MIN_SOLVE_S:
            self.report(None, "time limit reached before the first solve")
            return None
        exact = not problem.offload.enabled  # without transfers the relaxation is exact
        model, start = self.model_with_start(hint, hint_timeline, asap=False)
        clean = True  # no claim forbidden yet: the model's bound holds for every schedule
        best = None
        for round_number in range(_MAX_ROUNDS):
            left = self.left()
            if left < _MIN_SOLVE_S:
                self.report(None, "time limit reached")
                break
            trusted = clean

            def on_incumbent(objective: float, bound: float | None, trusted=trusted) -> None:
                shown = math.ceil(bound - 1e-6) if trusted and bound is not None else self.bound
                self.report(round(objective) * self.unit, f"{self.backend}: new incumbent", shown)

            limit = left if exact else left * _RELAXED_SHARE
            run = run_backend(model.lp, self.backend, time_limit_s=limit, seed=self.seed, threads=self.threads,
                              start=start, on_incumbent=on_incumbent if self.backend == "highs" else None)
            if clean and run.bound is not None:
                proven = math.ceil(run.bound - 1e-6)  # every makespan is a whole number of units
                self.bound = proven if self.bound is None else max(self.bound, proven)
            if clean and run.status == "infeasible":
                self.report(None, f"round {round_number}: {self.backend} proved that no schedule fits")
                return "infeasible", None
            timeline = None
            if run.values is not None:
                broken = _violation(model.lp, lambda var: run.values[var.name])
                if broken > _TOLERANCE:
                    raise InternalError(f"{self.backend} returned a solution that breaks its model (by {broken:g}); "
                                        f"try the other backend")
                schedule = _decode(model, run.values, self.solver)
                timeline = simulate(problem, schedule)
                objective_ms = round(run.objective) * self.unit
                if not model.tight:  # relaxed: its ops may wait where the simulator's would not
                    objective_ms = self.model_makespan(schedule) * self.unit
                verdict = "fits" if timeline.fits else "breaks the budget"
                self.report(timeline.makespan if timeline.fits else None,
                            f"round {round_number}: {run.status} at {objective_ms:g} ms, simulated "
                            f"{timeline.makespan:g} ms, {verdict}")
                if timeline.fits and (best is None or timeline.makespan < best[1].makespan):
                    best = (schedule, timeline, objective_ms)
                if timeline.fits and (run.status == "optimal" or exact):
                    break  # proven, or the exact model's time is up
            else:
                self.report(None, f"round {round_number}: {self.backend} found no schedule ({run.status})")
                if exact:
                    break
            if not exact:
                # The relaxed solution waited for memory, or time ran out: the exact model takes over,
                # warm-started from the best fitting schedule so far.
                exact = True
                if best is not None and (hint_timeline is None or not hint_timeline.fits
                                         or best[1].makespan < hint_timeline.makespan):
                    hint, hint_timeline = best[0], best[1]
                floor = self.bound if self.bound is not None else 0
                model, start = self.model_with_start(hint, hint_timeline, asap=True, floor=floor)
                clean = clean and model.margin == 0  # a margin forbids some schedules: no proof
                self.report(None, "solving the exact (as-soon-as-possible) model: the simulator never lets an op "
                                  "wait for memory")
                continue
            forbidden = _repair(model, run.values, timeline)
            clean = False
            self.report(None, f"round {round_number}: the rounded durations moved an allocation; "
                              f"{forbidden} memory claims forbidden")
            if forbidden == 0:
                break
            start = _valid_start(mm, model, hint, hint_timeline)
        return ("found", best) if best is not None else None

    def model_makespan(self, schedule: Schedule) -> int:
        """The schedule's makespan in the model's units, every op as soon as it may (the simulator's
        rule with the model's durations): what the exact model says of it."""
        times = self.mm.unit_times(self.data, schedule)
        return max(t + self.data.duration[op] for op, t in times.items())

    def model_with_start(self, hint, hint_timeline, *, asap: bool, floor: int = 0):
        """The model, searching makespans up to the hint's when the hint is a solution of it."""
        mm, data = self.mm, self.data
        # CBC 2.10 (PuLP's bundled binary) has proven wrong optima from a MIP start when the objective
        # variable was integer (its probing); HiGHS is right and twice as fast with it integer.
        integral = self.backend != "cbc"
        model = mm.build_model(data, mm.serial_horizon(data), asap=asap, floor=floor, integral_makespan=integral)
        start = _valid_start(mm, model, hint, hint_timeline)
        if start is None:
            return model, None
        horizon = int(round(start[model.makespan]))
        if horizon >= model.horizon:
            return model, start
        tighter = mm.build_model(data, horizon, asap=asap, floor=floor, integral_makespan=integral)
        return tighter, _valid_start(mm, tighter, hint, hint_timeline)

    # ----------------------------------------------------------------- result

    def finish(self, outcome, hint: Schedule | None, hint_timeline: Timeline | None, floor: int) -> SolveResult:
        hint_fits = hint_timeline is not None and hint_timeline.fits
        if outcome is not None and outcome[0] == "infeasible":
            if not hint_fits:
                return SolveResult(self.solver, SolveStatus.INFEASIBLE, None, None, None, math.inf,
                                   time.perf_counter() - self.began, self.unit)
            self.report(None, "the model found no schedule but the hint fits; returning the hint")
        self.bound = max(floor, self.bound) if self.bound is not None else floor
        if outcome is not None and outcome[0] == "found":
            schedule, timeline, objective_ms = outcome[1]
            if not hint_fits or timeline.makespan <= hint_timeline.makespan:
                status = SolveStatus.OPTIMAL if self.proves(timeline) else SolveStatus.FEASIBLE
                return self.result(status, schedule, timeline, objective_ms)
        if hint is None:
            return self.result(SolveStatus.NO_IMPROVEMENT, None, None, None)
        status = SolveStatus.OPTIMAL if hint_fits and self.proves(hint_timeline) else SolveStatus.NO_IMPROVEMENT
        return self.result(status, hint, hint_timeline, None)

    def proves(self, timeline: Timeline) -> bool:
        return timeline.makespan <= self.bound * self.unit + TOLERANCE_MS * max(1.0, timeline.makespan)

    def result(self, status, schedule, timeline, objective_ms) -> SolveResult:
        # The bound is proven for durations rounded up by at most ``rounding``; shrunk by that much
        # it holds for the exact durations too (OPTIMAL means optimal at the resolution).
        lower_bound_ms = self.bound * self.unit / (1 + self.data.grid.rounding)
        return SolveResult(self.solver, status, schedule, timeline, objective_ms, lower_bound_ms,
                           time.perf_counter() - self.began, self.unit)


def _default_hint(problem: Problem) -> Schedule | None:
    """The fastest registered heuristic that fits the budget, if any."""
    best = best_fitting([e for e in compare(problem) if e.judged is None or not e.judged.schedule.recomputed])
    return best.schedule if best is not None else None


def _valid_start(mm, model, hint: Schedule | None, hint_timeline: Timeline | None):
    """The hint's variable values when they satisfy every constraint (bounds included), else None."""
    if hint is None or hint_timeline is None or not hint_timeline.fits:
        return None
    values = mm.start_values(model, hint)
    if values is None or _violation(model.lp, values.__getitem__) > _TOLERANCE:
        return None
    return values


def _violation(lp, value_of) -> float:
    """The largest amount by which the values break a bound or a row of ``lp``."""
    worst = 0.0
    for var in lp.variables():
        value = value_of(var)
        if var.upBound is not None:
            worst = max(worst, value - var.upBound)
        if var.lowBound is not None:
            worst = max(worst, var.lowBound - value)
    for constraint in lp.constraints():
        total = constraint.constant + sum(coef * value_of(var) for var, coef in constraint.items())
        if constraint.sense <= 0:  # PuLP keeps a row as "expression (sense) 0"
            worst = max(worst, total)
        if constraint.sense >= 0:
            worst = max(worst, -total)
    return worst


def _decode(model, values: dict[str, float], name: str) -> Schedule:
    """Start times in ms for every op the solution runs, then the shared decoder."""
    unit = model.data.grid.resolution_ms
    chosen = {item for item, x in model.offload.items() if values[x.name] > 0.5}
    starts: dict[Op, float] = {}
    for op, var in model.start.items():
        if op.kind in TRANSFER_KINDS and (op.stage, op.microbatch) not in chosen:
            continue
        value = values[var.name]
        nearest = round(value)
        starts[op] = (nearest if abs(value - nearest) < 1e-6 else value) * unit
    return schedule_from_starts(model.data.problem, name, starts)


def _repair(model, values: dict[str, float], timeline: Timeline) -> int:
    """Forbid the relief claims the simulated timing breaks at overflowing allocations; how many."""
    overflowing = _overflowing_events(timeline)
    forbidden = 0
    for relief, var in model.relief.items():
        if relief.event in overflowing and values[var.name] > 0.5 and not _holds(relief, timeline):
            var.upBound = 0
            forbidden += 1
    return forbidden


_at = instant  # the simulator's memory replay compares times at this precision


def _holds(relief, timeline: Timeline) -> bool:
    """Whether a claim is true in the simulated timeline."""
    by_op = timeline.by_op
    t = _at(by_op[relief.event].start)
    subject = by_op.get(relief.subject)
    if relief.kind == "away":
        reload = by_op.get(Op(OpKind.RELOAD, relief.subject.stage, relief.subject.microbatch))
        return subject is not None and reload is not None and _at(subject.end) <= t and _at(reload.start) > t
    if relief.kind == "pending":
        return _at(subject.start) > t
    return subject is not None and _at(subject.end) <= t  # "ended" and "back"


def _overflowing_events(timeline: Timeline) -> set[Op]:
    """Allocations (F and RELOAD starts; on the host, OFFLOAD starts) at which memory is over budget."""
    problem = timeline.problem
    over: set[Op] = set()
    budget = problem.memory.budget
    for device, curve in enumerate(timeline.memory):
        times = {t for t, held in curve if held > budget}
        if times:
            over.update(t.op for t in timeline.timings if t.device == device
                        and t.op.kind in (OpKind.F, OpKind.RELOAD) and _at(t.start) in times)
    if problem.offload.enabled:
        for device in range(problem.devices):
            events = []  # the host's side of each transfer (semantics.effects), as the simulator replays it
            for t in timeline.timings:
                if t.device != device or t.op.kind not in TRANSFER_KINDS:
                    continue
                for effect in effects(problem, t.op, offloaded=True):
                    if effect.place is Place.HOST:
                        at_end = effect.at is At.END
                        events.append((_at(t.end if at_end else t.start), 0 if at_end else 1, effect.delta, t.op))
            held = 0
            for _, _, delta, op in sorted(events):
                held += delta
                if delta > 0 and held > problem.offload.host_budget:
                    over.add(op)
    return over
