"""PO-H and PO-F: PipeOffload's offloading schedules (Wan et al., arXiv 2503.01328).

Both start from GIS-H, whose interleaving spreads each device's activations evenly over time,
and move activations to host memory in the window between F and B: an offload right after F,
a reload as late as still ends before B (``offload_slots.add_offloads``).

- PO-H offloads, on every device, the activations of the half of its stages (ceil(v/2)) that
  live longest. Under GIS-H with v = 2 these are the first chunk's stages, which make up most of a
  device's peak: with F = B = W and k <= 1 device 0 falls from ceil(p/2) + p chunk activations
  to ceil(p/2) + 2 (the second chunk's plus two of the first in transit: an F starts as the
  previous F's offload begins). That is the paper's better-than-linear saving for p > 8,
  exactly half at p = 8, and below a quarter of interleaved 1F1B's p*v + p - 1 for even
  p >= 10 and odd p >= 13. With v = 3 it leaves the last chunk: 0.159 of 1F1B-I's peak at
  p = 16 and k <= 1, the paper's (v+2)/(8v) / ((v+1)/v) = 0.156. The choice is per device
  because windows shrink along the pipeline: the longest-lived half of all stages would offload
  two chunks on the first devices and one on the others, which then set the peak (0.25). When
  the link is slower than that (k well above 1) an offloaded activation stays on the device
  while it waits for the channel and while it moves, and the saving shrinks accordingly.
- PO-F offloads every activation. The host link keeps up when a stage's round trip
  (offload + reload) takes no longer than its F + B, k <= 1 in the paper; beyond that PO-F does
  not apply and PO-H (or a solver) is the choice.

Both leave on the device the activations whose window cannot hold a round trip (the last
stage's B follows its F at once), as PipeOffload's released code also skips them, and those whose
transfers the channels cannot hide behind others' (``add_hidden_offloads``): moving them would
only make a backward wait, so both run exactly as fast as GIS-H.
"""

from __future__ import annotations

from optpipe.core.problem import Problem
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.semantics import duration_ms
from optpipe.core.simulate import simulate

from ..offload_slots import add_hidden_offloads, longest_lived_stages, offloadable, round_trip_ms
from ._register import register, require
from .gis import gis_h

__all__ = ["po_h", "po_f", "K_TOLERANCE", "longest_half_per_device"]

_SOURCE = "Wan et al., PipeOffload (arXiv 2503.01328): selective (PO-H) and full (PO-F) offload"

# Problem files give sizes to 0.1 MiB, so a link sized for k = 1 reads as k = 1.0001
# (benchmarks/problems/zb15b-p8-m32-half.toml); a round trip 0.1% over F + B is still "k = 1".
K_TOLERANCE = 1e-3


def _require_offload(problem: Problem, name: str) -> None:
    require(problem.offload.enabled,
            f"{name} moves activations to host memory, but offload is not enabled in this problem; add "
            f"[offload] enabled = true with d2h_bandwidth and h2d_bandwidth")


def longest_half_per_device(problem: Problem, timeline) -> frozenset[int]:
    """On every device, the ceil(v/2) of its stages whose activations live longest.

    Per device, not over the whole pipeline: the stages' windows shrink from device 0 to device
    p-1, so the longest-lived half of all stages would be every first chunk plus the second
    chunks of the first devices only, and for v >= 3 the devices after those would keep two
    chunks' activations and set the peak (0.25 of 1F1B-I's instead of 0.16 on p = 16, v = 3).
    """
    pipe = problem.pipeline
    per_device = -(-pipe.chunks_per_device // 2)
    taken = [0] * pipe.devices
    chosen: list[int] = []
    for stage in longest_lived_stages(timeline):
        device = pipe.device_of(stage)
        if taken[device] < per_device:
            taken[device] += 1
            chosen.append(stage)
    return frozenset(chosen)


@register("PO-H", _SOURCE, "GIS-H with the longest-lived half of the stages offloaded", effort=1)
def po_h(problem: Problem) -> Schedule:
    _require_offload(problem, "PO-H")
    base = gis_h(problem)
    timeline = simulate(problem, base)
    stages = longest_half_per_device(problem, timeline)
    chosen = [pair for pair in offloadable(timeline) if pair[0] in stages]
    return add_hidden_offloads(problem, base, chosen).renamed("PO-H")


@register("PO-F", _SOURCE, "GIS-H with every activation offloaded that fits a round trip; needs k <= 1",
          effort=1)
def po_f(problem: Problem) -> Schedule:
    _require_offload(problem, "PO-F")
    for stage in range(problem.stages):
        out, back = (duration_ms(problem, Op(kind, stage, 0)) for kind in (OpKind.OFFLOAD, OpKind.RELOAD))
        trip = round_trip_ms(problem, stage)
        compute = sum(duration_ms(problem, Op(kind, stage, 0)) for kind in (OpKind.F, OpKind.B))
        k = trip / compute
        require(k <= 1 + K_TOLERANCE,
                f"PO-F offloads every activation, which the host link hides only when a round trip takes no "
                f"longer than the stage's F + B (k <= 1); stage {stage}: offload {out:.2f} ms "
                f"+ reload {back:.2f} ms = {trip:.2f} ms > F + B = {compute:.2f} ms "
                f"(k = {k:.2f}); use PO-H, which offloads only the longest-lived half")
    base = gis_h(problem)
    return add_hidden_offloads(problem, base, offloadable(simulate(problem, base))).renamed("PO-F")
