"""The MILP solver (PuLP with HiGHS and CBC): exact on small problems, and what it returns fits.

Expected makespans are derived by hand where a short argument exists, or checked against an
exhaustive search over every schedule of a tiny problem; elsewhere the two backends must agree.
Every returned schedule is re-simulated: it must fit and match the solver's objective.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from conftest import PROBLEM_DIR, uniform_problem
from optpipe.core.errors import ScheduleError, SolverError
from optpipe.core.problem import Offload, Placement, Recompute
from optpipe.core.problem_file import load_problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import simulate
from optpipe.solvers import milp_model as mm
from optpipe.solvers.heuristics.one_f_one_b import one_f_one_b
from optpipe.solvers.recompute import add_recomputes
from optpipe.solvers.milp import _decode, _holds, _repair, _valid_start, solve_milp
from optpipe.solvers.cpsat import solve_cpsat
from optpipe.solvers.milp_backend import run_backend
from optpipe.solvers.result import SolveStatus
from optpipe.solvers.timegrid import Grid

F, B, W, BW, OFF, REL = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD
BACKENDS = ("highs", "cbc")
FAST_LINK = Offload(True, 200_000.0, 200_000.0, 10**9)  # 100-byte activations move in 0.5 ms each way


def balanced(name: str, microbatches: int):
    problem = load_problem(PROBLEM_DIR / f"{name}.toml")
    return dataclasses.replace(problem, pipeline=dataclasses.replace(problem.pipeline, microbatches=microbatches))


def checked(result):
    """The result's schedule re-simulates to its timeline, fits, and agrees with the objective."""
    assert result.schedule is not None and result.timeline is not None
    timeline = simulate(result.timeline.problem, result.schedule)
    assert timeline.fits, "the returned schedule breaks a budget when re-simulated"
    assert timeline.makespan == pytest.approx(result.timeline.makespan)
    grid = mm.choose_milp_grid(result.timeline.problem)
    if result.objective_ms is not None:
        # Durations round up on the grid, so the simulator is never slower than the model and
        # faster by no more than the rounding along a chain (the grid's slack, timegrid.py).
        assert timeline.makespan <= result.objective_ms + 1e-9
        assert timeline.makespan >= result.objective_ms * (1 - grid.rounding) - grid.slack_ms - result.resolution_ms
    assert timeline.makespan >= result.lower_bound_ms * (1 - grid.rounding) - 1e-9
    return timeline


# --------------------------------------------------------------------------- exact on small problems

PROVEN = [
    # Memory-free: the last device cannot start before p - 1 and has 3m of work, and zero-bubble
    # orders reach that bound: 3m + p - 1.
    pytest.param(uniform_problem(2, 4), 13.0, id="p2-m4"),
    pytest.param(uniform_problem(4, 8, budget=400, offload=FAST_LINK), 27.0, id="p4-m8-offload-enabled"),
    # One activation per device: F(0, i+1) needs all of F(0, i)'s activation gone. An offload cannot
    # do it (nothing can run between the two F ops, and the simulator never waits), so it follows
    # W(0, i): microbatches pass one at a time, 4 x (F0 + F1 + B1 + B0 + W0) = 20, offload or not.
    pytest.param(uniform_problem(2, 4, budget=100, offload=FAST_LINK), 20.0, id="p2-m4-one-activation"),
    # balanced-p4-m8 with m = 4: the last device starts at 3 x (20 + 0.5) = 61.5 and after its last
    # B it can only run W ops (at most 4 x 20 = 80 ms) while the backward chain down to device 0
    # still needs 3 x (20 + 0.5) + 20 = 81.5 ms; so 61.5 + 8 x 20 + 81.5 = 303.
    pytest.param(balanced("balanced-p4-m8", 4), 303.0, id="balanced-p4-m4"),
]


@pytest.mark.parametrize("problem, expected", PROVEN)
def test_both_backends_prove_the_optimum(problem, expected):
    for backend in BACKENDS:
        result = solve_milp(problem, backend=backend, time_limit_s=30)
        assert result.status is SolveStatus.OPTIMAL, backend
        assert checked(result).makespan == pytest.approx(expected), backend
        # balanced-p4-m8's transfers take 10.0008 ms, rounded up in the model: the bound shrinks by that rounding.
        assert result.lower_bound_ms == pytest.approx(expected, rel=mm.choose_milp_grid(problem).rounding + 1e-12)
        assert result.solver == f"milp-{backend}"


