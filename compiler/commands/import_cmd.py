"""optpipe import: another tool's schedule (PyTorch's CSV) as a verified plan."""

from __future__ import annotations

from pathlib import Path

from ..errors import OptpipeError
from ..files import read_text
from .common import console, read_problem


def add_parser(sub) -> None:
    parser = sub.add_parser("import", help="compile PyTorch's schedule CSV into a plan")
    parser.add_argument("csv", metavar="FILE.csv", help="compute-only CSV as torch.distributed.pipelining dumps it")
    parser.add_argument("--format", choices=["torch-csv"], default="torch-csv",
                        help="torch-csv: one row per rank, actions such as 0F3, 1I2, 1W2, 2B0")
    parser.add_argument("--problem", required=True, metavar="PROBLEM.toml", help="problem the schedule runs on")
    parser.add_argument("-o", "--output", required=True, metavar="PLAN.opb", help="plan file to write")
    parser.add_argument("--name", help="schedule name in the plan (default: the CSV file's stem)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..bytecode import write_plan
    from ..lower import lower
    from ..simulate import simulate
    from ..torch_csv import schedule_from_torch_csv
    from ..verify import verify

    path = Path(args.csv)
    text = read_text(path, "CSV file", OptpipeError)
    problem = read_problem(args)
    try:
        schedule = schedule_from_torch_csv(text, problem, name=args.name or path.stem)
    except OptpipeError as error:
        raise type(error)(f"{path}: {error}") from None
    program = lower(problem, schedule)
    verify(program)
    write_plan(args.output, program)
    timeline = simulate(problem, schedule)
    console.print(f"wrote {args.output}: {schedule.name!r} on {problem.name}, verified, simulated makespan "
                  f"{timeline.makespan:,.2f} ms, bubble {timeline.bubble_ratio:.1%}")
    return 0
