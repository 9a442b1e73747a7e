"""Lowering: a Schedule becomes a Program, one straight-line instruction stream per rank.

Before: ``schedule`` is valid for ``problem`` (the simulator accepts it; lowering calls it and
lets its ``ScheduleError`` through). After: every rank's stream holds, in the schedule's
order, one block per schedule op, and between blocks the receives posted early and the
offload waits::

    [POST_RECV_* for receives needed one compute op later]  [WAIT_OFFLOAD ...]
    LOAD_MICROBATCH | WAIT_RECV_ACTIVATION   FORWARD   LOSS   SEND_ACTIVATION | LOCAL_ACTIVATION
    RECOMPUTE                               (re-runs the forward of a recomputed activation)
    WAIT_RECV_GRADIENT   WAIT_RELOAD   BACKWARD_INPUT | BACKWARD   SEND_GRADIENT | LOCAL_GRADIENT
    BACKWARD_WEIGHT
    OFFLOAD | RELOAD                        (at the op's place in the device list)
    ... WAIT_SENDS                          (once, at the end)

Placement rules and why:

* A receive is posted at the start of the block of the compute op *before* the one that needs
  it, so the message lands while that op runs, and waited on just before use. Between two
  ranks messages pair up in order (NCCL matches point-to-point calls by order), so a rank posts
  its receives from one peer in the order the peer sends them: a post moves earlier when a
  later message from the same peer is needed sooner.
* Sends follow the op that produced the data and never block; WAIT_SENDS closes the step.
* WAIT_OFFLOAD is where the device memory of an offloaded activation is released. The
  simulator frees it when the copy ends, so the wait goes before the first compute op or
  reload (both take memory from their start) that the simulator starts at or after that
  instant (the copy is then done and the wait costs nothing), but never after the RELOAD of
  the same activation: a reload reads the host copy, which is complete only after WAIT_OFFLOAD.
* WAIT_RELOAD goes right before the backward that uses the reloaded activation.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

from optpipe.core.problem import Problem
from optpipe.core.problem_file import dumps_problem
from optpipe.plan.program import KIND_OF, OPCODE_OF, Instruction, Opcode, PlanHeader, Program
from optpipe.core.schedule import COMPUTE_KINDS, Op, OpKind, Schedule
from optpipe.core.semantics import TOLERANCE_MS
from optpipe.core.simulate import simulate

__all__ = ["lower", "raise_schedule", "problem_hash", "header_for"]

_F, _B, _W, _BW, _OFF, _REL = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD
_EPS = TOLERANCE_MS  # the simulator treats times this close as one instant


def problem_hash(problem: Problem) -> bytes:
    """sha256 of the problem's canonical TOML: a plan names the problem it was compiled for."""
    return hashlib.sha256(dumps_problem(problem).encode()).digest()


def header_for(problem: Problem, schedule_name: str) -> PlanHeader:
    """What a plan compiled for ``problem`` says about itself."""
    pipe = problem.pipeline
    return PlanHeader(
        world_size=pipe.devices,
        stage_ranks=tuple(pipe.device_of(s) for s in range(pipe.stages)),
        chunks=pipe.chunks_per_device,
        microbatches=pipe.microbatches,
        schedule_name=schedule_name,
        problem_hash=problem_hash(problem),
    )


def lower(problem: Problem, schedule: Schedule) -> Program:
    """The plan for ``schedule``: per rank, compute, communication and transfer instructions."""
    timeline = simulate(problem, schedule)
    timing = timeline.by_op
    header = header_for(problem, schedule.name)
    rank_of = header.stage_ranks
    last = header.stages - 1
    pre = _posted_receives(schedule, rank_of, last)
    for device, ops in enumerate(schedule.devices):
        for index, waits in _offload_waits(ops, timing).items():
            pre[device][index].extend(waits)
    ranks = []
    for device, ops in enumerate(schedule.devices):
        offloaded = {(op.stage, op.microbatch) for op in ops if op.kind is _OFF}
        stream: list[Instruction] = []
        for index, op in enumerate(ops):
            stream.extend(instruction for _, instruction in sorted(pre[device].get(index, ())))
            stream.extend(_block(op, device, rank_of, last, (op.stage, op.microbatch) in offloaded))
        stream.append(Instruction(Opcode.WAIT_SENDS))
        ranks.append(tuple(stream))
    return Program(header, tuple(ranks))


