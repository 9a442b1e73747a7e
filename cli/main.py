"""The ``optpipe`` command line.

Each subcommand lives in ``commands/<name>.py`` with ``add_parser(subparsers)``. User errors
(``OptpipeError``) print one message and exit non-zero; a traceback means a bug in optpipe.

Exit codes are the same for every command (``errors.EXIT_*``): 0 done, 1 an error the message
explains, 2 no schedule fits the memory budget, 64 a malformed command line (argparse's own
errors included, which would otherwise exit 2 and read as "no schedule fits").
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rich.console import Console
from rich.text import Text

from optpipe.core.errors import EXIT_ERROR, EXIT_NO_FIT, EXIT_OK, EXIT_USAGE, OptpipeError, printable

__all__ = ["main", "COMMANDS", "EXIT_CODES_HELP"]

# In the order ``optpipe --help`` lists them.
COMMANDS = ("check", "compare", "show", "simulate", "compile", "disasm", "verify", "export", "import", "profile", "train",
            "demo")

EXIT_CODES_HELP = (f"exit codes (every command): {EXIT_OK} done; {EXIT_ERROR} error (the message says what and how "
                   f"to fix it); {EXIT_NO_FIT} no schedule fits the memory budget; {EXIT_USAGE} malformed command "
                   f"line (unknown option, missing or out-of-range argument); 130 interrupted")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors on exit code 64 instead of a usage block on 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("epilog", EXIT_CODES_HELP)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        err = Console(stderr=True)
        err.print(Text("error: ", style="bold red") + Text(printable(f"{self.prog}: {message}; "
                                                                     f"see `{self.prog} --help`")),
                  highlight=False, soft_wrap=True)
        self.exit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="optpipe",
        description="Pipeline-parallel schedule compiler: heuristics, exact solvers with activation offload, "
        "a verified plan bytecode, and a torch runtime.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:  # every listed command has its module: a missing one is a broken install
        importlib.import_module(f".commands.{name}_cmd", __package__).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    err = Console(stderr=True)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help (0) or a usage error (64); returned, so main(argv) never exits
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    try:
        return int(args.run(args) or 0)
    except OptpipeError as error:
        err.print(Text("error: ", style="bold red") + Text(printable(str(error))), highlight=False, soft_wrap=True)
        return error.exit_code
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
