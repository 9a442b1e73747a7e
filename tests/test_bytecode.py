"""The plan file: exact round trips, the documented layout, and damaged or foreign bytes that
fail with the offset and what was expected -- never another exception, never a hang."""

from __future__ import annotations

import struct
import zlib

import pytest
from conftest import PROBLEM_DIR, uniform_problem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optpipe.plan.bytecode import FORMAT_VERSION, INSTRUCTION_SIZE, MAGIC, decode, encode, read_plan, write_plan
from optpipe.core.errors import PlanError
from optpipe.plan.lower import lower
from optpipe.core.problem_file import load_problem
from optpipe.plan.program import Instruction, Opcode, PlanHeader, Program
from optpipe.solvers.registry import generate

TIGHT = load_problem(PROBLEM_DIR / "balanced-p4-m8-tight.toml")
PLANS = {name: encode(lower(TIGHT, generate(name, TIGHT))) for name in ("1F1B", "GPipe")}
SMALL = lower(uniform_problem(2, 2), generate("1F1B", uniform_problem(2, 2)))
SMALL_BYTES = encode(SMALL)
NAME_AT = 58  # offset of the schedule name
MAP_AT = NAME_AT + len(b"1F1B")  # offset of the stage -> rank map
SECTION_AT = MAP_AT + 2 * 2  # offset of rank 0's section (two stages)


def _reseal(data: bytes | bytearray) -> bytes:
    """Fix the length field and the checksum, so that a change reaches the field checks."""
    body = bytearray(data[:-4])
    struct.pack_into("<I", body, 12, len(body) + 4)
    return bytes(body) + struct.pack("<I", zlib.crc32(body))


def _patched(offset: int, layout: str, value: int) -> bytes:
    data = bytearray(SMALL_BYTES)
    struct.pack_into(layout, data, offset, value)
    return _reseal(data)


def test_round_trip_is_exact():
    for data in PLANS.values():
        assert encode(decode(data)) == data
    assert decode(SMALL_BYTES) == SMALL


def test_layout_matches_the_spec():
    h = SMALL.header
    magic, version, flags, total, world, stages, chunks, micro = struct.unpack_from("<8sHHIHHHH", SMALL_BYTES)
    assert (magic, version, flags, total) == (MAGIC, 1, 0, len(SMALL_BYTES))  # no RECOMPUTE: format 1
    assert (world, stages, chunks, micro) == (2, 2, 1, 2)
    assert SMALL_BYTES[24:56] == h.problem_hash
    assert struct.unpack_from("<H", SMALL_BYTES, 56) == (4,) and SMALL_BYTES[NAME_AT:MAP_AT] == b"1F1B"
    assert struct.unpack_from("<2H", SMALL_BYTES, MAP_AT) == (0, 1)
    rank, count = struct.unpack_from("<HI", SMALL_BYTES, SECTION_AT)
    assert (rank, count) == (0, len(SMALL.ranks[0]))
    first = struct.unpack_from("<BHHH", SMALL_BYTES, SECTION_AT + 6)
    assert first == (Opcode.LOAD_MICROBATCH, 0, 0, 0xFFFF)
    sizes = sum(6 + INSTRUCTION_SIZE * len(stream) for stream in SMALL.ranks)
    assert len(SMALL_BYTES) == SECTION_AT + sizes + 4
    assert struct.unpack_from("<I", SMALL_BYTES, len(SMALL_BYTES) - 4)[0] == zlib.crc32(SMALL_BYTES[:-4])


