"""The opcode table: numbers pinned (they are in plan files), every derived set agrees with the
rows, the rows agree with each other and with the schedule IR, every opcode disassembles and
round-trips through the bytecode, and lowering then raising keeps every schedule op kind."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import uniform_problem

from optpipe.core.problem import Offload, Recompute
from optpipe.core.schedule import COMPUTE_KINDS, TRANSFER_KINDS, OpKind, Schedule
from optpipe.plan.bytecode import FORMAT_VERSION, decode, encode, version_of
from optpipe.plan.disasm import disassemble
from optpipe.plan.lower import lower, raise_schedule
from optpipe.plan.program import (COMPUTE, HAS_PEER, KIND_OF, NEIGHBOUR, NO_PEER, OPCODE_OF, POSTS_MESSAGE,
                                  RECEIVE_OF, RECEIVE_POSTS, RECEIVE_WAITS, SENDS, SINCE_VERSION, TRACE_KIND,
                                  TRACE_NAME, WAIT_OF, Exchange, Group, Instruction, Message, Opcode, Operand,
                                  PlanHeader, Program)
from optpipe.plan.verify import verify

O = Opcode
DOC = Path(__file__).resolve().parent.parent / "docs" / "plan-format.md"

# Written into every plan file: a change here breaks every plan already compiled.
NUMBERS = {
    "LOAD_MICROBATCH": 1, "LOSS": 2,
    "FORWARD": 10, "BACKWARD_INPUT": 11, "BACKWARD_WEIGHT": 12, "BACKWARD": 13, "RECOMPUTE": 14,
    "SEND_ACTIVATION": 20, "POST_RECV_ACTIVATION": 21, "WAIT_RECV_ACTIVATION": 22,
    "SEND_GRADIENT": 23, "POST_RECV_GRADIENT": 24, "WAIT_RECV_GRADIENT": 25, "WAIT_SENDS": 26,
    "LOCAL_ACTIVATION": 30, "LOCAL_GRADIENT": 31,
    "OFFLOAD": 40, "WAIT_OFFLOAD": 41, "RELOAD": 42, "WAIT_RELOAD": 43,
}


def test_numbers_are_pinned_unique_and_fit_a_byte():
    assert {op.name: int(op) for op in Opcode} == NUMBERS
    assert len(Opcode.__members__) == len(Opcode) == len({int(op) for op in Opcode})  # no aliases
    assert all(0 < int(op) < 256 and op.mnemonic == op.name for op in Opcode)


def test_each_number_lies_in_its_groups_decade():
    for op in Opcode:
        assert int(op) // 10 * 10 == op.spec.group.value, op


@pytest.mark.parametrize("op", list(Opcode), ids=lambda op: op.name)
def test_derived_sets_agree_with_the_row(op):
    spec = op.spec
    exchange = spec.message[1] if spec.message else None
    assert (op in COMPUTE) == (spec.group is Group.COMPUTE)
    assert (op in SENDS, op in RECEIVE_POSTS, op in RECEIVE_WAITS) == (
        exchange is Exchange.SEND, exchange is Exchange.POST, exchange is Exchange.WAIT)
    assert (op in HAS_PEER) == (Operand.PEER in spec.operands)
    assert NEIGHBOUR.get(op) == spec.neighbour
    assert KIND_OF.get(op) == spec.raises
    assert TRACE_NAME.get(op) == spec.trace_name
    assert TRACE_KIND.get(op) == (spec.trace_kind.mnemonic if spec.trace_kind is not None else None)
    assert SINCE_VERSION[op] == spec.since


def test_the_sets_the_runtime_relies_on():
    assert POSTS_MESSAGE == {O.SEND_ACTIVATION, O.SEND_GRADIENT, O.POST_RECV_ACTIVATION, O.POST_RECV_GRADIENT}
    assert COMPUTE == {O.FORWARD, O.BACKWARD_INPUT, O.BACKWARD_WEIGHT, O.BACKWARD, O.RECOMPUTE}
    assert TRACE_KIND == {O.FORWARD: "F", O.LOSS: "F", O.BACKWARD_INPUT: "B", O.BACKWARD_WEIGHT: "W",
                          O.BACKWARD: "BW"}
    assert TRACE_NAME == {O.FORWARD: "F", O.BACKWARD_INPUT: "B", O.BACKWARD_WEIGHT: "W", O.BACKWARD: "BW",
                          O.RECOMPUTE: "RC", O.OFFLOAD: "OFF", O.RELOAD: "REL"}
    assert {op: v for op, v in SINCE_VERSION.items() if v > 1} == {O.RECOMPUTE: 2}
    assert max(SINCE_VERSION.values()) <= FORMAT_VERSION


def test_operands():
    # A posted message names its peer; nothing else has one. Only WAIT_SENDS has no operands.
    assert HAS_PEER == POSTS_MESSAGE == SENDS | RECEIVE_POSTS
    assert [op for op in Opcode if not op.spec.operands] == [O.WAIT_SENDS]
    for op in Opcode:
        assert op.spec.operands in ((), (Operand.STAGE, Operand.MICROBATCH),
                                    (Operand.STAGE, Operand.MICROBATCH, Operand.PEER)), op


def test_messages_pair_send_post_and_wait():
    for message in Message:
        by_exchange = {op.spec.message[1]: op for op in Opcode if op.spec.message and op.spec.message[0] is message}
        send, post, wait = by_exchange[Exchange.SEND], by_exchange[Exchange.POST], by_exchange[Exchange.WAIT]
        assert RECEIVE_OF[send] is post and WAIT_OF[post] is wait
        # The receiver's stage looks back at the sender's; its post and its wait name the same stage.
        assert NEIGHBOUR[post] == NEIGHBOUR[wait] == (-NEIGHBOUR[send].step, True)
    assert NEIGHBOUR[O.SEND_ACTIVATION].step == +1 and NEIGHBOUR[O.SEND_GRADIENT].step == -1
    assert set(RECEIVE_OF.values()) == RECEIVE_POSTS and set(WAIT_OF.values()) == RECEIVE_WAITS


def test_neighbours_cross_ranks_exactly_for_messages():
    for op, link in NEIGHBOUR.items():
        assert link.step in (-1, +1)
        assert link.crosses == (op.spec.group is Group.COMMUNICATION), op
        assert (op.spec.message is not None) == link.crosses, op
    handovers = {op for op in Opcode if op.spec.group is Group.HANDOVER}
    assert handovers and handovers <= set(NEIGHBOUR)


def test_raised_kinds_match_the_schedule_ir():
    assert sorted(KIND_OF.values()) == sorted(OpKind)  # every kind, each from exactly one opcode
    assert {kind: KIND_OF[op] for kind, op in OPCODE_OF.items()} == {kind: kind for kind in OpKind}
    assert {KIND_OF[op] for op in COMPUTE} == COMPUTE_KINDS
    assert {KIND_OF[op] for op in KIND_OF if op.spec.group is Group.TRANSFER} == TRANSFER_KINDS
    assert set(TRACE_NAME) == set(KIND_OF)  # every op the schedule has shows in a trace under its own name
    for op, name in TRACE_NAME.items():
        assert name == KIND_OF[op].mnemonic, op  # a measured event is named like the predicted op
    for op in TRACE_KIND:
        assert op.spec.raises in (None, op.spec.trace_kind), op


def test_lowering_then_raising_keeps_every_op_kind():
    problem = replace(uniform_problem(2, 2, offload=Offload(True, 1e9, 1e9, 1 << 30)),
                      recompute=Recompute(True, (1.0,) * 2, (10,) * 2))
    schedule = Schedule.from_text("every-kind", "d0: F0:0 OFF0:0 F0:1 REL0:0 B0:0 W0:0 RC0:1 BW0:1\n"
                                                "d1: F1:0 B1:0 W1:0 F1:1 RC1:1 BW1:1")
    assert {op.kind for _, op in schedule.ops()} == set(OpKind)
    program = lower(problem, schedule)
    verify(program)
    opcodes = {ins.opcode for stream in program.ranks for ins in stream}
    assert {OPCODE_OF[kind] for kind in OpKind} <= opcodes
    assert raise_schedule(program) == schedule


def _every_opcode() -> Program:
    """Rank 1 of three holds one instruction of each opcode, with the operands its row names."""
    header = PlanHeader(3, (0, 1, 2), 1, 2, "every-opcode", bytes(32))
    stream = []
    for op in Opcode:
        if not op.spec.operands:
            stream.append(Instruction(op))
            continue
        link = op.spec.neighbour
        peer = 1 + link.step if Operand.PEER in op.spec.operands else NO_PEER
        stream.append(Instruction(op, 1, 1, peer))
    return Program(header, ((), tuple(stream), ()))


def test_every_opcode_disassembles_to_its_columns():
    program = _every_opcode()
    lines = disassemble(program, rank=1).splitlines()
    body = lines[lines.index(next(line for line in lines if line.lstrip().startswith("pos"))) + 1:]
    assert len(body) == len(Opcode)

    def number(text: str) -> int:
        return int(text) if text.strip() else -1

    for line, ins in zip(body, program.ranks[1]):
        opcode = Opcode[line[8:30].strip()]
        assert (line[:6].strip(), opcode, number(line[31:36]), number(line[37:42]), number(line[43:48])) == (
            str(program.ranks[1].index(ins)), *ins)
        link = NEIGHBOUR.get(ins.opcode)
        if link is not None:  # the comment names the neighbouring stage, or its rank
            other = ins.stage + link.step
            assert (f"rank {other}" if link.crosses else f"stage {other} on this rank") in line, line


def test_every_opcode_round_trips_through_the_bytecode():
    program = _every_opcode()
    data = encode(program)
    assert decode(data) == program
    assert version_of(program) == max(SINCE_VERSION.values())


def test_the_format_doc_lists_the_table():
    section = DOC.read_text().split("\n## Instructions\n")[1].split("\n## ")[0]
    rows = re.findall(r"^\| (\d+) \| ([A-Z_]+) \| (.*) \|$", section, re.MULTILINE)
    assert [(int(number), name) for number, name, _ in rows] == [(int(op), op.name) for op in Opcode]
    for (_, name, meaning) in rows:
        assert ("format 2" in meaning) == (Opcode[name].spec.since == 2), name
