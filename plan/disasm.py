"""Disassembly of a plan, in the manner of Python's ``dis``.

Three steps: the program is already decoded; ``resolve`` turns each instruction into fixed
columns and a comment (the peer it talks to, the bytes it frees or moves when the problem is
known); ``disassemble`` formats a header summary and one line per instruction.
"""

from __future__ import annotations

from typing import NamedTuple

from optpipe.plan.bytecode import version_of
from optpipe.plan.lower import problem_hash
from optpipe.core.errors import PlanError, printable
from optpipe.core.problem import Problem
from optpipe.plan.program import (NEIGHBOUR, NO_PEER, SENDS, Exchange, Instruction, Neighbour, Opcode, PlanHeader,
                                  Program)
from optpipe.core.units import format_size

__all__ = ["Line", "resolve", "disassemble"]

O = Opcode


class Line(NamedTuple):
    """One disassembled instruction: raw operands next to their human-readable comment."""

    position: int
    instruction: Instruction
    comment: str


def _operand(value: int) -> str:
    return "" if value == -1 else str(value)


def _link(ins: Instruction, link: Neighbour, rank_of: tuple[int, ...]) -> str:
    """Where the data of a message or hand-over goes or comes from: the neighbouring stage's rank."""
    other = ins.stage + link.step
    if not link.crosses:
        return f"to stage {other} on this rank"
    exchange = ins.opcode.spec.message[1]
    if exchange is Exchange.SEND:
        return f"to rank {ins.peer}, stage {other}"
    if exchange is Exchange.POST:
        return f"from rank {ins.peer}, stage {other}"
    # A wait has no peer operand: the header says which rank the stage lives on (the plan may be unverified).
    return f"from rank {rank_of[other]}" if ins.stage >= 0 and 0 <= other < len(rank_of) else ""


def _comment(ins: Instruction, header: PlanHeader, problem: Problem | None, sends: int) -> str:
    op, s = ins.opcode, ins.stage
    sizes = problem.memory if problem is not None else None
    link = NEIGHBOUR.get(op)
    if link is not None:
        return _link(ins, link, header.stage_ranks)
    if op is O.WAIT_SENDS:
        return f"{sends} send{'s' if sends != 1 else ''}"
    if sizes is None or not 0 <= s < len(sizes.activation):
        return {O.OFFLOAD: "device to host", O.RELOAD: "host to device",
                O.RECOMPUTE: "forward again, same RNG state"}.get(op, "")
    act, keep = sizes.activation[s], sizes.weight_activation[s]
    return {
        O.FORWARD: f"holds {format_size(act)}",
        O.BACKWARD_INPUT: f"frees {format_size(act - keep)}, keeps {format_size(keep)} for W",
        O.BACKWARD_WEIGHT: f"frees {format_size(keep)}",
        O.BACKWARD: f"frees {format_size(act)}",
        O.OFFLOAD: f"moves {format_size(act)} to host",
        O.WAIT_OFFLOAD: f"frees {format_size(act)} on device",
        O.RELOAD: f"moves {format_size(act)} to device, holds it",
        O.RECOMPUTE: (f"forward again, holds {format_size(act - problem.recompute.resident[s])} more"
                      if problem.recompute.enabled else "forward again"),
    }.get(op, "")


def resolve(program: Program, rank: int, problem: Problem | None = None) -> list[Line]:
    stream = program.ranks[rank]
    sends = sum(1 for ins in stream if ins.opcode in SENDS)
    return [Line(position, ins, _comment(ins, program.header, problem, sends)) for position, ins in enumerate(stream)]


_COLUMNS = f"{'pos':>6}  {'opcode':<22} {'stage':>5} {'mb':>5} {'peer':>5}"


def _format(line: Line) -> str:
    ins = line.instruction
    text = (f"{line.position:>6}  {ins.opcode.name:<22} {_operand(ins.stage):>5} {_operand(ins.microbatch):>5} "
            f"{_operand(ins.peer) if ins.peer != NO_PEER else '':>5}")
    return f"{text}  ({line.comment})" if line.comment else text.rstrip()


def _count(n: int, word: str, plural: str = "") -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _summary(program: Program, problem: Problem | None) -> list[str]:
    h = program.header
    mapping = " ".join(f"{s}:{r}" for s, r in enumerate(h.stage_ranks))
    counts = " + ".join(str(len(stream)) for stream in program.ranks)
    total = sum(len(stream) for stream in program.ranks)
    digest = h.problem_hash.hex()
    if problem is not None:
        same = problem_hash(problem) == h.problem_hash
        digest += f"  (matches {printable(repr(problem.name))})" if same else "  (DIFFERS from the given problem)"
    return [
        f"optpipe plan, format {version_of(program)}",
        f"  schedule       {printable(h.schedule_name)}",  # a name from a file: no raw control characters
        f"  shape          {_count(h.world_size, 'rank')}, {_count(h.stages, 'stage')} ({h.chunks} per rank), "
        f"{_count(h.microbatches, 'microbatch', 'microbatches')}",
        f"  stage -> rank  {mapping}",
        f"  problem        sha256 {digest}",
        f"  instructions   {counts} = {total}" if len(program.ranks) > 1 else f"  instructions   {total}",
    ]


def disassemble(program: Program, rank: int | None = None, problem: Problem | None = None) -> str:
    """Header summary, then each rank's (or one rank's) instructions, one per line."""
    world = len(program.ranks)
    if rank is not None and not 0 <= rank < world:
        raise PlanError(f"--rank {rank}: the plan has ranks 0..{world - 1}")
    lines = _summary(program, problem)
    for r in range(world) if rank is None else (rank,):
        stages = ", ".join(str(s) for s in program.header.stages_on(r))
        plural = "s" if len(program.header.stages_on(r)) != 1 else ""
        lines += ["", f"rank {r} (stage{plural} {stages}): {_count(len(program.ranks[r]), 'instruction')}", _COLUMNS]
        lines += [_format(line) for line in resolve(program, r, problem)]
    return "\n".join(lines) + "\n"
