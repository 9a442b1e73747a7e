"""The benchmark's generated problems: the same every run, and scaled budgets change only the budget."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.problem_grid import grid, small, with_budgets, with_microbatches


def test_grid_is_the_same_every_run():
    assert grid() == grid()
    assert [p.name for p in grid()][:2] == ["grid00-p4-v1-m8-b0.5-k1", "grid01-p4-v2-m16-b0.35-k2"]


def test_small_problems_stay_small():
    for problem in small(12):
        pipe = problem.pipeline
        assert 3 * pipe.devices * pipe.chunks_per_device * pipe.microbatches <= 160


def test_with_budgets_scales_the_budget_and_nothing_else():
    problem = grid()[11]
    scaled = with_budgets(problem, [1, 1.5, 2])
    assert [p.name for p in scaled] == [problem.name + suffix for suffix in ("@1x", "@1.5x", "@2x")]
    assert [p.memory.budget for p in scaled] == [problem.memory.budget, int(problem.memory.budget * 1.5),
                                                 problem.memory.budget * 2]
    for p in scaled:
        same = dataclasses.replace(p, name=problem.name, memory=problem.memory)
        assert same == problem


def test_with_microbatches_changes_the_count_and_nothing_else():
    problem = grid()[3]
    shorter = with_microbatches(problem, [4, 6])
    assert [p.name for p in shorter] == [problem.name + "@m4", problem.name + "@m6"]
    assert [p.pipeline.microbatches for p in shorter] == [4, 6]
    for p in shorter:
        assert dataclasses.replace(p, name=problem.name, pipeline=problem.pipeline) == problem


def test_per_microbatch_gives_each_steps_cost_per_microbatch():
    from benchmarks.solver_quality import per_microbatch

    def row(m, makespan, bound, status="feasible", problem="g"):
        return {"problem": f"{problem}@m{m}", "microbatches": m, "makespan_ms": makespan, "lower_bound_ms": bound,
                "status": status, "time_limit_s": 60.0}

    rows = [row(8, 368.0, 338.0), row(4, 192.0, 192.0, "optimal"), row(6, 280.0, 280.0, "optimal"),
            row(4, 1.0, 1.0, "infeasible", problem="h"), row(4, 10.0, 10.0, problem="k")]
    again = [{**row(4, 190.0, 190.0), "run": 1}]  # another run's compile is not a step of this ladder
    ladder = per_microbatch(rows + again)
    assert [(s["from"], s["to"], s["proven_at_from"]) for s in ladder] == [(4, 6, True), (6, 8, True)]
    assert [s["problem"] for s in ladder] == ["g", "g"]  # one count alone (k), or none that solved (h): no step
    assert ladder[0]["makespan_ms_per_microbatch"] == 44.0 and ladder[0]["bound_ms_per_microbatch"] == 44.0
    assert ladder[1]["makespan_ms_per_microbatch"] == 44.0 and ladder[1]["bound_ms_per_microbatch"] == 29.0


def test_a_microbatch_ladder_compiles_each_count_and_saves_the_steps(monkeypatch):
    import benchmarks.solver_quality as quality

    saved = {}
    monkeypatch.setattr(quality, "save", lambda name, rows, **meta: saved.update(name=name, rows=rows, **meta))
    rows = quality.run_grid([5.0], only="grid00", microbatches=[2, 4])
    assert [(r["problem"], r["microbatches"]) for r in rows] == [
        ("grid00-p4-v1-m8-b0.5-k1@m2", 2), ("grid00-p4-v1-m8-b0.5-k1@m4", 4)]
    assert saved["name"] == "solver_quality_grid_only-grid00_microbatches" and saved["microbatches"] == [2, 4]
    (step,) = saved["per_microbatch"]
    assert (step["from"], step["to"]) == (2, 4)
    # grid00 (p = 4, v = 1) is solved to optimality at both counts: schedule and bound grow alike
    assert step["proven_at_from"] and [r["status"] for r in rows] == ["optimal", "optimal"]
    assert step["makespan_ms_per_microbatch"] == pytest.approx(step["bound_ms_per_microbatch"])
    assert step["makespan_ms_per_microbatch"] > 0


@pytest.mark.parametrize("argv", [
    ["--grid", "--budgets", "x"], ["--grid", "--time-limits", "0,5"], ["--budgets", "1,2"],
    ["--grid", "--repeat", "0"], ["--grid", "--repeat", "two"], ["--repeat", "3"],
    ["--microbatches", "4,8"], ["--grid", "--microbatches", "0,4"], ["--grid", "--microbatches", "4.5"],
    ["--grid", "--microbatches", ","],
])
def test_solver_quality_checks_its_command_line(argv, capsys):
    from benchmarks.solver_quality import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_stability_counts_each_rows_runs_within_two_percent():
    from benchmarks.solver_quality import stability

    def row(problem, gap, limit=60.0, status="feasible"):
        return {"problem": problem, "gap": gap, "time_limit_s": limit, "status": status}

    rows = [row("a", 0.03), row("a", 0.01), row("a", 0.02), row("a", 0.025),
            row("b", 0.0), row("b", 0.0, limit=10.0), row("c", None, status="infeasible")]
    spread = {(s["problem"], s["time_limit_s"]): s for s in stability(rows)}
    assert set(spread) == {("a", 60.0), ("b", 60.0), ("b", 10.0)}  # an infeasible run has no gap to count
    a = spread[("a", 60.0)]
    assert (a["runs"], a["within_2_percent"]) == (4, 2)  # exactly 2% counts as within
    assert (a["best_gap"], a["median_gap"], a["worst_gap"]) == (0.01, 0.02, 0.03)  # lower middle of four
    assert spread[("b", 10.0)]["runs"] == 1


def test_a_repeated_grid_run_compiles_each_problem_again_with_the_next_seed(monkeypatch):
    import benchmarks.solver_quality as quality

    saved = {}
    seeds = []
    real_row = quality._row
    monkeypatch.setattr(quality, "save", lambda name, rows, **meta: saved.update(name=name, rows=rows, **meta))
    monkeypatch.setattr(quality, "_row", lambda problem, limit, seed: seeds.append(seed) or real_row(problem, limit, seed))
    rows = quality.run_grid([5.0], seed=0, only="grid00, nothing-by-this-name", repeat=2)  # a space after the comma too
    assert seeds == [0, 1]
    assert [r["run"] for r in rows] == [0, 1] and {r["problem"] for r in rows} == {"grid00-p4-v1-m8-b0.5-k1"}
    assert saved["name"] == "solver_quality_grid_only-grid00-nothing-by-this-name_repeat" and saved["runs"] == 2
    (spread,) = saved["stability"]
    assert spread["runs"] == 2 and spread["within_2_percent"] == 2  # grid00 is solved to optimality


def test_a_grid_of_another_seed_is_saved_under_its_own_name(monkeypatch):
    """Seed 0's grid is the committed record; another seed's run must not overwrite it."""
    import benchmarks.solver_quality as quality

    saved = {}
    monkeypatch.setattr(quality, "save", lambda name, rows, **meta: saved.update(name=name, **meta))
    rows = quality.run_grid([2.0], seed=3, only="grid00")
    assert saved["name"] == "solver_quality_grid_only-grid00_seed3" and saved["seed"] == 3
    assert [r["problem"] for r in rows] == ["grid00-p4-v1-m8-b0.5-k1"]


def test_runs_of_other_rows_are_saved_under_their_own_names():
    """A run of one row's ladder must not overwrite another row's (it did, twice, with one name for
    every --only run)."""
    from benchmarks.solver_quality import _selection, grid_result_name

    assert _selection("grid02, grid08,") == ["grid02", "grid08"]  # " grid08" would match no row

    plain = dict(budgets=False, microbatches=False, repeat=False)
    assert grid_result_name(0, "", **plain) == "solver_quality_grid"
    ladder = {**plain, "microbatches": True}
    assert grid_result_name(2, "grid03", **ladder) == "solver_quality_grid_only-grid03_microbatches_seed2"
    assert grid_result_name(2, "grid11", **ladder) == "solver_quality_grid_only-grid11_microbatches_seed2"
    assert grid_result_name(0, "grid02, grid08", **plain) == "solver_quality_grid_only-grid02-grid08"
    assert grid_result_name(1, "p8-v3", **{**plain, "budgets": True, "repeat": True}) == (
        "solver_quality_grid_budgets_only-p8-v3_repeat_seed1")
    assert "/" not in grid_result_name(0, "../x", **plain)  # never a path
