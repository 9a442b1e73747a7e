"""Property tests: any order that respects each stage's dependencies simulates; broken ones raise."""

from __future__ import annotations

import random

import pytest
from conftest import examples, uniform_problem
from hypothesis import given, settings
from hypothesis import strategies as st

from optpipe.core.errors import ScheduleError
from optpipe.core.idle import idle_phases
from optpipe.core.problem import Placement
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import simulate


def _topological_schedule(problem, seed: int, split: bool) -> Schedule:
    """A random global order that respects every data dependency, cut into per-device lists."""
    rng = random.Random(seed)
    pipe = problem.pipeline
    last = pipe.stages - 1
    done: set[Op] = set()
    pending: set[Op] = set()
    for s in range(pipe.stages):
        for i in range(pipe.microbatches):
            pending.add(Op(OpKind.F, s, i))
            pending.update({Op(OpKind.B, s, i), Op(OpKind.W, s, i)} if split else {Op(OpKind.BW, s, i)})

    def back(s, i):
        return Op(OpKind.B if split else OpKind.BW, s, i)

    def ready(op: Op) -> bool:
        s, i = op.stage, op.microbatch
        if op.kind is OpKind.F:
            return s == 0 or Op(OpKind.F, s - 1, i) in done
        if op.kind is OpKind.W:
            return Op(OpKind.B, s, i) in done
        return Op(OpKind.F, s, i) in done and (s == last or back(s + 1, i) in done)

    devices: list[list[Op]] = [[] for _ in range(pipe.devices)]
    while pending:
        choices = sorted(op for op in pending if ready(op))
        op = rng.choice(choices)
        pending.remove(op)
        done.add(op)
        devices[pipe.device_of(op.stage)].append(op)
    return Schedule.of(f"random-{seed}", devices)


shapes = st.tuples(st.integers(1, 4), st.integers(1, 2), st.integers(1, 6), st.booleans(), st.booleans())


@settings(max_examples=examples(60, ci=20), deadline=None)
@given(shape=shapes, seed=st.integers(0, 10**6))
def test_dependency_respecting_orders_simulate(shape, seed):
    p, v, m, split, vshape = shape
    placement = Placement.VSHAPE if vshape and v == 2 else Placement.INTERLEAVED
    problem = uniform_problem(p, m, v=v, placement=placement, p2p=0.25)
    timeline = simulate(problem, _topological_schedule(problem, seed, split))
    assert timeline.makespan >= max(timeline.busy) - 1e-9
    assert 0.0 <= timeline.bubble_ratio < 1.0
    for t in timeline.timings:  # every dependency is honoured in the timing
        if t.op.kind is OpKind.F and t.op.stage > 0:
            assert t.start >= timeline.by_op[Op(OpKind.F, t.op.stage - 1, t.op.microbatch)].end - 1e-9
    for device, idle in enumerate(idle_phases(timeline)):  # the idle split (core/idle.py) adds up
        assert min(idle.head, idle.fill, idle.steady, idle.tail) >= 0.0
        assert idle.total == pytest.approx(timeline.makespan - timeline.busy[device])


@settings(max_examples=examples(60, ci=20), deadline=None)
@given(shape=shapes, seed=st.integers(0, 10**6))
def test_shuffles_that_break_dependencies_raise_the_cycle_error(shape, seed):
    p, v, m, split, vshape = shape
    placement = Placement.VSHAPE if vshape and v == 2 else Placement.INTERLEAVED
    problem = uniform_problem(p, m, v=v, placement=placement)
    schedule = _topological_schedule(problem, seed, split)
    # Move one backward of stage s ahead of its own forward on the same device: a guaranteed cycle.
    rng = random.Random(seed)
    device = rng.randrange(p)
    ops = list(schedule.devices[device])
    backward = rng.choice([op for op in ops if op.kind in (OpKind.B, OpKind.BW)])
    ops.remove(backward)
    ops.insert(ops.index(Op(OpKind.F, backward.stage, backward.microbatch)), backward)
    broken = Schedule.of("broken", [ops if d == device else list(schedule.devices[d]) for d in range(p)])
    with pytest.raises(ScheduleError, match="dependency cycle"):
        simulate(problem, broken)
