"""Model factories for the tests (``--model tests.factories:NAME``): the tiny GPT with a fault."""

from __future__ import annotations

import os
import signal

from optpipe.runtime.model import tiny
from optpipe.runtime.workload import WorkloadRequest


class _KillAt:
    """The batches of ``inner``; rank 0 kills itself (SIGKILL, as ``kill -9``) when it asks for batch ``step``."""

    def __init__(self, inner, step: int):
        self.inner, self.step = inner, step

    def __iter__(self):
        for k, batch in enumerate(self.inner):
            if k == self.step and os.environ.get("RANK") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch


def tiny_rank0_killed_at_step_3(request):
    workload = tiny(request)
    workload.batches = _KillAt(workload.batches, 3)
    return workload


def tiny_rank0_killed_after_step_3(request):
    """Rank 0 dies as its last weight gradient of step 3 lands: its peer is then in the loss all-reduce."""
    workload = tiny(request)
    if os.environ.get("RANK") == "0":
        first = next(workload.stages[0].parameters())
        calls = {"n": 0}

        def hook(param):
            calls["n"] += 1
            if calls["n"] == 4 * request.microbatches:
                os.kill(os.getpid(), signal.SIGKILL)

        first.register_post_accumulate_grad_hook(hook)
    return workload


def one_stage(request):
    """A model that is not split at all, whatever the plan asks for."""
    workload = tiny(WorkloadRequest(1, request.microbatches, request.seed))
    return workload


def not_a_workload(request):
    return [None]
