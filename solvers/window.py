"""A time window of a schedule as a CP-SAT scope, and the model's answer spliced back.

The window search (lns.py) cuts a window [t0, t1) out of a timeline: the ops in it are free, the
ops of the next stretch up to t2 keep their order but are re-timed, the rest is fixed or summed
up as the compute each device still has to do. What the model returns is put back in list order
(``splice``), every op outside the window where the simulator had it.
"""

from __future__ import annotations

from optpipe.core.problem import Problem
from optpipe.core.schedule import COMPUTE_KINDS, Op, OpKind, Schedule
from optpipe.core.semantics import TOLERANCE_MS, duration_ms
from optpipe.core.simulate import Timeline

from .cpsat import Scope
from .decode import schedule_from_starts
from .timegrid import Grid

__all__ = ["offloaded_pairs", "splice", "window_scope"]

_F, _B, _W, _BW, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD
_EPS = TOLERANCE_MS


def _regions(timeline: Timeline, t0: float, t1: float, t2: float) -> dict[Op, int]:
    """Each schedule op's region: 0 before the window, 1 in it, 2 following it, 3 after that.

    A compute op goes by its start. A transfer goes with the compute op it is listed after (its
    issue point), so that the ops of a region keep their list order; one that starts before t0
    stays fixed, and one issued before t0 that starts later joins the window.
    """
    region: dict[Op, int] = {}
    by_device: dict[int, list] = {}
    for t in timeline.timings:
        by_device.setdefault(t.device, []).append(t)
    for timings in by_device.values():
        issue = 0
        for t in timings:
            start = t.start
            if t.op.kind in COMPUTE_KINDS:
                issue = 0 if start < t0 - _EPS else 1 if start < t1 - _EPS else 2 if start < t2 - _EPS else 3
                region[t.op] = issue
            else:
                region[t.op] = 0 if start < t0 - _EPS else max(issue, 1)
    return region


def _model_op(problem: Problem, grid: Grid, op: Op, start: float) -> list[tuple[Op, int]]:
    """A schedule op in model terms, with its start in units rounded up like every model time
    (timegrid.py): a fused BW is B then W."""
    if op.kind is not _BW:
        return [(op, grid.up(start))]
    b, w = Op(_B, op.stage, op.microbatch), Op(_W, op.stage, op.microbatch)
    return [(b, grid.up(start)), (w, grid.up(start) + grid.up(duration_ms(problem, b)))]


def window_scope(problem: Problem, timeline: Timeline, grid: Grid, t0: float, t1: float,
           t2: float, free: frozenset[int] | None = None,
           microbatches: range | None = None) -> tuple[Scope, dict[Op, int]]:
    """The window [t0, t1), re-timed ops up to t2, as a model scope; and the hint (current starts).

    With ``free``, only those devices' ops in the window are free; the other devices' ops there
    keep their list order and are re-timed, like the ops after the window. With
    ``microbatches``, the window's compute ops of the other microbatches keep their list order
    (``Scope.chains``) and their pairs their offload decisions (their transfers may change
    slots); the free ops may go anywhere between them.
    """
    pipe = problem.pipeline
    region = _regions(timeline, t0, t1, t2)
    if free is not None:
        device = {t.op: t.device for t in timeline.timings}
        region = {op: 2 if where == 1 and device[op] not in free else where for op, where in region.items()}
    offloaded = frozenset((t.op.stage, t.op.microbatch) for t in timeline.timings if t.op.kind is _OFF)
    fixed, inside, window = {}, {}, set()
    rest = [0] * pipe.devices
    follow: list[list[Op]] = [[] for _ in range(pipe.devices)]
    for t in timeline.timings:
        where = region[t.op]
        for op, units in _model_op(problem, grid, t.op, t.start):
            if where == 0:
                fixed[op] = units
            elif where in (1, 2):
                inside[op] = units
                if where == 2:
                    follow[t.device].append(op)
                else:
                    window.add(op)
            elif op.kind in COMPUTE_KINDS:
                rest[t.device] += grid.up(duration_ms(problem, op))
    pairs = frozenset((op.stage, op.microbatch) for op in window if op.kind is _F
                      and Op(_B, op.stage, op.microbatch) in window
                      and (microbatches is None or op.microbatch in microbatches)) if problem.offload.enabled else frozenset()
    compute = frozenset(op for op in window if op.kind in COMPUTE_KINDS)
    transfers = frozenset(op for op in window if op.kind in (_OFF, _REL) and (op.stage, op.microbatch) not in pairs)
    chains = () if microbatches is None else tuple(_held(problem, timeline, grid, window, microbatches))
    scope = Scope(compute=compute, open_pairs=pairs, offloaded=offloaded - pairs, transfers=transfers,
                  fixed=fixed, t0=grid.down(t0), rest=tuple(rest), follow=tuple(tuple(ops) for ops in follow),
                  chains=chains, unordered=unordered_chains(timeline))
    return scope, inside


def unordered_chains(timeline: Timeline) -> frozenset[tuple[OpKind, int]]:
    """(kind, stage) of the compute ops that ``timeline`` does not run in microbatch order.

    The model's symmetry breaking (cpsat_model.py) runs each stage's F, B and W in microbatch
    order; W deferral (wdefer.py) moves single W passes past later ones, and a window that
    freed one of such a pair while the other was re-timed after it (or fixed before it) had no
    solution at all: on seed 1's grid14 (p = 12) 71 of a 60 s compile's 118 windows were
    infeasible."""
    latest: dict[tuple[OpKind, int], int] = {}  # per chain, the latest microbatch run so far
    out = set()
    for t in timeline.timings:  # a stage's ops share one device, whose timings come in start order
        if t.op.kind not in COMPUTE_KINDS:
            continue
        for kind in (_B, _W) if t.op.kind is _BW else (t.op.kind,):  # a fused BW is B then W
            key = (kind, t.op.stage)
            if t.op.microbatch < latest.get(key, -1):
                out.add(key)
            latest[key] = max(t.op.microbatch, latest.get(key, -1))
    return frozenset(out)


def _held(problem: Problem, timeline: Timeline, grid: Grid, window: set[Op],
          microbatches: range) -> list[tuple[Op, ...]]:
    """Per device, the window's compute ops of the other microbatches, in list order (model terms)."""
    chains: list[list[Op]] = [[] for _ in range(problem.devices)]
    for t in timeline.timings:
        if t.op.kind in COMPUTE_KINDS and t.op.microbatch not in microbatches:
            chains[t.device] += [op for op, _ in _model_op(problem, grid, t.op, t.start) if op in window]
    return [tuple(chain) for chain in chains if len(chain) > 1]


def splice(problem: Problem, timeline: Timeline, scope: Scope, modelled: frozenset[Op], solved: dict[Op, int],
            grid: Grid, shift: float) -> Schedule:
    """Ops before the window as they were, the window and what follows as solved (transfers the
    solution drops are gone), the rest after them in their order."""
    starts: dict[Op, float] = {}
    for t in timeline.timings:
        op = t.op
        key = Op(_B, op.stage, op.microbatch) if op.kind is _BW else op
        if key in scope.fixed:
            starts[op] = t.start
        elif key not in modelled:
            starts[op] = t.start + shift  # after every re-timed op, order kept
    for op, units in solved.items():
        starts[op] = grid.ms(units)
    return schedule_from_starts(problem, timeline.schedule_name, starts)


def offloaded_pairs(timeline: Timeline) -> frozenset[tuple[int, int]]:
    """The (stage, microbatch) pairs the timeline offloads."""
    return frozenset((t.op.stage, t.op.microbatch) for t in timeline.timings if t.op.kind is _OFF)
