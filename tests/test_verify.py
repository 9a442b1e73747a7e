"""The verifier: hand-made broken plans are rejected with a message that points at the broken
instruction and names the rule; deadlocks list every rank's position and the cycle of waits."""

from __future__ import annotations

import re
import struct
import zlib

import pytest
from conftest import examples, uniform_problem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optpipe.plan.bytecode import decode, encode, write_plan
from optpipe.cli.main import main
from optpipe.plan.disasm import disassemble
from optpipe.core.errors import PlanError
from optpipe.plan.lower import lower
from optpipe.core.problem import Offload, Placement
from optpipe.core.problem_file import dumps_problem
from optpipe.plan.program import Instruction, Opcode, PlanHeader, Program
from optpipe.core.schedule import Schedule
from optpipe.core.simulate import simulate
from optpipe.plan.verify import check_against_problem, predict, verify
from optpipe.solvers.registry import generate

O = Opcode
PLAIN = uniform_problem(3, 4)
ONE_F_ONE_B = lower(PLAIN, generate("1F1B", PLAIN))
SPLIT_PROBLEM = uniform_problem(2, 2)
SPLIT = lower(SPLIT_PROBLEM, Schedule.from_text("split", "d0: F0:0 F0:1 B0:0 W0:0 B0:1 W0:1\n"
                                                         "d1: F1:0 B1:0 W1:0 F1:1 B1:1 W1:1"))
OFFLOAD_PROBLEM = uniform_problem(2, 3, offload=Offload(True, 1e5, 1e5, 10**9))
OFFLOAD_SCHEDULE = Schedule.from_text("offload", "d0: F0:0 OFF0:0 F0:1 F0:2 REL0:0 BW0:0 BW0:1 BW0:2\n"
                                                 "d1: F1:0 BW1:0 F1:1 BW1:1 F1:2 BW1:2")
OFFLOADED = lower(OFFLOAD_PROBLEM, OFFLOAD_SCHEDULE)
V_PROBLEM = uniform_problem(2, 2, v=2, placement=Placement.VSHAPE)
V_PLAN = lower(V_PROBLEM, generate("GPipe", V_PROBLEM))


def _at(program: Program, rank: int, ins: Instruction) -> int:
    return program.ranks[rank].index(ins)


def _edit(program: Program, rank: int, stream: list[Instruction]) -> Program:
    ranks = list(program.ranks)
    ranks[rank] = tuple(stream)
    return Program(program.header, tuple(ranks))


def _without(program: Program, rank: int, ins: Instruction) -> Program:
    stream = list(program.ranks[rank])
    stream.remove(ins)
    return _edit(program, rank, stream)


def _moved(program: Program, rank: int, ins: Instruction, before: Instruction) -> Program:
    """``ins`` taken out and put right before ``before``."""
    stream = list(program.ranks[rank])
    stream.remove(ins)
    stream.insert(stream.index(before), ins)
    return _edit(program, rank, stream)


def _swapped(program: Program, rank: int, a: Instruction, b: Instruction) -> Program:
    stream = list(program.ranks[rank])
    i, j = stream.index(a), stream.index(b)
    stream[i], stream[j] = stream[j], stream[i]
    return _edit(program, rank, stream)


def _reject(program: Program) -> str:
    with pytest.raises(PlanError) as error:
        verify(program)
    return str(error.value)


def test_generated_plans_verify():
    for program in (ONE_F_ONE_B, SPLIT, OFFLOADED):
        verdict = verify(program)
        assert verdict.instructions == tuple(len(s) for s in program.ranks)
    assert verify(ONE_F_ONE_B).messages == 2 * 2 * 4  # two boundaries, both directions, four microbatches


def test_swapped_receive_pair_is_rejected_at_the_receive():
    first, second = Instruction(O.POST_RECV_ACTIVATION, 1, 0, 0), Instruction(O.POST_RECV_ACTIVATION, 1, 1, 0)
    broken = _swapped(ONE_F_ONE_B, 1, first, second)
    message = _reject(broken)
    send_at = _at(ONE_F_ONE_B, 0, Instruction(O.SEND_ACTIVATION, 0, 0, 1))
    assert message.startswith(f"rank 1 position {_at(broken, 1, second)}: POST_RECV_ACTIVATION s=1 mb=1 peer=0: "
                              f"breaks rule 'sends and receives pair up in order between two ranks'")
    assert f"SEND_ACTIVATION s=0 mb=0 peer=1 at rank 0 position {send_at}" in message


