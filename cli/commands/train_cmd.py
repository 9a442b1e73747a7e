"""optpipe train: run every rank of a plan on this machine and report in one line.

The options are the training entry point's (``optpipe.runtime.options``), checked here before
any rank starts; the ranks are ``python -m optpipe.runtime.train`` processes (``launcher.py``).
For several machines use torchrun with the same options (README, "Several machines").
"""

from __future__ import annotations

from optpipe.core.problem_file import load_problem
from optpipe.plan.bytecode import read_plan
from optpipe.runtime.launcher import launch_local
from optpipe.runtime.options import add_train_arguments, check, to_argv


def add_parser(sub) -> None:
    parser = sub.add_parser("train", help="train with a plan: one local process per rank, one line if one fails")
    add_train_arguments(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    check(args)
    return launch_local(to_argv(args), _world_size(args), args.timeout)  # one process per rank of the plan


def _world_size(args) -> int:
    if args.plan:
        return read_plan(args.plan).header.world_size
    return load_problem(args.problem).devices
