"""Recompute variants (issue 14): 1F1B-capped-RC and PO-H-RC.

- 1F1B-capped-RC is the memory-capped list schedule (capped.py) with every activation but the
  last stage's recomputed: between F and its recompute a microbatch holds only ``[recompute] resident``
  bytes, so the cap admits as many microbatches as the resident bytes allow, leaving room for
  one whole activation (the F or the recompute in progress: one compute op runs at a time, and
  the recompute sits right before its backward). It fits whenever one activation plus the
  resident bytes fit, and trades a forward's time per microbatch for pipeline depth.
- 1F1B-capped-RC/OFF is 1F1B-capped-RC with recomputes traded for offloads where that is
  faster and still fits: longest window first, each pair whose window holds a round trip moves
  to the host instead when the simulator says the schedule gets faster within the budget (the
  device saves a forward's time; the link carries what it can hide).
- PO-H-RC is PO-H with the pairs it wanted to offload but the host link could not hide
  (``add_hidden_offloads`` dropped them) recomputed instead: "recompute what the link cannot
  hide" (PipeOffload's selective recomputation, arXiv 2503.01328).
"""

from __future__ import annotations

from dataclasses import replace

from optpipe.core.problem import Problem
from optpipe.core.schedule import Schedule
from optpipe.core.simulate import simulate

from ..offload_slots import add_hidden_offloads, offloadable
from ..recompute import add_recomputes, trade_for_offloads
from ._register import register, require
from .capped import one_f_one_b_capped
from .gis import gis_h
from .pipeoffload import longest_half_per_device

__all__ = ["capped_recompute", "po_h_recompute", "capped_recompute_offload"]


def _require_recompute(problem: Problem, name: str, offloads: str | None = None) -> None:
    """NotApplicable unless recompute is enabled, and offload too when ``offloads`` says why it is needed."""
    require(problem.recompute.enabled,
            f"{name} re-runs forwards before their backwards, but recompute is not enabled in this problem; "
            f"add a [recompute] table")
    if offloads is not None:
        require(problem.offload.enabled, f"{name} {offloads}; enable [offload]")


@register("1F1B-capped-RC", "memory-capped list schedule with every activation recomputed (issue 14)",
          "keeps only each microbatch's resident bytes between F and B; fits when one activation does", effort=1,
          fallback=True)
def capped_recompute(problem: Problem) -> Schedule:
    _require_recompute(problem, "1F1B-capped-RC")
    pipe, memory = problem.pipeline, problem.memory
    # The last stage's backward can follow its forward at once, so it is recomputed only when its
    # whole activation does not fit next to the room kept for one recompute.
    resident, last = problem.recompute.resident, pipe.stages - 1
    extra = max(memory.activation[s] - resident[s] for s in range(max(last, 1)))
    budget = memory.budget - extra
    spare_last = memory.activation[last] <= budget
    if spare_last:
        resident = resident[:last] + (memory.activation[last],)
    else:
        extra = max(extra, memory.activation[last] - resident[last])
        budget = memory.budget - extra
    require(budget > 0 and all(sum(resident[s] for s in pipe.stages_on(d)) <= budget for d in range(pipe.devices)),
            "1F1B-capped-RC needs room for one whole activation next to the resident bytes of one microbatch")
    lean = replace(problem, memory=replace(memory, activation=tuple(resident),
                                           weight_activation=tuple(min(k, r) for k, r in
                                                                   zip(memory.weight_activation, resident)),
                                           budget=budget))
    base = one_f_one_b_capped(lean)
    pairs = [(s, i) for s in range(last if spare_last else pipe.stages) for i in range(pipe.microbatches)]
    return add_recomputes(problem, base, pairs).renamed("1F1B-capped-RC")


@register("PO-H-RC", "PO-H with what the host link cannot hide recomputed (issue 14)",
          "offloads the longest-lived half where the link hides it, recomputes the rest of that half", effort=1)
def po_h_recompute(problem: Problem) -> Schedule:
    _require_recompute(problem, "PO-H-RC", offloads="offloads what the host link hides")
    base = gis_h(problem)
    timeline = simulate(problem, base)
    half = longest_half_per_device(problem, timeline)
    wanted = [(s, i) for s in half for i in range(problem.microbatches)]
    chosen = [pair for pair in offloadable(timeline) if pair[0] in half]
    offloaded = add_hidden_offloads(problem, base, chosen)
    rest = [pair for pair in wanted if pair not in offloaded.offloaded]
    return add_recomputes(problem, offloaded, rest).renamed("PO-H-RC")


@register("1F1B-capped-RC/OFF", "1F1B-capped-RC with recomputes traded for offloads the link hides (issue 14)",
          "recomputes what the link cannot carry, offloads the rest; fits whenever 1F1B-capped-RC does", effort=1,
          fallback=True)
def capped_recompute_offload(problem: Problem) -> Schedule:
    _require_recompute(problem, "1F1B-capped-RC/OFF", offloads="trades recomputes for offloads")
    return trade_for_offloads(problem, capped_recompute(problem)).renamed("1F1B-capped-RC/OFF")
