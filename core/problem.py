"""The problem model: pipeline shape, per-stage costs, memory budget and host link.

A ``Problem`` is plain frozen data; ``problem_file`` reads and writes its TOML form (docs/design.md,
"The problem file"), and ``costmodel`` derives costs from a model and a device. Every value
error names the key it came from and what would be accepted; the limits below hold for every
way in.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

__all__ = [
    "Placement",
    "Pipeline",
    "Costs",
    "Memory",
    "Offload",
    "Recompute",
    "Problem",
    "MAX_DEVICES",
    "MAX_STAGES",
    "MAX_MICROBATCHES",
    "MAX_MILLISECONDS",
    "MIN_MILLISECONDS",
    "MAX_NAME",
]

# The plan file holds world size, stage count and microbatch count in 16 bits (0xFFFF means
# "none"), so a problem beyond these could never become a plan; larger values are typos.
MAX_DEVICES = 65534
MAX_STAGES = 65534
MAX_MICROBATCHES = 65534
MAX_MILLISECONDS = 1e9  # one op longer than eleven days is a unit mistake, and sums of such overflow
MIN_MILLISECONDS = 1e-6  # a compute op shorter than a nanosecond is below the simulator's time resolution
MAX_NAME = 200  # characters



class Placement(str, Enum):
    """How stages map to devices."""

    INTERLEAVED = "interleaved"  # stage s on device s % p
    VSHAPE = "vshape"  # v = 2: stage s on s if s < p else 2p-1-s


@dataclass(frozen=True)
class Pipeline:
    devices: int  # p
    chunks_per_device: int  # v
    placement: Placement
    microbatches: int  # m

    @property
    def stages(self) -> int:
        return self.devices * self.chunks_per_device

    def device_of(self, stage: int) -> int:
        p = self.devices
        if self.placement is Placement.VSHAPE:
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    def stages_on(self, device: int) -> tuple[int, ...]:
        """The stages on ``device`` in increasing order; O(chunks_per_device), not O(stages)."""
        p = self.devices
        if not 0 <= device < p:
            return ()
        if self.placement is Placement.VSHAPE:
            return (device, 2 * p - 1 - device)
        return tuple(range(device, self.stages, p))

    def chunk_of(self, stage: int) -> int:
        """Index of the stage among its device's stages (0 for the first model chunk)."""
        return stage // self.devices


@dataclass(frozen=True)
class Costs:
    """Milliseconds, one entry per stage."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    p2p: float

    def backward(self, stage: int) -> float:
        """A fused backward (BW) costs B + W."""
        return self.backward_input[stage] + self.backward_weight[stage]


@dataclass(frozen=True)
class Memory:
    """Bytes. ``activation[s]`` is saved by F(s, i); ``weight_activation[s]`` is what W still needs."""

    activation: tuple[int, ...]
    weight_activation: tuple[int, ...]
    budget: int


@dataclass(frozen=True)
class Offload:
    enabled: bool = False
    d2h_bandwidth: float = 0.0  # bytes per second
    h2d_bandwidth: float = 0.0
    host_budget: int = 0  # bytes per device
    # Devices that share one host link (one PCIe switch): each group has one D2H and one H2D
    # channel, so its devices' transfers run one at a time, each at the link's bandwidth.
    # Devices in no group keep a link of their own.
    link_groups: tuple[tuple[int, ...], ...] = ()

    def link_of(self, device: int) -> int:
        """The link a device's transfers use: its group's first device, or the device itself."""
        for group in self.link_groups:
            if device in group:
                return group[0]
        return device


@dataclass(frozen=True)
class Recompute:
    """Re-running F(s, i) before its backward instead of keeping what it saved (issue 14).

    Per stage: ``time_ms`` is the RECOMPUTE op's duration; ``resident`` is what stays on the
    device from F's end to the recompute's start (the stage input, or in selective mode the
    activations that are kept).
    """

    enabled: bool = False
    time_ms: tuple[float, ...] = ()
    resident: tuple[int, ...] = ()


@dataclass(frozen=True)
class Problem:
    name: str
    pipeline: Pipeline
    costs: Costs
    memory: Memory
    offload: Offload = field(default_factory=Offload)
    recompute: Recompute = field(default_factory=Recompute)

    @property
    def devices(self) -> int:
        return self.pipeline.devices

    @property
    def stages(self) -> int:
        return self.pipeline.stages

    @property
    def microbatches(self) -> int:
        return self.pipeline.microbatches

    @property
    def compute_ops(self) -> int:
        """F, B and W of every stage and microbatch: what sizes a solver's model."""
        return 3 * self.stages * self.microbatches

    @property
    def compute_ops_per_device(self) -> int:
        return 3 * self.pipeline.chunks_per_device * self.microbatches

    def offload_ms(self, stage: int) -> float:
        """Time to move F(stage)'s activation to the host."""
        return self.memory.activation[stage] / self.offload.d2h_bandwidth * 1e3

    def reload_ms(self, stage: int) -> float:
        return self.memory.activation[stage] / self.offload.h2d_bandwidth * 1e3

    def recompute_ms(self, stage: int) -> float:
        """Time to re-run F(stage) before its backward (a whole forward when the problem gives none)."""
        return self.recompute.time_ms[stage] if self.recompute.enabled else self.costs.forward[stage]

    def without_recompute(self) -> "Problem":
        return replace(self, recompute=Recompute())

    def with_budget(self, budget: int) -> "Problem":
        return replace(self, memory=replace(self.memory, budget=int(budget)))

    def without_offload(self) -> "Problem":
        return replace(self, offload=Offload())

