"""What whole activations force: at any instant the budget holds a whole number of each.

The area bound (bounds.py) lets the budget hold fractions of activations. When it holds only a
few, that is far from true: two 261 MiB activations and a third's 235 MiB weight part do not fit
in 586 MiB, however the bytes are shared out. Here every instant of a device is in one memory
*configuration*: for each of its stages, how many activations are held whole (from F's start to
B's end: phase a) and how many hold only the part W needs (from B's end to W's end: phase b),
with the bytes of all of them within the budget. The time spent in each configuration is a
variable of a covering LP:

- each stage's m activations need at least their least phase-a time in total: F + gap + B kept,
  F + offload + reload + B offloaded, F + recompute + B recomputed (the resident input it keeps
  in between is left out, so this stays a relaxation); and at least W each in phase b;
- offloads (reloads) run one at a time on the device's D2H (H2D) channel, none before the
  device's first forward ends;
- after the device's last B no activation is whole: the least tail after a B (its W, or the
  backward passes below) is spent in configurations without phase a;
- the device's ends hold few pairs (``_edges``): before its (k+1)-th compute op starts, at most
  k pairs hold anything (a hold begins at its forward's start, or later), and after its k-th op
  from the last begins, at most k (every hold ends by its pair's W, one op each). Those two
  windows last at least the first k ops (the first a forward) and the last k (the last a W), so
  configurations of at most k pairs take at least that long. Where only two or three
  activations fit, that is a share of a forward and a W the fractional count gave away: grid03
  (p = 4, v = 1, m = 32, two activations fit) goes from 1,594.9 ms to 1,604.7 on seed 1's costs
  and from 1,357.9 to 1,366.0 on seed 0's;
- the times add up to the makespan minus the earliest start of the device's first forward.

Configurations are too many to list (a knapsack's worth), so the LP is solved by column
generation: the master LP (HiGHS) over the configurations found so far gives each demand a
price, and an exact knapsack finds the configuration that pays most; none paying more than its
time means the master's optimum is the LP's. A fused BW holds the whole activation through its W
part, but holding the weight part only would use less, so that instant fits a configuration that
counts it in phase b: the bound holds for fused schedules too.
"""

from __future__ import annotations

from dataclasses import dataclass

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind
from optpipe.core.semantics import duration_ms, stage_ms

from .phases import most_pairs
from .quiet import quiet_stdout

__all__ = ["packing_bound"]

_F, _B, _W, _OFF, _REL, _RC = OpKind.F, OpKind.B, OpKind.W, OpKind.OFFLOAD, OpKind.RELOAD, OpKind.RECOMPUTE
_MAX_ROUNDS = 400  # column generation rounds; past them no bound is claimed
_REDUCED_COST_TOL = 1e-9
_SAFETY = 1e-7  # relative: what the LP's floating point may be off by, taken off the bound
# Edge rows only where the budget holds at most this many pairs: with more, no grid bound moved
# and the pricing took 5 to 8 times as long (grid16, p = 12, v = 3: 0.2 s to 1.3 s a bound).
_EDGE_PAIRS = 8


@dataclass(frozen=True)
class _Stage:
    act: int  # bytes held whole in phase a
    keep: int  # bytes held in phase b
    kept_ms: float  # least phase-a time of a kept activation
    offloaded_ms: float | None  # ... of an offloaded one, when that is shorter (else None)
    recomputed_ms: float | None  # ... of a recomputed one, when that is shorter
    out_ms: float  # its offload's D2H time
    back_ms: float  # its reload's H2D time
    w_ms: float  # least phase-b time


def packing_bound(problem: Problem, device: int, *, head: float, first_end: float, gap: dict[int, float],
                  tail_after_b: float) -> float | None:
    """A makespan bound for ``device`` (ms), or None where memory cannot bind or no proof came.

    ``head``: the earliest the device's first forward can start; ``first_end``: the earliest any
    of them can end; ``gap[s]``: the least time from F(s)'s end to B(s)'s start; ``tail_after_b``:
    the least time from any B of the device to the makespan's end.
    """
    memory, m = problem.memory, problem.microbatches
    stages = problem.pipeline.stages_on(device)
    if m * sum(memory.activation[s] for s in stages) <= memory.budget:
        return None  # everything fits at once: nothing to pack
    if any(memory.activation[s] > memory.budget for s in stages):
        return None  # nothing fits; memory_lower_bound says so
    data = [_stage(problem, s, gap[s]) for s in stages]
    value = _MasterLP(data, m, memory.budget, tail_after_b, first_end - head, _edges(problem, stages)).solve()
    return None if value is None else head + value * (1 - _SAFETY)


