"""Silence what C++ solver libraries print on file descriptor 1.

HiGHS prints a banner the first time a ``Highs`` object is created in a process; on stdout it
would land in the middle of a report or a JSON answer. Python's ``sys.stdout`` cannot catch it,
so file descriptor 1 is pointed at /dev/null for the call.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

__all__ = ["quiet_stdout"]


@contextmanager
def quiet_stdout():
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as sink:
            os.dup2(sink.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
