"""Every heuristic schedule on every benchmark problem, judged by the simulator; then ours against
the Zero Bubble / PipeOffload authors' own generators (figures in tests/data/reference_schedules.json,
which says how they were produced): the PipeOffload schedules side by side on the offload instances,
and worst / mean makespan ratio per schedule over the reference grid."""

from __future__ import annotations

import json

from rich.table import Table

from optpipe.cli.views import print_comparison
from optpipe.core.errors import NotApplicable
from optpipe.core.problem_file import load_problem, problem_from_dict
from optpipe.core.simulate import simulate
from optpipe.core.units import format_size
from optpipe.solvers.compare import compare
from optpipe.solvers.registry import generate

from ._common import HERE, PROBLEMS, console, instances, save

REFERENCE = HERE.parent / "tests" / "data" / "reference_schedules.json"
PIPEOFFLOAD = "pipeoffload (inline)"


def _offload_problem(label: str, data: dict):
    return problem_from_dict(data["pipeoffload_problem"]) if label == PIPEOFFLOAD else load_problem(PROBLEMS / label)


def pipeoffload_side_by_side(data: dict) -> list[dict]:
    """Makespan and peak of GIS, GIS-H, PO-H, PO-F: the authors' (group-interleaved 1F1B + offload pass) and ours."""
    rows = []
    problems: dict[str, object] = {}
    for ref in data["offload"]:
        label, name = ref["problem"], ref["schedule"]
        problem = problems.setdefault(label, _offload_problem(label, data))
        row = {"problem": label, "schedule": name, "ref_makespan_ms": ref["makespan"], "ref_peak_bytes": ref["peak"],
               "ours_makespan_ms": None, "ours_peak_bytes": None,
               "note": f"the authors' generator fails: {ref['note']}" if ref.get("note") else ""}
        try:
            timeline = simulate(problem, generate(name, problem))
            row["ours_makespan_ms"], row["ours_peak_bytes"] = timeline.makespan, timeline.peak
        except NotApplicable as why:
            row["note"] = (row["note"] + "; " if row["note"] else "") + f"ours: {why}"
        rows.append(row)
    table = Table(title="PipeOffload schedules: the authors' generator + offload pass vs ours (our simulator)")
    for column in ("problem", "schedule", "authors ms", "authors peak", "ours ms", "ours peak", "ms ratio",
                   "peak ratio"):
        table.add_column(column, justify="left" if column in ("problem", "schedule") else "right")
    notes = []
    for r in rows:
        rm, om, rp, op = r["ref_makespan_ms"], r["ours_makespan_ms"], r["ref_peak_bytes"], r["ours_peak_bytes"]
        mark = ""
        if r["note"]:
            notes.append(f"[{len(notes) + 1}] {r['problem']} {r['schedule']}: {r['note']}")
            mark = f" [{len(notes)}]"
        table.add_row(r["problem"].removesuffix(".toml"), r["schedule"] + mark, f"{rm:,.1f}" if rm else "-",
                      format_size(rp) if rp else "-", f"{om:,.1f}" if om else "-", format_size(op) if op else "-",
                      f"{om / rm:.3f}" if om and rm else "-", f"{op / rp:.3f}" if op and rp else "-")
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True, markup=False)
    return rows


def reference_grid(data: dict) -> list[dict]:
    """Ours / the authors' makespan on every grid row, summarised per schedule."""
    import sys

    sys.path.insert(0, str(HERE.parent / "tests"))
    from test_heuristics_reference import ROWS, problem_of  # one reading of the data file's rows

    ratios: dict[str, list[tuple[float, bool]]] = {}
    for row in ROWS:
        problem = problem_of(row)
        timeline = simulate(problem, generate(row["schedule"], problem))
        ratios.setdefault(row["schedule"], []).append((timeline.makespan / row["makespan"],
                                                       timeline.peak <= row["peak"]))
    table = Table(title=f"Ours / the authors' makespan over the reference grid ({len(ROWS)} rows)")
    for column in ("schedule", "shapes", "worst", "mean", "best", "slower", "peak <= theirs"):
        table.add_column(column, justify="left" if column == "schedule" else "right")
    summary = []
    for name, values in ratios.items():
        r = [v for v, _ in values]
        entry = {"schedule": name, "shapes": len(r), "worst": max(r), "mean": sum(r) / len(r), "best": min(r),
                 "slower": sum(v > 1 + 1e-9 for v in r), "peak_ok": all(ok for _, ok in values)}
        summary.append(entry)
        table.add_row(name, str(entry["shapes"]), f"{entry['worst']:.4f}", f"{entry['mean']:.4f}",
                      f"{entry['best']:.4f}", str(entry["slower"]), "yes" if entry["peak_ok"] else "NO")
    console.print(table)
    return summary


def run() -> list[dict]:
    rows = []
    for path in instances():
        problem = load_problem(path)
        entries = compare(problem)
        print_comparison(problem, entries)
        rows += [{"problem": problem.name, **entry.to_json()} for entry in entries]
    data = json.loads(REFERENCE.read_text())
    side_by_side = pipeoffload_side_by_side(data)
    grid = reference_grid(data)
    save("heuristics", rows, pipeoffload_side_by_side=side_by_side, reference_grid=grid)
    return rows


if __name__ == "__main__":
    run()
