"""The training command's options, shared by ``python -m optpipe.runtime.train`` and ``optpipe train``.

No torch here: ``optpipe --help`` builds these parsers. Every value is checked before any
process group is joined (``check``), so a bad option is one line per rank, not a traceback.
"""

from __future__ import annotations

import argparse
import math

from optpipe.core.errors import EXIT_USAGE, OptpipeError

__all__ = ["UsageError", "add_train_arguments", "check", "LineParser", "to_argv"]


class UsageError(OptpipeError):
    """A bad command-line option: the same exit code as every optpipe command's usage errors."""

    exit_code = EXIT_USAGE


class LineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are a ``UsageError`` (one line) instead of usage text and exit."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        raise UsageError(f"{message} (see --help)")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", metavar="PLAN.opb", help="plan file from `optpipe compile` (with --improve and "
                                                            "--problem it may be left out: training starts on the "
                                                            "best fitting heuristic)")
    parser.add_argument("--model", default="tiny",
                        help="tiny, small, or package.module:factory returning a Workload (default tiny)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate (default 1e-2)")
    parser.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd", "none"),
                        help="none computes the gradients and leaves the weights (default adamw)")
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float16", "float32"),
                        help="parameter and activation dtype")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="sequences per microbatch")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--trace", metavar="FILE", help="write a Chrome trace of the last step (measured and predicted)")
    parser.add_argument("--problem", metavar="PROBLEM.toml",
                        help="the problem the plan was compiled for: the predicted half of --trace, and what "
                             "--improve re-solves with measured costs")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds a rank waits on a peer (or to join the job) before it stops with an error "
                             "(default 60)")
    improve = parser.add_argument_group("online improvement")
    improve.add_argument("--improve", action="store_true",
                         help="measure op times over the first steps, re-solve in the background with them, and "
                              "switch every rank to a faster plan at a step boundary (needs --problem)")
    improve.add_argument("--improve-after", type=int, default=3, metavar="STEPS",
                         help="steps measured before the re-solve starts (default 3; step 0 is not counted)")
    improve.add_argument("--improve-time-limit", type=float, default=20.0, metavar="S",
                         help="solver time for the re-solve (default 20)")
    improve.add_argument("--improve-min-gain", type=float, default=0.02, metavar="FRACTION",
                         help="switch only when the new plan is predicted this much faster (default 0.02)")
    improve.add_argument("--improve-solver", default="cpsat", help="solver of the re-solve (default cpsat)")
    improve.add_argument("--improve-wait", action="store_true",
                         help="wait for the re-solve at the step after the measured ones instead of training on "
                              "while it runs (the switch then comes at a known step)")


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        what = "a finite number >= 0" if allow_zero else "a finite positive number"
        raise UsageError(f"{name}: expected {what}, got {value}")


def check(args: argparse.Namespace) -> None:
    """Every option's value, before anything runs; raises UsageError naming the option."""
    if args.steps < 1:
        raise UsageError(f"--steps: expected at least 1, got {args.steps}")
    _positive("--timeout", args.timeout)
    if args.timeout > 7 * 24 * 3600:
        raise UsageError(f"--timeout: {args.timeout} s is more than a week; give at most 604800")
    _positive("--lr", args.lr, allow_zero=True)
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        raise UsageError(f"--micro-batch-size: expected a positive integer, got {args.micro_batch_size}")
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed: expected an integer from 0 to 2**63-1, got {args.seed}")
    if args.plan is None and not (args.improve and args.problem):
        raise UsageError("--plan is required (or --improve with --problem, which starts on the best fitting "
                         "heuristic of the problem)")
    if args.improve:
        if not args.problem:
            raise UsageError("--improve needs --problem PROBLEM.toml: the pipeline, budget and host link to "
                             "re-solve with the measured op times")
        if args.improve_after < 1:
            raise UsageError(f"--improve-after: expected at least 1 step, got {args.improve_after}")
        _positive("--improve-time-limit", args.improve_time_limit)
        if not (math.isfinite(args.improve_min_gain) and 0 <= args.improve_min_gain < 1):
            raise UsageError(f"--improve-min-gain: expected a fraction from 0 to below 1, got {args.improve_min_gain}")


def to_argv(args: argparse.Namespace) -> list[str]:
    """The training options in ``args`` as command-line words again (for the ranks a launcher starts)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_train_arguments(parser)
    words: list[str] = []
    for action in parser._actions:  # argparse keeps no public list of a parser's options
        if not action.option_strings:
            continue
        value = getattr(args, action.dest, action.default)
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                words.append(action.option_strings[0])
        elif value is not None and value != action.default:
            words += [action.option_strings[0], repr(value) if isinstance(value, float) else str(value)]
    return words
