"""Every heuristic schedule on every benchmark problem, judged by the simulator."""

from __future__ import annotations

from optpipe.compiler.commands.compare_cmd import print_comparison
from optpipe.compiler.problem import load_problem
from optpipe.solvers.compare import compare

from ._common import instances, save


def run() -> list[dict]:
    rows = []
    for path in instances():
        problem = load_problem(path)
        entries = compare(problem)
        print_comparison(problem, entries)
        rows += [{"problem": problem.name, **entry.to_json()} for entry in entries]
    save("heuristics", rows)
    return rows


if __name__ == "__main__":
    run()
