"""The neighbourhood search: never worse than its start, always within budget, reproducible."""

from __future__ import annotations

import random
import re
import time

import pytest

from optpipe.core.problem import Offload
from optpipe.core.simulate import simulate
from optpipe.solvers.compare import compare
from optpipe.solvers.lns import KINDS, improve
from optpipe.solvers.moves import improve_by_moves, move_score
from optpipe.solvers.neighbourhoods import KINDS as WINDOW_KINDS
from optpipe.solvers.neighbourhoods import choose

from conftest import uniform_problem

# p = 4, m = 8, F = B = W = 1 ms: a budget of three activations and a
# link that moves one in 1 ms each way, so offload decisions are open.
OFFLOAD = uniform_problem(4, 8, act=100, keep=50, budget=300, offload=Offload(True, 1e5, 1e5, 10**9),
                          name="search-offload")
PLAIN = uniform_problem(4, 8, act=100, keep=50, budget=400, name="search-plain")


def _fitting(problem):
    fitting = [e.judged for e in compare(problem) if e.fits]
    return sorted(fitting, key=lambda j: -j.makespan_ms)  # the slowest first: room to improve


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("problem", [OFFLOAD, PLAIN], ids=lambda p: p.name)
def test_each_kind_alone_never_worse_and_fits(problem, kind):
    start = _fitting(problem)[0]
    search = improve(problem, start.schedule, time_limit_s=30.0, workers=1, seed=3, kinds=(kind,),
                     max_windows=4, deterministic=True, window_limit_s=0.5)
    again = simulate(problem, search.best.schedule)
    assert again.fits
    assert again.makespan == search.best.makespan_ms
    assert again.makespan <= start.timeline.makespan + 1e-9


def test_restarts_never_worse_than_the_first_start():
    starts = _fitting(OFFLOAD)
    search = improve(OFFLOAD, starts[0].schedule, time_limit_s=30.0, workers=1, seed=1,
                     restarts=[e.schedule for e in starts[1:3]], max_windows=9, deterministic=True,
                     window_limit_s=0.5)
    assert search.best.fits
    assert search.best.makespan_ms <= min(e.timeline.makespan for e in starts[:3]) + 1e-9


def test_compile_restarts_from_other_families_only_on_small_pipelines():
    from optpipe.solvers.restarts import _RESTART_DEVICES, restarts
    from optpipe.solvers.result import Judged

    ahead = list(reversed(_fitting(PLAIN)))[0]  # the fastest
    other = Judged("Other+W(1)", ahead.schedule.renamed("Other+W(1)"), ahead.timeline)  # another family, as fast
    assert restarts(PLAIN, ahead, [ahead, other]) == [other.schedule]
    wide = uniform_problem(_RESTART_DEVICES, 2 * _RESTART_DEVICES, act=100, keep=50, budget=10**6, name="wide")
    assert restarts(wide, ahead, [ahead, other]) == []


def test_deep_warm_up_applies_to_small_interleaved_pipelines_only():
    from optpipe.solvers.neighbourhoods import deep_applies

    assert deep_applies(uniform_problem(4, 8, v=2))
    assert not deep_applies(uniform_problem(4, 8, v=1))
    assert not deep_applies(uniform_problem(12, 12, v=2))


def test_deep_warm_up_windows_come_first_interleaved_never_worse_and_fit(monkeypatch):
    from optpipe.solvers import lns

    interleaved = []
    real = lns.solve_model

    def spy(model, **options):
        interleaved.append(options.get("interleave", False))
        return real(model, **options)

    monkeypatch.setattr(lns, "solve_model", spy)
    problem = uniform_problem(4, 8, v=2, f=1.0, b=1.2, w=0.8, p2p=0.1, act=100, keep=50, budget=700,
                              offload=Offload(True, 1e5, 1e5, 10**9), name="deep")
    start = max((e.judged for e in compare(problem) if e.fits), key=lambda j: j.makespan_ms)
    seen = []
    search = improve(problem, start.schedule, time_limit_s=60.0, workers=1, seed=2, max_windows=1,
                     deterministic=True, window_limit_s=0.2, deep_warm_up=True,
                     on_progress=lambda progress: seen.append(progress.message))
    assert seen and "last deep warm-up" in seen[0]
    assert interleaved == [True]  # one worker gets CP-SAT's LNS helpers too, on this large model only
    improve(problem, start.schedule, time_limit_s=60.0, workers=2, seed=2, max_windows=1, deterministic=True,
            window_limit_s=0.2, deep_warm_up=True)
    assert interleaved == [True, False]  # a second worker runs them already
    again = simulate(problem, search.best.schedule)
    assert again.fits
    assert again.makespan <= start.timeline.makespan + 1e-9


