"""The plan file: a Program as bytes, and back.

The layout is specified in docs/plan-format.md. In short, all integers little-endian::

    magic 89 4F 50 42 0D 0A 1A 0A | version u16 | flags u16 | total length u32
    world size u16 | stages u16 | chunks u16 | microbatches u16 | problem sha256 [32]
    name length u16 | name UTF-8 | stage -> rank u16 x stages
    per rank: rank u16 | count u32 | count x (opcode u8, stage u16, microbatch u16, peer u16)
    CRC32 u32 of every byte before it

Operands that an instruction does not have (-1 in the IR) are written as 0xFFFF. Decoding
checks, in this order, magic, version, flags, length, checksum, then every field's range, so
a damaged or foreign file fails with the offset and what was expected, never a crash.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from optpipe.core.errors import PlanError
from optpipe.core.files import read_bytes, write_atomic
from optpipe.plan.program import SINCE_VERSION, Instruction, Opcode, PlanHeader, Program

__all__ = ["MAGIC", "FORMAT_VERSION", "version_of", "INSTRUCTION_SIZE", "encode", "decode", "write_plan", "read_plan"]

MAGIC = b"\x89OPB\r\n\x1a\n"  # PNG-style: a high byte, a name, and line endings that text-mode copies break
FORMAT_VERSION = 2  # 2: RECOMPUTE (issue 14). A plan is written in the oldest version that holds its opcodes.
NONE = 0xFFFF  # an absent operand (-1)
LIMIT = NONE - 1  # largest world size, stage count, microbatch count or operand value
HASH_SIZE = 32
_FIXED = struct.Struct("<8sHHIHHHH32sH")  # magic .. name length
_INSTRUCTION = struct.Struct("<BHHH")
_SECTION = struct.Struct("<HI")
_U16 = struct.Struct("<H")
INSTRUCTION_SIZE = _INSTRUCTION.size
_CRC = struct.Struct("<I")
_SMALLEST = _FIXED.size + _CRC.size
_OPCODES = {int(op) for op in Opcode}


# --------------------------------------------------------------------------- encoding


def version_of(program: Program) -> int:
    """The oldest format version that holds every opcode of the program (what ``encode`` writes)."""
    return max([1] + [SINCE_VERSION.get(ins.opcode, 1) for stream in program.ranks for ins in stream])


def encode(program: Program) -> bytes:
    """The plan file's bytes; raises PlanError when a value does not fit the format."""
    header = program.header
    name = header.schedule_name.encode("utf-8")
    _fits("world size", header.world_size, 1, LIMIT)
    _fits("stage count", header.stages, 1, LIMIT)
    _fits("chunks", header.chunks, 1, LIMIT)
    _fits("microbatches", header.microbatches, 1, LIMIT)
    _fits("schedule name length (UTF-8 bytes)", len(name), 0, NONE)
    if not isinstance(header.problem_hash, bytes) or len(header.problem_hash) != HASH_SIZE:
        raise PlanError(f"cannot encode the plan: problem_hash must be {HASH_SIZE} bytes (a sha256 digest)")
    if len(program.ranks) != header.world_size:
        raise PlanError(f"cannot encode the plan: the header says {header.world_size} ranks "
                        f"but the program has {len(program.ranks)} instruction streams")
    version = version_of(program)
    parts = [
        _FIXED.pack(MAGIC, version, 0, 0, header.world_size, header.stages, header.chunks,
                    header.microbatches, header.problem_hash, len(name)),
        name,
    ]
    for stage, rank in enumerate(header.stage_ranks):
        _fits(f"stage_ranks[{stage}]", rank, 0, header.world_size - 1)
    parts.append(struct.pack(f"<{header.stages}H", *header.stage_ranks))
    for rank, stream in enumerate(program.ranks):
        parts.append(_SECTION.pack(rank, len(stream)))
        for position, ins in enumerate(stream):
            where = f"rank {rank} position {position} ({ins})"
            if int(ins.opcode) not in _OPCODES:
                raise PlanError(f"cannot encode {where}: {ins.opcode!r} is not an opcode")
            parts.append(_INSTRUCTION.pack(int(ins.opcode), _operand(ins.stage, f"{where}: stage"),
                                           _operand(ins.microbatch, f"{where}: microbatch"),
                                           _operand(ins.peer, f"{where}: peer")))
    body = bytearray(b"".join(parts))
    total = len(body) + _CRC.size
    struct.pack_into("<I", body, 12, total)
    return bytes(body) + _CRC.pack(zlib.crc32(body))


