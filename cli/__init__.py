"""The ``optpipe`` command line: the top layer, the only one that reads arguments and prints.

``main`` parses the command line; each subcommand lives in ``commands/<name>_cmd.py``.
"""

from .main import main

__all__ = ["main"]