def test_deterministic_with_a_fixed_seed_and_one_worker():
    start = _fitting(OFFLOAD)[0]
    runs = [improve(OFFLOAD, start.schedule, time_limit_s=60.0, workers=1, seed=7, max_windows=8,
                    deterministic=True, window_limit_s=0.5) for _ in range(2)]
    assert runs[0].best.schedule.to_text() == runs[1].best.schedule.to_text()
    assert runs[0].best.makespan_ms == runs[1].best.makespan_ms


def test_the_search_improves_a_slow_start():
    start = _fitting(OFFLOAD)[0]
    search = improve(OFFLOAD, start.schedule, time_limit_s=60.0, workers=1, seed=1, max_windows=12,
                     deterministic=True, window_limit_s=0.5)
    assert search.best.makespan_ms < start.timeline.makespan
    assert search.improvements >= 1


@pytest.mark.parametrize("problem", [OFFLOAD, PLAIN], ids=lambda p: p.name)
def test_list_moves_keep_every_op_never_worse_and_fit(problem):
    start = _fitting(problem)[0]
    moved = improve_by_moves(problem, start.schedule, deadline=float("inf"), rng=random.Random(0), max_tries=60)
    assert sorted(op for _, op in moved.schedule.ops()) == sorted(op for _, op in start.schedule.ops())
    again = simulate(problem, moved.schedule)
    assert again.fits
    assert move_score(again) <= move_score(start.timeline)
    assert start.schedule == _fitting(problem)[0].schedule  # the input is not changed


def test_list_moves_begin_no_simulation_past_their_deadline(monkeypatch):
    from optpipe.solvers import moves

    start = _fitting(OFFLOAD)[0]
    simulated = []
    real = moves.try_simulate
    monkeypatch.setattr(moves, "try_simulate", lambda *args: simulated.append(1) or real(*args))
    moved = improve_by_moves(OFFLOAD, start.schedule, deadline=time.monotonic() - 1.0, rng=random.Random(0),
                             timeline=start.timeline)
    assert (moved.tried, simulated) == (0, [])
    assert moved.schedule == start.schedule


@pytest.mark.parametrize("kind", WINDOW_KINDS)
def test_neighbourhoods_are_slices_in_time(kind):
    timeline = _fitting(OFFLOAD)[0].timeline
    hood = choose(OFFLOAD, timeline, kind, 2, 1, random.Random(0))
    assert hood.t0 < hood.t1 <= hood.t2
    assert hood.devices is None or all(0 <= d < OFFLOAD.devices for d in hood.devices)
    again = choose(OFFLOAD, timeline, kind, 2, 1, random.Random(0))
    assert again == hood


def test_a_microbatch_neighbourhood_frees_only_its_microbatches():
    """The slice's other ops keep their order and offload decisions; the model still finds a
    schedule (the current one is a solution) that fits when spliced in."""
    from optpipe.solvers.cpsat import Model, solve_model
    from optpipe.solvers.window import splice, window_scope
    from optpipe.solvers.timegrid import choose_grid

    timeline = _fitting(OFFLOAD)[0].timeline
    hood = choose(OFFLOAD, timeline, "microbatches", 2, 1, random.Random(0))
    free = hood.microbatches
    assert free
    grid = choose_grid(OFFLOAD)
    scope, inside = window_scope(OFFLOAD, timeline, grid, hood.t0, hood.t1, hood.t2, hood.devices, free)
    assert scope.chains and not any(op.microbatch in free for chain in scope.chains for op in chain)
    assert any(op.microbatch in free for op in scope.compute)
    assert all(i in free for _, i in scope.open_pairs)
    model = Model(OFFLOAD, grid, scope, grid.up(timeline.makespan) + 1)
    model.hint(inside, scope.offloaded)
    solver, code = solve_model(model, time_limit_s=10.0, seed=0, workers=1)
    assert solver.StatusName(code) in ("OPTIMAL", "FEASIBLE")
    spliced = splice(OFFLOAD, timeline, scope, frozenset(model.start), model.values(solver), grid,
                      timeline.makespan + 1.0)
    for chain in scope.chains:  # held ops in the order they had
        device = OFFLOAD.pipeline.device_of(chain[0].stage)
        order = [op for op in spliced.devices[device] if op in set(chain)]
        assert order == list(chain)
    assert simulate(OFFLOAD, spliced).fits