def _interleavings(chains):
    """Every merge of the chains that keeps each chain's order."""
    if not any(chains):
        yield []
        return
    for k, chain in enumerate(chains):
        if chain:
            rest = [c[1:] if j == k else c for j, c in enumerate(chains)]
            for tail in _interleavings(rest):
                yield [chain[0]] + tail


def _with_transfers(order, items):
    """The order with OFFLOAD/RELOAD of each item at every legal place (after F, REL before B)."""
    position = {op: k for k, op in enumerate(order)}
    places = [[(a, b) for a in range(position[Op(F, s, i)] + 1, position[Op(B, s, i)] + 1)
               for b in range(a, position[Op(B, s, i)] + 1)] for s, i in items]
    for pick in itertools.product(*places):
        after = [[] for _ in range(len(order) + 1)]
        for (s, i), (a, b) in zip(items, pick):
            after[a].append(Op(OFF, s, i))
            after[b].append(Op(REL, s, i))
        yield after[0] + [op for k, compute in enumerate(order) for op in [compute] + after[k + 1]]


def _exhaustive(problem, fused=False, offload_on=()):
    """The best fitting makespan over every device order (and transfer places on ``offload_on``)."""
    kinds = (F, BW) if fused else (F, B, W)
    rows = []
    for device in range(problem.devices):
        stages = problem.pipeline.stages_on(device)
        items = [(s, i) for s in stages for i in range(problem.microbatches)]
        orders = list(_interleavings([[Op(k, s, i) for k in kinds] for s, i in items]))
        if device in offload_on:
            orders = [row for order in orders for r in range(len(items) + 1)
                      for chosen in itertools.combinations(items, r) for row in _with_transfers(order, list(chosen))]
        rows.append(orders)
    best = None
    for lists in itertools.product(*rows):
        try:
            timeline = simulate(problem, Schedule.of("exhaustive", lists))
        except ScheduleError:  # a dependency cycle between the device orders
            continue
        if timeline.fits and (best is None or timeline.makespan < best):
            best = timeline.makespan
    return best


EXHAUSTIVE = [
    pytest.param(uniform_problem(2, 2, budget=150), {}, {}, id="p2-m2-split"),
    pytest.param(uniform_problem(2, 2, budget=100, b=2.0, w=0.5), {}, {}, id="p2-m2-one-activation"),
    pytest.param(uniform_problem(3, 2, budget=100), {"split_backward": False}, {"fused": True}, id="p3-m2-fused"),
    # Offload enumerated on device 0 only (all places for every subset): on the last stage B(1, i)
    # needs only F(1, i), so moving that activation out and back only delays B.
    pytest.param(uniform_problem(2, 2, budget=150, offload=FAST_LINK), {}, {"offload_on": (0,)}, id="p2-m2-offload"),
]


@pytest.mark.parametrize("problem, options, search", EXHAUSTIVE)
def test_optimum_matches_exhaustive_search(problem, options, search):
    best = _exhaustive(problem, **search)
    for backend in BACKENDS:
        result = solve_milp(problem, backend=backend, time_limit_s=30, **options)
        assert result.status is SolveStatus.OPTIMAL
        assert checked(result).makespan == pytest.approx(best), backend
    kinds = {op.kind for _, op in result.schedule.ops()}
    assert (BW in kinds) == (options.get("split_backward") is False)


# --------------------------------------------------------------------------- memory


def _two_chunks(microbatches: int = 2, **changes):
    """p = 2, v = 2: device 0 holds F(0, i) while it runs F(2, i), so 1.5 activations need offload."""
    return uniform_problem(2, microbatches, v=2, budget=150, **changes)


def test_tight_budget_forces_offload():
    # m = 1: the chain F0 F1 F2 F3 B3 B2 B1 B0 W0 (9 ms) bounds every schedule, and offload reaches
    # it: F(0, 0) leaves while device 1 runs F(1, 0), and returns once B(2, 0) has freed its part.
    problem = _two_chunks(1, offload=FAST_LINK)
    for backend in BACKENDS:
        result = solve_milp(problem, backend=backend, time_limit_s=30)
        assert result.status is SolveStatus.OPTIMAL
        assert result.schedule.offloaded, "the budget cannot hold two activations, so something must move"
        assert checked(result).makespan == pytest.approx(9.0)
        assert solve_milp(problem.without_offload(), backend=backend).status is SolveStatus.INFEASIBLE
    bigger = solve_milp(_two_chunks(2, offload=FAST_LINK), time_limit_s=30)
    assert bigger.status is SolveStatus.OPTIMAL and bigger.schedule.offloaded
    checked(bigger)


