"""Run a PuLP model on one MILP backend and report what it proved.

Backends: ``pulp.HiGHS`` (the highspy API; there is no ``highs`` binary here, so not HiGHS_CMD)
and ``pulp.PULP_CBC_CMD`` (the CBC binary bundled with PuLP). Warm starts: CBC honours PuLP's
``warmStart=True`` (PuLP writes the initial values as a MIP start file); PuLP's HiGHS class
ignores initial values, so ``_Highs`` hands them to ``Highs.setSolution`` before the run.
The objective is integral (time units), so both stop once the gap is below one unit. The
bundled CBC is 2.10.3; the faults of it we work around are noted where we do.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import pulp

from optpipe.core.errors import SolverError

from .quiet import quiet_stdout

__all__ = ["BACKENDS", "BackendRun", "run_backend"]

BACKENDS = ("highs", "cbc")
_INTEGRAL_GAP = 0.999  # an integral objective: a bound within one unit proves optimality


@dataclass(frozen=True)
class BackendRun:
    status: str  # "optimal", "feasible" (a solution, not proven), "infeasible" (proven) or "unknown" (nothing)
    objective: float | None
    bound: float | None  # the backend's proven lower bound on the objective
    values: dict[str, float] | None  # by variable name
    seconds: float


def run_backend(lp: pulp.LpProblem, backend: str, *, time_limit_s: float, seed: int, threads: int,
                start: dict[pulp.LpVariable, float] | None,
                on_incumbent: Callable[[float, float | None], None] | None = None) -> BackendRun:
    """Solve ``lp`` once; ``start`` (values for every variable) is the warm start when given."""
    for var in lp.variables():
        var.varValue = None if start is None else start.get(var)
    began = time.perf_counter()
    if backend == "highs":
        status, objective, bound = _run_highs(lp, time_limit_s, seed, threads, start is not None, on_incumbent)
    elif backend == "cbc":
        status, objective, bound = _run_cbc(lp, time_limit_s, seed, threads, start is not None)
    else:
        raise SolverError(f"unknown MILP backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    seconds = time.perf_counter() - began
    values = None
    if status in ("optimal", "feasible"):
        values = {var.name: (var.varValue if var.varValue is not None else 0.0) for var in lp.variables()}
    return BackendRun(status, objective, bound, values, seconds)


# --------------------------------------------------------------------------- HiGHS


# HiGHS starts one thread pool per process, sized by the first run; a run asking for another size
# fails ("Not Set") unless the pool is reset first. This is the size our last run gave it.
_highs_threads: int | None = None


class _Highs(pulp.HiGHS):
    """PuLP's HiGHS class, plus the warm start PuLP leaves out and an improving-solution callback."""

    def __init__(self, *, use_start: bool, on_incumbent, **options):
        super().__init__(**options)
        self.use_start = use_start
        self.on_incumbent = on_incumbent

    def createAndConfigureSolver(self, lp):
        with quiet_stdout():
            super().createAndConfigureSolver(lp)
        if self.on_incumbent is not None:
            report = self.on_incumbent

            def improving(event) -> None:
                out = event.data_out
                bound = out.mip_dual_bound
                report(out.objective_function_value, bound if abs(bound) < 1e30 else None)

            lp.solverModel.cbMipImprovingSolution += improving

    def callSolver(self, lp):
        if self.use_start:
            import highspy  # lazy: only a HiGHS run with a warm start needs it

            solution = highspy.HighsSolution()
            values = [0.0] * lp.solverModel.getNumCol()
            for var in lp.variables():
                values[var.index] = float(var.varValue) if var.varValue is not None else 0.0
            solution.col_value = values
            solution.value_valid = True
            lp.solverModel.setSolution(solution)
        super().callSolver(lp)


def _run_highs(lp, time_limit_s, seed, threads, use_start, on_incumbent):
    import highspy  # lazy: only the HiGHS backend needs it, not CBC or an import of this module

    global _highs_threads
    if _highs_threads != threads:  # None: another part of the process may have started the pool
        highspy.Highs.resetGlobalScheduler(True)
    _highs_threads = threads

    solver = _Highs(use_start=use_start, on_incumbent=on_incumbent, msg=False, timeLimit=max(time_limit_s, 0.01),
                    gapRel=0.0, gapAbs=_INTEGRAL_GAP, threads=threads, random_seed=int(seed))
    try:
        lp.solve(solver)
    except pulp.PulpSolverError as error:
        raise SolverError(f"HiGHS failed on the schedule model: {error}") from None
    model = lp.solverModel
    state = model.getModelStatus()
    info = model.getInfo()
    found = info.primal_solution_status == 2  # kSolutionStatusFeasible
    bound = info.mip_dual_bound if abs(info.mip_dual_bound) < 1e30 else None
    objective = info.objective_function_value if found else None
    if state == highspy.HighsModelStatus.kOptimal:
        return "optimal", objective, objective if bound is None else bound
    if state in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
        return "infeasible", None, None
    if state in (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt,
                 highspy.HighsModelStatus.kIterationLimit, highspy.HighsModelStatus.kSolutionLimit):
        return ("feasible" if found else "unknown"), objective, bound
    raise SolverError(f"HiGHS stopped with status {model.modelStatusToString(state)!r} on the schedule model; "
                      f"try the other backend (--backend cbc)")


# --------------------------------------------------------------------------- CBC

_CBC_BOUND = re.compile(r"^(?:Lower|Upper) bound:\s+(\S+)", re.MULTILINE)


def _run_cbc(lp, time_limit_s, seed, threads, use_start):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="PULP_CBC_CMD is deprecated")  # the bundled binary is what we have
        command = pulp.PULP_CBC_CMD
        handle, log_path = tempfile.mkstemp(prefix="optpipe-cbc-", suffix=".log")
        os.close(handle)
        # CBC's randomCbcSeed 0 means "seed from the clock", so seeds shift by one to stay reproducible.
        # Its preprocessing has returned "optimal" solutions that break the model (it logs "Postprocessed
        # model is infeasible") on small schedule models HiGHS proves infeasible; without it CBC is right
        # and about as fast on these models.
        solver = command(msg=False, timeLimit=max(time_limit_s, 0.01), gapRel=0.0, gapAbs=_INTEGRAL_GAP,
                         threads=threads, warmStart=use_start, logPath=log_path,
                         options=[f"randomCbcSeed {int(seed) + 1}", "preprocess off"])
    if not solver.available():
        os.unlink(log_path)
        raise SolverError("the CBC binary bundled with PuLP is missing or not executable; reinstall pulp "
                          "(pip install --force-reinstall pulp) or use the HiGHS backend")
    try:
        lp.solve(solver)
        with open(log_path) as log:
            text = log.read()
    except pulp.PulpSolverError as error:
        raise SolverError(f"CBC failed on the schedule model: {error}") from None
    finally:
        if os.path.exists(log_path):
            os.unlink(log_path)
    objective = pulp.value(lp.objective)
    if lp.sol_status == pulp.LpSolutionOptimal:
        return "optimal", objective, objective
    if lp.sol_status == pulp.LpSolutionInfeasible or lp.status == pulp.LpStatusInfeasible:
        return "infeasible", None, None  # CBC's "Integer infeasible" sets only the status
    match = _CBC_BOUND.search(text)
    bound = float(match.group(1)) if match else None
    if lp.sol_status == pulp.LpSolutionIntegerFeasible:
        return "feasible", objective, bound
    return "unknown", None, bound
