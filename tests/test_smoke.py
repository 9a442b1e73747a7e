"""The first things a user meets: every command and benchmark is there, every heuristic judged, a missing
file is one line."""

import importlib
import sys

import pytest
from conftest import ROOT

from optpipe.cli.main import COMMANDS, main


def test_compare_runs_on_every_instance(instance):
    from optpipe.solvers.compare import compare

    entries = compare(instance)
    assert any(e.applicable for e in entries)


def test_help_lists_every_command_in_order(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ") and line[4:5].isalpha()]
    assert listed == list(COMMANDS)


@pytest.mark.parametrize("argv", [["check"], ["compare"], ["compile"], ["show", "--schedule", "1F1B"],
                                  ["simulate", "/nonexistent.json"]], ids=lambda argv: argv[0])
def test_a_missing_problem_file_is_one_line_and_exit_1(argv, capsys):
    command, *rest = argv
    assert main([command, "/nonexistent.toml", *rest]) == 1
    err = capsys.readouterr().err
    assert "/nonexistent.toml: no such problem file" in err
    assert len(err.strip().splitlines()) == 1


def test_every_benchmark_make_bench_names_is_there():
    if str(ROOT) not in sys.path:  # benchmarks/ is a folder of the repository, not of the installed package
        sys.path.insert(0, str(ROOT))
    from benchmarks.__main__ import ORDER

    for name in ORDER:
        assert callable(importlib.import_module(f"benchmarks.{name}").run), name
