"""GIS and GIS-H: the generalised interleaved schedule of PipeOffload (Wan et al., arXiv 2503.01328).

Interleaved placement (stage c*p + j on device j, v chunks per device) with the backward split
into B and W. Microbatches run in groups of g: a device runs a group's forwards chunk by chunk
(g forwards per chunk) and its backwards in reverse chunk order. Device j starts with

    w_j = g*(v-1) + p - j

forwards, then repeats (B, W, F) and drains with (B, W). With F = B = W, device j's first B
is ready just as its last warm-up F ends: microbatch 0 has then run its last chunk and crossed
the p-1-j devices after j forward and back.

Peak, in chunk activations on device j, is w_j (the next F always follows a W): g*(v-1) + p - j.
With g = p (GIS) device 0 holds d*v, d = p, where Megatron's interleaved 1F1B, which groups by p
too but warms up with (v-1)*p + 2*(p-1-j) forwards and adds one before its first backward, holds
d*v + d - 1. GIS-H takes PipeOffload's smallest group (min_group_size in its released code),
g = ceil(p/2), and holds ceil(p/2)*(v-1) + p: about half of interleaved 1F1B's peak for v = 2.

A lead of L runs the first chunk L microbatches ahead: device j warms up with w_j + L
forwards, the extra ones first-chunk forwards of the microbatches after the first group. Where
memory lets the first devices fill deeper than GIS-H does (offloading the extra activations), a
device whose later chunk's data comes late has first-chunk forwards to run meanwhile: seed 1's
grid14 (p = 12, v = 2, 0.3 budgets, k = 1.6) leaves device 6 idle 58 ms before F18:0 under GIS-H,
after six first-chunk forwards.

Why small groups fail: device p-1's B of chunk c-1 waits for device 0's B of chunk c of the same
microbatch, g backwards earlier in device 0's list, and device 0 reaches that B only after
w_0 + k - g forwards, which need device p-1's forwards from g earlier. Device p-1 has run
w_{p-1} + k of them by its k-th B, enough whenever 2g >= p - 1; below that the lists can wait
on each other in a cycle (p = 8: groups of 1 to 3 deadlock, 4 runs).
"""

from __future__ import annotations

from optpipe.core.problem import Placement, Problem
from optpipe.core.schedule import Op, OpKind, Schedule

from ._register import register, require

__all__ = ["gis", "gis_h", "gis_schedule", "gis_warmup", "smallest_group"]

_SOURCE = "Wan et al., PipeOffload (arXiv 2503.01328): generalised interleaved schedule"


def smallest_group(devices: int) -> int:
    """GIS-H's group size, PipeOffload's smallest: ceil(p/2)."""
    return (devices + 1) // 2


def _deadlock_free(devices: int, group: int) -> bool:
    """The counting argument in the module docstring; sufficient, not necessary."""
    return 2 * group >= devices - 1


def gis_warmup(problem: Problem, group: int, device: int, lead: int = 0) -> int:
    """Forwards device ``device`` runs before its first backward (before capping at the total)."""
    pipe = problem.pipeline
    return group * (pipe.chunks_per_device - 1) + pipe.devices - device + lead


def _padded_order(p: int, v: int, groups: int, group: int, chunks_reversed: bool) -> list[tuple[int, int]]:
    """(chunk, microbatch) in group order; microbatches past m are dropped by the caller."""
    order = []
    for first in range(0, groups * group, group):
        chunks = range(v - 1, -1, -1) if chunks_reversed else range(v)
        for chunk in chunks:
            order.extend((chunk, first + k) for k in range(group))
    return order


def gis_schedule(problem: Problem, group: int, name: str, lead: int = 0) -> Schedule:
    """GIS with group size ``group`` and the first chunk ``lead`` microbatches ahead; NotApplicable
    outside interleaved placement or for groups below (p-1)/2."""
    pipe = problem.pipeline
    p, v, m = pipe.devices, pipe.chunks_per_device, pipe.microbatches
    require(pipe.placement is Placement.INTERLEAVED,
            f"{name} places stage c*p + j on device j (interleaved placement); this problem uses "
            f'placement = "{pipe.placement.value}"')
    require(group >= 1 and _deadlock_free(p, group),
            f"{name}: a group of {group} microbatches can deadlock on {p} devices; use a group size of at "
            f"least (p-1)/2, e.g. ceil(p/2) = {smallest_group(p)}")
    require(lead >= 0, f"{name}: the first chunk's lead must be at least 0, not {lead}")
    groups = -(-m // group)
    forwards = _padded_order(p, v, groups, group, chunks_reversed=False)
    if lead:  # the first chunk's microbatches shifted by the lead; the padding past m is dropped below
        forwards = [(0, i) for i in range(lead)] + [(c, i + lead if c == 0 else i) for c, i in forwards]
    backwards = _padded_order(p, v, groups, group, chunks_reversed=True)
    devices = []
    for device in range(p):
        # Build the padded order (whole groups), then drop the padding: removing ops from a
        # deadlock-free order keeps it deadlock-free, and the padded order is the one analysed above
        # (with a lead it is not: a property test in tests/test_heuristics_offload.py simulates leads).
        warmup = min(gis_warmup(problem, group, device, lead), len(forwards))
        padded: list[tuple[OpKind, int, int]] = [(OpKind.F, c, i) for c, i in forwards[:warmup]]
        for n, (c, i) in enumerate(backwards):
            padded.append((OpKind.B, c, i))
            padded.append((OpKind.W, c, i))
            if warmup + n < len(forwards):
                padded.append((OpKind.F, *forwards[warmup + n]))
        devices.append([Op(kind, c * p + device, i) for kind, c, i in padded if i < m])
    return Schedule.of(name, devices)


@register("GIS", _SOURCE, "group size p, split B/W; device 0 holds p*v chunk activations (1F1B-I: p*v + p - 1)")
def gis(problem: Problem) -> Schedule:
    return gis_schedule(problem, problem.devices, "GIS")


@register("GIS-H", _SOURCE, "group size ceil(p/2), split B/W; device 0 holds ceil(p/2)*(v-1) + p chunk activations")
def gis_h(problem: Problem) -> Schedule:
    return gis_schedule(problem, smallest_group(problem.devices), "GIS-H")
