"""Disassembly: golden text for a plan with transfers and one with V-placement hand-overs,
the --rank filter, and the command line."""

from __future__ import annotations

import re

import pytest
from conftest import uniform_problem

from optpipe.plan.bytecode import write_plan
from optpipe.cli.main import main
from optpipe.plan.disasm import disassemble, resolve
from optpipe.core.errors import PlanError
from optpipe.plan.lower import lower, problem_hash
from optpipe.core.problem import Offload, Placement
from optpipe.core.problem_file import dumps_problem
from optpipe.core.schedule import Schedule
from optpipe.solvers.registry import generate

TINY = uniform_problem(2, 2, act=3 << 20, keep=1 << 20, offload=Offload(True, 1e9, 1e9, 1 << 30), name="tiny")
# F0:0's 3 MiB copy takes 3.1 ms, longer than F0:1 (1 ms), so WAIT_OFFLOAD lands right before the RELOAD.
TINY_PLAN = lower(TINY, Schedule.from_text("tiny-offload", "d0: F0:0 OFF0:0 F0:1 REL0:0 B0:0 W0:0 B0:1 W0:1\n"
                                                           "d1: F1:0 B1:0 W1:0 F1:1 B1:1 W1:1"))
V = uniform_problem(1, 1, v=2, placement=Placement.VSHAPE, name="v")
V_PLAN = lower(V, generate("GPipe", V))

HEADER_TINY = """\
optpipe plan, format 1
  schedule       tiny-offload
  shape          2 ranks, 2 stages (1 per rank), 2 microbatches
  stage -> rank  0:0 1:1
  problem        sha256 {hash}  (matches 'tiny')
  instructions   19 + 15 = 34
"""

RANK0_TINY = """
rank 0 (stage 0): 19 instructions
   pos  opcode                 stage    mb  peer
     0  LOAD_MICROBATCH            0     0
     1  FORWARD                    0     0        (holds 3MiB)
     2  SEND_ACTIVATION            0     0     1  (to rank 1, stage 1)
     3  OFFLOAD                    0     0        (moves 3MiB to host)
     4  POST_RECV_GRADIENT         0     0     1  (from rank 1, stage 1)
     5  LOAD_MICROBATCH            0     1
     6  FORWARD                    0     1        (holds 3MiB)
     7  SEND_ACTIVATION            0     1     1  (to rank 1, stage 1)
     8  WAIT_OFFLOAD               0     0        (frees 3MiB on device)
     9  RELOAD                     0     0        (moves 3MiB to device, holds it)
    10  WAIT_RECV_GRADIENT         0     0        (from rank 1)
    11  WAIT_RELOAD                0     0
    12  BACKWARD_INPUT             0     0        (frees 2MiB, keeps 1MiB for W)
    13  POST_RECV_GRADIENT         0     1     1  (from rank 1, stage 1)
    14  BACKWARD_WEIGHT            0     0        (frees 1MiB)
    15  WAIT_RECV_GRADIENT         0     1        (from rank 1)
    16  BACKWARD_INPUT             0     1        (frees 2MiB, keeps 1MiB for W)
    17  BACKWARD_WEIGHT            0     1        (frees 1MiB)
    18  WAIT_SENDS                                (2 sends)
"""

RANK1_TINY = """
rank 1 (stage 1): 15 instructions
   pos  opcode                 stage    mb  peer
     0  POST_RECV_ACTIVATION       1     0     0  (from rank 0, stage 0)
     1  WAIT_RECV_ACTIVATION       1     0        (from rank 0)
     2  FORWARD                    1     0        (holds 3MiB)
     3  LOSS                       1     0
     4  BACKWARD_INPUT             1     0        (frees 2MiB, keeps 1MiB for W)
     5  SEND_GRADIENT              1     0     0  (to rank 0, stage 0)
     6  POST_RECV_ACTIVATION       1     1     0  (from rank 0, stage 0)
     7  BACKWARD_WEIGHT            1     0        (frees 1MiB)
     8  WAIT_RECV_ACTIVATION       1     1        (from rank 0)
     9  FORWARD                    1     1        (holds 3MiB)
    10  LOSS                       1     1
    11  BACKWARD_INPUT             1     1        (frees 2MiB, keeps 1MiB for W)
    12  SEND_GRADIENT              1     1     0  (to rank 0, stage 0)
    13  BACKWARD_WEIGHT            1     1        (frees 1MiB)
    14  WAIT_SENDS                                (2 sends)
"""

GOLDEN_V = """\
optpipe plan, format 1
  schedule       GPipe
  shape          1 rank, 2 stages (2 per rank), 1 microbatch
  stage -> rank  0:0 1:0
  problem        sha256 {hash}
  instructions   9

rank 0 (stages 0, 1): 9 instructions
   pos  opcode                 stage    mb  peer
     0  LOAD_MICROBATCH            0     0
     1  FORWARD                    0     0
     2  LOCAL_ACTIVATION           0     0        (to stage 1 on this rank)
     3  FORWARD                    1     0
     4  LOSS                       1     0
     5  BACKWARD                   1     0
     6  LOCAL_GRADIENT             1     0        (to stage 0 on this rank)
     7  BACKWARD                   0     0
     8  WAIT_SENDS                                (0 sends)
"""


def test_golden_with_the_problem():
    header = HEADER_TINY.format(hash=problem_hash(TINY).hex())
    assert disassemble(TINY_PLAN, problem=TINY) == header + RANK0_TINY + RANK1_TINY


def test_golden_v_placement_without_a_problem():
    assert disassemble(V_PLAN) == GOLDEN_V.format(hash=problem_hash(V).hex())


def test_rank_filter_and_comments_without_sizes():
    text = disassemble(TINY_PLAN, rank=1)
    unsized = [re.sub(r"\s+\((holds|frees) [^)]*\)$", "", line) for line in RANK1_TINY.splitlines()]
    assert text.splitlines()[-len(unsized):] == unsized
    assert "rank 0 (" not in text
    with pytest.raises(PlanError, match=r"--rank 2: the plan has ranks 0..1"):
        disassemble(TINY_PLAN, rank=2)


def test_a_different_problem_is_flagged():
    other = uniform_problem(1, 1, v=2, placement=Placement.VSHAPE, f=2.0)
    assert "(DIFFERS from the given problem)" in disassemble(V_PLAN, problem=other)


def test_resolve_keeps_raw_operands_next_to_the_comment():
    line = resolve(TINY_PLAN, 0)[2]
    assert (line.position, tuple(line.instruction), line.comment) == (2, (20, 0, 0, 1), "to rank 1, stage 1")


def test_disasm_command(tmp_path, capsys):
    plan, problem = tmp_path / "tiny.opb", tmp_path / "tiny.toml"
    write_plan(plan, TINY_PLAN)
    problem.write_text(dumps_problem(TINY))
    assert main(["disasm", str(plan), "--rank", "0", "--problem", str(problem)]) == 0
    assert capsys.readouterr().out == HEADER_TINY.format(hash=problem_hash(TINY).hex()) + RANK0_TINY
    assert main(["disasm", str(plan), "--rank", "5"]) == 1
    assert "--rank 5" in capsys.readouterr().err
    (tmp_path / "junk.opb").write_bytes(b"not a plan")
    assert main(["disasm", str(tmp_path / "junk.opb")]) == 1
    assert "not an optpipe plan file" in capsys.readouterr().err
