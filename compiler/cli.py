"""The ``optpipe`` command line.

Each subcommand lives in ``commands/<name>.py`` with ``add_parser(subparsers)``. User errors
(``OptpipeError``) print one message and exit non-zero; a traceback means a bug in optpipe.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rich.console import Console
from rich.text import Text

from .errors import OptpipeError

__all__ = ["main", "COMMANDS"]

# In the order ``optpipe --help`` lists them.
COMMANDS = ("check", "compare", "show", "simulate", "compile", "disasm", "verify", "export", "import", "profile", "train",
            "demo")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optpipe",
        description="Pipeline-parallel schedule compiler: heuristics, exact solvers with activation offload, "
        "a verified plan bytecode, and a torch runtime.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        try:
            module = importlib.import_module(f".commands.{name}_cmd", __package__)
        except ModuleNotFoundError as error:
            if error.name and error.name.endswith(f"{name}_cmd"):
                continue  # a command not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    err = Console(stderr=True)
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except OptpipeError as error:
        err.print(Text("error: ", style="bold red") + Text(str(error)), highlight=False, soft_wrap=True)
        return error.exit_code
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/]")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
