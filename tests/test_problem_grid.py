"""The benchmark's generated problems: the same every run, and scaled budgets change only the budget."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.problem_grid import grid, small, with_budgets


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


def test_solver_quality_lists_of_numbers_are_checked_on_the_command_line(capsys):
    from benchmarks.solver_quality import main

    for argv in (["--grid", "--budgets", "x"], ["--grid", "--time-limits", "0,5"], ["--budgets", "1,2"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "error:" in capsys.readouterr().err
