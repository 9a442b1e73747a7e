"""The runtime's own error: a pipeline that cannot go on (a rank failed or a peer went away)."""

from __future__ import annotations

from optpipe.core.errors import OptpipeError

__all__ = ["PipelineAborted", "first_line"]


class PipelineAborted(OptpipeError):
    """A rank stopped the training step; the message names the rank, what it was doing and why."""


def first_line(error: BaseException) -> str:
    """The first line of an error's message (torch's C++ errors go on for pages), or its class name.

    Gloo's "[/path/pair.cc:537] Read error ..." loses the source location and the advice after it.
    """
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = text.splitlines()[0]
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(" This is typically caused by")[0].rstrip()
