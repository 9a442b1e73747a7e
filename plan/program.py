"""The plan IR: per rank, a straight-line stream of instructions.

One opcode table is the single source of truth (CPython ``opcode.py`` style): each row of
``Opcode`` declares an opcode once, with its number, its mnemonic (the member's name) and a
``Spec`` of its operand kinds and flags. Numbers are stable because they are written into plan
files (docs/plan-format.md lists them from here). Every property set and map below (needs a
peer, posts a message, the schedule op it stands for, its trace name, ...) is derived from the
table; the lowering, verifier, disassembler, bytecode, interpreter and trace read those, never
a second hand-kept list.

An instruction has three operand slots, all plain ints: ``stage``, ``microbatch`` and
``peer`` (the other rank for communication); a slot the opcode does not use holds -1.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum, unique
from functools import cached_property
from typing import NamedTuple

from optpipe.core.schedule import OpKind

__all__ = [
    "Opcode",
    "Spec",
    "Operand",
    "Group",
    "Message",
    "Exchange",
    "Neighbour",
    "Instruction",
    "PlanHeader",
    "Program",
    "COMPUTE",
    "SENDS",
    "RECEIVE_POSTS",
    "RECEIVE_WAITS",
    "POSTS_MESSAGE",
    "HAS_PEER",
    "NEIGHBOUR",
    "RECEIVE_OF",
    "WAIT_OF",
    "KIND_OF",
    "OPCODE_OF",
    "TRACE_KIND",
    "TRACE_NAME",
    "NO_PEER",
    "SINCE_VERSION",
]

NO_PEER = -1


class Operand(Enum):
    """What an operand slot means for an opcode that uses it."""

    STAGE = "stage"  # the stage the instruction runs for; it lives on the instruction's rank
    MICROBATCH = "microbatch"
    PEER = "peer"  # the rank of the neighbouring stage that a message goes to or comes from


class Group(Enum):
    """The table's groups; an opcode's number lies in its group's decade (value .. value + 9)."""

    DATA = 0  # data in and out of the pipeline
    COMPUTE = 10  # runs a stage's module on the compute stream
    COMMUNICATION = 20  # messages between ranks
    HANDOVER = 30  # between two stages on the same rank (V placement)
    TRANSFER = 40  # saved activations to the host and back


class Message(Enum):
    """What a communication instruction carries."""

    ACTIVATION = "activation"  # output of F(stage, i), to the rank of stage + 1
    GRADIENT = "gradient"  # input gradient of B(stage, i), to the rank of stage - 1


class Exchange(Enum):
    """What a communication instruction does with its message."""

    SEND = "send"  # issued without blocking; WAIT_SENDS completes it
    POST = "post"  # post the receive, without blocking
    WAIT = "wait"  # block until the posted receive has landed


class Neighbour(NamedTuple):
    """The stage an instruction exchanges data with: ``stage + step``."""

    step: int  # +1: the next stage, -1: the previous one
    crosses: bool  # on another rank (a message) or on this one (a hand-over)


_SM = (Operand.STAGE, Operand.MICROBATCH)
_SMP = _SM + (Operand.PEER,)


@dataclass(frozen=True)
class Spec:
    """An opcode's operand kinds and flags: one row of the table."""

    group: Group
    operands: tuple[Operand, ...] = _SM  # the slots it uses; the others hold -1
    neighbour: Neighbour | None = None
    message: tuple[Message, Exchange] | None = None  # communication only
    raises: OpKind | None = None  # the schedule op it stands for (raise_schedule; lower inverts it)
    trace_kind: OpKind | None = None  # the op whose measured time its own time adds to
    # Trace events read ``{name}{stage}:{mb}``, like the predicted op; without one, the mnemonic.
    trace_name: str | None = None
    since: int = 1  # the plan format version that introduced it


_F, _B, _W, _BW = OpKind.F, OpKind.B, OpKind.W, OpKind.BW
_ACT, _GRAD = Message.ACTIVATION, Message.GRADIENT
_SEND, _POST, _WAIT = Exchange.SEND, Exchange.POST, Exchange.WAIT
_NEXT, _PREV = Neighbour(+1, True), Neighbour(-1, True)  # a stage on another rank
_HERE_NEXT, _HERE_PREV = Neighbour(+1, False), Neighbour(-1, False)  # a stage on this rank
_DATA, _COMPUTE, _COMM = Group.DATA, Group.COMPUTE, Group.COMMUNICATION
_HANDOVER, _TRANSFER = Group.HANDOVER, Group.TRANSFER


