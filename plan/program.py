"""The plan IR: per rank, a straight-line stream of instructions.

One opcode table is the single source of truth (CPython ``opcode.py`` style): numbers are
stable because they are written into plan files; every property set (needs a peer, moves
memory, is communication) is derived from the table, never kept by hand elsewhere.

An instruction has three operands, all plain ints: ``stage``, ``microbatch`` and ``peer`` (the
other rank for communication, -1 when there is none).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from typing import NamedTuple

__all__ = [
    "Opcode",
    "Instruction",
    "PlanHeader",
    "Program",
    "COMPUTE",
    "COMMUNICATION",
    "SENDS",
    "RECEIVE_POSTS",
    "RECEIVE_WAITS",
    "TRANSFERS",
    "HAS_PEER",
    "NO_PEER",
    "SINCE_VERSION",
]

NO_PEER = -1


class Opcode(IntEnum):
    # -- data in and out of the pipeline
    LOAD_MICROBATCH = 1  # first stage: fetch microbatch i's input
    LOSS = 2  # last stage: loss of microbatch i after its forward
    # -- compute
    FORWARD = 10
    BACKWARD_INPUT = 11  # gradient w.r.t. the stage's input only
    BACKWARD_WEIGHT = 12  # gradient w.r.t. the stage's parameters, from what BACKWARD_INPUT kept
    BACKWARD = 13  # fused: input and weight gradients at once
    RECOMPUTE = 14  # re-run the forward of (stage, i) under its RNG state; what it saved is back (plan format 2)
    # -- communication between ranks (peer is the other rank)
    SEND_ACTIVATION = 20  # output of F(stage, i) to the rank of stage + 1; does not block
    POST_RECV_ACTIVATION = 21  # post the receive of stage's input for microbatch i from peer
    WAIT_RECV_ACTIVATION = 22  # block until that receive has landed
    SEND_GRADIENT = 23  # input gradient of B(stage, i) to the rank of stage - 1; does not block
    POST_RECV_GRADIENT = 24  # post the receive of stage's output gradient from peer
    WAIT_RECV_GRADIENT = 25
    WAIT_SENDS = 26  # block until every send this rank posted has completed (end of step)
    # -- hand-over between stages on the same rank (V placement)
    LOCAL_ACTIVATION = 30  # output of F(stage, i) becomes the input of stage + 1 here
    LOCAL_GRADIENT = 31  # input gradient of B(stage, i) becomes stage - 1's output gradient here
    # -- host transfers of saved activations
    OFFLOAD = 40  # start copying F(stage, i)'s saved activations to the host (D2H)
    WAIT_OFFLOAD = 41  # the copy is done; the device memory is released
    RELOAD = 42  # start copying them back (H2D)
    WAIT_RELOAD = 43  # the copy is done; the backward may use them

    @property
    def mnemonic(self) -> str:
        return self.name


COMPUTE = frozenset({Opcode.FORWARD, Opcode.BACKWARD_INPUT, Opcode.BACKWARD_WEIGHT, Opcode.BACKWARD,
                     Opcode.RECOMPUTE})
# The plan format version that introduced an opcode (opcodes not listed are in version 1).
SINCE_VERSION = {Opcode.RECOMPUTE: 2}
SENDS = frozenset({Opcode.SEND_ACTIVATION, Opcode.SEND_GRADIENT})
RECEIVE_POSTS = frozenset({Opcode.POST_RECV_ACTIVATION, Opcode.POST_RECV_GRADIENT})
RECEIVE_WAITS = frozenset({Opcode.WAIT_RECV_ACTIVATION, Opcode.WAIT_RECV_GRADIENT})
COMMUNICATION = SENDS | RECEIVE_POSTS | RECEIVE_WAITS | {Opcode.WAIT_SENDS}
HAS_PEER = SENDS | RECEIVE_POSTS
TRANSFERS = frozenset({Opcode.OFFLOAD, Opcode.WAIT_OFFLOAD, Opcode.RELOAD, Opcode.WAIT_RELOAD})


class Instruction(NamedTuple):
    opcode: Opcode
    stage: int = -1
    microbatch: int = -1
    peer: int = NO_PEER

    def __str__(self) -> str:
        text = f"{self.opcode.name} s={self.stage} mb={self.microbatch}"
        return text + (f" peer={self.peer}" if self.peer != NO_PEER else "")


@dataclass(frozen=True)
class PlanHeader:
    world_size: int
    stage_ranks: tuple[int, ...]  # stage -> rank
    chunks: int  # stages per rank
    microbatches: int
    schedule_name: str
    problem_hash: bytes  # 32 bytes, sha256 of the problem's canonical TOML

    @property
    def stages(self) -> int:
        return len(self.stage_ranks)

    def stages_on(self, rank: int) -> tuple[int, ...]:
        """The stages on ``rank`` in increasing order; one pass over the map for all ranks, then O(1)."""
        return self._stages_by_rank.get(rank, ())

    @cached_property
    def _stages_by_rank(self) -> dict[int, tuple[int, ...]]:
        # Built once: disasm and verify ask for every rank, and a 65,534-rank plan made the
        # per-call scan quadratic. cached_property writes the instance __dict__, which a frozen
        # dataclass allows; the map is derived data, not a field, so equality is unchanged.
        index: dict[int, list[int]] = {}
        for stage, rank in enumerate(self.stage_ranks):
            index.setdefault(rank, []).append(stage)
        return {rank: tuple(stages) for rank, stages in index.items()}


@dataclass(frozen=True)
class Program:
    """``ranks[r]`` is rank r's instruction stream, run top to bottom each training step."""

    header: PlanHeader
    ranks: tuple[tuple[Instruction, ...], ...]
