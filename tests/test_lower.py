"""Lowering: every heuristic on every instance becomes a plan that round-trips and verifies;
blocks, early posts, offload waits and V-placement hand-overs sit where the docstring says."""

from __future__ import annotations

import pytest
from conftest import PROBLEM_DIR, uniform_problem

from optpipe.plan.bytecode import decode, encode
from optpipe.core.errors import NotApplicable, ScheduleError
from optpipe.plan.lower import lower, problem_hash, raise_schedule
from optpipe.core.problem import Placement
from optpipe.core.problem_file import load_problem
from optpipe.plan.program import COMPUTE, Instruction, Opcode
from optpipe.core.schedule import Op, OpKind, Schedule
from optpipe.core.simulate import simulate
from optpipe.plan.verify import predict, verify
from optpipe.solvers.registry import generate, generators

O = Opcode


def test_every_heuristic_on_every_instance_lowers_encodes_decodes_and_verifies(instance):
    lowered = 0
    for generator in generators():
        try:
            schedule = generate(generator.name, instance)
        except NotApplicable:
            continue
        program = lower(instance, schedule)
        assert decode(encode(program)) == program, generator.name
        verify(program)
        assert raise_schedule(program) == schedule, generator.name
        assert predict(program, instance).makespan == simulate(instance, schedule).makespan
        lowered += 1
    assert lowered >= 1  # GPipe applies to every placement


def _one_f_one_b_with_offload():
    """1F1B on the tight instance with microbatches 0 and 1 of stages 0 and 1 offloaded by hand."""
    problem = load_problem(PROBLEM_DIR / "balanced-p4-m8-tight.toml")
    base = generate("1F1B", problem)
    devices = []
    for ops in base.devices:
        out = []
        for op in ops:
            moved = op.stage in (0, 1) and op.microbatch in (0, 1)
            if op.kind is OpKind.BW and moved:
                out.append(Op(OpKind.RELOAD, op.stage, op.microbatch))
            out.append(op)
            if op.kind is OpKind.F and moved:
                out.append(Op(OpKind.OFFLOAD, op.stage, op.microbatch))
        devices.append(out)
    return problem, Schedule.of("1F1B+offload", devices)


def test_offload_lowering_places_transfers_and_waits():
    problem, schedule = _one_f_one_b_with_offload()
    program = lower(problem, schedule)
    verify(program)
    timing = simulate(problem, schedule).by_op
    for rank, stream in enumerate(program.ranks):
        at = {(ins.opcode, ins.stage, ins.microbatch): n for n, ins in enumerate(stream)}
        for (s, i) in schedule.offloaded:
            if problem.pipeline.device_of(s) != rank:
                continue
            off, wait_off = at[(O.OFFLOAD, s, i)], at[(O.WAIT_OFFLOAD, s, i)]
            rel, wait_rel, back = at[(O.RELOAD, s, i)], at[(O.WAIT_RELOAD, s, i)], at[(O.BACKWARD, s, i)]
            assert stream[off - 1] == Instruction(O.SEND_ACTIVATION, s, i, rank + 1)  # right after F's block
            assert off < wait_off < rel < wait_rel == back - 1
            # The first compute after WAIT_OFFLOAD starts when the simulator has finished the copy,
            # or WAIT_OFFLOAD had to come before the RELOAD that reads the host copy.
            after = next(ins for ins in stream[wait_off:] if ins.opcode in COMPUTE | {O.RELOAD})
            copy_end = timing[Op(OpKind.OFFLOAD, s, i)].end
            if after.opcode is not O.RELOAD:
                kind = {O.FORWARD: OpKind.F, O.BACKWARD: OpKind.BW}[after.opcode]
                assert timing[Op(kind, after.stage, after.microbatch)].start >= copy_end - 1e-9
                before = [ins for ins in stream[:wait_off] if ins.opcode in COMPUTE][-1]
                kind = {O.FORWARD: OpKind.F, O.BACKWARD: OpKind.BW}[before.opcode]
                assert timing[Op(kind, before.stage, before.microbatch)].start < copy_end
    assert raise_schedule(program) == schedule
    assert predict(program, problem).peak == simulate(problem, schedule).peak


