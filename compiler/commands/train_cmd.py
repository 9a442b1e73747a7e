"""optpipe train: run every rank of a plan on this machine and report in one line.

The options are the training entry point's (``optpipe.runtime.options``), checked here before
any rank starts; the ranks are ``python -m optpipe.runtime.train`` processes (``launcher.py``).
For several machines use torchrun with the same options (README, "Several machines").
"""

from __future__ import annotations

from ..errors import OptpipeError


def add_parser(sub) -> None:
    from optpipe.runtime.options import add_train_arguments

    parser = sub.add_parser("train", help="train with a plan: one local process per rank, one line if one fails")
    add_train_arguments(parser)
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="processes to start (default: the plan's world size)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from optpipe.runtime.launcher import launch_local
    from optpipe.runtime.options import check, to_argv

    check(args)
    nproc = args.nproc or _world_size(args)
    if nproc < 1:
        raise OptpipeError(f"--nproc: expected a positive integer, got {nproc}")
    return launch_local(to_argv(args), nproc, args.timeout)


def _world_size(args) -> int:
    if args.plan:
        from ..bytecode import read_plan

        return read_plan(args.plan).header.world_size
    from ..problem import load_problem

    return load_problem(args.problem).devices
