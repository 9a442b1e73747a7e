"""The command line: each command's output and its one-line errors with non-zero exits."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import PROBLEM_DIR, uniform_problem

from optpipe.cli.main import main
from optpipe.core.render import chrome_trace, gantt_text
from optpipe.core.schedule import dump_schedule
from optpipe.core.simulate import simulate
from optpipe.solvers import generate

BALANCED = str(PROBLEM_DIR / "balanced-p4-m8.toml")

GOLDEN_1F1B = """\
1F1B: makespan 18.0 ms, bubble 33.3%, one column = 0.333 ms
 d0 |F0 F1 F2 ............BW0   F3 BW1   ...BW2   ...BW3
 d1 |...F0 F1 ......BW0   F2 BW1   F3 BW2   ...BW3   ......
 d2 |......F0 BW0   F1 BW1   F2 BW2   F3 BW3   ............"""


def test_gantt_golden_text():
    problem = uniform_problem(3, 4)
    assert gantt_text(simulate(problem, generate("1F1B", problem))) == GOLDEN_1F1B


def test_chrome_trace_has_tracks_and_memory_counter():
    problem = uniform_problem(2, 2)
    trace = chrome_trace(simulate(problem, generate("1F1B", problem)))
    events = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "thread_name"}
    assert {(0, "compute"), (0, "d2h"), (0, "h2d"), (1, "compute")} <= names
    ops = [e for e in events if e["ph"] == "X"]
    assert len(ops) == 8 and all(e["dur"] > 0 for e in ops)
    counters = [e for e in events if e["ph"] == "C" and e["pid"] == 0]
    assert max(e["args"]["bytes"] for e in counters) == 200


def test_check_prints_the_problem(capsys):
    assert main(["check", BALANCED]) == 0
    out = capsys.readouterr().out
    assert "balanced-p4-m8: valid" in out and "k = 0.50" in out


def test_compare_json_keys(capsys):
    assert main(["compare", BALANCED, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    keys = {"name", "applicable", "reason", "makespan_ms", "bubble_ratio", "peak_memory_bytes", "host_peak_bytes",
            "fits_budget"}
    assert all(keys <= set(row) for row in rows)
    fitting = [row for row in rows if row["fits_budget"]]
    assert fitting == sorted(fitting, key=lambda row: row["makespan_ms"])
    assert rows.index(fitting[-1]) < min((rows.index(r) for r in rows if not r["fits_budget"]), default=len(rows))


def test_compare_budget_override(capsys):
    assert main(["compare", BALANCED, "--budget", "300MiB", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    one_f_one_b = next(row for row in rows if row["name"] == "1F1B")
    assert not one_f_one_b["fits_budget"]


def test_simulate_json_and_trace(tmp_path, capsys):
    from optpipe.core.problem_file import load_problem

    problem = load_problem(BALANCED)
    path = tmp_path / "s.json"
    dump_schedule(generate("1F1B", problem), path)
    trace = tmp_path / "t.json"
    assert main(["simulate", BALANCED, str(path), "--json", "--trace", str(trace)]) == 0
    summary = json.loads(capsys.readouterr().out)
    timeline = simulate(problem, generate("1F1B", problem))
    assert summary["makespan_ms"] == timeline.makespan
    # idle by phase, per device: it adds up to the device's idle time, and 1F1B's last device
    # starts last, so its wait for its first forward is the longest
    idle = summary["idle_ms"]
    assert [sum(d.values()) for d in idle] == pytest.approx([timeline.makespan - b for b in timeline.busy])
    assert max(range(len(idle)), key=lambda d: idle[d]["head"]) == len(idle) - 1
    assert json.loads(trace.read_text())["otherData"]["schedule"] == "1F1B"


def test_show_draws_a_chart(capsys):
    assert main(["show", BALANCED, "--schedule", "1f1b", "--width", "100"]) == 0
    assert "BW0" in capsys.readouterr().out


def test_errors_are_one_line_and_non_zero(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[pipeline]\ndevices = 0\nmicrobatches = 4\n')
    assert main(["check", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert "pipeline.devices: must be greater than zero" in err and "Traceback" not in err
    assert main(["show", BALANCED, "--schedule", "nope"]) == 1
    assert "unknown schedule 'nope'" in capsys.readouterr().err
    assert main(["compare", BALANCED, "--budget", "1MiB"]) == 2  # no schedule fits: the budget is below one activation
    assert "below one stage's activation" in capsys.readouterr().err
    schedule = tmp_path / "s.json"
    schedule.write_text('{"format": "optpipe-schedule", "version": 1, "name": "x", "devices": [["F0:0"]]}')
    assert main(["simulate", BALANCED, str(schedule)]) == 1
    assert "has 1 devices but the problem has 4" in capsys.readouterr().err


def test_console_script_runs_without_torch():
    """The compiler must not import torch: `optpipe compare` in a fresh interpreter."""
    code = ("import sys; from optpipe.cli.main import main; main(['compare', '--json']); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_error_text_keeps_square_brackets(tmp_path, capsys):
    """Messages name tables like [costs]; rich must not read them as markup."""
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[pipeline]\ndevices = 2\nmicrobatches = 4\n')
    assert main(["check", str(bad)]) == 1
    assert "[costs]: missing table" in capsys.readouterr().err
