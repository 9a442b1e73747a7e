"""optpipe disasm: a plan file as text, one instruction per line (like Python's dis)."""

from __future__ import annotations

import sys

from optpipe.core.problem_file import load_problem
from optpipe.plan.bytecode import read_plan
from optpipe.plan.disasm import disassemble


def add_parser(sub) -> None:
    parser = sub.add_parser("disasm", help="print a plan file's header and instructions")
    parser.add_argument("plan", metavar="PLAN.opb", help="plan file written by `optpipe compile -o`")
    parser.add_argument("--rank", type=int, metavar="R", help="only this rank's instructions")
    parser.add_argument("--problem", metavar="PROBLEM.toml",
                        help="the plan's problem: show the bytes each instruction holds, frees or moves")
    parser.set_defaults(run=run)


def run(args) -> int:
    program = read_plan(args.plan)
    problem = load_problem(args.problem) if args.problem else None
    sys.stdout.write(disassemble(program, rank=args.rank, problem=problem))
    return 0
