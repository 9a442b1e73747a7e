"""PyTorch's own pipeline schedules, judged by our simulator next to our generators.

PyTorch's schedule classes compute every rank's compute order when they are built; stand-in
stage objects that carry only the pipeline's shape are enough, so no process group is needed.
PyTorch writes that order as its compute-only CSV; we import it (``optpipe import``), lower,
verify and simulate it on the problem, and compare with our generator of the same schedule.

``Schedule1F1B`` appears twice. Its declared ``pipeline_order`` in PyTorch 2.13 is off by one
on the last rank (it lists microbatches 1..m and never 0, because the forward counter starts
at 0 and is incremented before its first use when that rank has no warm-up forwards), so our
import rejects it and the row says why. The order its runtime executes comes from
``_step_microbatches`` with a recording stand-in stage: that one is PyTorch's 1F1B.
"""

from __future__ import annotations

import csv
import io
import tempfile
from pathlib import Path
from types import SimpleNamespace

from rich.table import Table

from optpipe.core.errors import NotApplicable, OptpipeError
from optpipe.plan.lower import lower
from optpipe.core.problem import Placement, Problem
from optpipe.core.problem_file import load_problem
from optpipe.core.simulate import simulate
from optpipe.plan.torch_csv import schedule_from_torch_csv
from optpipe.core.units import format_size
from optpipe.plan.verify import verify
from optpipe.solvers.registry import generate, generators

from ._common import PROBLEMS, console, save

__all__ = ["TORCH_SCHEDULES", "torch_csv", "judge", "run"]

# PyTorch schedule (and variant) -> our generator of the same schedule, by problem shape.
TORCH_SCHEDULES = (
    ("Schedule1F1B", "declared"),
    ("Schedule1F1B", "run"),
    ("ScheduleInterleaved1F1B", "declared"),
    ("ScheduleInterleavedZeroBubble", "declared"),
    ("ScheduleZBVZeroBubble", "declared"),
    ("ScheduleDualPipeV", "declared"),
)
PROBLEM_FILES = ("balanced-p4-m8.toml", "zb15b-p8-m32.toml", "gpt-p8-v2-m32-quarter.toml", "vshape-p4-m16-half.toml")


def counterpart(schedule: str, problem: Problem) -> str:
    """Our generator of the same schedule."""
    if schedule == "Schedule1F1B":
        return "1F1B"
    if schedule == "ScheduleInterleaved1F1B":
        return "1F1B-I"
    if schedule == "ScheduleInterleavedZeroBubble":
        return "ZB-H1" if problem.pipeline.chunks_per_device == 1 else "ZB-I"
    if schedule == "ScheduleDualPipeV":
        return "DualPipeV"
    return "ZBV"


def _stand_in(problem: Problem, rank: int, stage: int, log: list | None = None) -> SimpleNamespace:
    """What the schedule classes read from a stage; with ``log``, a stage that records what it runs."""
    stages = problem.stages
    stand_in = SimpleNamespace(num_stages=stages, group_size=problem.devices, group_rank=rank, stage_index=stage,
                               submod=None, is_first=stage == 0, is_last=stage == stages - 1)
    if log is not None:
        stand_in.get_fwd_recv_ops = stand_in.get_fwd_send_ops = lambda i: []
        stand_in.get_bwd_recv_ops = stand_in.get_bwd_send_ops = lambda i: []
        stand_in.forward_one_chunk = lambda i, *args, **kwargs: log.append(f"{stage}F{i}")
        stand_in.backward_one_chunk = lambda i, **kwargs: log.append(f"{stage}B{i}")
        stand_in.perform_reduce_grad = lambda scale: None
    return stand_in