INFEASIBLE = [
    pytest.param(_two_chunks(), id="two-chunks-without-offload"),
    # Host memory too small for one activation: offload is enabled but useless.
    pytest.param(_two_chunks(offload=dataclasses.replace(FAST_LINK, host_budget=50)), id="no-host-room"),
    # V-shape: device 1 runs F(2, 0) right after F(1, 0), before F(1, 0)'s activation can leave;
    # only the exact (as-soon-as-possible) model sees this, the relaxed one lets F(2, 0) wait.
    pytest.param(uniform_problem(2, 1, v=2, budget=150, placement=Placement.VSHAPE, offload=FAST_LINK), id="vshape"),
]


@pytest.mark.parametrize("problem", INFEASIBLE)
def test_impossible_budget_is_infeasible(problem):
    for backend in BACKENDS:
        result = solve_milp(problem, backend=backend, time_limit_s=30)
        assert result.status is SolveStatus.INFEASIBLE, backend
        assert result.schedule is None and result.timeline is None


def test_rounded_durations_stay_within_a_tenth_of_a_percent():
    problem = balanced("balanced-p4-m8-tight", 3)  # a transfer takes 10.0008 ms
    grid = mm.choose_milp_grid(problem)
    assert not grid.exact and 0 < grid.rounding <= 1e-3 and grid.slack_ms <= 1e-3 * 366.0
    assert grid.up(problem.offload_ms(0)) * grid.resolution_ms >= problem.offload_ms(0)
    result = solve_milp(problem, backend="highs", time_limit_s=30)
    # A rounded grid keeps a margin around every memory claim (safe, timegrid.py), so the exact
    # model proves nothing and the status says feasible unless the relaxed bound is met.
    assert result.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE) and result.schedule.offloaded
    timeline = checked(result)
    assert timeline.makespan < 366.0  # the best schedule without offload (its model, exact, says so)
    assert timeline.makespan <= 1.05 * result.lower_bound_ms
    assert mm.choose_milp_grid(uniform_problem(2, 2)) == Grid(1.0, True, 0, 0.0)


def test_repair_forbids_only_claims_the_simulator_breaks():
    problem = uniform_problem(2, 4, budget=100, offload=FAST_LINK)
    data = mm.prepare(problem, mm.choose_milp_grid(problem))
    model = mm.build_model(data, mm.serial_horizon(data))  # relaxed: an F may wait for an offload
    run = run_backend(model.lp, "highs", time_limit_s=30, seed=0, threads=1, start=None)
    timeline = simulate(problem, _decode(model, run.values, "relaxed"))
    assert run.objective < 40 and not timeline.fits  # below the true 20 ms only by waiting
    assert _repair(model, run.values, timeline) > 0
    for relief, var in model.relief.items():
        if var.upBound == 0:
            assert run.values[var.name] > 0.5 and not _holds(relief, timeline)


# --------------------------------------------------------------------------- recompute (issue 14)

SLOWER_LINK = Offload(True, 100_000.0, 100_000.0, 10**9)  # 1 ms each way


def _recomputing(problem, time_ms: float = 1.0, resident: int = 10):
    """``problem`` where every (stage, microbatch) may be recomputed: RECOMPUTE runs ``time_ms``,
    and ``resident`` of the 100-byte activation stays from F to RECOMPUTE."""
    stages = problem.stages
    return dataclasses.replace(problem, recompute=Recompute(True, (time_ms,) * stages, (resident,) * stages))