def _edges(problem: Problem, stages: tuple[int, ...]) -> tuple[float, ...]:
    """Per k = 1, 2, ...: the least time the device spends holding at most k pairs (see above).

    The first op is a forward (every other op of a pair follows its forward on the same device) and
    the last a W or a fused BW (which the B and every other op of its pair precede), each op at
    least the device's shortest. For k below the device's number of pairs the two windows do not
    overlap: it has at least two compute ops (F and B or BW) per pair, so at least 2k + 2.
    """
    memory, m = problem.memory, problem.microbatches
    most = most_pairs({s: min(memory.activation[s], memory.weight_activation[s]) for s in stages},
                      dict.fromkeys(stages, m), memory.budget)  # the smallest holds are weight parts
    if most > _EDGE_PAIRS:
        return ()
    kinds = [_F, _B, _W] + ([_RC] if problem.recompute.enabled else [])
    shortest = min(duration_ms(problem, Op(kind, s, 0)) for kind in kinds for s in stages)
    first = min(stage_ms(problem, _F)[s] for s in stages)
    last = min(stage_ms(problem, _W)[s] for s in stages)  # a fused BW lasts longer than its W
    # past the most that fit (and all the device's pairs) every configuration counts
    return tuple(first + last + 2 * (k - 1) * shortest for k in range(1, min(most, m * len(stages))))


def _stage(problem: Problem, s: int, gap: float) -> _Stage:
    f, b, w = (stage_ms(problem, kind)[s] for kind in (_F, _B, _W))
    act = problem.memory.activation[s]
    keep = min(act, problem.memory.weight_activation[s])
    kept = f + gap + b
    out = back = 0.0
    offloaded = recomputed = None
    if problem.offload.enabled:
        out, back = duration_ms(problem, Op(_OFF, s, 0)), duration_ms(problem, Op(_REL, s, 0))
        offloaded = f + out + back + b if f + out + back + b < kept else None
    if problem.recompute.enabled:
        rc = f + duration_ms(problem, Op(_RC, s, 0)) + b
        recomputed = rc if rc < kept else None
    return _Stage(act, keep, kept, offloaded, recomputed, out, back, w)


