"""optpipe export: a plan's compute order in another tool's format (PyTorch's schedule CSV)."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from .common import console


def add_parser(sub) -> None:
    parser = sub.add_parser("export", help="write a plan's compute order as PyTorch's schedule CSV")
    parser.add_argument("plan", metavar="PLAN.opb", help="plan file written by `optpipe compile -o`")
    parser.add_argument("--format", choices=["torch-csv"], default="torch-csv",
                        help="torch-csv: the compute-only CSV that torch.distributed.pipelining loads")
    parser.add_argument("-o", "--output", metavar="FILE.csv", help="output file (default: standard output)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..bytecode import read_plan
    from ..lower import raise_schedule
    from ..schedule import TRANSFER_KINDS
    from ..torch_csv import schedule_to_torch_csv

    schedule = raise_schedule(read_plan(args.plan))
    text = schedule_to_torch_csv(schedule)
    transfers = sum(1 for _, op in schedule.ops() if op.kind in TRANSFER_KINDS)
    if args.output:
        Path(args.output).write_text(text, newline="")
        console.print(f"wrote {args.output}: {schedule.num_devices} rows, one per rank")
    else:
        sys.stdout.write(text)
    if transfers:
        Console(stderr=True).print(f"[yellow]note:[/] {transfers} offload/reload transfers are not in the CSV; "
                                   f"PyTorch's schedule format has no action for them", highlight=False)
    return 0
