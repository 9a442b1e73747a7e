"""optpipe verify: prove a plan well-formed and free of deadlock; with a problem, predict it."""

from __future__ import annotations

from .common import console


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
    console.print(f"[green]verified[/] {args.plan}: {h.schedule_name!r}, {h.world_size} ranks, "
                  f"{sum(verdict.instructions)} instructions, {verdict.messages} messages paired in order, "
                  f"no deadlock ({verdict.rounds} rounds of the abstract run)")
    if args.problem:
        from .simulate_cmd import timeline_table

        console.print(timeline_table(predict(program, load_problem(args.problem))))
    return 0