@pytest.mark.parametrize("kind", ["sweep", "warm-up", "cool-down"])
def test_a_window_model_proves_the_same_optimum_without_the_lp(kind):
    """The window search solves its models without CP-SAT's linear relaxation (lns.py, for speed):
    what it proves optimal must be what the model with the LP proves."""
    from optpipe.solvers.cpsat import Model, solve_model
    from optpipe.solvers.window import window_scope
    from optpipe.solvers.timegrid import choose_grid

    timeline = _fitting(OFFLOAD)[0].timeline
    hood = choose(OFFLOAD, timeline, kind, 3, 1, random.Random(0))
    grid = choose_grid(OFFLOAD)
    scope, inside = window_scope(OFFLOAD, timeline, grid, hood.t0, hood.t1, hood.t2, hood.devices, hood.microbatches)
    answers = []
    for linear_relaxation in (True, False):
        model = Model(OFFLOAD, grid, scope, grid.up(timeline.makespan) + 1)
        model.hint(inside, scope.offloaded)
        solver, code = solve_model(model, time_limit_s=20.0, seed=0, workers=1, light_presolve=True,
                                   linear_relaxation=linear_relaxation)
        assert solver.StatusName(code) == "OPTIMAL"
        answers.append(solver.objective_value)
    assert answers[0] == answers[1]


def test_a_window_that_gains_is_followed_by_w_deferral():
    start = _fitting(OFFLOAD)[0]
    seen = []
    improve(OFFLOAD, start.schedule, time_limit_s=60.0, workers=1, seed=1, max_windows=10, deterministic=True,
            window_limit_s=0.5, kinds=("sweep", "defer", "idle", "warm-up", "cool-down"),
            on_progress=lambda progress: seen.append(progress.message))
    faster = [int(re.search(r"(\d+) faster", message).group(1)) for message in seen]
    before = [0] + faster
    gains = [k for k in range(len(seen)) if faster[k] > before[k] and "W passes deferred" not in seen[k]]
    assert gains, seen  # a window gained: the rule below is put to the test
    for k in gains:
        if k + 1 < len(seen):
            assert "critical W passes deferred" in seen[k + 1], seen


def test_from_16_devices_the_search_finishes_the_start_s_w_deferral_before_any_window():
    """There windows move no start in a 60 s compile, and the pass the starts began may have been
    cut at its share of the limit (wdefer.search_defers_first)."""
    from benchmarks.problem_grid import generated
    from optpipe.solvers import registry
    from optpipe.solvers.wdefer import defer_critical_w

    problem = generated(0, 16, 1, 16, 1.0, None, seed=0)
    schedule = registry.generate("GIS-H", problem)  # each W right after its B: deferral pays
    problem = problem.with_budget(max(problem.memory.budget, simulate(problem, schedule).peak))
    _, whole_pass = defer_critical_w(problem, schedule, simulate(problem, schedule))
    runs = {}
    for first in (True, False):
        seen = []
        search = improve(problem, schedule, time_limit_s=60.0, workers=1, seed=1, max_windows=1, deterministic=True,
                         window_limit_s=0.5, defer_first=first, on_progress=lambda progress: seen.append(progress.message))
        runs[first] = (search.best.makespan_ms, seen)
    assert "critical W passes deferred" in runs[True][1][0]
    assert runs[True][0] == pytest.approx(whole_pass.makespan)  # where the pass alone ends
    assert "critical W passes deferred" not in runs[False][1][0]  # the portfolio's other search: windows