RECOMPUTE_CASES = [
    # (problem, the optimum, the optimum when every activation must be kept or offloaded)
    pytest.param(_recomputing(uniform_problem(2, 3, budget=150)), 12.0, 13.0, id="p2-m3"),
    pytest.param(_recomputing(uniform_problem(3, 3, budget=200)), 13.0, 14.0, id="p3-m3"),
    pytest.param(_recomputing(uniform_problem(2, 2, v=2, budget=250)), 15.0, 16.0, id="v2"),
    # with offload the relaxed answer waits for memory: the exact model decides the recomputes
    pytest.param(_recomputing(uniform_problem(2, 3, budget=150, p2p=0.5, offload=SLOWER_LINK), time_ms=2.0),
                 15.0, None, id="offload-exact"),
    # recompute on one stage, offload on the other: no faster than offload alone, but as fast
    pytest.param(_recomputing(uniform_problem(2, 4, budget=120, offload=FAST_LINK), time_ms=2.0), 20.0, 20.0,
                 id="mixed"),
]


@pytest.mark.parametrize("problem, expected, keep_or_offload", RECOMPUTE_CASES)
def test_recompute_optimum_equals_cpsat_and_re_simulates(problem, expected, keep_or_offload):
    milp = solve_milp(problem, time_limit_s=60)
    cpsat = solve_cpsat(problem, time_limit_s=60, workers=1, seed=0)
    assert milp.status is SolveStatus.OPTIMAL and cpsat.status is SolveStatus.OPTIMAL
    assert milp.timeline.makespan == cpsat.timeline.makespan == expected
    timeline = checked(milp)
    assert mm.choose_milp_grid(problem).exact and timeline.makespan == milp.objective_ms  # the model's makespan
    assert timeline.peak <= problem.memory.budget
    if keep_or_offload is not None:
        without = solve_milp(dataclasses.replace(problem, recompute=Recompute()), time_limit_s=60)
        assert without.status is SolveStatus.OPTIMAL and without.timeline.makespan == keep_or_offload
        if keep_or_offload > expected:  # only recomputing is this fast
            assert milp.schedule.recomputed


def test_fused_backwards_recompute_too():
    problem = _recomputing(uniform_problem(2, 3, budget=150))
    fused = solve_milp(problem, time_limit_s=60, split_backward=False)
    kept = solve_milp(dataclasses.replace(problem, recompute=Recompute()), time_limit_s=60, split_backward=False)
    assert fused.status is SolveStatus.OPTIMAL and fused.schedule.recomputed
    assert checked(fused).makespan == fused.objective_ms < kept.timeline.makespan


def test_a_recomputed_hint_is_a_solution_of_both_models():
    problem = _recomputing(uniform_problem(3, 4, budget=400, offload=FAST_LINK))
    offloaded = _with_offload(problem, one_f_one_b(problem), {(0, 1), (1, 0)})
    hint = add_recomputes(problem, offloaded, [(0, 2), (0, 3), (1, 2), (2, 1)])
    timeline = simulate(problem, hint)
    assert timeline.fits and len(hint.recomputed) == 4
    data = mm.prepare(problem, mm.choose_milp_grid(problem))
    for asap in (False, True):
        model = mm.build_model(data, mm.serial_horizon(data), asap=asap)
        values = _valid_start(model, hint, timeline)
        assert values is not None, f"the hint breaks the {'exact' if asap else 'relaxed'} model"
        assert values[model.makespan] * 0.5 == timeline.makespan
        assert sum(values[r] for r in model.recompute.values()) == 4


# --------------------------------------------------------------------------- shared host links


def _linked(problem, *groups):
    return dataclasses.replace(problem, offload=dataclasses.replace(problem.offload, link_groups=groups))


LINKED_CASES = [
    pytest.param(_linked(uniform_problem(2, 4, budget=150, offload=SLOWER_LINK), (0, 1)), 17.0, id="p2"),
    pytest.param(_recomputing(_linked(uniform_problem(2, 4, budget=120, offload=SLOWER_LINK), (0, 1)), time_ms=2.0),
                 20.0, id="p2-recompute"),
]


@pytest.mark.parametrize("problem, expected", LINKED_CASES)
def test_shared_links_are_served_as_the_simulator_serves_them(problem, expected):
    milp = solve_milp(problem, time_limit_s=60)
    cpsat = solve_cpsat(problem, time_limit_s=60, workers=1, seed=0)
    assert milp.status is SolveStatus.OPTIMAL and cpsat.status is SolveStatus.OPTIMAL
    assert milp.timeline.makespan == cpsat.timeline.makespan == expected
    assert checked(milp).makespan == milp.objective_ms  # first come first served in the model too


