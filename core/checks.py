"""What the simulator checks of a schedule before it times anything, and the ops as it numbers them.

Every op once, on its stage's device, naming a real stage and microbatch; each (stage,
microbatch) with its F and one backward, split or fused, and its recompute or transfers listed
where they can run. A broken schedule raises ``ScheduleError`` for the first rule broken: the ops
in list order first, then the (stage, microbatch) pairs in order.
"""

from __future__ import annotations

from collections import Counter
from itertools import accumulate, chain, repeat
from operator import attrgetter

from optpipe.core.errors import ScheduleError
from optpipe.core.problem import Pipeline, Problem
from optpipe.core.schedule import Op, OpKind, Schedule

__all__ = ["Nodes", "check_ops"]

_F, _B, _W, _BW, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD
_RC = OpKind.RECOMPUTE

_KEY = attrgetter("kind", "stage", "microbatch")
_KIND, _STAGE, _MICROBATCH = attrgetter("kind"), attrgetter("stage"), attrgetter("microbatch")


class Nodes:
    """The schedule's ops in (device, position) order, a node each, found by key: (kind, stage,
    microbatch) hashes and compares as its Op does (a dataclass's hash and == are its fields'
    tuple's), but in C rather than in the dataclass's Python methods, and the simulator is hot."""

    __slots__ = ("ops", "device", "keys", "index", "first", "counts", "_of_kind")

    def __init__(self, schedule: Schedule):
        self.ops: list[Op] = list(chain.from_iterable(schedule.devices))
        self.device = list(chain.from_iterable(repeat(d, len(ops)) for d, ops in enumerate(schedule.devices)))
        self.keys = list(map(_KEY, self.ops))
        self.index = dict(zip(self.keys, range(len(self.keys))))  # of duplicates, the last (they are refused)
        self.first = list(accumulate(map(len, schedule.devices), initial=0))  # each device's first node
        self.counts = Counter(map(_KIND, self.ops))  # ops per kind
        self._of_kind: dict[OpKind, list[tuple[int, int]]] = {}

    def at(self, node: int) -> tuple[int, int]:
        """(device, position)."""
        device = self.device[node]
        return device, node - self.first[device]

    def of_kind(self, kind: OpKind) -> list[tuple[int, int]]:
        """(stage, microbatch) of every op of ``kind``, in list order."""
        if kind not in self._of_kind:
            self._of_kind[kind] = [key[1:] for key in self.keys if key[0] is kind] if self.counts[kind] else []
        return self._of_kind[kind]


def check_ops(problem: Problem, schedule: Schedule) -> Nodes:
    """Every op once, on its stage's device, and each (stage, microbatch)'s ops complete and in
    order; returns the nodes. Checked in bulk; only when that finds something wrong do the per-op
    and per-pair checks run, in their order, to name the first rule broken."""
    pipe = problem.pipeline
    if schedule.num_devices != pipe.devices:
        raise ScheduleError(
            f"schedule {schedule.name!r} has {schedule.num_devices} devices but the problem has {pipe.devices}"
        )
    try:
        nodes = Nodes(schedule)
    except Exception:  # an entry that is no op: the per-op checks meet it where they always did
        _placed(problem, schedule)
        raise
    if not _placed_well(pipe, nodes):
        _placed(problem, schedule)
    _check_enabled(problem, nodes.ops, nodes.counts)
    if not _pairs_well(problem, nodes):
        for s in range(problem.stages):
            for i in range(problem.microbatches):
                split = _check_passes(nodes.index, s, i)
                backward = Op(_B, s, i) if split else Op(_BW, s, i)
                _check_recompute(nodes, s, i, backward)
                _check_offload(nodes, s, i, backward)
    return nodes


def _placed_well(pipe: Pipeline, nodes: Nodes) -> bool:
    """Whether ``_placed`` finds nothing wrong: stages and microbatches in range, each op on its
    stage's device, none twice."""
    if not nodes.ops:
        return True
    try:
        stages, microbatches = list(map(_STAGE, nodes.ops)), list(map(_MICROBATCH, nodes.ops))
        device_of = [pipe.device_of(s) for s in range(pipe.stages)]
        return (0 <= min(stages) and max(stages) < pipe.stages and 0 <= min(microbatches)
                and max(microbatches) < pipe.microbatches and len(nodes.index) == len(nodes.keys)
                and list(map(device_of.__getitem__, stages)) == nodes.device)
    except Exception:  # a stage or microbatch that is no number: _placed says what it does with it
        return False


def _placed(problem: Problem, schedule: Schedule) -> None:
    """Raise naming the first op that names no real stage or microbatch, sits off its stage's
    device, or appears twice."""
    pipe = problem.pipeline
    where: dict[tuple, int] = {}  # key -> position
    stages, microbatches = pipe.stages, pipe.microbatches
    device_of = [pipe.device_of(s) for s in range(stages)]
    for device, ops in enumerate(schedule.devices):
        for position, op in enumerate(ops):
            if not 0 <= op.stage < stages:
                raise ScheduleError(f"device {device} position {position}: {op} names stage {op.stage}, "
                                    f"but stages run 0..{stages - 1}")
            if not 0 <= op.microbatch < microbatches:
                raise ScheduleError(f"device {device} position {position}: {op} names microbatch {op.microbatch}, "
                                    f"but microbatches run 0..{microbatches - 1}")
            if device_of[op.stage] != device:
                raise ScheduleError(f"device {device} position {position}: {op} is on the wrong device; "
                                    f"stage {op.stage} runs on device {device_of[op.stage]}")
            key = _KEY(op)
            if key in where:
                raise ScheduleError(f"device {device} position {position}: duplicate op {op} "
                                    f"(already at position {where[key]})")
            where[key] = position