def _block(op: Op, device: int, rank_of: tuple[int, ...], last: int, offloaded: bool) -> list[Instruction]:
    """The instructions of one schedule op, from its waits to its sends."""
    s, i = op.stage, op.microbatch
    out: list[Instruction] = []
    if op.kind is _F:
        if s == 0:
            out.append(Instruction(Opcode.LOAD_MICROBATCH, s, i))
        elif rank_of[s - 1] != device:
            out.append(Instruction(Opcode.WAIT_RECV_ACTIVATION, s, i))
        out.append(Instruction(Opcode.FORWARD, s, i))
        if s == last:
            out.append(Instruction(Opcode.LOSS, s, i))
        elif rank_of[s + 1] != device:
            out.append(Instruction(Opcode.SEND_ACTIVATION, s, i, rank_of[s + 1]))
        else:
            out.append(Instruction(Opcode.LOCAL_ACTIVATION, s, i))
    elif op.kind is _B or op.kind is _BW:
        if s < last and rank_of[s + 1] != device:
            out.append(Instruction(Opcode.WAIT_RECV_GRADIENT, s, i))
        if offloaded:
            out.append(Instruction(Opcode.WAIT_RELOAD, s, i))
        out.append(Instruction(OPCODE_OF[op.kind], s, i))
        if s > 0:
            if rank_of[s - 1] != device:
                out.append(Instruction(Opcode.SEND_GRADIENT, s, i, rank_of[s - 1]))
            else:
                out.append(Instruction(Opcode.LOCAL_GRADIENT, s, i))
    else:  # W, OFFLOAD, RELOAD, RECOMPUTE: the op's own instruction, nothing around it
        out.append(Instruction(OPCODE_OF[op.kind], s, i))
    return out


def _posted_receives(schedule: Schedule, rank_of: tuple[int, ...], last: int):
    """pre[rank][op index] -> [(sort key, POST_RECV_*)] placed before that op's block."""
    pre: list[dict[int, list]] = [defaultdict(list) for _ in schedule.devices]
    where: dict[Op, int] = {}
    previous_compute: list[list[int]] = []
    for ops in schedule.devices:
        before, prev = [], None
        for index, op in enumerate(ops):
            where[op] = index
            before.append(index if prev is None else prev)
            if op.kind in COMPUTE_KINDS:
                prev = index
        previous_compute.append(before)

    # Channel (src, dst): what src sends to dst, in src's order, as (post instruction, consumer op).
    channels: dict[tuple[int, int], list[tuple[Instruction, Op]]] = defaultdict(list)
    for src, ops in enumerate(schedule.devices):
        for op in ops:
            s, i = op.stage, op.microbatch
            if op.kind is _F and s < last and rank_of[s + 1] != src:
                post = Instruction(Opcode.POST_RECV_ACTIVATION, s + 1, i, src)
                channels[(src, rank_of[s + 1])].append((post, Op(_F, s + 1, i)))
            elif op.kind in (_B, _BW) and s > 0 and rank_of[s - 1] != src:
                post = Instruction(Opcode.POST_RECV_GRADIENT, s - 1, i, src)
                consumer = Op(_B, s - 1, i) if Op(_B, s - 1, i) in where else Op(_BW, s - 1, i)
                channels[(src, rank_of[s - 1])].append((post, consumer))

    for (src, dst), messages in channels.items():
        at = None
        for k in range(len(messages) - 1, -1, -1):  # a post may not come after a later message's post
            post, consumer = messages[k]
            natural = previous_compute[dst][where[consumer]]
            at = natural if at is None else min(natural, at)
            pre[dst][at].append(((0, src, k), post))
    return pre


def _offload_waits(ops: tuple[Op, ...], timing) -> dict[int, list]:
    """op index -> [(sort key, WAIT_OFFLOAD)] to place before that op's block."""
    waits: dict[int, list] = defaultdict(list)
    for index, op in enumerate(ops):
        if op.kind is not _OFF:
            continue
        done = timing[op].end
        reload = Op(_REL, op.stage, op.microbatch)
        for later in range(index + 1, len(ops)):
            other = ops[later]
            allocates = other.kind in COMPUTE_KINDS or other.kind is _REL  # a reload holds memory from its start
            if other == reload or (allocates and timing[other].start >= done - _EPS):
                waits[later].append(((1, index), Instruction(Opcode.WAIT_OFFLOAD, op.stage, op.microbatch)))
                break
    return waits


def raise_schedule(program: Program) -> Schedule:
    """The schedule a program runs: its compute and transfer starts in stream order (inverse of lower)."""
    devices = [
        [Op(KIND_OF[ins.opcode], ins.stage, ins.microbatch) for ins in stream if ins.opcode in KIND_OF]
        for stream in program.ranks
    ]
    return Schedule.of(program.header.schedule_name, devices)