def test_a_hint_on_shared_links_is_a_solution_of_both_models():
    problem = _recomputing(_linked(uniform_problem(3, 4, budget=400, offload=SLOWER_LINK), (0, 1, 2)))
    offloaded = _with_offload(problem, one_f_one_b(problem), {(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)})
    hint = add_recomputes(problem, offloaded, [(0, 3), (1, 2)])
    timeline = simulate(problem, hint)
    assert timeline.fits
    data = mm.prepare(problem, mm.choose_milp_grid(problem))
    for asap in (False, True):
        model = mm.build_model(data, mm.serial_horizon(data), asap=asap)
        assert len(model.ready) == 2 * 12  # a ready time per OFFLOAD and per RELOAD on the shared link
        values = _valid_start(model, hint, timeline)
        assert values is not None, f"the hint breaks the {'exact' if asap else 'relaxed'} model"
        assert values[model.makespan] * data.grid.resolution_ms == timeline.makespan


# --------------------------------------------------------------------------- limits, hints, progress


def test_tiny_time_limit_returns_the_hint():
    problem = uniform_problem(4, 8, budget=400, offload=FAST_LINK)
    hint = one_f_one_b(problem)
    result = solve_milp(problem, time_limit_s=0.01, hint=hint)
    assert result.status is SolveStatus.NO_IMPROVEMENT
    assert result.schedule == hint and result.objective_ms is None
    checked(result)
    assert result.lower_bound_ms == pytest.approx(27.0)  # the memory-free bound needs no solve


def test_without_a_hint_a_fitting_heuristic_is_the_fallback():
    result = solve_milp(uniform_problem(3, 6, budget=300), time_limit_s=0.01)
    assert result.status in (SolveStatus.NO_IMPROVEMENT, SolveStatus.OPTIMAL)
    checked(result)


def _with_offload(problem, schedule, items):
    """The schedule in split form, OFFLOAD right after F and RELOAD right before B for ``items``."""
    rows = []
    for ops in schedule.devices:
        row = []
        for op in ops:
            s, i = op.stage, op.microbatch
            if op.kind is BW:
                row += ([Op(REL, s, i)] if (s, i) in items else []) + [Op(B, s, i), Op(W, s, i)]
            else:
                row += [op] + ([Op(OFF, s, i)] if (s, i) in items else [])
        rows.append(row)
    return Schedule.of(schedule.name, rows)


def test_hint_is_a_solution_of_both_models_and_unit_times_match_the_simulator():
    problem = uniform_problem(3, 4, budget=400, offload=FAST_LINK)
    hint = _with_offload(problem, one_f_one_b(problem), {(0, 1), (1, 0), (0, 3)})
    timeline = simulate(problem, hint)
    assert timeline.fits and hint.offloaded
    data = mm.prepare(problem, mm.choose_milp_grid(problem))
    times = mm.unit_times(data, hint)
    assert {op: t.start for op, t in timeline.by_op.items()} == {op: t * 0.5 for op, t in times.items()}
    for asap in (False, True):
        model = mm.build_model(data, mm.serial_horizon(data), asap=asap)
        values = _valid_start(model, hint, timeline)
        assert values is not None, f"the hint breaks the {'exact' if asap else 'relaxed'} model"
        assert values[model.makespan] * 0.5 == timeline.makespan


def test_progress_reports_incumbents_and_bounds():
    seen = []
    result = solve_milp(uniform_problem(2, 4, budget=100, offload=FAST_LINK), on_progress=seen.append)
    assert result.status is SolveStatus.OPTIMAL
    assert seen and all(a.elapsed_s <= b.elapsed_s for a, b in zip(seen, seen[1:]))
    assert any("exact" in p.message for p in seen)  # the relaxed solution waited for memory
    assert "fits" in seen[-1].message and seen[-1].gap == 0.0
    assert all(p.bound_ms <= p.incumbent_ms + 1e-9 for p in seen if p.gap is not None)


@pytest.mark.parametrize("options, words", [
    ({"backend": "gurobi"}, "unknown MILP backend 'gurobi'"),
    ({"time_limit_s": 0}, "time limit"),
    ({"threads": 0}, "threads"),
    ({"seed": -1}, "seed"),
])
def test_bad_options_say_what_is_wrong(options, words):
    with pytest.raises(SolverError, match=words):
        solve_milp(uniform_problem(2, 2), **options)
