"""optpipe import: another tool's schedule (PyTorch's CSV) as a verified plan."""

from __future__ import annotations

from pathlib import Path

from optpipe.core.errors import EXIT_NO_FIT, OptpipeError
from optpipe.core.files import read_text
from optpipe.core.simulate import simulate
from optpipe.core.units import format_size
from optpipe.plan.bytecode import write_plan
from optpipe.plan.lower import lower
from optpipe.plan.torch_csv import schedule_from_torch_csv
from optpipe.plan.verify import verify
from optpipe.cli.commands.common import add_budget_argument, check_size, console, markup_safe, output_path, read_problem

IMPORT_PAIRS = 2**19  # import lowers, verifies and simulates: near-linear, like simulate


def add_parser(sub) -> None:
    parser = sub.add_parser("import", help="compile PyTorch's schedule CSV into a plan")
    parser.add_argument("csv", metavar="FILE.csv", help="compute-only CSV as torch.distributed.pipelining dumps it")
    parser.add_argument("--format", choices=["torch-csv"], default="torch-csv",
                        help="torch-csv: one row per rank, actions such as 0F3, 1I2, 1W2, 2B0")
    parser.add_argument("--problem", required=True, metavar="PROBLEM.toml", help="problem the schedule runs on")
    add_budget_argument(parser)
    parser.add_argument("-o", "--output", required=True, metavar="PLAN.opb", type=output_path("-o"),
                        help="plan file to write")
    parser.add_argument("--name", help="schedule name in the plan (default: the CSV file's stem)")
    parser.add_argument("--allow-over-budget", action="store_true",
                        help="write the plan even when its peak memory is over memory.budget (exit code still 2)")
    parser.set_defaults(run=run)


def run(args) -> int:
    path = Path(args.csv)
    text = read_text(path, "CSV file", OptpipeError, limit=256 << 20)
    problem = read_problem(args)
    check_size(problem, "import", IMPORT_PAIRS, work=None)
    name = args.name if args.name is not None else path.stem
    if not name or len(name) > 200 or not name.isprintable():
        raise OptpipeError(f"--name: expected a short printable schedule name, got {markup_safe(name[:40])!r}; "
                           f"give --name NAME")
    try:
        schedule = schedule_from_torch_csv(text, problem, name=name)
    except OptpipeError as error:
        raise type(error)(f"{path}: {error}") from None
    program = lower(problem, schedule)
    verify(program)
    timeline = simulate(problem, schedule)
    over = not timeline.fits
    if over and not args.allow_over_budget:
        console.print(f"[red]not written[/]: {_over_budget(problem, timeline)}; raise memory.budget (or --budget) "
                      f"if the devices have the room, or pass --allow-over-budget to write the plan anyway")
        return EXIT_NO_FIT
    write_plan(args.output, program)
    console.print(f"wrote {markup_safe(args.output)}: {markup_safe(repr(schedule.name))} on "
                  f"{markup_safe(problem.name)}, verified, simulated makespan {timeline.makespan:,.2f} ms, "
                  f"bubble {timeline.bubble_ratio:.1%}")
    if over:
        console.print(f"[yellow]warning[/]: {_over_budget(problem, timeline)}; the plan may run out of memory")
        return EXIT_NO_FIT
    return 0


def _over_budget(problem, timeline) -> str:
    if not timeline.fits_budget:
        return (f"the schedule peaks at {format_size(timeline.peak)} on device {timeline.peak_device}, over the "
                f"{format_size(problem.memory.budget)} memory.budget")
    return (f"the schedule holds {format_size(max(timeline.host_peak))} on the host, over the "
            f"{format_size(problem.offload.host_budget)} offload.host_budget")
