"""PyTorch interop: the compute-only CSV that ``torch.distributed.pipelining`` dumps and loads.

Row r holds rank r's actions, one per cell, written ``{stage}{kind}{microbatch}``: kind ``F``
is a forward, ``I`` a backward for the input (our B), ``W`` a backward for the weights (our
W), and ``B`` PyTorch's full backward (our fused BW). Empty cells are PyTorch's idle steps.
On import, ``REDUCE_GRAD``, ``UNSHARD`` and ``RESHARD`` cells (data-parallel and FSDP
collectives, outside our cost model) are skipped, and an ``(a;b)OVERLAP_F_B`` cell runs its
sub-actions in order. Export writes compute ops only: transfers have no PyTorch action.
"""

from __future__ import annotations

import csv
import io
import re

from optpipe.core.errors import ScheduleError
from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule

__all__ = ["schedule_to_torch_csv", "schedule_from_torch_csv", "TORCH_KIND", "SKIPPED_ACTIONS"]

TORCH_KIND = {OpKind.F: "F", OpKind.B: "I", OpKind.W: "W", OpKind.BW: "B"}
_OUR_KIND = {text: kind for kind, text in TORCH_KIND.items()}
SKIPPED_ACTIONS = frozenset({"REDUCE_GRAD", "UNSHARD", "RESHARD"})
_COMMUNICATION = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})
# At most 9 digits: a larger number names no stage or microbatch (plans stop at 65,534) and a
# 5,000-digit one would only be slow to convert.
_ACTION = re.compile(r"(\d{1,9})(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d{0,9})")
_MAX_CELL = 200  # characters: an OVERLAP_F_B cell of a few actions; longer is not an action
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")


def schedule_to_torch_csv(schedule: Schedule) -> str:
    """One row per device with its compute ops in order (csv.writer's format, as PyTorch writes it)."""
    out = io.StringIO()
    writer = csv.writer(out)
    for ops in schedule.devices:
        writer.writerow([f"{op.stage}{TORCH_KIND[op.kind]}{op.microbatch}" for op in ops if op.kind in TORCH_KIND])
    return out.getvalue()


def schedule_from_torch_csv(text: str, problem: Problem, name: str = "torch-csv") -> Schedule:
    """The schedule in a compute-only CSV, checked cell by cell against the problem's shape."""
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as error:  # a field over the csv module's limit, a NUL byte
        raise ScheduleError(f"not a schedule CSV: {error}; expected one row of short actions such as '2F0' per rank") \
            from None
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()
    pipe = problem.pipeline
    if len(rows) != pipe.devices:
        raise ScheduleError(f"the CSV has {len(rows)} rows, but problem {problem.name!r} has {pipe.devices} ranks; "
                            f"expected one row of actions per rank")
    devices = []
    seen: dict[Op, str] = {}
    for rank, row in enumerate(rows):
        ops = []
        for column, cell in enumerate(row):
            where = f"row {rank + 1} (rank {rank}), column {column + 1}"
            for op in _parse_cell(cell.strip(), where):
                _check_op(op, cell.strip(), where, rank, problem)
                if op in seen:
                    raise ScheduleError(f"{where}: {cell.strip()!r} repeats {seen[op]}; each action runs once")
                seen[op] = where
                ops.append(op)
        devices.append(ops)
    return Schedule.of(name, devices)


def _parse_cell(cell: str, where: str, nested: bool = False) -> list[Op]:
    if not cell:
        return []
    if len(cell) > _MAX_CELL:
        raise ScheduleError(f"{where}: cannot read {cell[:30]!r}... ({len(cell):,} characters): expected one action "
                            f"such as '2F0' or '1I3', or a few in '(a;b)OVERLAP_F_B'")
    overlap = None if nested else _OVERLAP.fullmatch(cell)
    if overlap:
        return [op for part in overlap.group(1).split(";") for op in _parse_cell(part.strip(), where, nested=True)]
    match = _ACTION.fullmatch(cell)
    if not match:
        raise ScheduleError(f"{where}: cannot read {cell!r}: expected STAGE KIND MICROBATCH such as '2F0' or '1I3', "
                            f"with KIND one of F, I, W, B")
    stage, kind, microbatch = match.groups()
    if kind in SKIPPED_ACTIONS:
        return []
    if kind in _COMMUNICATION:
        raise ScheduleError(f"{where}: {cell!r} is a communication action; import reads the compute-only CSV "
                            f"(PyTorch: schedule._dump_csv(path, format=\"compute_only\"))")
    if not microbatch:
        raise ScheduleError(f"{where}: {cell!r} has no microbatch; expected e.g. '{stage}{kind}0'")
    return [Op(_OUR_KIND[kind], int(stage), int(microbatch))]


def _check_op(op: Op, cell: str, where: str, rank: int, problem: Problem) -> None:
    pipe = problem.pipeline
    if op.stage >= pipe.stages:
        raise ScheduleError(f"{where}: {cell!r} names stage {op.stage}, but problem {problem.name!r} has "
                            f"{pipe.stages} stages (0..{pipe.stages - 1})")
    if op.microbatch >= pipe.microbatches:
        raise ScheduleError(f"{where}: {cell!r} names microbatch {op.microbatch}, but problem {problem.name!r} has "
                            f"{pipe.microbatches} microbatches (0..{pipe.microbatches - 1})")
    if pipe.device_of(op.stage) != rank:
        raise ScheduleError(f"{where}: {cell!r} runs stage {op.stage} on rank {rank}, but problem {problem.name!r} "
                            f"places stage {op.stage} on rank {pipe.device_of(op.stage)} "
                            f"(placement {pipe.placement.value!r}); use a problem with the CSV's placement")
