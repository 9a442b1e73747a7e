"""optpipe compile, from the command line and through compile_problem."""

from __future__ import annotations

import json

import pytest

from optpipe.cli.main import main
from optpipe.core.errors import InfeasibleError
from optpipe.core.problem import Offload
from optpipe.core.problem_file import dump_problem, load_problem
from optpipe.core.schedule import load_schedule
from optpipe.core.simulate import simulate
from optpipe.plan.bytecode import read_plan
from optpipe.solvers.compile import compile_problem
from optpipe.solvers.result import SolveStatus

from conftest import PROBLEM_DIR, uniform_problem

KEYS = {"solver", "status", "makespan_ms", "lower_bound_ms", "gap", "solve_time_s", "peak_memory_bytes",
        "budget_bytes", "offloaded", "baseline_name", "baseline_makespan_ms", "busiest_compute_ms"}


def _small(tmp_path, m: int):
    path = tmp_path / "small.toml"
    dump_problem(uniform_problem(4, m, act=100, keep=50, budget=250, offload=Offload(True, 1e5, 1e5, 10**9),
                                 name="small"), path)
    return path


@pytest.fixture
def small(tmp_path):
    """p = 4, m = 8, two and a half activations of budget, a fast host link."""
    return _small(tmp_path, 8)


@pytest.fixture
def proven(tmp_path):
    """The same at m = 4: compile proves it optimal in about a second (m = 8 took 13 s)."""
    return _small(tmp_path, 4)


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


def test_json_has_every_key_and_beats_the_baseline_and_the_files_hold_the_result(proven, tmp_path, capsys):
    """One solve for the JSON and the schedule and plan files (the solve is most of the time)."""
    schedule_path, plan_path = tmp_path / "s.json", tmp_path / "p.opb"
    assert main(["compile", str(proven), "--time-limit", "120", "--workers", "2", "--json",
                 "--schedule-out", str(schedule_path), "-o", str(plan_path)]) == 0
    out = _json(capsys)
    assert KEYS <= out.keys()
    assert out["solver"] == "cpsat"
    assert out["status"] == "optimal"
    assert out["makespan_ms"] == pytest.approx(16.0)
    assert out["makespan_ms"] <= out["baseline_makespan_ms"]
    assert out["peak_memory_bytes"] <= out["budget_bytes"] == 250
    assert out["busiest_compute_ms"] == 12.0
    assert out["lower_bound_ms"] == pytest.approx(16.0) and out["gap"] == 0.0
    timeline = simulate(load_problem(proven), load_schedule(schedule_path))
    assert timeline.makespan == pytest.approx(out["makespan_ms"])
    assert read_plan(plan_path) is not None


