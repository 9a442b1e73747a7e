"""The runtime's own error: a pipeline that cannot go on (a rank failed or a peer went away)."""

from __future__ import annotations

from optpipe.compiler.errors import OptpipeError

__all__ = ["PipelineAborted"]


class PipelineAborted(OptpipeError):
    """A rank stopped the training step; the message names the rank, what it was doing and why."""
