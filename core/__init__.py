"""The core layer: units, errors, the problem model and its file format, the schedule IR, the
one definition of what an op does (``semantics``), the simulator, and pictures of a timeline.

Every other layer builds on this one and nothing here imports them (docs/design.md, "Layers");
nothing here imports torch, so compiling and checking plans stays fast.
"""

from optpipe.core.errors import InfeasibleError, NotApplicable, OptpipeError, PlanError, ProblemError, ScheduleError, SolverError
from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem
from optpipe.core.problem_file import dump_problem, load_problem, loads_problem
from optpipe.core.schedule import Op, OpKind, Schedule, dump_schedule, load_schedule
from optpipe.core.simulate import OpTiming, Timeline, simulate

__all__ = [
    "OptpipeError", "ProblemError", "ScheduleError", "NotApplicable", "SolverError", "InfeasibleError", "PlanError",
    "Problem", "Pipeline", "Placement", "Costs", "Memory", "Offload", "load_problem", "loads_problem", "dump_problem",
    "Op", "OpKind", "Schedule", "load_schedule", "dump_schedule",
    "OpTiming", "Timeline", "simulate",
]