def _applicable(schedule: str, problem: Problem) -> str:
    """Why PyTorch's schedule cannot run this problem's shape, or "" when it can."""
    pipe = problem.pipeline
    if schedule == "Schedule1F1B" and pipe.chunks_per_device != 1:
        return "one stage per rank only"
    if schedule == "Schedule1F1B" and pipe.microbatches < pipe.devices:
        return "needs microbatches >= ranks"
    if schedule in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        if pipe.placement is not Placement.INTERLEAVED:
            return "interleaved placement only"
        if pipe.chunks_per_device == 1 and schedule == "ScheduleInterleaved1F1B":
            return "v = 1 is not 1F1B here (2(p-1-r) warm-up forwards); see Schedule1F1B"
        rounds = max(1, pipe.microbatches // pipe.devices)
        if pipe.microbatches % rounds:
            return f"needs microbatches divisible by {rounds} rounds"
    if schedule in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") and pipe.placement is not Placement.VSHAPE:
        return "V placement (vshape, 2 chunks per rank) only"
    if schedule == "ScheduleDualPipeV" and pipe.microbatches < 2 * pipe.devices:
        return "needs microbatches >= 2 x ranks"
    return ""


def torch_csv(schedule: str, variant: str, problem: Problem) -> str:
    """PyTorch's compute-only CSV of ``schedule`` for ``problem``'s shape, written by PyTorch."""
    from torch.distributed.pipelining import schedules as torch_schedules

    p, m = problem.devices, problem.microbatches
    if schedule == "Schedule1F1B":
        if variant == "run":
            rows = []
            for rank in range(p):
                log: list[str] = []
                runner = torch_schedules.Schedule1F1B(_stand_in(problem, rank, rank, log), m)
                runner._initialize_stage = lambda *args, **kwargs: None  # shape inference needs real tensors
                runner._step_microbatches()
                rows.append(log)
        else:
            built = torch_schedules.Schedule1F1B(_stand_in(problem, 0, 0), m)
            rows = [built.pipeline_order[rank] for rank in range(p)]
        out = io.StringIO()  # single-stage schedules have no _dump_csv; this is the writer it uses
        csv.writer(out).writerows([[str(a) if a is not None else "" for a in row] for row in rows])
        return out.getvalue()
    kind = getattr(torch_schedules, schedule)
    mine = problem.pipeline.stages_on(0)
    built = kind([_stand_in(problem, 0, s) for s in mine], m)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "schedule.csv"
        built._dump_csv(str(path), format="compute_only")
        return path.read_text()


def _joined(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more


def judge(schedule: str, variant: str, problem: Problem) -> dict:
    """Import PyTorch's order, lower, verify and simulate it; the same for our counterpart."""
    label = schedule + (" (run order)" if variant == "run" else "")
    row = {"problem": problem.name, "torch_schedule": label, "ours": counterpart(schedule, problem),
           "torch_makespan_ms": None, "ours_makespan_ms": None, "torch_peak_bytes": None, "ours_peak_bytes": None,
           "note": _applicable(schedule, problem)}
    if row["note"]:
        return row
    try:
        imported = schedule_from_torch_csv(torch_csv(schedule, variant, problem), problem, name=label)
        verify(lower(problem, imported))
        timeline = simulate(problem, imported)
        row["torch_makespan_ms"], row["torch_peak_bytes"] = timeline.makespan, timeline.peak
    except OptpipeError as error:
        row["note"] = f"PyTorch's order rejected: {error}"
    if schedule == "ScheduleDualPipeV" and not row["note"]:
        row["note"] = ("PyTorch overlaps each F+B pair; the simulator runs the pair's two ops in turn "
                       "(both rows alike), see solvers/heuristics/dualpipe.py")
    if row["ours"] not in {g.name for g in generators()}:
        row["note"] = _joined(row["note"], f"{row['ours']} is not registered")
        return row
    try:
        ours = simulate(problem, generate(row["ours"], problem))
        row["ours_makespan_ms"], row["ours_peak_bytes"] = ours.makespan, ours.peak
    except NotApplicable as why:
        row["note"] = _joined(row["note"], f"{row['ours']}: {why}")
    return row


def _table(rows: list[dict]) -> tuple[Table, list[str]]:
    table = Table(title="PyTorch's schedules vs ours: same problem, same simulator")
    for column, justify in (("problem", "left"), ("PyTorch", "left"), ("ms", "right"), ("peak", "right"),
                            ("ours", "left"), ("ms", "right"), ("peak", "right"), ("ours/torch", "right")):
        table.add_column(column, justify=justify)
    notes = []
    for r in rows:
        t, o = r["torch_makespan_ms"], r["ours_makespan_ms"]
        mark = ""
        if r["note"]:
            notes.append(f"[{len(notes) + 1}] {r['problem']}, {r['torch_schedule']}: {r['note']}")
            mark = f" [{len(notes)}]"
        short = r["torch_schedule"].removeprefix("Schedule").replace("ZBVZeroBubble", "ZBV")
        short = short.replace("ZeroBubble", "ZB").replace(" order", "")
        table.add_row(r["problem"], short + mark, f"{t:,.1f}" if t else "-",
                      format_size(r["torch_peak_bytes"]) if r["torch_peak_bytes"] else "-", r["ours"],
                      f"{o:,.1f}" if o else "-", format_size(r["ours_peak_bytes"]) if r["ours_peak_bytes"] else "-",
                      f"{o / t:.3f}" if t and o else "-")
    return table, notes


def run() -> list[dict]:
    rows = []
    for name in PROBLEM_FILES:
        problem = load_problem(PROBLEMS / name)
        for schedule, variant in TORCH_SCHEDULES:
            row = judge(schedule, variant, problem)
            if not row["note"].startswith(("one stage", "interleaved placement", "V placement", "v = 1")):
                rows.append(row)
    table, notes = _table(rows)
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True, markup=False)
    save("torch_interop", rows)
    return rows


if __name__ == "__main__":
    run()
