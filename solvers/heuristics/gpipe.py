"""GPipe (Huang et al., 2019): all forwards, then all backwards.

Promises: the simplest valid order for any placement; holds every microbatch's activation at
once (peak m per stage on a device), bubble (p-1)/(m+p-1) with equal stage costs.
"""

from __future__ import annotations

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule

from ._register import register


@register("GPipe", "Huang et al., GPipe (arXiv 1811.06965), section 2.2", "all F then all fused backwards; peak m activations")
def gpipe(problem: Problem) -> Schedule:
    pipe = problem.pipeline
    devices = []
    for device in range(pipe.devices):
        stages = pipe.stages_on(device)
        forwards = [Op(OpKind.F, s, i) for s in stages for i in range(pipe.microbatches)]
        backwards = [Op(OpKind.BW, s, i) for s in reversed(stages) for i in range(pipe.microbatches)]
        devices.append(forwards + backwards)
    return Schedule.of("GPipe", devices)