@unique
class Opcode(IntEnum):
    """The table: ``MNEMONIC = number, Spec(...)``, one row per opcode, in groups by decade."""

    spec: Spec

    def __new__(cls, number: int, spec: Spec) -> Opcode:
        member = int.__new__(cls, number)
        member._value_ = number
        member.spec = spec
        return member

    # -- data in and out of the pipeline
    LOAD_MICROBATCH = 1, Spec(_DATA)  # first stage: fetch microbatch i's input
    LOSS = 2, Spec(_DATA, trace_kind=_F)  # last stage: loss of microbatch i after its forward (timed with F)
    # -- compute
    FORWARD = 10, Spec(_COMPUTE, raises=_F, trace_kind=_F, trace_name="F")
    BACKWARD_INPUT = 11, Spec(_COMPUTE, raises=_B, trace_kind=_B, trace_name="B")  # gradient w.r.t. the input only
    # gradient w.r.t. the stage's parameters, from what BACKWARD_INPUT kept
    BACKWARD_WEIGHT = 12, Spec(_COMPUTE, raises=_W, trace_kind=_W, trace_name="W")
    BACKWARD = 13, Spec(_COMPUTE, raises=_BW, trace_kind=_BW, trace_name="BW")  # fused: input and weight gradients
    # re-run the forward of (stage, i) under its RNG state; what it saved is back (plan format 2)
    RECOMPUTE = 14, Spec(_COMPUTE, raises=OpKind.RECOMPUTE, trace_name="RC", since=2)
    # -- communication between ranks (peer is the other rank)
    SEND_ACTIVATION = 20, Spec(_COMM, _SMP, _NEXT, (_ACT, _SEND))  # output of F(stage, i); does not block
    POST_RECV_ACTIVATION = 21, Spec(_COMM, _SMP, _PREV, (_ACT, _POST))  # stage's input for microbatch i
    WAIT_RECV_ACTIVATION = 22, Spec(_COMM, _SM, _PREV, (_ACT, _WAIT))  # block until that receive has landed
    SEND_GRADIENT = 23, Spec(_COMM, _SMP, _PREV, (_GRAD, _SEND))  # input gradient of B(stage, i); does not block
    POST_RECV_GRADIENT = 24, Spec(_COMM, _SMP, _NEXT, (_GRAD, _POST))  # stage's output gradient
    WAIT_RECV_GRADIENT = 25, Spec(_COMM, _SM, _NEXT, (_GRAD, _WAIT))
    WAIT_SENDS = 26, Spec(_COMM, ())  # block until every send this rank posted has completed (end of step)
    # -- hand-over between stages on the same rank (V placement)
    LOCAL_ACTIVATION = 30, Spec(_HANDOVER, neighbour=_HERE_NEXT)  # output of F(stage, i) is stage + 1's input
    LOCAL_GRADIENT = 31, Spec(_HANDOVER, neighbour=_HERE_PREV)  # input gradient of B(stage, i) goes to stage - 1
    # -- host transfers of saved activations
    OFFLOAD = 40, Spec(_TRANSFER, raises=OpKind.OFFLOAD, trace_name="OFF")  # start the D2H copy of F's saved tensors
    WAIT_OFFLOAD = 41, Spec(_TRANSFER)  # the copy is done; the device memory is released
    RELOAD = 42, Spec(_TRANSFER, raises=OpKind.RELOAD, trace_name="REL")  # start copying them back (H2D)
    WAIT_RELOAD = 43, Spec(_TRANSFER)  # the copy is done; the backward may use them

    @property
    def mnemonic(self) -> str:
        return self.name


def _where(flag) -> frozenset[Opcode]:
    return frozenset(op for op in Opcode if flag(op.spec))


def _exchanging(exchange: Exchange) -> frozenset[Opcode]:
    return _where(lambda spec: spec.message is not None and spec.message[1] is exchange)


def _one(message: Message, exchange: Exchange) -> Opcode:
    (op,) = (op for op in Opcode if op.spec.message == (message, exchange))
    return op


# -- derived from the table; nothing below names an opcode
COMPUTE = _where(lambda spec: spec.group is Group.COMPUTE)
SENDS = _exchanging(Exchange.SEND)
RECEIVE_POSTS = _exchanging(Exchange.POST)
RECEIVE_WAITS = _exchanging(Exchange.WAIT)
POSTS_MESSAGE = SENDS | RECEIVE_POSTS  # issued without blocking (the interpreter batches adjacent ones)
HAS_PEER = _where(lambda spec: Operand.PEER in spec.operands)
NEIGHBOUR = {op: op.spec.neighbour for op in Opcode if op.spec.neighbour is not None}
RECEIVE_OF = {send: _one(send.spec.message[0], Exchange.POST) for send in SENDS}  # the post a send pairs with
WAIT_OF = {post: _one(post.spec.message[0], Exchange.WAIT) for post in RECEIVE_POSTS}  # how a post is waited on
KIND_OF = {op: op.spec.raises for op in Opcode if op.spec.raises is not None}  # opcode -> schedule op kind
OPCODE_OF = {kind: op for op, kind in KIND_OF.items()}  # schedule op kind -> opcode (lowering)
TRACE_KIND = {op: op.spec.trace_kind.mnemonic for op in Opcode if op.spec.trace_kind is not None}
TRACE_NAME = {op: op.spec.trace_name for op in Opcode if op.spec.trace_name is not None}
SINCE_VERSION = {op: op.spec.since for op in Opcode}  # the plan format version that introduced each opcode


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
