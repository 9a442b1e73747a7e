"""The schedule IR: per device, an ordered list of ops.

An op is (kind, stage, microbatch). Compute ops (F, B, W, BW) run one at a time on their device
in list order. OFFLOAD ops run in list order on the device's D2H channel and RELOAD ops on its
H2D channel; a transfer cannot start before the compute op listed just before it has ended
(that is where the runtime issues it). Offload decisions are the OFFLOAD ops present.

Text form of an op: ``F3:0`` (kind, stage, ``:``, microbatch); kinds F, B, W, BW, OFF, REL, RC.
A RECOMPUTE (RC) op re-runs F(s, i) on the compute channel before its backward (issue 14).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Iterable, Iterator

from optpipe.core.errors import ScheduleError
from optpipe.core.files import read_text, write_atomic

__all__ = [
    "OpKind",
    "Op",
    "Schedule",
    "COMPUTE_KINDS",
    "TRANSFER_KINDS",
    "parse_op",
    "load_schedule",
    "dump_schedule",
]


class OpKind(IntEnum):
    """Stable numbers: they appear in plan files."""

    F = 0  # forward
    B = 1  # backward for the stage's input (activation gradient)
    W = 2  # backward for the stage's weights
    BW = 3  # fused backward: B and W in one op
    OFFLOAD = 4  # activation of F(s, i) to host memory (D2H channel)
    RELOAD = 5  # back to device memory before B(s, i) (H2D channel)
    RECOMPUTE = 6  # re-run F(s, i) before B(s, i): what F saved was dropped at F's end (compute channel)

    @property
    def mnemonic(self) -> str:
        return _MNEMONIC[self]


_MNEMONIC = {
    OpKind.F: "F",
    OpKind.B: "B",
    OpKind.W: "W",
    OpKind.BW: "BW",
    OpKind.OFFLOAD: "OFF",
    OpKind.RELOAD: "REL",
    OpKind.RECOMPUTE: "RC",
}
_BY_MNEMONIC = {text: kind for kind, text in _MNEMONIC.items()}
COMPUTE_KINDS = frozenset({OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.RECOMPUTE})
TRANSFER_KINDS = frozenset({OpKind.OFFLOAD, OpKind.RELOAD})
# Stage and microbatch have at most 9 digits: more can never name a stage or microbatch of a
# problem (plan files stop at 65,534) and would only cost time converting 5,000-digit numbers.
_OP_TEXT = re.compile(r"^(F|B|W|BW|OFF|REL|RC)(\d{1,9}):(\d{1,9})$")
MAX_OPS = 10_000_000  # in one schedule file: far beyond any problem that simulate takes (2^19 pairs)


@dataclass(frozen=True, order=True, slots=True)
class Op:
    kind: OpKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{_MNEMONIC[self.kind]}{self.stage}:{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


def parse_op(text: str) -> Op:
    match = _OP_TEXT.match(text.strip()) if len(text) <= 40 else None
    if not match:
        shown = repr(text) if len(text) <= 40 else repr(text[:30]) + f"... ({len(text)} characters)"
        raise ScheduleError(
            f"cannot parse op {shown}: expected KIND STAGE ':' MICROBATCH such as 'F3:0', "
            f"with KIND one of {', '.join(_BY_MNEMONIC)}"
        )
    return Op(_BY_MNEMONIC[match.group(1)], int(match.group(2)), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """``devices[d]`` is device d's ops in issue order."""

    name: str
    devices: tuple[tuple[Op, ...], ...]

    @staticmethod
    def of(name: str, devices: Iterable[Iterable[Op]]) -> "Schedule":
        return Schedule(name, tuple(tuple(ops) for ops in devices))

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def ops(self) -> Iterator[tuple[int, Op]]:
        for device, ops in enumerate(self.devices):
            for op in ops:
                yield device, op

    def compute(self, device: int) -> tuple[Op, ...]:
        return tuple(op for op in self.devices[device] if op.kind in COMPUTE_KINDS)

    def compute_only(self) -> "Schedule":
        """The same compute order without transfers: what offloaded variants of one order share."""
        return Schedule(self.name, tuple(self.compute(d) for d in range(self.num_devices)))

    @property
    def offloaded(self) -> frozenset[tuple[int, int]]:
        """(stage, microbatch) pairs whose activation goes to the host."""
        return frozenset((op.stage, op.microbatch) for _, op in self.ops() if op.kind is OpKind.OFFLOAD)

    @property
    def recomputed(self) -> frozenset[tuple[int, int]]:
        """(stage, microbatch) pairs whose forward runs again before their backward."""
        return frozenset((op.stage, op.microbatch) for _, op in self.ops() if op.kind is OpKind.RECOMPUTE)

    @property
    def splits_backward(self) -> bool:
        return any(op.kind is OpKind.W for _, op in self.ops())

    def renamed(self, name: str) -> "Schedule":
        return Schedule(name, self.devices)

    def with_split_backwards(self) -> "Schedule":
        """Every fused BW as B then W, in place: the same order, with W free to move later."""
        rows = []
        for ops in self.devices:
            row: list[Op] = []
            for op in ops:
                if op.kind is OpKind.BW:
                    row += [Op(OpKind.B, op.stage, op.microbatch), Op(OpKind.W, op.stage, op.microbatch)]
                else:
                    row.append(op)
            rows.append(tuple(row))
        return Schedule(self.name, tuple(rows))

    # ----------------------------------------------------------------- text and JSON

    def to_text(self) -> str:
        """One line per device: ``d0: F0:0 F0:1 B0:0 ...``."""
        return "\n".join(f"d{d}: " + " ".join(str(op) for op in ops) for d, ops in enumerate(self.devices))

    @staticmethod
    def from_text(name: str, text: str) -> "Schedule":
        rows = []
        for number, line in enumerate(l for l in text.splitlines() if l.strip()):
            head, _, body = line.partition(":")
            if head.strip() != f"d{number}":
                raise ScheduleError(f"line {number + 1}: expected it to start with 'd{number}:', got {line[:20]!r}")
            rows.append(tuple(parse_op(token) for token in body.split()))
        return Schedule(name, tuple(rows))

    def to_json(self) -> dict:
        return {
            "format": "optpipe-schedule",
            "version": 1,
            "name": self.name,
            "devices": [[str(op) for op in ops] for ops in self.devices],
        }

    @staticmethod
    def from_json(data: object) -> "Schedule":
        if not isinstance(data, dict) or data.get("format") != "optpipe-schedule":
            raise ScheduleError('not a schedule: expected a JSON object with "format": "optpipe-schedule"')
        if data.get("version") != 1:
            raise ScheduleError(f"schedule format version {_short_json(data.get('version'))} is not supported "
                                f"(expected 1)")
        name, devices = data.get("name"), data.get("devices")
        if not isinstance(name, str) or not isinstance(devices, list) or not all(isinstance(d, list) for d in devices):
            raise ScheduleError('schedule: expected "name" (a string) and "devices" (a list of lists of ops)')
        if len(devices) > 65534:
            raise ScheduleError(f'schedule: "devices" has {len(devices):,} entries; a plan holds at most 65,534 ranks')
        total = sum(len(ops) for ops in devices)
        if total > MAX_OPS:
            raise ScheduleError(f"schedule: {total:,} ops, more than {MAX_OPS:,}; no problem optpipe can simulate "
                                f"is that large")
        rows = []
        for device, ops in enumerate(devices):
            try:
                rows.append(tuple(parse_op(text if isinstance(text, str) else _short_json(text)) for text in ops))
            except ScheduleError as error:
                raise ScheduleError(f"devices[{device}]: {error}") from None
        return Schedule(name, tuple(rows))


def load_schedule(path: str | Path) -> Schedule:
    path = Path(path)
    text = read_text(path, "schedule file", ScheduleError, limit=256 << 20)
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as error:
        raise ScheduleError(f"{path}: not valid JSON ({error})") from None
    except RecursionError:
        raise ScheduleError(f"{path}: not a schedule: its JSON nests too deeply to read") from None
    except ValueError as error:  # an integer of more than 4,300 digits, or NaN/Infinity
        raise ScheduleError(f"{path}: not a schedule: {str(error).split(';')[0]}") from None
    try:
        return Schedule.from_json(data)
    except ScheduleError as error:
        raise ScheduleError(f"{path}: {error}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _short_json(value: object) -> str:
    """A non-string op entry as text for the error message, without converting huge integers."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:30] + "..."


def dump_schedule(schedule: Schedule, path: str | Path) -> None:
    write_atomic(path, json.dumps(schedule.to_json(), indent=1) + "\n", "schedule file")
