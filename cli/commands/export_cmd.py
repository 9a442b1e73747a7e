"""optpipe export: a plan's compute order in another tool's format (PyTorch's schedule CSV)."""

from __future__ import annotations

import sys

from rich.console import Console

from optpipe.core.files import write_atomic
from optpipe.core.schedule import TRANSFER_KINDS
from optpipe.plan.bytecode import read_plan
from optpipe.plan.lower import raise_schedule
from optpipe.plan.torch_csv import schedule_to_torch_csv
from optpipe.plan.verify import verify
from optpipe.cli.commands.common import console, markup_safe, output_path


def add_parser(sub) -> None:
    parser = sub.add_parser("export", help="write a plan's compute order as PyTorch's schedule CSV")
    parser.add_argument("plan", metavar="PLAN.opb", help="plan file written by `optpipe compile -o`")
    parser.add_argument("--format", choices=["torch-csv"], default="torch-csv",
                        help="torch-csv: the compute-only CSV that torch.distributed.pipelining loads")
    parser.add_argument("-o", "--output", metavar="FILE.csv", type=output_path("-o"),
                        help="output file (default: standard output)")
    parser.set_defaults(run=run)


def run(args) -> int:
    program = read_plan(args.plan)
    verify(program)  # a plan that deadlocks or is incomplete is not a schedule to hand to another tool
    schedule = raise_schedule(program)
    text = schedule_to_torch_csv(schedule)
    transfers = sum(1 for _, op in schedule.ops() if op.kind in TRANSFER_KINDS)
    if args.output:
        write_atomic(args.output, text, "CSV file")
        console.print(f"wrote {markup_safe(args.output)}: {schedule.num_devices} rows, one per rank")
    else:
        sys.stdout.write(text)
    if transfers:
        Console(stderr=True).print(f"[yellow]note:[/] {transfers} offload/reload transfers are not in the CSV; "
                                   f"PyTorch's schedule format has no action for them", highlight=False)
    return 0