def test_blocks_follow_the_documented_order():
    problem = uniform_problem(3, 3)
    program = lower(problem, generate("1F1B", problem))
    middle = program.ranks[1]
    forward = middle.index(Instruction(O.FORWARD, 1, 0))
    assert middle[forward - 1] == Instruction(O.WAIT_RECV_ACTIVATION, 1, 0)
    assert middle[forward + 1] == Instruction(O.SEND_ACTIVATION, 1, 0, 2)
    backward = middle.index(Instruction(O.BACKWARD, 1, 0))
    assert middle[backward - 1] == Instruction(O.WAIT_RECV_GRADIENT, 1, 0)
    assert middle[backward + 1] == Instruction(O.SEND_GRADIENT, 1, 0, 0)
    first, last = program.ranks[0], program.ranks[2]
    assert first[first.index(Instruction(O.FORWARD, 0, 2)) - 1] == Instruction(O.LOAD_MICROBATCH, 0, 2)
    assert last[last.index(Instruction(O.FORWARD, 2, 1)) + 1] == Instruction(O.LOSS, 2, 1)
    assert all(stream[-1] == Instruction(O.WAIT_SENDS) for stream in program.ranks)
    assert [ins.opcode for ins in program.ranks[0]].count(O.WAIT_SENDS) == 1


def test_receives_are_posted_one_compute_op_before_their_consumer():
    problem = uniform_problem(3, 4)
    program = lower(problem, generate("1F1B", problem))
    for stream in program.ranks:
        computes = [n for n, ins in enumerate(stream) if ins.opcode in COMPUTE]
        for n, ins in enumerate(stream):
            if ins.opcode not in (O.WAIT_RECV_ACTIVATION, O.WAIT_RECV_GRADIENT):
                continue
            post_kind = O.POST_RECV_ACTIVATION if ins.opcode is O.WAIT_RECV_ACTIVATION else O.POST_RECV_GRADIENT
            post = next(k for k, other in enumerate(stream) if (other.opcode, other.stage, other.microbatch)
                        == (post_kind, ins.stage, ins.microbatch))
            consumer = next(k for k in computes if k > n)
            previous = [k for k in computes if k < consumer]
            if previous:  # before the previous compute op: the message lands while it runs
                assert post < previous[-1]
                assert not [k for k in previous if post < k < previous[-1]]


def test_posts_follow_the_senders_order_when_the_receiver_consumes_out_of_order():
    problem = uniform_problem(2, 3)
    schedule = Schedule.from_text("swap", "\n".join([
        "d0: F0:0 F0:1 F0:2 BW0:1 BW0:0 BW0:2",
        "d1: F1:1 BW1:1 F1:0 BW1:0 F1:2 BW1:2",
    ]))
    program = lower(problem, schedule)
    verify(program)
    posts = [ins.microbatch for ins in program.ranks[1] if ins.opcode is O.POST_RECV_ACTIVATION]
    waits = [ins.microbatch for ins in program.ranks[1] if ins.opcode is O.WAIT_RECV_ACTIVATION]
    assert posts == [0, 1, 2]  # rank 0's send order
    assert waits == [1, 0, 2]  # rank 1's use order
    grads = [ins.microbatch for ins in program.ranks[0] if ins.opcode is O.POST_RECV_GRADIENT]
    assert grads == [1, 0, 2]


def test_v_placement_hands_over_on_the_rank():
    problem = uniform_problem(2, 2, v=2, placement=Placement.VSHAPE)
    program = lower(problem, generate("GPipe", problem))
    verify(program)
    rank1 = program.ranks[1]  # stages 1 and 2 share rank 1
    assert Instruction(O.LOCAL_ACTIVATION, 1, 0) in rank1
    assert Instruction(O.LOCAL_GRADIENT, 2, 0) in rank1
    assert Instruction(O.SEND_ACTIVATION, 1, 0, 1) not in rank1 and Instruction(O.SEND_GRADIENT, 2, 0, 1) not in rank1
    forward = rank1.index(Instruction(O.FORWARD, 1, 0))
    assert rank1[forward + 1] == Instruction(O.LOCAL_ACTIVATION, 1, 0)


def test_header_names_the_problem_and_shape():
    problem = uniform_problem(2, 3, v=2)
    program = lower(problem, generate("GPipe", problem))
    h = program.header
    assert (h.world_size, h.stage_ranks, h.chunks, h.microbatches, h.schedule_name) == (2, (0, 1, 0, 1), 2, 3, "GPipe")
    assert h.problem_hash == problem_hash(problem) and len(h.problem_hash) == 32
    assert problem_hash(uniform_problem(2, 4, v=2)) != h.problem_hash


def test_lowering_an_invalid_schedule_raises_the_simulators_error():
    problem = uniform_problem(2, 2)
    cyclic = Schedule.from_text("bad", "d0: BW0:0 F0:0 F0:1 BW0:1\nd1: F1:0 BW1:0 F1:1 BW1:1")
    with pytest.raises(ScheduleError, match="dependency cycle"):
        lower(problem, cyclic)
    with pytest.raises(ScheduleError, match="missing op"):
        lower(problem, Schedule.from_text("short", "d0: F0:0 BW0:0\nd1: F1:0 BW1:0"))