def _check_enabled(problem: Problem, ops: list[Op], counts: Counter) -> None:
    """Transfers need [offload] and recomputes [recompute]."""
    if not problem.offload.enabled and (counts[_OFF] or counts[_REL]):
        first = next(op for op in ops if op.kind in (_OFF, _REL))
        raise ScheduleError(f"{first} moves an activation, but offload is not enabled in the problem "
                            f"([offload] enabled = true with bandwidths)")
    if not problem.recompute.enabled and counts[_RC]:
        first = next((op for op in ops if op.kind is _RC), None)
        if first is not None:
            raise ScheduleError(f"{first} recomputes an activation, but recompute is not enabled in the problem "
                                f"(add a [recompute] table)")


def _pairs_well(problem: Problem, nodes: Nodes) -> bool:
    """Whether the per-pair checks below find nothing wrong, given every op once and in range.

    Counted: F for every pair; as many B as W, and B and BW together one per pair. A pair with
    a BW and neither B nor W then leaves every other pair both its B and its W. As many REL as
    OFF, and each OFF with its REL. Then the list order of each recompute and transfer."""
    pairs, counts = problem.stages * problem.microbatches, nodes.counts
    if (counts[_F] != pairs or counts[_B] != counts[_W] or counts[_B] + counts[_BW] != pairs
            or counts[_OFF] != counts[_REL]):
        return False
    index = nodes.index
    if counts[_BW] and counts[_B]:
        if any((_B, s, i) in index or (_W, s, i) in index for s, i in nodes.of_kind(_BW)):
            return False
    for s, i in nodes.of_kind(_RC):
        if (_OFF, s, i) in index or not index[_F, s, i] < index[_RC, s, i] < _backward(index, s, i):
            return False
    for s, i in nodes.of_kind(_OFF):
        reload = index.get((_REL, s, i))
        if reload is None or not index[_F, s, i] < index[_OFF, s, i] or not reload < _backward(index, s, i):
            return False
    return True


def _backward(index: dict, s: int, i: int) -> int:
    """The node of (s, i)'s B, or of its BW when it has no B."""
    node = index.get((_B, s, i))
    return index[_BW, s, i] if node is None else node


def _check_passes(index: dict, s: int, i: int) -> bool:
    """F and one backward, split (B and W) or fused (BW), for (s, i); returns whether it is split."""
    if (_F, s, i) not in index:
        raise ScheduleError(f"missing op F{s}:{i}: every stage runs F for every microbatch")
    split = (_B, s, i) in index or (_W, s, i) in index
    fused = (_BW, s, i) in index
    if split and fused:
        raise ScheduleError(f"BW{s}:{i} and a split B/W of the same stage and microbatch: use one or the other")
    if not split and not fused:
        raise ScheduleError(f"missing op B{s}:{i} (or BW{s}:{i}): every stage runs a backward for every microbatch")
    if split:
        for kind in (_B, _W):
            if (kind, s, i) not in index:
                raise ScheduleError(f"missing op {Op(kind, s, i)}: a split backward needs both B and W")
    return split


def _check_recompute(nodes: Nodes, s: int, i: int, backward: Op) -> None:
    """A recompute is not also offloaded, and is listed between its F and its backward."""
    rc, off = Op(_RC, s, i), Op(_OFF, s, i)
    if (_RC, s, i) not in nodes.index:
        return
    if (_OFF, s, i) in nodes.index:
        raise ScheduleError(f"{rc} and {off}: an activation is kept, offloaded or recomputed, "
                            f"not both offloaded and recomputed")
    _listed_after(nodes, Op(_F, s, i), rc, rc, "a recompute re-runs the forward, so it comes after F")
    _listed_after(nodes, rc, backward, rc, "the recompute must come before the backward that uses it")


def _check_offload(nodes: Nodes, s: int, i: int, backward: Op) -> None:
    """OFF and REL come as a pair, the offload after its F and the reload before its backward."""
    off, rel = Op(_OFF, s, i), Op(_REL, s, i)
    has_off, has_rel = (_OFF, s, i) in nodes.index, (_REL, s, i) in nodes.index
    if has_rel and not has_off:
        raise ScheduleError(f"{rel} without OFF{s}:{i}: only an offloaded activation can be reloaded")
    if has_off and not has_rel:
        raise ScheduleError(f"{off} without REL{s}:{i}: an offloaded activation must be reloaded before B")
    if has_off:
        _listed_after(nodes, Op(_F, s, i), off, off, "an offload moves what F saved, so it comes after F")
        _listed_after(nodes, rel, backward, rel, "the reload must come before the backward that uses it")


def _listed_after(nodes: Nodes, earlier: Op, later: Op, at: Op, why: str) -> None:
    """``later`` must be listed after ``earlier`` on their device (one device: one stage); the
    error points at ``at``."""
    if nodes.index[_KEY(later)] < nodes.index[_KEY(earlier)]:
        device, position = nodes.at(nodes.index[_KEY(at)])
        raise ScheduleError(f"device {device} position {position}: {later} is listed before "
                            f"its {earlier}; {why}")