class _MasterLP:
    """The covering LP over configurations found so far, grown by pricing until none pays."""

    def __init__(self, stages: list[_Stage], m: int, budget: int, tail_ms: float, link_start_ms: float,
                 edges: tuple[float, ...] = ()):
        import highspy  # lazy: the solvers package loads without HiGHS until a bound needs it

        self.stages, self.m, self.budget = stages, m, budget
        with quiet_stdout():  # the banner of the first Highs in a process
            self.highs = highspy.Highs()
        self.highs.setOptionValue("output_flag", False)
        self.inf = highspy.kHighsInf
        self.optimal = highspy.HighsModelStatus.kOptimal
        n = len(stages)
        rows: list[tuple[float, float]] = []  # (lower, upper)
        self.a_rows = list(range(n))
        rows += [(m * st.kept_ms, self.inf) for st in stages]
        self.b_rows = {}
        for k, st in enumerate(stages):
            if st.keep > 0 and st.w_ms > 0:
                self.b_rows[k] = len(rows)
                rows.append((m * st.w_ms, self.inf))
        self.tail_row = None
        if tail_ms > 0:
            self.tail_row = len(rows)
            rows.append((tail_ms, self.inf))
        self.edge_rows = list(range(len(rows), len(rows) + len(edges)))  # the k-th: at most k pairs held
        rows += [(ms, self.inf) for ms in edges]
        offloads = [k for k, st in enumerate(stages) if st.offloaded_ms is not None]
        self.link_rows: list[int] = []
        if offloads:  # sum of configuration time - D2H (H2D) time >= the link's earliest start
            self.link_rows = [len(rows), len(rows) + 1]
            rows += [(max(0.0, link_start_ms), self.inf)] * 2
        fates = [k for k, st in enumerate(stages) if st.offloaded_ms is not None and st.recomputed_ms is not None]
        fate_rows = {k: len(rows) + j for j, k in enumerate(fates)}  # offloaded + recomputed <= m
        rows += [(-self.inf, m)] * len(fates)
        for lower, upper in rows:
            self.highs.addRow(lower, upper, 0, [], [])
        for k, st in enumerate(stages):  # the fates: per stage, how many offloaded and recomputed
            if st.offloaded_ms is not None:
                index = [self.a_rows[k], self.link_rows[0], self.link_rows[1]]
                value = [st.kept_ms - st.offloaded_ms, -st.out_ms, -st.back_ms]
                if k in fate_rows:
                    index, value = index + [fate_rows[k]], value + [1.0]
                self.highs.addCol(0.0, 0.0, m, len(index), index, value)
            if st.recomputed_ms is not None:
                index, value = [self.a_rows[k]], [st.kept_ms - st.recomputed_ms]
                if k in fate_rows:
                    index, value = index + [fate_rows[k]], value + [1.0]
                self.highs.addCol(0.0, 0.0, m, len(index), index, value)
        # a feasible start: one activation whole, one weight part, or nothing held
        for k in range(n):
            self._add(tuple(1 if j == k else 0 for j in range(n)), (0,) * n)
            if k in self.b_rows:
                self._add((0,) * n, tuple(1 if j == k else 0 for j in range(n)))
        self._add((0,) * n, (0,) * n)

    def _add(self, whole: tuple[int, ...], weight: tuple[int, ...]) -> None:
        entries = {self.a_rows[k]: float(c) for k, c in enumerate(whole) if c}
        entries.update({self.b_rows[k]: float(c) for k, c in enumerate(weight) if c and k in self.b_rows})
        if self.tail_row is not None and not any(whole):
            entries[self.tail_row] = 1.0
        pairs = sum(whole) + sum(weight)
        for k, row in enumerate(self.edge_rows, start=1):
            if pairs <= k:
                entries[row] = 1.0
        for row in self.link_rows:
            entries[row] = 1.0
        index = sorted(entries)
        self.highs.addCol(1.0, 0.0, self.inf, len(index), index, [entries[r] for r in index])

    def solve(self) -> float | None:
        for _ in range(_MAX_ROUNDS):
            self.highs.run()
            if self.highs.getModelStatus() != self.optimal:
                return None
            duals = self.highs.getSolution().row_dual
            column = self._price(duals)
            if column is None:
                return self.highs.getInfo().objective_function_value
            self._add(*column)
        return None

    def _price(self, duals) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The configuration of most negative reduced cost, if any is negative."""
        n = len(self.stages)
        fixed = sum(duals[row] for row in self.link_rows)  # every configuration counts on the link rows
        pay_a = [max(0.0, duals[self.a_rows[k]]) for k in range(n)]
        pay_b = [max(0.0, duals[self.b_rows[k]]) if k in self.b_rows else 0.0 for k in range(n)]
        best, column = 1.0 - fixed + _REDUCED_COST_TOL, None
        items = [(pay_a[k], self.stages[k].act, k, 0) for k in range(n)] + \
                [(pay_b[k], self.stages[k].keep, k, 1) for k in range(n)]
        # a configuration of at most k pairs also pays the edge rows from the k-th on
        edge = [max(0.0, duals[row]) for row in self.edge_rows]
        bonus = [sum(edge[k - 1:]) for k in range(1, len(edge) + 1)] + [0.0]
        for most, extra in zip([*range(1, len(edge) + 1), None], bonus):
            if most is not None and extra <= 0:
                continue
            value, counts = _knapsack(items, self.budget, self.m, n, most)
            if value + extra > best:
                best, column = value + extra, counts
            if self.tail_row is not None:  # without phase a, the tail's time pays too
                value, counts = _knapsack([item for item in items if item[3] == 1], self.budget, self.m, n, most)
                value += max(0.0, duals[self.tail_row]) + extra
                if value > best:
                    best, column = value, counts
        return column


def _knapsack(items: list[tuple[float, int, int, int]], budget: int, m: int, n: int, most: int | None = None):
    """Most pay for whole items (pay, bytes, stage, phase) within ``budget`` bytes, at most m per
    stage and at most ``most`` in all; exact, by depth-first search with the fractional bound.
    Returns (pay, (whole, weight))."""
    useful = sorted((item for item in items if item[0] > 0 and item[1] > 0), key=lambda it: -it[0] / it[1])
    best = [0.0, [0] * len(useful)]
    counts = [0] * len(useful)
    per_stage = [0] * n

    def search(i: int, room: int, left: int, pay: float) -> None:
        if pay > best[0]:
            best[0], best[1] = pay, counts.copy()
        if i == len(useful) or left == 0 or pay + room * useful[i][0] / useful[i][1] <= best[0]:
            return
        value, size, stage, _ = useful[i]
        for c in range(min(room // size, m - per_stage[stage], left), -1, -1):
            counts[i] = c
            per_stage[stage] += c
            search(i + 1, room - c * size, left - c, pay + c * value)
            per_stage[stage] -= c
        counts[i] = 0

    search(0, budget, len(useful) * m if most is None else most, 0.0)
    whole, weight = [0] * n, [0] * n
    for (value, size, stage, phase), c in zip(useful, best[1]):
        (whole if phase == 0 else weight)[stage] += c
    return best[0], (tuple(whole), tuple(weight))