def test_table_names_the_result_and_the_baseline(proven, capsys):
    assert main(["compile", str(proven), "--time-limit", "120", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    assert "cpsat (optimal)" in out
    assert "best fitting heuristic" in out
    assert "lower bound" in out


def test_impossible_budget_says_what_would_fit(tmp_path, capsys):
    # two chunks per device and no offload: each device holds two activations at once
    path = tmp_path / "two-chunks.toml"
    dump_problem(uniform_problem(2, 4, v=2, act=100, keep=50, budget=150, name="two-chunks"), path)
    assert main(["compile", str(path), "--time-limit", "5", "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "no schedule fits the budget of 150B" in err
    assert "smallest budget at which one was found is 200B" in err
    assert "no schedule can fit below 200B" in err
    assert main(["compile", str(path), "--time-limit", "5", "--workers", "2", "--json"]) == 2
    out = _json(capsys)
    assert out["status"] == "infeasible"
    assert out["smallest_budget_found_bytes"] == 200 and out["memory_lower_bound_bytes"] == 200


def test_infeasible_error_carries_the_figures():
    problem = uniform_problem(2, 4, v=2, act=100, keep=50, budget=150)
    with pytest.raises(InfeasibleError) as caught:
        compile_problem(problem, time_limit_s=5.0, workers=2)
    assert caught.value.smallest_found == 200
    assert caught.value.memory_lower_bound == 200
    assert caught.value.exit_code == 2


def test_tiny_time_limit_still_returns_a_fitting_schedule():
    problem = uniform_problem(4, 8, act=100, keep=50, budget=200, offload=Offload(True, 1e5, 1e5, 10**9))
    compiled = compile_problem(problem, time_limit_s=0.01, workers=2)
    assert compiled.judged.fits
    assert compiled.makespan_ms <= compiled.baseline.timeline.makespan
    assert simulate(problem, compiled.judged.schedule).makespan == compiled.makespan_ms
    assert compiled.status in (SolveStatus.NO_IMPROVEMENT, SolveStatus.FEASIBLE)


def test_no_improvement_returns_the_heuristic_and_says_so():
    # without offload the only warm starts are W-filled heuristics; whether one is built within
    # 0.01 s depends on the machine's load, and each outcome has its own verdict
    problem = uniform_problem(4, 8, act=100, keep=50, budget=200)
    compiled = compile_problem(problem, time_limit_s=0.01, workers=2)
    if compiled.judged.schedule == compiled.baseline.schedule:
        assert compiled.status is SolveStatus.NO_IMPROVEMENT
        assert "no improvement" in compiled.note
    else:  # a W-filled start came in time: faster, returned as found, the search never began
        assert compiled.status is SolveStatus.FEASIBLE
        assert compiled.makespan_ms < compiled.baseline.timeline.makespan
        assert "returning the warm start" in compiled.note


def test_large_problems_go_through_the_window_search(capsys):
    path = PROBLEM_DIR / "vshape-p4-m16-half.toml"
    assert main(["compile", str(path), "--time-limit", "4", "--workers", "2", "--json"]) == 0
    out = _json(capsys)
    assert out["makespan_ms"] <= out["baseline_makespan_ms"]
    assert out["peak_memory_bytes"] <= out["budget_bytes"]
    assert out["status"] in ("feasible", "optimal")


def test_named_heuristic(small, capsys):
    assert main(["compile", str(small), "--solver", "heuristic:po-f", "--json"]) == 0
    out = _json(capsys)
    assert out["solver"] == "heuristic:po-f" and out["baseline_name"] is not None
    assert out["offloaded"] > 0


def test_named_heuristic_that_does_not_fit(small, capsys):
    assert main(["compile", str(small), "--solver", "heuristic:GPipe"]) == 2
    assert "GPipe does not fit" in capsys.readouterr().err


def test_unknown_solver(small, capsys):
    assert main(["compile", str(small), "--solver", "gurobi"]) == 1
    assert "unknown solver 'gurobi'" in capsys.readouterr().err


def test_milp_through_the_same_command(small, capsys):
    # correctness, not quality: the MILP runs to its limit here, so the limit is the test's time
    assert main(["compile", str(small), "--solver", "milp-highs", "--time-limit", "1", "--json"]) == 0
    out = _json(capsys)
    assert out["solver"] == "milp-highs"
    assert out["makespan_ms"] <= out["baseline_makespan_ms"]
    assert out["peak_memory_bytes"] <= out["budget_bytes"]


def test_budget_override(small, capsys):
    assert main(["compile", str(small), "--budget", "400B", "--time-limit", "5", "--workers", "2", "--json"]) == 0
    out = _json(capsys)
    assert out["budget_bytes"] == 400
    assert out["makespan_ms"] == pytest.approx(27.0)  # enough memory for ZB-H2's overlap: the fill-and-drain bound


def test_json_on_stdout_is_only_json_in_a_fresh_process(small):
    """The bound's LP (HiGHS) prints a banner on file descriptor 1 when first created; a fresh
    interpreter is where it would show, and it must not land in the JSON."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "optpipe.cli", "compile", str(small), "--time-limit", "2",
                           "--workers", "2", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["lower_bound_ms"] > 0


def _stalled_whole_model(monkeypatch, problem, time_limit_s: float = 20.0):
    """Compile ``problem`` with a whole-model CP-SAT that finds nothing better (not even takes its
    hint) and a window search cut to 1 s; returns the answer, the whole model's options and the
    time the windows were given."""
    from optpipe.solvers import compile as compile_module
    from optpipe.solvers import cpsat, lns
    from optpipe.solvers.result import SolveResult

    assert compile_module.exact_model_fits(problem)
    calls = {}

    def stalled(problem, **options):
        calls["whole"] = options
        return SolveResult("cpsat", SolveStatus.NO_IMPROVEMENT, None, None, None, 1.0, 0.0, 0.5)

    real_improve = lns.improve

    def windows(problem, schedule, **options):
        calls["windows"] = options["time_limit_s"]
        return real_improve(problem, schedule, **{**options, "time_limit_s": 1.0})

    monkeypatch.setattr(cpsat, "solve_cpsat", stalled)
    monkeypatch.setattr(lns, "improve", windows)
    compiled = compile_problem(problem, time_limit_s=time_limit_s, workers=2)
    return compiled, calls["whole"], calls["windows"]


def test_a_stalled_whole_model_hands_the_rest_of_the_time_to_the_window_search(monkeypatch):
    """A whole model that finds nothing better stops after its stall share, and one that keeps
    finding a little after its share of the time in all; the window search then runs from the
    warm start for what is left."""
    problem = uniform_problem(4, 8, act=100, keep=50, budget=250, offload=Offload(True, 1e5, 1e5, 10**9))
    compiled, whole, windows = _stalled_whole_model(monkeypatch, problem)
    assert whole["stall_from_start"] and 2.5 <= whole["stall_s"] <= 5.0  # a quarter of what is left
    assert whole["time_limit_s"] == pytest.approx(10.0)  # ... and a quarter in all, at least 10 s
    assert 10.0 < windows <= 20.0  # the rest of the time limit
    assert compiled.judged.timeline.fits and compiled.resolution_ms == 0.5


def test_the_whole_model_only_glances_at_a_problem_too_large_to_prove(monkeypatch):
    """p = 8, m = 16: 48 compute ops a device fit the whole model, but 384 in all are past where it
    keeps its quarter (compile._WHOLE_OPS), so it gets a twentieth of the time and the windows the rest."""
    problem = uniform_problem(8, 16, act=100, keep=50, budget=250, offload=Offload(True, 1e5, 1e5, 10**9))
    compiled, whole, windows = _stalled_whole_model(monkeypatch, problem)
    assert 0.0 < whole["time_limit_s"] <= 0.05 * 20.0
    assert windows > 10.0
    assert compiled.judged.timeline.fits


def test_a_proven_whole_model_answer_is_not_handed_over(monkeypatch):
    from optpipe.solvers import lns

    monkeypatch.setattr(lns, "improve", lambda *a, **k: pytest.fail("the window search ran after a proof"))
    # p = 4, m = 8, two whole activations of budget: CP-SAT proves 41 ms, above the analytic 36
    compiled = compile_problem(uniform_problem(4, 8, act=100, keep=90, budget=200), time_limit_s=10.0, workers=2)
    assert compiled.status is SolveStatus.OPTIMAL and compiled.makespan_ms == pytest.approx(41.0)
    assert compiled.lower_bound_ms == pytest.approx(41.0)


def test_a_given_start_is_never_beaten_by_a_slower_answer(small, tmp_path, capsys):
    """--start: a schedule compiled before (here for a smaller budget, so it fits this one too)."""
    schedule_path = tmp_path / "tight.json"
    assert main(["compile", str(small), "--budget", "200B", "--time-limit", "5", "--workers", "2",
                 "--schedule-out", str(schedule_path), "--json"]) == 0
    tight = _json(capsys)["makespan_ms"]
    given = load_schedule(schedule_path)
    problem = load_problem(small)
    compiled = compile_problem(problem, time_limit_s=0.5, workers=2, starts=[given])
    assert compiled.judged.timeline.fits and compiled.makespan_ms <= tight + 1e-9
    assert main(["compile", str(small), "--start", str(schedule_path), "--time-limit", "1", "--workers", "2",
                 "--json"]) == 0
    assert _json(capsys)["makespan_ms"] <= tight + 1e-9


def test_a_start_file_that_is_not_there_says_so(small, tmp_path, capsys):
    assert main(["compile", str(small), "--start", str(tmp_path / "nope.json"), "--time-limit", "1"]) == 1
    err = capsys.readouterr().err
    assert "nope.json" in err and "Traceback" not in err


def test_a_start_for_another_problem_says_so(small, tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text('{"format": "optpipe-schedule", "version": 1, "name": "x", "devices": [["F0:0"]]}')
    assert main(["compile", str(small), "--start", str(other), "--time-limit", "1"]) == 1
    assert "devices" in capsys.readouterr().err


def test_a_tight_budget_builds_the_capped_list_schedule_before_the_repairs():
    """Every fitting heuristic far slower than the fastest: the capped offloading schedule comes
    first, and the repairs count it among the fitting ones; a looser budget is not tight."""
    import time

    from optpipe.solvers.compare import compare
    from optpipe.solvers.starts import early_starts as _early_starts, tight as _tight

    link = Offload(True, 100 / 1.5 * 1e3, 100 / 1.5 * 1e3, 10**9)
    tight = uniform_problem(4, 8, v=2, act=100, keep=50, budget=300, offload=link)
    entries = compare(tight)
    assert _tight(tight, entries)
    early = _early_starts(tight, entries, time.monotonic() + 10.0)
    assert early[0].name.startswith("capped-offload(") and all(c.fits for c in early)
    assert all(simulate(tight, c.schedule).makespan == c.makespan_ms for c in early)
    loose = uniform_problem(4, 8, v=2, act=100, keep=50, budget=500, offload=link)
    assert not _tight(loose, compare(loose))
    assert _early_starts(loose, compare(loose), time.monotonic() + 10.0) is None  # warm starts build it then
