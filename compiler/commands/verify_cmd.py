"""optpipe verify: prove a plan well-formed and free of deadlock; with a problem, predict it."""

from __future__ import annotations

from .common import console, markup_safe


def add_parser(sub) -> None:
    parser = sub.add_parser("verify", help="check a plan's structure and deadlock freedom")
    parser.add_argument("plan", metavar="PLAN.opb", help="plan file written by `optpipe compile -o`")
    parser.add_argument("--problem", metavar="PROBLEM.toml",
                        help="also check the plan was compiled for it and predict time and memory")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..bytecode import read_plan
    from ..problem import load_problem
    from ..verify import predict, verify

    program = read_plan(args.plan)
    verdict = verify(program)
    h = program.header
    console.print(f"[green]verified[/] {markup_safe(args.plan)}: {markup_safe(repr(h.schedule_name))}, "
                  f"{h.world_size} ranks, {sum(verdict.instructions)} instructions, {verdict.messages} messages "
                  f"paired in order, no deadlock ({verdict.waits} waits on a peer in the abstract run)")
    if args.problem:
        from .simulate_cmd import timeline_table

        console.print(timeline_table(predict(program, load_problem(args.problem))))
    return 0
