"""optpipe compile, minus the terminal: heuristics, warm starts, a solver, and the verdict.

1. Judge every heuristic (compare.py); the best that fits is the baseline.
2. Build warm starts (starts.py, each phase within its share of the time limit): heuristics with
   their activations offloaded often fit where the plain ones do not (warmstart.py); the fastest
   that still overflow are repaired until they fit (repair.py: more offload, fewer forwards in
   flight where a device overflows).
3. Raise the bound, for at most a quarter of the time limit together: at any size with each
   device's warm-up and cool-down solved exactly (ends_relax.py); on small problems also with the
   whole model on a floor grid (floor_relax.py) where its own grid proves nothing, then with each
   device's exact relaxation (device_relax.py). The report and the whole model start from it.
4. Run the chosen solver from the best warm start: CP-SAT on the whole problem when it is small
   (handing over to the window search once it finds nothing better for a quarter of the time
   limit; a glance above _WHOLE_OPS), the window search (lns.py) otherwise; or the MILP; or
   return the named heuristic.
5. Re-simulate the solver's answer: one that breaks a budget, or a solver that fails inside
   (``InternalError``), is dropped with a warning in the report, never shown to the user as an
   error. Return the fastest fitting schedule seen, as the simulator times it: never slower than
   the baseline. When nothing fits, raise ``InfeasibleError`` with the smallest budget at which a
   schedule was found and the proven memory lower bound.

A problem that may both offload and recompute (issue 14) first gets each pure strategy solved
on its own until its search stalls (the problem without offload, and without recompute:
smaller models that CP-SAT searches well; on the recompute benchmark each reaches its 20 s
answer within 2 to 5 s), and their answers join the warm starts. What is left are the schedules
that both offload and recompute: when the whole problem fits the exact model, CP-SAT searches
only those for the rest of the time, from a mixed first solution (from a pure answer it rarely
leaves that answer's neighbourhood). The fastest of everything is returned, so the split costs
nothing, and the mix search's own bound, which says nothing of pure schedules, is not reported.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from dataclasses import replace

from optpipe.core.errors import InfeasibleError, InternalError, NotApplicable, SolverError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Schedule
from optpipe.core.semantics import TOLERANCE_MS
from optpipe.core.simulate import Timeline, describe_fit, simulate
from optpipe.core.units import format_size

from .bounds import Bound, makespan_lower_bound, memory_lower_bound
from .compare import Entry, best_fitting, compare
from .milp import solve_milp
from .registry import get_generator
from .restarts import restarts
from .result import Judged, Progress, SolveResult, SolveStatus, fastest_fitting, gap
from .starts import MIN_STEP_S, build_starts, simulate_s
from .recompute import mixed_neighbour, trade_for_offloads
from .timegrid import choose_grid

__all__ = ["SOLVERS", "Compiled", "compile_problem", "exact_model_fits"]

SOLVERS = ("cpsat", "milp-highs", "milp-cbc")  # and "heuristic:NAME"
_EPS = TOLERANCE_MS
# The full CP-SAT model has literals quadratic in a device's ops; above this many compute ops per
# device the window search finds better schedules in the same time.
_MAX_EXACT_OPS_PER_DEVICE = 48
# With both offload and recompute, each pure strategy is solved before the mix (issue 14) for at
# most this share of the time left, and stops once this share passes with nothing better (at least
# _MIN_STALL_S): on the recompute benchmark each reaches its 20 s answer in 2 to 5 s.
_PURE_SHARE, _PURE_STALL, _MIN_STALL_S = 0.35, 0.15, 1.0
_SEARCH_SIMS = 4  # the window search is begun only with this many simulations of the start left
_RELAX_SHARE = 0.25  # of the time limit, at most, for the relaxations that raise the bound (_relaxed)
# of that, for the whole model on a floor grid (floor_relax.py): on random problems of at most 160
# compute ops it proved p = 6, m = 6 optimal in 2.5 s and p = 3, m = 9 in 6.5 s, where the search
# had stalled within the first seconds
_FLOOR_SHARE = 0.75
# of it, first and on top of it, for each device's two ends solved exactly (ends_relax.py) where
# the relaxations above also run; elsewhere they may take it all (most devices are not solved at
# all: a greedy solution of their ends says they cannot raise the bound). grid09 (p = 8, v = 2,
# m = 24): 1,747.8 to 1,792.9 ms in 0.5 s, where compile finds about 1,824.
_ENDS_SHARE = 0.25
# of what the ends leave, for each device's ends solved with the devices that feed it
# (fill_relax.py; up to 8 devices), the smaller share where the relaxations above also run:
# grid09's bound 1,793.7 to 1,800.5 ms and grid06's 2,918.5 to 2,926.8, each in about 5 s.
_FED_SHARE = (0.5, 0.25)
_SEARCH_UNITS = 2**24  # a mix's makespan in more exact units than this is solved on a rounded grid
# The whole model, when it fits, runs until it finds nothing better for this share of the time
# limit; the window search then has the rest. On grid08 (p = 8, m = 16, k = 2, 48 compute ops
# per device) 300 s of the whole model never improved its 645 ms warm start; 60 s of windows
# found 602.6 ms.
_WHOLE_STALL, _MIN_WINDOWS_S = 0.25, 1.0
# ... and at most _WHOLE_MOST in all (never under _WHOLE_LEAST_S) up to _WHOLE_OPS compute ops: it
# proves random problems of up to 160 in 0.1 to 10 s, and at 192 (p = 4, v = 2, m = 8, 20 s) its 10 s
# still beat the windows (595 to 607 ms against 619 to 621). Above, it has _WHOLE_BRIEF: from 240 ops
# on the windows matched or won, and on the seed-1 grid's grid08 (384 ops) it gains a few ms every few
# seconds and never stalls: 60 s compiles ended at 1,089.3 and 1,092.7 ms with 15 s of it, 1,032.9 and
# 1,033.7 with 3.
_WHOLE_MOST, _WHOLE_LEAST_S, _WHOLE_BRIEF, _WHOLE_OPS = 0.25, 10.0, 0.05, 200
# What OR-Tools raises on a model whose numbers it cannot hold (a domain past int64 when durations
# span 1e-6 to 1e12 ms): optpipe's fault, reported as a warning; compile goes on with what it has.
_MODEL_ERRORS = (ArithmeticError, TypeError, ValueError, RuntimeError)


@dataclass(frozen=True)
class Compiled:
    """The schedule compile returns and everything the report shows about it."""

    problem: Problem
    solver: str
    status: SolveStatus
    judged: Judged  # the schedule returned, under the name of what found it (a solver or a warm start)
    lower_bound_ms: float
    lower_bound_reason: str
    solve_time_s: float
    baseline: Judged | None  # the best fitting heuristic
    start: str  # the warm start the solver began from
    note: str  # what happened, in words
    resolution_ms: float | None = None  # the exact model's time unit, when one ran
    warnings: tuple[str, ...] = ()  # solver answers that were dropped, and why

    @property
    def makespan_ms(self) -> float:
        return self.judged.makespan_ms

    @property
    def gap(self) -> float:
        share = gap(self.makespan_ms, self.lower_bound_ms)
        return 0.0 if share is None else share

    @property
    def offloaded(self) -> int:
        return len(self.judged.schedule.offloaded)

    def to_json(self) -> dict:
        base = self.baseline.timeline if self.baseline else None
        return {
            "solver": self.solver,
            "status": self.status.value,
            "makespan_ms": self.makespan_ms,
            "lower_bound_ms": self.lower_bound_ms,
            "gap": self.gap,
            "solve_time_s": self.solve_time_s,
            "peak_memory_bytes": self.judged.peak,
            "budget_bytes": self.problem.memory.budget,
            "offloaded": self.offloaded,
            "baseline_name": self.baseline.name if self.baseline else None,
            "baseline_makespan_ms": base.makespan if base else None,
            "busiest_compute_ms": self.judged.timeline.busiest_compute,
            "warnings": list(self.warnings),
        }


def exact_model_fits(problem: Problem) -> bool:
    """Is the problem small enough for the full CP-SAT model?"""
    return problem.compute_ops_per_device <= _MAX_EXACT_OPS_PER_DEVICE


def compile_problem(problem: Problem, *, solver: str = "cpsat", time_limit_s: float = 60.0, seed: int = 0,
                    workers: int | None = None, on_progress: Callable[[Progress], None] | None = None,
                    starts: Sequence[Schedule] = ()) -> Compiled:
    """The fastest fitting schedule the chosen solver finds within the time limit. ``starts``:
    schedules to start from besides the heuristics (a plan compiled earlier, or for a smaller
    budget, which fits this one too), judged by the simulator and repaired if they overflow."""
    began = time.monotonic()
    _check_solver(solver)
    workers = workers or max(2, os.cpu_count() or 1)  # CP-SAT's portfolio needs two workers at least
    report = on_progress or (lambda progress: None)
    bound = makespan_lower_bound(problem)
    if solver.startswith("heuristic:"):
        entries = compare(problem)
        return _heuristic(problem, solver, entries, baseline=best_fitting(entries), bound=bound, began=began)
    entries, candidates = build_starts(problem, starts, bound, (began, time_limit_s), report)
    baseline = best_fitting(entries)
    end = began + time_limit_s
    both_solved, resolution = False, _mix_resolution(problem, solver)
    if _mixes(problem, solver):
        pure, both_solved = _pure_strategies(problem, solver, candidates, end, seed, workers, report, bound,
                                             resolution)
        candidates += pure
    start = fastest_fitting(candidates)
    warnings: list[str] = []
    # The answer is re-simulated after the solver returns (_verified): about 0.4 s at p = 32,
    # m = 256, 3.7 s at p = 64, m = 512 with offloads. Timed first, so that the bound's
    # relaxations leave room for it too (timed after them, p = 64 returned 4 s past the limit).
    reserve = simulate_s(problem, start.schedule) if start is not None and end - time.monotonic() > MIN_STEP_S else 0.0
    if start is not None:
        report(Progress(time.monotonic() - began, start.timeline.makespan, bound.value, f"warm start: {start.name}"))
        bound = _relaxed(problem, solver, start, bound, (began, end - reserve, time_limit_s), workers, seed, report,
                         warnings)
    # With both pure strategies solved, only the mixes are left to search: CP-SAT from a pure
    # answer rarely leaves it, so the mixes get a search of their own from a mixed first solution.
    mixes_only = both_solved and start is not None and exact_model_fits(problem)
    hint = _mixed_hint(problem, candidates, start, end) if mixes_only else start
    left = max(0.0, end - reserve - time.monotonic())
    meets_bound = start is not None and start.timeline.makespan <= bound.value + _EPS
    # with a fitting start and no time left (p = 64, m = 512 at 60 s), the search is not begun:
    # setting it up alone takes seconds there, a few simulations' time (begun 0.6 s before the
    # limit at p = 32, m = 256, it returned 0.8 s past it)
    out_of_time = start is not None and left <= max(MIN_STEP_S, _SEARCH_SIMS * reserve)
    result = None if meets_bound or out_of_time else _verified(problem, solver, warnings, lambda: _run(
        problem, solver, hint, left, seed, workers, on_progress, bound, candidates, mixes_only=mixes_only,
        resolution_ms=resolution, simulation_s=reserve))
    elapsed = time.monotonic() - began
    chosen = _better(result, start)
    if chosen is None:
        raise _infeasible(problem, candidates, result)
    timeline, name = chosen.timeline, chosen.name
    lower = max(bound.value, result.lower_bound_ms if result is not None else 0.0)
    reason = bound.reason if lower == bound.value else f"{solver}'s own bound"
    lower = min(lower, timeline.makespan)
    status, note = _verdict(result, start, name, timeline, lower, baseline, searched=not out_of_time)
    return Compiled(problem, solver, status, chosen, lower, reason, elapsed, baseline,
                    start.name if start else "-", note, result.resolution_ms if result else None, tuple(warnings))


def _relaxed(problem: Problem, solver: str, start: Judged, bound: Bound, clock: tuple[float, float, float],
             workers: int, seed: int, report: Callable[[Progress], None], warnings: list[str]) -> Bound:
    """The bound raised by the relaxations, where a tight budget and a slow host link leave the
    analytic bounds below the optimum: at any size each device's two ends solved exactly
    (ends_relax.py; grid09, p = 8, v = 2, m = 24: 1,747.8 ms analytic, 1,792.9 proved, about 1,826
    found); on small problems the whole model on a floor grid
    (floor_relax.py) where its own grid proves nothing (p = 2, v = 2, m = 2, V placement, k = 1.6:
    128.3 ms analytic, 142.6 proved, V-Min's 142.6 optimal), then the devices' exact relaxations
    (device_relax.py; p = 4, v = 2, m = 4, 0.3 of 1F1B-I's activations, k = 1.6: 272.3 ms
    analytic, 300.6 relaxed, 307.7 found). The full model then starts from it and proves sooner.
    ``clock``: compile's start, end and time limit."""
    began, end, limit = clock
    until = time.monotonic() + min(_RELAX_SHARE * limit, end - time.monotonic())
    upper = start.timeline.makespan
    if solver != "cpsat" or upper <= bound.value + _EPS or until - time.monotonic() <= MIN_STEP_S:
        return bound
    from .device_relax import relaxation_applies, relaxation_bound  # lazy: loads OR-Tools
    from .ends_relax import ends_applies, ends_bound  # lazy: loads OR-Tools
    from .floor_relax import floor_relaxation_applies, floor_relaxation_bound  # lazy: loads OR-Tools
    from .fill_relax import fed_applies, fed_bound  # lazy: loads OR-Tools

    small = floor_relaxation_applies(problem) or relaxation_applies(problem)
    if ends_applies(problem):  # at any size: each device's two ends, solved exactly
        now = time.monotonic()
        bound = _guarded("devices' ends", warnings, bound, lambda: ends_bound(
            problem, floor=bound, time_limit_s=(_ENDS_SHARE if small else 1.0) * (until - now), workers=workers,
            seed=seed, upper_ms=upper))
        report(Progress(time.monotonic() - began, upper, bound.value, "bound: devices' ends solved exactly"))
        if small:  # the other two keep their shares: the ends take a fraction of a second where they prove
            until = min(end, until + time.monotonic() - now)
    if fed_applies(problem) and upper > bound.value + _EPS:  # the ends again, each with its feeders
        bound = _guarded("feeders' ends", warnings, bound, lambda: fed_bound(
            problem, floor=bound, time_limit_s=_FED_SHARE[small] * (until - time.monotonic()), upper_ms=upper,
            workers=workers, seed=seed))
        report(Progress(time.monotonic() - began, upper, bound.value, "bound: ends solved with their feeders"))
    if floor_relaxation_applies(problem) and upper > bound.value + _EPS:  # the whole model, where its grid proves nothing
        bound = _guarded("whole model's floor-grid", warnings, bound, lambda: floor_relaxation_bound(
            problem, upper=start, floor=bound, time_limit_s=_FLOOR_SHARE * (until - time.monotonic()),
            workers=workers, seed=seed))
        report(Progress(time.monotonic() - began, upper, bound.value, "bound: whole model, durations rounded down"))
    left = until - time.monotonic()
    if relaxation_applies(problem) and upper > bound.value + _EPS and left > MIN_STEP_S:
        bound = _guarded("devices' relaxation", warnings, bound, lambda: relaxation_bound(
            problem, upper_ms=upper, floor=bound, time_limit_s=left, workers=workers, seed=seed))
        report(Progress(time.monotonic() - began, upper, bound.value, "bound: devices relaxed"))
    return bound


def _guarded(what: str, warnings: list[str], bound: Bound, relax: Callable[[], Bound]) -> Bound:
    """``relax()``, or ``bound`` as it was when the relaxation fails inside: a weaker bound, said in
    a warning, never a traceback."""
    try:
        return relax()
    except _MODEL_ERRORS as error:
        warnings.append(f"the {what} bound was left out: it failed inside ({error!r}); please report this problem")
        return bound


def _verified(problem: Problem, solver: str, warnings: list[str], run: Callable[[], SolveResult | None]):
    """The solver's result with its schedule re-simulated; without a schedule that breaks a budget.

    A solver that fails inside (``InternalError``) leaves no result. Either way a warning says
    what was dropped: compile goes on with the best verified schedule it has.
    """
    try:
        result = run()
    except InternalError as error:
        warnings.append(f"{solver}'s answer was dropped: {error}")
        return None
    except _MODEL_ERRORS as error:
        warnings.append(f"{solver}'s answer was dropped: it failed inside ({error!r}); please report this problem")
        return None
    if result is None or result.schedule is None:
        return result
    timeline = simulate(problem, result.schedule)
    if not timeline.fits:
        warnings.append(f"{solver}'s schedule was dropped: it re-simulates over the budget ({describe_fit(timeline)}, "
                        f"host peak {max(timeline.host_peak)} bytes); please report this problem")
        return replace(result, schedule=None, timeline=None, status=SolveStatus.NO_IMPROVEMENT, lower_bound_ms=0.0)
    return replace(result, timeline=timeline)


def _check_solver(solver: str) -> None:
    if solver in SOLVERS or solver.startswith("heuristic:"):
        return
    raise SolverError(f"--solver: unknown solver {solver!r}; expected one of {', '.join(SOLVERS)} "
                      f"or heuristic:NAME (for example heuristic:ZB-H1)")


def _heuristic(problem: Problem, solver: str, entries: list[Entry], baseline: Judged | None, bound: Bound,
               began: float) -> Compiled:
    name = solver.split(":", 1)[1]
    canonical = get_generator(name).name
    entry = next(e for e in entries if e.name == canonical)
    if entry.judged is None:
        raise NotApplicable(f"{canonical} does not apply to this problem: {entry.reason}")
    if not entry.fits:
        peak = entry.judged.peak
        raise InfeasibleError(
            f"{canonical} does not fit: it peaks at {format_size(peak)} against a budget of "
            f"{format_size(problem.memory.budget)}; raise the budget to {format_size(peak)} or use --solver cpsat",
            smallest_found=peak, memory_lower_bound=int(memory_lower_bound(problem).value))
    timeline = entry.judged.timeline
    lower = min(bound.value, timeline.makespan)
    optimal = timeline.makespan <= lower + _EPS
    status = SolveStatus.OPTIMAL if optimal else SolveStatus.FEASIBLE
    return Compiled(problem, solver, status, entry.judged, lower, bound.reason,
                    time.monotonic() - began, baseline, canonical, f"the {canonical} heuristic, as asked")


def _run(problem: Problem, solver: str, start: Judged | None, time_limit_s: float, seed: int,
         workers: int | None, on_progress, bound: Bound, candidates: list[Judged] = (),
         stall_s: float | None = None, mixes_only: bool = False,
         resolution_ms: float | None = None, simulation_s: float = 0.0) -> SolveResult | None:
    """The chosen solver from ``start``; ``stall_s`` ends a whole-problem CP-SAT solve early when it
    finds nothing better for that long; ``mixes_only`` has it search only schedules that both
    offload and recompute."""
    hint = start.schedule if start is not None else None
    if solver == "cpsat":
        began, lower, resolution = time.monotonic(), bound.value, 0.0
        if exact_model_fits(problem) or start is None:
            from .cpsat import solve_cpsat  # lazy: loads OR-Tools, which compile without cpsat does not need

            # The main search hands over to the windows once the whole model stalls (_WHOLE_STALL),
            # or has had its share (_WHOLE_MOST).
            handover = stall_s is None and not mixes_only and start is not None
            stall = max(_MIN_STALL_S, _WHOLE_STALL * time_limit_s) if handover else stall_s
            whole_s = min(time_limit_s, _whole_s(problem, time_limit_s)) if handover else time_limit_s
            whole = solve_cpsat(problem, time_limit_s=whole_s, hint=hint, seed=seed, workers=workers,
                                on_progress=on_progress, resolution_ms=resolution_ms, floor_ms=bound.value,
                                stall_s=stall, mixes_only=mixes_only, stall_from_start=handover)
            left = time_limit_s - (time.monotonic() - began)
            if not handover or whole.status is SolveStatus.OPTIMAL or left < _MIN_WINDOWS_S:
                return whole
            start, lower, resolution = _better(whole, start), whole.lower_bound_ms, whole.resolution_ms
        from .lns import improve  # lazy: loads OR-Tools
        from .portfolio import improve_in_parallel, parallel_applies  # lazy: loads OR-Tools (through lns)

        left = time_limit_s - (time.monotonic() - began)
        search_with = improve_in_parallel if parallel_applies(problem, left, workers or 1, simulation_s) else improve
        search = search_with(problem, start.schedule, time_limit_s=left, seed=seed, workers=workers,
                             on_progress=on_progress, bound_ms=bound.value, restarts=restarts(problem, start, candidates))
        return SolveResult("cpsat", SolveStatus.FEASIBLE, search.best.schedule.renamed("cpsat"), search.best.timeline,
                           search.best.makespan_ms, lower, time.monotonic() - began, resolution)
    backend = solver.split("-", 1)[1]
    return solve_milp(problem, backend=backend, time_limit_s=time_limit_s, hint=hint, seed=seed,
                      on_progress=on_progress)


def _whole_s(problem: Problem, time_limit_s: float) -> float:
    """The whole model's time before the window search takes over: enough to prove a small problem,
    a glance at a larger one, where windows gain more in the same seconds."""
    if problem.compute_ops <= _WHOLE_OPS:
        return max(_WHOLE_LEAST_S, _WHOLE_MOST * time_limit_s)
    return _WHOLE_BRIEF * time_limit_s


def _mixes(problem: Problem, solver: str) -> bool:
    return solver == "cpsat" and problem.offload.enabled and problem.recompute.enabled


def _mix_resolution(problem: Problem, solver: str) -> float | None:
    """One rounded grid for the pure strategies and the mix when the exact one is very fine:
    transfers of odd byte counts make the exact unit ~1e-7 ms, and on the rounded grid CP-SAT
    finds mixes far more often (at 2.5 activations, k = 1, of the recompute benchmark: 564 to
    583 ms, against 583 to 603 ms on the exact grid). The same grid for all, so that an
    answer that peaks at the budget stays a feasible hint for the next solve (a rounded grid
    holds a transfer's release longer, and an exact answer at the budget would not fit it). The
    rounded grid is safe (timegrid.py; its padding stays under SLACK_SHARE of the bound) and
    proves nothing."""
    if not _mixes(problem, solver):
        return None
    grid = choose_grid(problem, max_units=_SEARCH_UNITS)
    return None if grid.exact else grid.resolution_ms


def _pure_strategies(problem: Problem, solver: str, candidates: list[Judged], end: float, seed: int,
                     workers: int, report: Callable[[Progress], None], bound: Bound,
                     resolution_ms: float | None) -> tuple[list[Judged], bool]:
    """The solver's answers on the problem without offload and on the problem without recompute,
    each until it stalls (_PURE_STALL) or _PURE_SHARE of the time left has passed, from the best
    candidate that uses only that strategy, as candidates of the whole problem (a schedule with no
    transfers, or no recompute, simulates the same on either), and whether both were solved. The
    strategy whose warm start is faster goes first; each on the mix's grid (_mix_resolution)."""
    pure = {"recompute-only": (problem.without_offload(), lambda c: not c.schedule.offloaded),
            "offload-only": (problem.without_recompute(), lambda c: not c.schedule.recomputed)}
    starts = {name: fastest_fitting([c for c in candidates if usable(c)]) for name, (_, usable) in pure.items()}
    share = _PURE_SHARE * (end - time.monotonic())
    stall = max(_MIN_STALL_S, _PURE_STALL * (end - time.monotonic()))
    out: list[Judged] = []
    solved = 0
    for name in sorted(pure, key=lambda name: starts[name].timeline.makespan if starts[name] else float("inf")):
        sub, usable = pure[name]
        start = starts[name]
        if start is None or end - time.monotonic() <= MIN_STEP_S or start.timeline.makespan <= bound.value + _EPS:
            continue
        relay = lambda p, name=name: report(replace(p, bound_ms=bound.value, message=f"{name}: {p.message}"))  # noqa: E731
        own = [c for c in candidates if usable(c)]
        result = _verified(sub, solver, [], lambda: _run(sub, solver, start, min(share, end - time.monotonic()), seed,
                                                         workers, relay, makespan_lower_bound(sub), own, stall,
                                                         resolution_ms=resolution_ms))
        if result is None or result.schedule is None:
            continue
        solved += 1
        label = f"{solver}/{name}"
        if name == "recompute-only":  # recompute only what the link cannot hide
            traded = trade_for_offloads(problem, result.schedule, deadline=end)
            if traded is not result.schedule:  # no slower, less compute: listed first, it wins a tie
                out.append(Judged(label + "+offload", traded.renamed(label + "+offload"), simulate(problem, traded)))
        out.append(Judged(label, result.schedule.renamed(label), simulate(problem, result.schedule)))
    return out, solved == len(pure)


def _mixed_hint(problem: Problem, candidates: list[Judged], start: Judged, end: float) -> Judged:
    """The first solution of the search among mixes: the fastest fitting candidate that offloads
    and recomputes, or ``start`` with one choice changed to make it so (recompute.mixed_neighbour),
    whichever is faster; ``start`` itself when neither fits (CP-SAT then repairs it)."""
    mixed = [c for c in candidates if c.fits and c.schedule.offloaded and c.schedule.recomputed]
    neighbour = mixed_neighbour(problem, start.schedule, deadline=end)
    if neighbour is not None:
        mixed.append(Judged(start.name + "+mixed", neighbour.renamed(start.name + "+mixed"), simulate(problem, neighbour)))
    return fastest_fitting(mixed) or start


def _better(result: SolveResult | None, start: Judged | None) -> Judged | None:
    """The solver's schedule when it fits and is faster than the warm start, else the warm start."""
    solved = result is not None and result.timeline is not None and result.timeline.fits
    if solved and (start is None or result.timeline.makespan < start.timeline.makespan - _EPS):
        return result.judged
    return start


def _verdict(result: SolveResult | None, start: Judged | None, name: str, timeline: Timeline, lower: float,
             baseline: Judged | None, searched: bool = True) -> tuple[SolveStatus, str]:
    proven = result is not None and result.status is SolveStatus.OPTIMAL and name == result.solver
    if proven or timeline.makespan <= lower + _EPS:
        return SolveStatus.OPTIMAL, "optimal: the makespan meets the lower bound" if not proven else "proven optimal"
    late = "" if searched else "the time limit ran out before the search could begin: "
    again = "" if searched else " (a longer --time-limit searches on)"
    if start is not None and name == start.name:
        if baseline is not None and start.name == baseline.name:
            what = "no improvement on" if not searched else "the time limit passed with no improvement on"
            return SolveStatus.NO_IMPROVEMENT, f"{late}{what} {start.name}, the best fitting heuristic; returning it{again}"
        if not searched:
            return SolveStatus.FEASIBLE, f"{late}returning the warm start {start.name}{again}"
        return SolveStatus.FEASIBLE, f"the solver did not improve on its warm start {start.name}"
    return SolveStatus.FEASIBLE, "not proven optimal within the time limit"


def _infeasible(problem: Problem, candidates: list[Judged], result: SolveResult | None) -> InfeasibleError:
    memory = memory_lower_bound(problem)
    closest = min(candidates, key=lambda c: c.timeline.peak) if candidates else None
    proven = result is not None and result.status is SolveStatus.INFEASIBLE
    budget = format_size(problem.memory.budget)
    parts = [f"no schedule fits the budget of {budget}" + (" (proven by CP-SAT)" if proven else "")]
    if closest is not None:
        parts.append(f"the smallest budget at which one was found is {format_size(closest.timeline.peak)} "
                     f"({closest.name})")
    parts.append(f"no schedule can fit below {format_size(memory.value)} ({memory.reason})")
    advice = "raise memory.budget (or --budget)"
    if not problem.offload.enabled:
        advice += ", or enable [offload] so activations can wait in host memory"
    return InfeasibleError("; ".join(parts) + f"; {advice}",
                           smallest_found=closest.timeline.peak if closest else None,
                           memory_lower_bound=int(memory.value))