# Each case: damaged bytes, the offset the message must name, and words from what was expected.
D = SMALL_BYTES
END = len(D)
_OP = SECTION_AT + 6  # rank 0's first instruction
CASES = {
    "foreign file": (b"PK\x03\x04" + D[4:], 0, "not an optpipe plan"),
    "empty": (b"", 0, "magic"),
    "cut in the magic": (D[:5], 5, "truncated: expected the 8-byte magic"),
    "newer version": (D[:8] + struct.pack("<H", FORMAT_VERSION + 1) + D[10:], 8, "newer than this optpipe reads"),
    "version zero": (D[:8] + b"\0\0" + D[10:], 8, "expected a format version"),
    "unknown flag": (D[:10] + b"\x01\0" + D[12:], 10, "expected flags 0"),
    "truncated": (D[:100], 100, f"the header says the plan is {END} bytes, got 100"),
    "trailing bytes": (D + b"\0\0", END, "2 unexpected bytes after the end"),
    "bad checksum": (D[:70] + bytes([D[70] ^ 1]) + D[71:], END - 4, "checksum mismatch"),
    "length too small": (D[:12] + struct.pack("<I", 20) + D[16:], 12, "at least"),
    "zero ranks": (_patched(16, "<H", 0), 16, "world size 0 is out of range; expected 1..65534"),
    "more chunks than stages": (_patched(20, "<H", 3), 20, "chunks (stages per rank) 3 is out of range; expected 1..2"),
    "zero microbatches": (_patched(22, "<H", 0), 22, "microbatches 0 is out of range"),
    "stage on a missing rank": (_patched(MAP_AT + 2, "<H", 5), MAP_AT + 2, "stage_ranks[1] 5 is out of range"),
    "bad UTF-8 name": (_patched(NAME_AT, "<B", 0xFF), NAME_AT, "UTF-8"),
    "sections out of order": (_patched(SECTION_AT, "<H", 1), SECTION_AT, "expected the section of rank 0, got rank 1"),
    "count beyond the data": (_patched(SECTION_AT + 2, "<I", 10**9), SECTION_AT + 2, "only"),
    "unknown opcode": (_patched(_OP, "<B", 99), _OP, "opcode 99 is not an opcode"),
    "stage out of range": (_patched(_OP + 1, "<H", 7), _OP + 1, "stage 7 is out of range; expected 0..1"),
    "microbatch out of range": (_patched(_OP + 3, "<H", 2), _OP + 3, "microbatch 2 is out of range"),
    "peer out of range": (_patched(_OP + 5, "<H", 2), _OP + 5, "peer 2 is out of range"),
    "count short of the data": (_patched(SECTION_AT + 2, "<I", len(SMALL.ranks[0]) - 1), None,
                                "expected the section of rank 1"),
    "bytes before the checksum": (_reseal(D[:-4] + b"\0\0\0" + D[-4:]), END - 4, "3 unexpected bytes between"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_damage_is_reported_with_offset_and_expectation(case):
    data, offset, words = CASES[case]
    with pytest.raises(PlanError) as error:
        decode(data)
    message = str(error.value)
    assert words in message
    if offset is not None:
        assert message.startswith(f"offset {offset}:"), message


def test_encode_refuses_values_the_format_cannot_hold():
    too_many = Program(PlanHeader(1, (0,), 1, 70000, "x", bytes(32)), ((Instruction(Opcode.WAIT_SENDS),),))
    with pytest.raises(PlanError, match="microbatches is 70000"):
        encode(too_many)
    bad_operand = Program(SMALL.header, (SMALL.ranks[0] + (Instruction(Opcode.FORWARD, 0, -5),), SMALL.ranks[1]))
    with pytest.raises(PlanError, match="rank 0 position .*microbatch = -5"):
        encode(bad_operand)
    with pytest.raises(PlanError, match="32 bytes"):
        encode(Program(PlanHeader(1, (0,), 1, 1, "x", b"short"), ((),)))
    with pytest.raises(PlanError, match="2 instruction streams"):
        encode(Program(PlanHeader(1, (0,), 1, 1, "x", bytes(32)), ((), ())))


def test_plan_files(tmp_path):
    path = tmp_path / "plan.opb"
    write_plan(path, SMALL)
    assert read_plan(path) == SMALL
    with pytest.raises(PlanError, match="no such plan file"):
        read_plan(tmp_path / "missing.opb")
    path.write_bytes(SMALL_BYTES[:-1])
    with pytest.raises(PlanError, match=r"plan\.opb: offset"):
        read_plan(path)


# --------------------------------------------------------------------------- fuzzing

_plans = st.sampled_from(sorted(PLANS))
_FUZZ = settings(max_examples=150, deadline=1000, suppress_health_check=[HealthCheck.too_slow])


def _decodes_or_plan_error(data: bytes) -> Program | None:
    try:
        return decode(data)
    except PlanError:
        return None


@_FUZZ
@given(_plans, st.data())
def test_flipped_bytes(name, data):
    blob = bytearray(PLANS[name])
    for at in data.draw(st.lists(st.integers(0, len(blob) - 1), min_size=1, max_size=4, unique=True)):
        blob[at] ^= data.draw(st.integers(1, 255))
    assert _decodes_or_plan_error(bytes(blob)) is None  # CRC32 misses a random change with odds 2**-32


@_FUZZ
@given(_plans, st.data())
def test_inserted_and_cut_bytes(name, data):
    blob = PLANS[name]
    at = data.draw(st.integers(0, len(blob)))
    if data.draw(st.booleans()):
        blob = blob[:at] + data.draw(st.binary(min_size=1, max_size=16)) + blob[at:]
    else:
        blob = blob[:at] + blob[at + data.draw(st.integers(1, 64)):]
    decoded = _decodes_or_plan_error(blob)
    if blob == PLANS[name]:  # a cut at the very end removes nothing
        assert decoded is not None
    else:  # the length in the header, then the CRC32, catches a changed size
        assert decoded is None


@_FUZZ
@given(_plans, st.data())
def test_resealed_damage_reaches_the_field_checks(name, data):
    """With length and checksum fixed up, any accepted file is canonical: it re-encodes to itself."""
    blob = bytearray(PLANS[name])
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(16, len(blob) - 5))
        action = data.draw(st.sampled_from(["flip", "insert", "cut"]))
        if action == "flip":
            blob[at] ^= data.draw(st.integers(1, 255))
        elif action == "insert":
            blob[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del blob[at:at + data.draw(st.integers(1, 8))]
    sealed = _reseal(blob)
    program = _decodes_or_plan_error(sealed)
    if program is not None:
        assert encode(program) == sealed