def test_swapped_send_and_receive_deadlock_with_the_cycle_of_waits():
    """Rank 0 waits for the gradient of microbatch 0 before sending its activation: neither can move."""
    post, wait = Instruction(O.POST_RECV_GRADIENT, 0, 0, 1), Instruction(O.WAIT_RECV_GRADIENT, 0, 0)
    send = Instruction(O.SEND_ACTIVATION, 0, 0, 1)
    broken = _moved(_moved(ONE_F_ONE_B, 0, post, send), 0, wait, send)
    message = _reject(broken)
    wait0 = _at(broken, 0, wait)
    wait1 = _at(broken, 1, Instruction(O.WAIT_RECV_ACTIVATION, 1, 0))
    send1 = _at(broken, 1, Instruction(O.SEND_GRADIENT, 1, 0, 0))
    lines = message.splitlines()
    assert lines[0] == "deadlock: no rank can proceed; each rank's position:"
    assert lines[1] == (f"  rank 0 at position {wait0}: WAIT_RECV_GRADIENT s=0 mb=0  (waits for rank 1 to run "
                        f"position {send1}: SEND_GRADIENT s=1 mb=0 peer=0)")
    assert lines[2].startswith(f"  rank 1 at position {wait1}: WAIT_RECV_ACTIVATION s=1 mb=0  (waits for rank 0")
    assert lines[3].startswith("  rank 2 at position 1: WAIT_RECV_ACTIVATION s=2 mb=0")
    assert lines[4] == (f"cycle of waits: rank 0 (position {wait0}: WAIT_RECV_GRADIENT s=0 mb=0) -> "
                        f"rank 1 (position {wait1}: WAIT_RECV_ACTIVATION s=1 mb=0) -> rank 0")


def test_missing_w_is_named():
    weight = Instruction(O.BACKWARD_WEIGHT, 0, 1)
    message = _reject(_without(SPLIT, 0, weight))
    b_at = _at(SPLIT, 0, Instruction(O.BACKWARD_INPUT, 0, 1))
    assert message == (f"rank 0: BACKWARD_WEIGHT s=0 mb=1 is missing: breaks rule 'every split backward runs W': "
                       f"BACKWARD_INPUT s=0 mb=1 at position {b_at} has no W")


def test_reload_before_its_offload_is_rejected_at_the_reload():
    reload, offload = Instruction(O.RELOAD, 0, 0), Instruction(O.OFFLOAD, 0, 0)
    broken = _moved(OFFLOADED, 0, reload, offload)
    message = _reject(broken)
    assert message == (f"rank 0 position {_at(broken, 0, reload)}: RELOAD s=0 mb=0: breaks rule 'every reload comes "
                       f"after its offload': needs OFFLOAD s=0 mb=0 before it; it comes too late: OFFLOAD s=0 mb=0 "
                       f"is at position {_at(broken, 0, offload)}")


def test_receive_with_no_send_is_rejected_at_the_receive():
    broken = _without(ONE_F_ONE_B, 0, Instruction(O.SEND_ACTIVATION, 0, 2, 1))
    message = _reject(broken)
    post_at = _at(broken, 1, Instruction(O.POST_RECV_ACTIVATION, 1, 2, 0))
    assert message == (f"rank 1 position {post_at}: POST_RECV_ACTIVATION s=1 mb=2 peer=0: breaks rule 'every receive "
                       f"has its send': rank 0 never sends the matching message to rank 1 (it sends 3 message(s) "
                       f"to rank 1)")


def _with_extra(program: Program, rank: int, ins: Instruction) -> Program:
    """``ins`` added just before the rank's final WAIT_SENDS."""
    stream = list(program.ranks[rank])
    stream.insert(len(stream) - 1, ins)
    return _edit(program, rank, stream)


def _appended(program: Program, rank: int, ins: Instruction) -> Program:
    return _edit(program, rank, list(program.ranks[rank]) + [ins])


def _without_microbatch(program: Program, microbatch: int) -> Program:
    return Program(program.header, tuple(tuple(i for i in s if i.microbatch != microbatch) for s in program.ranks))