def _fits(what: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise PlanError(f"cannot encode the plan: {what} is {value}, the format allows {low}..{high}")


def _operand(value: int, what: str) -> int:
    if value == -1:
        return NONE
    if not 0 <= value <= LIMIT:
        raise PlanError(f"cannot encode {what} = {value}: operands are -1 (none) or 0..{LIMIT}")
    return value


# --------------------------------------------------------------------------- decoding


class _Reader:
    """Reads fields in order and names the offset of whatever is wrong."""

    def __init__(self, data: bytes, end: int):
        self.data, self.offset, self.end = data, 0, end

    def take(self, size: int, what: str) -> bytes:
        if self.offset + size > self.end:
            raise PlanError(f"offset {self.offset}: truncated: expected {what} ({size} bytes), "
                            f"but only {max(self.end - self.offset, 0)} bytes remain before the checksum")
        chunk = self.data[self.offset:self.offset + size]
        self.offset += size
        return chunk

    def unpack(self, layout: struct.Struct, what: str) -> tuple:
        return layout.unpack(self.take(layout.size, what))


def _bad(offset: int, message: str) -> PlanError:
    return PlanError(f"offset {offset}: {message}")


def decode(data: bytes) -> Program:
    """The Program in a plan file's bytes; raises PlanError naming the offset of any damage."""
    data = bytes(data)
    if len(data) < len(MAGIC) or data[:len(MAGIC)] != MAGIC:
        if len(data) < len(MAGIC) and MAGIC.startswith(data):
            raise _bad(len(data), f"truncated: expected the {len(MAGIC)}-byte magic, got {len(data)} bytes")
        got = data[:len(MAGIC)].hex(" ") or "nothing"
        raise _bad(0, f"expected the optpipe plan magic {MAGIC.hex(' ')}, got {got}; "
                      f"this is not an optpipe plan file (write one with `optpipe compile ... -o PLAN.opb`)")
    if len(data) < 12:
        raise _bad(len(data), f"truncated: expected the format version and flags at offset 8, got {len(data)} bytes")
    version, flags = struct.unpack_from("<HH", data, 8)
    if version > FORMAT_VERSION:
        raise _bad(8, f"plan format version {version} is newer than this optpipe reads (up to {FORMAT_VERSION}); "
                      f"upgrade optpipe or recompile the plan")
    if version == 0:
        raise _bad(8, f"expected a format version 1..{FORMAT_VERSION}, got 0")
    if flags != 0:
        raise _bad(10, f"expected flags 0 (format {FORMAT_VERSION} defines none), got {flags:#06x}")
    if len(data) < 16:
        raise _bad(len(data), f"truncated: expected the total length at offset 12, got {len(data)} bytes")
    (total,) = struct.unpack_from("<I", data, 12)
    if total < _SMALLEST:
        raise _bad(12, f"expected a total length of at least {_SMALLEST} bytes, got {total}")
    if len(data) < total:
        raise _bad(len(data), f"truncated: the header says the plan is {total} bytes, got {len(data)}")
    if len(data) > total:
        raise _bad(total, f"{len(data) - total} unexpected bytes after the end of the plan ({total} bytes)")
    (stored,) = _CRC.unpack_from(data, total - _CRC.size)
    computed = zlib.crc32(data[:total - _CRC.size])
    if stored != computed:
        raise _bad(total - _CRC.size, f"checksum mismatch: stored CRC32 {stored:#010x}, computed {computed:#010x}; "
                                      f"the plan is damaged, recompile it")
    return _fields(_Reader(data, total - _CRC.size), version)


def _fields(reader: _Reader, version: int = FORMAT_VERSION) -> Program:
    (_, _, _, _, world, stages, chunks, microbatches, digest, name_size) = reader.unpack(_FIXED, "the header")
    _range(16, "world size", world, 1, LIMIT)
    _range(18, "stage count", stages, 1, LIMIT)
    _range(20, "chunks (stages per rank)", chunks, 1, stages)
    _range(22, "microbatches", microbatches, 1, LIMIT)
    at = reader.offset
    try:
        name = reader.take(name_size, "the schedule name").decode("utf-8")
    except UnicodeDecodeError as error:
        raise _bad(at + error.start, "expected the schedule name in UTF-8") from None
    stage_ranks = []
    for stage in range(stages):
        at = reader.offset
        (rank,) = reader.unpack(_U16, f"the rank of stage {stage}")
        _range(at, f"stage_ranks[{stage}]", rank, 0, world - 1)
        stage_ranks.append(rank)
    ranks = []
    for expected in range(world):
        at = reader.offset
        rank, count = reader.unpack(_SECTION, f"rank {expected}'s section header")
        if rank != expected:
            raise _bad(at, f"expected the section of rank {expected}, got rank {rank}")
        room = (reader.end - reader.offset) // INSTRUCTION_SIZE
        if count > room:
            raise _bad(at + 2, f"rank {rank}'s section says {count} instructions, but only {room} fit "
                               f"in the bytes before the checksum")
        ranks.append(tuple(_instruction(reader, rank, position, stages, microbatches, world, version)
                           for position in range(count)))
    if reader.offset != reader.end:
        raise _bad(reader.offset, f"{reader.end - reader.offset} unexpected bytes between the last rank section "
                                  f"and the checksum")
    header = PlanHeader(world, tuple(stage_ranks), chunks, microbatches, name, digest)
    return Program(header, tuple(ranks))



def _instruction(reader: _Reader, rank: int, position: int, stages: int, microbatches: int, world: int,
                 version: int = FORMAT_VERSION) -> Instruction:
    at = reader.offset
    opcode, stage, microbatch, peer = reader.unpack(_INSTRUCTION, f"rank {rank} instruction {position}")
    where = f"rank {rank} instruction {position}"
    if opcode not in _OPCODES:
        known = ", ".join(f"{int(op)} ({op.name})" for op in Opcode)
        raise _bad(at, f"{where}: opcode {opcode} is not an opcode; expected one of {known}")
    since = SINCE_VERSION.get(Opcode(opcode), 1)
    if since > version:
        raise _bad(at, f"{where}: opcode {opcode} ({Opcode(opcode).name}) is new in plan format {since}, but this "
                       f"file says format {version}; the plan is damaged or was rewritten by hand, recompile it")
    return Instruction(
        Opcode(opcode),
        _operand_in(at + 1, where, "stage", stage, stages),
        _operand_in(at + 3, where, "microbatch", microbatch, microbatches),
        _operand_in(at + 5, where, "peer", peer, world),
    )


def _operand_in(offset: int, where: str, what: str, value: int, count: int) -> int:
    if value == NONE:
        return -1
    if value >= count:
        raise _bad(offset, f"{where}: {what} {value} is out of range; expected 0..{count - 1} or {NONE:#06x} (none)")
    return value


def _range(offset: int, what: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise _bad(offset, f"{what} {value} is out of range; expected {low}..{high}")


# --------------------------------------------------------------------------- files


def write_plan(path: str | Path, program: Program) -> None:
    """Encode, then replace ``path`` atomically: readers see the old plan or the new one, never a torn one."""
    write_atomic(path, encode(program), "plan file")


def read_plan(path: str | Path) -> Program:
    path = Path(path)
    data = read_bytes(path, "plan file", PlanError)
    try:
        return decode(data)
    except PlanError as error:
        raise PlanError(f"{path}: {error}") from None
