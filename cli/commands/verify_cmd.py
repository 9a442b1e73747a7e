"""optpipe verify: prove a plan well-formed and free of deadlock; with a problem, predict it."""

from __future__ import annotations

from optpipe.core.errors import EXIT_NO_FIT
from optpipe.core.problem_file import load_problem
from optpipe.core.units import format_size
from optpipe.plan.bytecode import read_plan
from optpipe.plan.verify import predict, verify
from optpipe.cli.commands.common import console, markup_safe
from optpipe.cli.views import timeline_table


def add_parser(sub) -> None:
    parser = sub.add_parser("verify", help="check a plan's structure and deadlock freedom")
    parser.add_argument("plan", metavar="PLAN.opb", help="plan file written by `optpipe compile -o`")
    parser.add_argument("--problem", metavar="PROBLEM.toml",
                        help="also check the plan was compiled for it and predict time and memory")
    parser.set_defaults(run=run)


def run(args) -> int:
    program = read_plan(args.plan)
    verdict = verify(program)
    h = program.header
    console.print(f"[green]verified[/] {markup_safe(args.plan)}: {markup_safe(repr(h.schedule_name))}, "
                  f"{h.world_size} ranks, {sum(verdict.instructions)} instructions, {verdict.messages} messages "
                  f"paired in order, no deadlock ({verdict.waits} waits on a peer in the abstract run)")
    if args.problem:
        problem = load_problem(args.problem)
        timeline = predict(program, problem)
        console.print(timeline_table(timeline))
        if not timeline.fits:
            # verify has no --budget: the advice names what the user can change, the problem file.
            if not timeline.fits_budget:
                what = (f"the plan peaks at {format_size(timeline.peak)} on device {timeline.peak_device}, over "
                        f"memory.budget = {format_size(problem.memory.budget)}")
            else:
                what = (f"the plan holds {format_size(max(timeline.host_peak))} on a host, over "
                        f"offload.host_budget = {format_size(problem.offload.host_budget)}")
            console.print(f"[red]does not fit[/]: {what} in {markup_safe(args.problem)}; recompile it with "
                          f"`optpipe compile` for the budget it must fit, or give the devices more memory")
            return EXIT_NO_FIT
    return 0