I = Instruction  # noqa: E741  (short, for the table)
BROKEN = {
    "wrong peer": (
        lambda: _edit(ONE_F_ONE_B, 0, [I(O.SEND_ACTIVATION, 0, 0, 2) if i == I(O.SEND_ACTIVATION, 0, 0, 1) else i
                                       for i in ONE_F_ONE_B.ranks[0]]),
        r"rank 0 position 2: SEND_ACTIVATION s=0 mb=0 peer=2: breaks rule 'the peer is the neighbouring stage's "
        r"rank': expected peer 1"),
    "stage on another rank": (
        lambda: _with_extra(ONE_F_ONE_B, 0, I(O.BACKWARD_WEIGHT, 2, 0)),
        r"breaks rule 'an instruction runs on its stage's rank': stage 2 lives on rank 2"),
    "twice": (
        lambda: _with_extra(ONE_F_ONE_B, 2, I(O.LOSS, 2, 0)),
        r"LOSS s=2 mb=0: breaks rule 'each instruction runs once per step': it already ran at position \d+"),
    "wait without post": (
        lambda: _without(ONE_F_ONE_B, 1, I(O.POST_RECV_ACTIVATION, 1, 3, 0)),
        r"SEND_ACTIVATION s=0 mb=3 peer=1: breaks rule 'every send has its receive': rank 1 never posts "
        r"POST_RECV_ACTIVATION s=1 mb=3 from rank 0; it waits for it at position \d+ without posting it"),
    "wait before post": (
        lambda: _swapped(ONE_F_ONE_B, 1, I(O.POST_RECV_ACTIVATION, 1, 3, 0), I(O.WAIT_RECV_ACTIVATION, 1, 3)),
        r"WAIT_RECV_ACTIVATION s=1 mb=3: breaks rule 'a receive is waited on after it is posted': "
        r"needs POST_RECV_ACTIVATION s=1 mb=3 before it; it comes too late"),
    "forward before its input": (
        lambda: _swapped(ONE_F_ONE_B, 1, I(O.WAIT_RECV_ACTIVATION, 1, 0), I(O.FORWARD, 1, 0)),
        r"rank 1 position \d+: FORWARD s=1 mb=0: breaks rule 'a forward runs after its input is in place': "
        r"needs WAIT_RECV_ACTIVATION s=1 mb=0 before it; it comes too late"),
    "nothing after WAIT_SENDS": (
        lambda: _appended(ONE_F_ONE_B, 1, I(O.BACKWARD_WEIGHT, 1, 0)),
        r"breaks rule 'WAIT_SENDS ends the stream': nothing may follow it"),
    "no WAIT_SENDS": (
        lambda: _without(ONE_F_ONE_B, 2, I(O.WAIT_SENDS)),
        r"rank 2: breaks rule 'the stream ends with WAIT_SENDS': it ends with SEND_GRADIENT s=2 mb=3 peer=1"),
    "missing loss": (
        lambda: _without(ONE_F_ONE_B, 2, I(O.LOSS, 2, 1)),
        r"BACKWARD s=2 mb=1: breaks rule 'the last stage's backward runs after the loss'"),
    "fused and split": (
        lambda: _with_extra(ONE_F_ONE_B, 0, I(O.BACKWARD_INPUT, 0, 0)),
        r"BACKWARD_INPUT s=0 mb=0: breaks rule 'one microbatch's backward is either fused or split"),
    "offload after backward": (
        lambda: _with_extra(ONE_F_ONE_B, 0, I(O.OFFLOAD, 0, 3)),
        r"rank 0 position \d+: OFFLOAD s=0 mb=3: breaks rule 'an activation is offloaded before its backward, "
        r"not after': BACKWARD s=0 mb=3 already ran at position \d+"),
    "backward without reload": (
        lambda: _without(_without(OFFLOADED, 0, I(O.WAIT_RELOAD, 0, 0)), 0, I(O.RELOAD, 0, 0)),
        r"BACKWARD s=0 mb=0: breaks rule 'an offloaded activation is reloaded and waited on"),
    "reload before the copy is done": (
        lambda: _moved(OFFLOADED, 0, I(O.WAIT_OFFLOAD, 0, 0), I(O.WAIT_RELOAD, 0, 0)),
        r"RELOAD s=0 mb=0: breaks rule 'a reload reads the host copy"),
    "send with no receive": (
        lambda: _without(_without(ONE_F_ONE_B, 1, I(O.POST_RECV_GRADIENT, 1, 3, 2)), 1, I(O.WAIT_RECV_GRADIENT, 1, 3)),
        r"rank 2 position \d+: SEND_GRADIENT s=2 mb=3 peer=1: breaks rule 'every send has its receive': "
        r"rank 1 never posts POST_RECV_GRADIENT s=1 mb=3 from rank 2"),
    "hand-over missing": (
        lambda: _without(V_PLAN, 1, I(O.LOCAL_ACTIVATION, 1, 0)),
        r"rank 1 position \d+: FORWARD s=2 mb=0: breaks rule 'a forward runs after its input is in place': "
        r"needs LOCAL_ACTIVATION s=1 mb=0 before it; it is missing from this rank"),
    "missing forward": (
        lambda: _without_microbatch(SPLIT, 1),
        r"^rank 0: FORWARD s=0 mb=1 is missing: breaks rule 'every stage runs F for every microbatch'$"),
    "local hand-over across ranks": (
        lambda: _with_extra(ONE_F_ONE_B, 0, I(O.LOCAL_GRADIENT, 0, 0)),
        r"stage 0 has no stage -1 to exchange with"),
    "load on a later stage": (
        lambda: _with_extra(ONE_F_ONE_B, 1, I(O.LOAD_MICROBATCH, 1, 0)),
        r"breaks rule 'microbatches are loaded by the first stage'"),
    "header world size": (
        lambda: Program(ONE_F_ONE_B.header, ONE_F_ONE_B.ranks[:2]),
        r"header: world size 3 but the plan has 2 rank streams"),
    "header chunks": (
        lambda: Program(PlanHeader(3, (0, 1, 1), 1, 4, "x", bytes(32)), ONE_F_ONE_B.ranks),
        r"header: rank 1 hosts stages \[1, 2\], but the header says 1 stage\(s\) per rank"),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_broken_plans_are_rejected(case):
    build, pattern = BROKEN[case]
    assert re.search(pattern, _reject(build())), case


def test_prediction_needs_the_plans_problem():
    assert predict(ONE_F_ONE_B, PLAIN).makespan == simulate(PLAIN, generate("1F1B", PLAIN)).makespan
    check_against_problem(ONE_F_ONE_B, PLAIN)
    with pytest.raises(PlanError, match="compiled for a different problem"):
        predict(ONE_F_ONE_B, uniform_problem(3, 4, f=2.0))


def test_verify_command(tmp_path, capsys):
    good, bad = tmp_path / "good.opb", tmp_path / "bad.opb"
    write_plan(good, OFFLOADED)
    write_plan(bad, _moved(OFFLOADED, 0, Instruction(O.RELOAD, 0, 0), Instruction(O.OFFLOAD, 0, 0)))
    problem = tmp_path / "problem.toml"
    problem.write_text(dumps_problem(OFFLOAD_PROBLEM))
    assert main(["verify", str(good)]) == 0
    assert "verified" in capsys.readouterr().out
    assert main(["verify", str(good), "--problem", str(problem)]) == 0
    out = capsys.readouterr().out
    makespan = simulate(OFFLOAD_PROBLEM, OFFLOAD_SCHEDULE).makespan
    assert f"makespan {makespan:,.2f} ms" in out
    assert main(["verify", str(bad)]) == 1
    assert "every reload comes after its offload" in capsys.readouterr().err


# --------------------------------------------------------------------------- fuzzing

_SEALED = [encode(p) for p in (ONE_F_ONE_B, SPLIT, OFFLOADED)]


def _reseal(body: bytearray) -> bytes:
    struct.pack_into("<I", body, 12, len(body) + 4)
    return bytes(body) + struct.pack("<I", zlib.crc32(body))


@settings(max_examples=examples(200, ci=50), deadline=1000, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(_SEALED))), st.data())
def test_any_decodable_plan_verifies_or_is_rejected_and_disassembles(which, data):
    """Damage that survives decoding (operands still in range) never crashes the verifier or dis."""
    body = bytearray(_SEALED[which][:-4])
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(58, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    try:
        program = decode(_reseal(body))
    except PlanError:
        return
    listed = [line for line in disassemble(program).splitlines() if line[:6].strip().isdigit()]
    assert len(listed) == sum(len(stream) for stream in program.ranks)  # one line per instruction
    try:
        verify(program)
    except PlanError:  # the damage broke a rule: said in one message, never a crash
        pass
