"""The compiler: problem model, schedule IR, simulator, plan bytecode, rendering, command line.

Nothing here imports torch, so compiling and checking plans stays fast.
"""

from .errors import InfeasibleError, NotApplicable, OptpipeError, PlanError, ProblemError, ScheduleError, SolverError
from .problem import Costs, Memory, Offload, Pipeline, Placement, Problem, dump_problem, load_problem, loads_problem
from .schedule import Op, OpKind, Schedule, dump_schedule, load_schedule
from .simulate import OpTiming, Timeline, simulate

__all__ = [
    "OptpipeError", "ProblemError", "ScheduleError", "NotApplicable", "SolverError", "InfeasibleError", "PlanError",
    "Problem", "Pipeline", "Placement", "Costs", "Memory", "Offload", "load_problem", "loads_problem", "dump_problem",
    "Op", "OpKind", "Schedule", "load_schedule", "dump_schedule",
    "OpTiming", "Timeline", "simulate",
]
