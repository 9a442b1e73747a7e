"""A generated grid of problems for the solver-quality benchmark (issue 11, item 4).

Deterministic (seeded): pipelines of p = 4..32 devices, v = 1..3 chunks, m = p..8p microbatches;
uneven stage costs (each stage's F drawn from 0.7..1.3 of a base, B and W in proportion, the
last stage heavier for the output layer); activation sizes that vary by stage; budgets from
tight (a few activations) to ample (what interleaved 1F1B holds); host links with k = 0.3..3
(a round trip takes k x (F + B) of a stage) or no offload. Sizes grow with p, so the grid runs
in minutes at short time limits; ``LARGE`` adds the issue's p = 32, m = 256 case, and ``huge``
is its p = 64, m = 512 case (a benchmark of its own: it takes minutes at any limit).
"""

from __future__ import annotations

import dataclasses
import random

from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem

__all__ = ["grid", "generated", "huge", "small", "vshaped", "with_budgets", "LARGE", "HUGE"]

_MIB = 2**20
# (p, v, m, budget as a fraction of 1F1B-I's activations p*v + p - 1, k or None for no offload)
_SHAPES = [
    (4, 1, 8, 0.5, 1.0), (4, 2, 16, 0.35, 2.0), (4, 3, 12, 0.6, None), (4, 1, 32, 0.25, 3.0),
    (6, 2, 12, 0.3, 0.6), (6, 1, 24, 0.8, None), (6, 3, 18, 0.4, 1.6), (6, 2, 48, 0.2, 0.3),
    (8, 1, 16, 0.3, 2.0), (8, 2, 24, 0.25, 2.0), (8, 2, 32, 0.5, 1.0), (8, 3, 16, 0.3, 3.0),
    (8, 1, 64, 1.0, None), (8, 2, 48, 0.15, 0.6), (12, 2, 24, 0.3, 1.6), (12, 1, 48, 0.4, 0.3),
    (12, 3, 36, 0.25, 1.0), (16, 2, 32, 0.3, 1.6), (16, 1, 64, 0.6, 2.0), (16, 2, 64, 0.2, 1.0),
    (24, 2, 48, 0.3, 1.6), (24, 1, 96, 0.5, None), (32, 2, 64, 0.25, 1.6), (32, 1, 128, 0.35, 0.6),
]
LARGE = (32, 2, 256, 0.24, 1.6)
HUGE = (64, 2, 512, 0.24, 1.6)


def generated(index: int, p: int, v: int, m: int, fraction: float, k: float | None, seed: int) -> Problem:
    """One problem of the kind above: the index-th shape of the grid with ``seed``, or any other shape."""
    rng = random.Random(seed * 1000 + index)
    stages = p * v
    base = rng.choice([8.0, 10.0, 14.0])
    forward = [round(base * rng.uniform(0.7, 1.3), 2) for _ in range(stages)]
    forward[-1] = round(forward[-1] * 1.4, 2)  # the output layer
    backward_input = [round(f * rng.uniform(1.0, 1.2), 2) for f in forward]
    backward_weight = [round(f * rng.uniform(0.8, 1.0), 2) for f in forward]
    activation = [int(rng.uniform(0.8, 1.2) * 256 * _MIB) for _ in range(stages)]
    keep = [int(a * 0.9) for a in activation]
    slots = max(v + 1, round(fraction * (stages + p - 1)))
    budget = max(slots * max(activation), sum(sorted(activation)[-v:]) + 1)
    offload = Offload()
    if k is not None:
        # the slowest round trip relative to its stage's F + B is k: bytes/ms = 2 act / (k (F + B))
        rate = min(2 * a / (k * (f + b)) for a, f, b in zip(activation, forward, backward_input))
        offload = Offload(True, rate * 1e3, rate * 1e3, 1 << 40)
    name = f"grid{index:02d}-p{p}-v{v}-m{m}-b{fraction:g}" + (f"-k{k:g}" if k is not None else "-nooff")
    return Problem(name, Pipeline(p, v, Placement.INTERLEAVED, m),
                   Costs(tuple(forward), tuple(backward_input), tuple(backward_weight), 0.2),
                   Memory(tuple(activation), tuple(keep), int(budget)), offload)


def grid(seed: int = 0, large: bool = False) -> list[Problem]:
    """The grid's problems, smallest first; with ``large`` the p = 32, m = 256 case at the end."""
    shapes = _SHAPES + ([LARGE] if large else [])
    return [generated(index, *shape, seed=seed) for index, shape in enumerate(shapes)]


def huge(seed: int = 0) -> Problem:
    """The p = 64, v = 2, m = 512 problem (65,536 stage-microbatch pairs), numbered after the large one."""
    return generated(len(_SHAPES) + 1, *HUGE, seed=seed)


def small(count: int, seed: int = 0) -> list[Problem]:
    """``count`` random problems of the same kind with at most 160 compute ops (p = 2..6, v = 1..3,
    m = p..3p, a tight budget, offload with k = 0.6..3; V placement for some with v = 2): where a
    user expects compile to prove its answer optimal, and where it once reported gaps of 10% on
    two devices. Numbered from 200."""
    rng = random.Random(seed)
    problems: list[Problem] = []
    while len(problems) < count:
        p, v = rng.choice([2, 3, 4, 5, 6]), rng.choice([1, 2, 3])
        m = rng.choice([p, 2 * p, 3 * p])
        fraction, k, shape_seed = rng.choice([0.2, 0.3, 0.5]), rng.choice([0.6, 1.0, 1.6, 2.0, 3.0]), rng.randrange(1000)
        vshape = v == 2 and rng.random() < 0.4
        if 3 * p * v * m > 160:
            continue
        problem = generated(200 + len(problems), p, v, m, fraction, k, seed=shape_seed)
        problems.append(vshaped(problem) if vshape else problem)
    return problems


def vshaped(problem: Problem) -> Problem:
    """The same problem in V placement (v = 2: stage s and 2p - 1 - s on device s), named with -V."""
    pipeline = dataclasses.replace(problem.pipeline, placement=Placement.VSHAPE)
    return dataclasses.replace(problem, name=problem.name + "-V", pipeline=pipeline)


def with_budgets(problem: Problem, factors: list[float]) -> list[Problem]:
    """The problem at each budget factor, named with @<factor>x: whether a gap comes from the
    budget (it closes as memory grows) or from the pipeline (it does not) shows in one table."""
    return [dataclasses.replace(problem.with_budget(int(problem.memory.budget * factor)),
                                name=f"{problem.name}@{factor:g}x") for factor in factors]


def with_microbatches(problem: Problem, counts: list[int]) -> list[Problem]:
    """The problem at each microbatch count, named with @m<count>: where the small counts are
    proven optimal and the found makespan grows by the same ms per microbatch to the full count,
    a gap that grows with it is the bound's, not the search's."""
    return [dataclasses.replace(problem, name=f"{problem.name}@m{count}",
                                pipeline=dataclasses.replace(problem.pipeline, microbatches=count))
            for count in counts]
