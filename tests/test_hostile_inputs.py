"""Hostile input (issue 15): every example of a bad number, a huge size, an unwritable path or a
bad plan is one clear line on stderr, a documented exit code, and nothing lost or torn.

Exit codes: 0 done, 1 error, 2 no schedule fits, 64 malformed command line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import threading
import time

import pytest
from conftest import BASE_PROBLEM, PROBLEM_DIR

from optpipe.plan.bytecode import decode, encode, read_plan, write_plan
from optpipe.cli.main import main
from optpipe.core.errors import OptpipeError
from optpipe.core.files import write_atomic
from optpipe.plan.lower import lower
from optpipe.core.problem import Pipeline, Placement
from optpipe.core.problem_file import loads_problem
from optpipe.plan.program import Instruction, Opcode, PlanHeader, Program
from optpipe.plan.verify import verify
from optpipe.solvers import generate

BALANCED = str(PROBLEM_DIR / "balanced-p4-m8.toml")
CODES = {0, 1, 2, 64}

# The shared small problem, without the keys these tests set themselves or expect absent.
BASE = BASE_PROBLEM.lstrip("\n").replace('placement = "interleaved"\n', "").replace('host_budget = "64GiB"\n', "")

MODEL = """\
name = "m"
[pipeline]
devices = 2
microbatches = 4
[model]
layers = 4
hidden = 256
heads = 4
seq_len = 128
micro_batch_size = 1
vocab = 1000
[hardware]
preset = "A100-80GB"
"""


def run(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def one_line_error(code: int, err: str, expected_code: int, *needles: str) -> None:
    assert code == expected_code, err
    assert "Traceback" not in err
    text = err.strip()
    assert text.startswith("error: ") and "\n" not in text, text
    for needle in needles:
        assert needle in text, text


def problem_file(tmp_path, text: str, name: str = "p.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def edited(old: str, new: str, base: str = BASE) -> str:
    assert old in base, old
    return base.replace(old, new)


# --------------------------------------------------------------------------- numbers in problem files

@pytest.mark.parametrize("old, new, key", [
    ('activation = "200MiB"', "activation = nan", "memory.activation"),
    ('budget = "1GiB"', "budget = inf", "memory.budget"),
    ('budget = "1GiB"', 'budget = "1e400GiB"', "memory.budget"),
    ('budget = "1GiB"', "budget = 1e400", "memory.budget"),
    ('budget = "1GiB"', "budget = " + "9" * 4000, "memory.budget"),
    ('d2h_bandwidth = "24GB/s"', "d2h_bandwidth = inf", "offload.d2h_bandwidth"),
    ('d2h_bandwidth = "24GB/s"', 'd2h_bandwidth = "nanGB/s"', "offload.d2h_bandwidth"),
    ("devices = 4", "devices = 9223372036854775807", "pipeline.devices"),
    ("devices = 4", "devices = 100000", "pipeline.devices"),
    ("chunks_per_device = 1", "chunks_per_device = 100000", "pipeline.chunks_per_device"),
    ("microbatches = 8", "microbatches = 100000", "pipeline.microbatches"),
    ("microbatches = 8", "microbatches = 1000000000", "pipeline.microbatches"),
    ("forward = 20", "forward = 1e300", "costs.forward"),
    ("forward = 20", "forward = 1e-12", "costs.forward"),
    ("backward_weight = 20", "backward_weight = 5e-324", "costs.backward_weight"),
    ("forward = 20", "forward = " + "9" * 400, "costs.forward"),
    ("p2p = 0.5", "p2p = nan", "costs.p2p"),
    ('name = "t"', 'name = "t\\u001b[31m"', "name"),
])
def test_bad_numbers_in_a_problem_are_one_line(tmp_path, old, new, key):
    path = problem_file(tmp_path, edited(old, new))
    for command in (["check"], ["compare", "--json"]):
        code, out, err = run([*command[:1], path, *command[1:]])
        one_line_error(code, err, 1, key)
        assert out == ""


def test_five_thousand_digits_in_a_problem(tmp_path):
    path = problem_file(tmp_path, edited("devices = 4", "devices = " + "1" * 5000))
    code, _, err = run(["check", path])
    one_line_error(code, err, 1, "4300 digits")


def test_deeply_nested_toml(tmp_path):
    path = problem_file(tmp_path, BASE + "x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    code, _, err = run(["check", path])
    one_line_error(code, err, 1, "nest too deeply")


def test_budget_below_one_activation_means_nothing_fits(tmp_path):
    path = problem_file(tmp_path, edited('budget = "1GiB"', 'budget = "100MiB"'))
    code, _, err = run(["compare", path])
    one_line_error(code, err, 2, "below one stage's activation")
    code, _, err = run(["compare", BALANCED, "--budget", "1MiB"])
    one_line_error(code, err, 2, "--budget")


# --------------------------------------------------------------------------- the cost model

@pytest.mark.parametrize("hardware, key", [
    ('preset = ["A100-80GB"]', "hardware.preset"),
    ('preset = "A100-80GB"\ntflops = nan', "hardware.tflops"),
    ('preset = "A100-80GB"\ntflops = inf', "hardware.tflops"),
    ('preset = "A100-80GB"\nmfu = nan', "hardware.mfu"),
    ('preset = "A100-80GB"\nmfu = 2', "hardware.mfu"),
    ('preset = "A100-80GB"\ntflops = ' + "9" * 400, "hardware.tflops"),
    ('preset = "A100-80GB"\nmemory = nan', "hardware.memory"),
])
def test_bad_hardware_is_rejected(tmp_path, hardware, key):
    path = problem_file(tmp_path, edited('preset = "A100-80GB"', hardware, MODEL))
    code, out, err = run(["compare", path, "--json"])
    one_line_error(code, err, 1, key)
    assert out == ""


def test_model_times_that_round_to_zero_are_rejected(tmp_path):
    tiny = edited("hidden = 256", "hidden = 16", MODEL).replace("seq_len = 128", "seq_len = 8")
    path = problem_file(tmp_path, edited('preset = "A100-80GB"', 'preset = "A100-80GB"\ntflops = 1000000', tiny))
    one_line_error(*run(["check", path])[::2], 1, "rounds to 0 ms")


def test_model_sizes_are_bounded(tmp_path):
    path = problem_file(tmp_path, edited("hidden = 256", "hidden = 9223372036854775807", MODEL))
    one_line_error(*run(["check", path])[::2], 1, "model.hidden")


def test_model_problem_rejects_memory_activation(tmp_path):
    path = problem_file(tmp_path, MODEL + '[memory]\nactivation = "1GiB"\n')
    one_line_error(*run(["check", path])[::2], 1, "memory.activation", "[model] derives")
    # a budget override is what [memory] is for next to [model]
    path = problem_file(tmp_path, MODEL + '[memory]\nbudget = "20GiB"\n', "ok.toml")
    assert run(["check", path])[0] == 0


# --------------------------------------------------------------------------- command-line options

@pytest.mark.parametrize("argv, option", [
    (["compile", BALANCED, "--budget", "1e400"], "--budget"),
    (["compile", BALANCED, "--budget", "nan"], "--budget"),
    (["compile", BALANCED, "--seed", "99999999999999999999"], "--seed"),
    (["compile", BALANCED, "--seed", "-1"], "--seed"),
    (["compile", BALANCED, "--workers", "-4"], "--workers"),
    (["compile", BALANCED, "--workers", "0"], "--workers"),
    (["compile", BALANCED, "--time-limit", "nan"], "--time-limit"),
    (["compile", BALANCED, "--time-limit", "inf"], "--time-limit"),
    (["compile", BALANCED, "--time-limit", "-5"], "--time-limit"),
    (["compile", BALANCED, "--time-limit", "1e400"], "--time-limit"),
    (["show", BALANCED, "--schedule", "1F1B", "--width", "1000000000"], "--width"),
    (["profile", "--devices", "2", "--microbatches", "4", "--micro-batch-size", "0", "-o", "x.toml"],
     "--micro-batch-size"),
    (["profile", "--devices", "0", "--microbatches", "4", "-o", "x.toml"], "--devices"),
    (["profile", "--devices", "2", "--microbatches", "4", "--p2p", "nan", "-o", "x.toml"], "--p2p"),
    (["profile", "--devices", "2", "--microbatches", "4", "--repeats", "-1", "-o", "x.toml"], "--repeats"),
    (["compare", "--no-such-option"], "unrecognized"),
    (["no-such-command"], "invalid choice"),
    ([], "required"),
])
def test_bad_options_are_usage_errors(tmp_path, monkeypatch, argv, option):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(argv)
    one_line_error(code, err, 64, option)
    assert out == ""


def test_help_lists_the_exit_codes():
    code, out, _ = run(["--help"])
    assert code == 0 and "exit codes" in out and "64" in out
    code, out, _ = run(["compile", "--help"])
    assert code == 0 and "no schedule fits" in out


# --------------------------------------------------------------------------- sizes that would take hours

@pytest.mark.parametrize("devices, chunks, microbatches", [(60000, 1, 8), (4, 1, 60000), (4, 15000, 8), (512, 1, 512)])
def test_huge_problems_are_refused_up_front(tmp_path, devices, chunks, microbatches):
    shape = f"devices = {devices}\nchunks_per_device = {chunks}\nmicrobatches = {microbatches}\n"
    text = BASE.replace("devices = 4\nchunks_per_device = 1\nmicrobatches = 8\n", shape)
    text = text.replace('budget = "1GiB"', 'budget = "100TiB"')
    path = problem_file(tmp_path, text)
    for command in (["compare"], ["compile", "--solver", "heuristic:GPipe"], ["show", "--schedule", "GPipe"]):
        began = time.monotonic()
        code, _, err = run([command[0], path, *command[1:]])
        one_line_error(code, err, 1, "beyond what", "reasonable time")
        assert time.monotonic() - began < 20


def test_stages_on_is_not_quadratic():
    pipe = Pipeline(65534, 1, Placement.INTERLEAVED, 1)
    began = time.monotonic()
    assert [pipe.stages_on(d) for d in range(pipe.devices)][-1] == (65533,)
    assert time.monotonic() - began < 5
    v = Pipeline(8, 2, Placement.VSHAPE, 1)
    assert [v.stages_on(d) for d in range(8)] == [(d, 15 - d) for d in range(8)]
    wide = Pipeline(3, 4, Placement.INTERLEAVED, 1)
    assert wide.stages_on(1) == (1, 4, 7, 10) and wide.stages_on(3) == ()


def chain_plan(ranks: int, name: str = "chain") -> Program:
    """A valid GPipe plan of one microbatch over ``ranks`` ranks (as `lower` writes it), built directly."""
    O = Opcode
    streams = []
    for r in range(ranks):
        first, last = r == 0, r == ranks - 1
        s = []
        if not first:
            s.append(Instruction(O.POST_RECV_ACTIVATION, r, 0, r - 1))
        if not last:
            s.append(Instruction(O.POST_RECV_GRADIENT, r, 0, r + 1))
        s.append(Instruction(O.LOAD_MICROBATCH, 0, 0) if first else Instruction(O.WAIT_RECV_ACTIVATION, r, 0))
        s.append(Instruction(O.FORWARD, r, 0))
        if last:
            s.append(Instruction(O.LOSS, r, 0))
        else:
            s += [Instruction(O.SEND_ACTIVATION, r, 0, r + 1), Instruction(O.WAIT_RECV_GRADIENT, r, 0)]
        s.append(Instruction(O.BACKWARD, r, 0))
        if not first:
            s.append(Instruction(O.SEND_GRADIENT, r, 0, r - 1))
        s.append(Instruction(O.WAIT_SENDS))
        streams.append(tuple(s))
    header = PlanHeader(ranks, tuple(range(ranks)), 1, 1, name, bytes(32))
    return Program(header, tuple(streams))


def test_chain_plan_matches_lowering():
    problem = loads_problem(edited("microbatches = 8", "microbatches = 1").replace("[offload]\nenabled = true",
                                                                                    "[offload]\nenabled = false"))
    lowered = lower(problem, generate("GPipe", problem))
    assert lowered.ranks == chain_plan(4).ranks


def test_verify_and_disasm_of_many_ranks_are_near_linear(tmp_path):
    """A backward chain over every rank took one sweep of all ranks per rank: quadratic."""
    ranks = int(os.environ.get("OPTPIPE_BIG_PLAN_RANKS", "16384"))
    path = tmp_path / "wide.opb"
    write_plan(path, chain_plan(ranks))
    began = time.monotonic()
    assert run(["verify", path])[0] == 0
    code, out, _ = run(["disasm", path])
    assert code == 0 and f"rank {ranks - 1} (stage {ranks - 1})" in out
    assert time.monotonic() - began < 60


# --------------------------------------------------------------------------- schedule JSON and CSV

def schedule_file(tmp_path, text: str):
    path = tmp_path / "s.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, needle", [
    ("[" * 100_000 + "]" * 100_000, "nests too deeply"),
    ('{"format": "optpipe-schedule", "version": ' + "1" * 5000 + "}", "4300 digits"),
    ('{"format": "optpipe-schedule", "version": ' + "1" * 4000 + "}", "is not supported"),
    ('{"format": "optpipe-schedule", "version": 1, "name": "x", "devices": [[' + "1" * 4000 + "]]}", "bits"),
    ('{"format": "optpipe-schedule", "version": 1, "name": "x", "devices": [["F' + "1" * 5000 + ':0"]]}',
     "cannot parse op"),
    ('{"format": "optpipe-schedule", "version": NaN}', "NaN"),
    ('{"format": "optpipe-schedule", "version": 1, "name": "x", "devices": [[{"a": 1}]]}', "cannot parse op"),
])
def test_hostile_schedule_json(tmp_path, text, needle):
    code, out, err = run(["simulate", BALANCED, schedule_file(tmp_path, text), "--json"])
    one_line_error(code, err, 1, needle)
    assert out == ""


def csv_file(tmp_path, text: str):
    path = tmp_path / "s.csv"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, needle", [
    ("0F" + "1" * 5000 + "\n", "cannot read"),
    ("1" * 5000 + "F0\n", "cannot read"),
    ("x" * 200_000 + "\n", "field larger than field limit"),
    ("0F0\x00\n", "cannot read"),
    ("(" * 5000 + "0F0" + ")OVERLAP_F_B" * 5000 + "\n", "cannot read"),
    ("((0F0)OVERLAP_F_B;0F1)OVERLAP_F_B\n", "cannot read"),
])
def test_hostile_csv(tmp_path, text, needle):
    text += "1F0\n2F0\n3F0\n"  # the problem's other three ranks
    code, _, err = run(["import", csv_file(tmp_path, text), "--problem", BALANCED, "-o", tmp_path / "p.opb"])
    one_line_error(code, err, 1, needle)
    assert not (tmp_path / "p.opb").exists()


# --------------------------------------------------------------------------- import, export, verify, disasm

def csv_of(name: str, problem_path: str) -> str:
    from optpipe.core.problem_file import load_problem
    from optpipe.plan.torch_csv import schedule_to_torch_csv

    return schedule_to_torch_csv(generate(name, load_problem(problem_path)))


def test_import_over_budget_says_so_and_does_not_write(tmp_path):
    csv = csv_file(tmp_path, csv_of("GPipe", BALANCED))
    plan = tmp_path / "p.opb"
    code, out, err = run(["import", csv, "--problem", BALANCED, "-o", plan])
    assert code == 2 and "Traceback" not in err
    assert "over the" in out and "memory.budget" in out and "verified" not in out
    assert not plan.exists()
    code, out, _ = run(["import", csv, "--problem", BALANCED, "-o", plan, "--allow-over-budget"])
    assert code == 2 and "warning" in out and plan.exists()
    # verify --problem predicts the same and names the file's key, not an option it lacks
    code, out, err = run(["verify", plan, "--problem", BALANCED])
    assert code == 2 and "memory.budget" in out and "--budget" not in out + err


def test_import_that_fits_is_verified(tmp_path):
    csv = csv_file(tmp_path, csv_of("1F1B", BALANCED))
    code, out, _ = run(["import", csv, "--problem", BALANCED, "-o", tmp_path / "p.opb"])
    assert code == 0 and "verified" in out


def test_export_of_a_deadlocking_plan_fails(tmp_path):
    program = chain_plan(3)
    stream = list(program.ranks[1])  # rank 1 waits for the gradient before sending the activation that causes it
    a = stream.index(Instruction(Opcode.SEND_ACTIVATION, 1, 0, 2))
    w = stream.index(Instruction(Opcode.WAIT_RECV_GRADIENT, 1, 0))
    stream[a], stream[w] = stream[w], stream[a]
    bad = Program(program.header, (program.ranks[0], tuple(stream), program.ranks[2]))
    with pytest.raises(OptpipeError, match="deadlock"):
        verify(bad)
    path = tmp_path / "bad.opb"
    write_plan(path, bad)
    code, out, err = run(["export", path, "-o", tmp_path / "x.csv"])
    one_line_error(code, err.split("\n")[0] + "\n", 1, "deadlock")
    assert not (tmp_path / "x.csv").exists()
    assert run(["export", path])[0] == 1


def test_disasm_escapes_control_characters(tmp_path):
    path = tmp_path / "evil.opb"
    write_plan(path, chain_plan(2, name="evil\x1b[2J\x07\rname"))
    code, out, _ = run(["disasm", path])
    assert code == 0 and "\x1b" not in out and "\x07" not in out and "\r" not in out
    assert "evil\\x1b[2J\\x07\\rname" in out
    code, out, _ = run(["verify", path])
    assert code == 0 and "\x1b" not in out


def test_markup_in_a_problem_name_is_shown_as_written(tmp_path):
    path = problem_file(tmp_path, edited('name = "t"', 'name = "[/][bold]x"'))
    code, out, err = run(["check", path])
    assert code == 0 and "[/][bold]x: valid" in out, err


# --------------------------------------------------------------------------- output paths and atomic writes

@pytest.mark.parametrize("argv", [
    ["compile", BALANCED, "--solver", "heuristic:1F1B-capped", "-o", "{missing}/x.opb"],
    ["compile", BALANCED, "--solver", "heuristic:1F1B-capped", "-o", "{dir}"],
    ["compile", BALANCED, "--solver", "heuristic:1F1B-capped", "--schedule-out", "{missing}/x.json"],
    ["show", BALANCED, "--schedule", "1F1B", "--trace", "{missing}/t.json"],
    ["simulate", BALANCED, "{schedule}", "--trace", "{dir}"],
    ["export", "{plan}", "-o", "{missing}/x.csv"],
    ["import", "{csv}", "--problem", BALANCED, "-o", "{missing}/x.opb"],
    ["profile", "--devices", "2", "--microbatches", "4", "-o", "{missing}/p.toml"],
])
def test_unwritable_outputs_fail_before_any_work(tmp_path, argv):
    from optpipe.core.problem_file import load_problem
    from optpipe.core.schedule import dump_schedule

    schedule, plan, csv = tmp_path / "s.json", tmp_path / "p.opb", tmp_path / "s.csv"
    problem = load_problem(BALANCED)
    dump_schedule(generate("1F1B", problem), schedule)
    write_plan(plan, lower(problem, generate("1F1B", problem)))
    csv.write_text(csv_of("1F1B", BALANCED))
    values = {"missing": tmp_path / "missing", "dir": tmp_path, "schedule": schedule, "plan": plan, "csv": csv}
    argv = [a.format(**values) for a in argv]
    began = time.monotonic()
    code, out, err = run(argv)
    one_line_error(code, err, 64, "does not exist" if "missing" in " ".join(argv) else "is a folder")
    assert time.monotonic() - began < 10


def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "plan.opb"
    path.write_bytes(b"old plan")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OptpipeError, match="No space left on device.*unchanged"):
        write_atomic(path, b"new plan" * 1000, "plan file")
    assert path.read_bytes() == b"old plan"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.opb"]  # no temporary file left behind


def test_write_atomic_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "x"
    path.write_text("a")
    path.chmod(0o640)
    write_atomic(path, "b")
    assert path.read_text() == "b" and (path.stat().st_mode & 0o777) == 0o640


def test_full_disk_leaves_the_existing_plan_whole(tmp_path):
    """`ulimit -f 1`: the write fails with one line and the plan already there is untouched."""
    plan = tmp_path / "plan.opb"
    problem = str(PROBLEM_DIR / "zb15b-p8-m32.toml")
    assert run(["compile", problem, "--solver", "heuristic:1F1B-capped", "-o", plan])[0] == 0
    before = plan.read_bytes()
    assert len(before) > 1024

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    done = subprocess.run([sys.executable, "-m", "optpipe.cli", "compile", problem, "--solver",
                           "heuristic:ZB-H1", "--budget", "100GiB", "-o", str(plan)],
                          capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "File too large" in done.stderr
    assert plan.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.opb"]


def test_concurrent_writers_and_a_reader_never_see_a_torn_plan(tmp_path):
    path = tmp_path / "plan.opb"
    plans = [encode(chain_plan(n)) for n in (2, 40, 300)]
    write_atomic(path, plans[0])
    stop = time.monotonic() + 2.0
    torn = []

    def writer(k):
        while time.monotonic() < stop:
            write_atomic(path, plans[k % len(plans)])

    def reader():
        while time.monotonic() < stop:
            data = path.read_bytes()
            try:
                decode(data)
            except OptpipeError as error:
                torn.append(str(error))

    threads = [threading.Thread(target=writer, args=(k,)) for k in (1, 2)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torn == []
    assert read_plan(path).header.world_size in (2, 40, 300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.opb"]


# --------------------------------------------------------------------------- as a user runs it

@pytest.mark.parametrize("argv, expected", [
    (["compile", BALANCED, "--seed", "99999999999999999999"], 64),
    (["compare", "--json", "--budget", "inf"], 64),
    (["check", "{nan}"], 1),
])
def test_console_script_never_prints_a_traceback(tmp_path, argv, expected):
    nan = problem_file(tmp_path, edited("activation = \"200MiB\"", "activation = nan"))
    argv = [a.format(nan=nan) for a in argv]
    done = subprocess.run([sys.executable, "-m", "optpipe.cli", *argv], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == expected
    assert "Traceback" not in done.stderr and done.stderr.startswith("error: ")
    assert len(done.stderr.strip().splitlines()) == 1


def test_compare_json_is_strict_json(tmp_path):
    code, out, _ = run(["compare", BALANCED, "--json"])
    assert code == 0
    json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in --json output"))


def test_an_overlong_output_name_is_refused_up_front(tmp_path):
    code, _, err = run(["compile", BALANCED, "--solver", "heuristic:1F1B-capped", "-o", tmp_path / ("x" * 300)])
    one_line_error(code, err, 64, "255")
    # a name near the limit still leaves room for the temporary file beside it
    name = tmp_path / ("y" * 250)
    assert run(["compile", BALANCED, "--solver", "heuristic:1F1B-capped", "-o", name])[0] == 0
    assert read_plan(name).header.world_size == 4


@pytest.mark.parametrize("argv, what", [
    (["check", "{big}"], "problem file"),
    (["simulate", BALANCED, "{big}"], "schedule file"),
    (["import", "{big}", "--problem", BALANCED, "-o", "{out}"], "CSV file"),
])
def test_oversized_inputs_are_refused_before_reading(tmp_path, argv, what):
    big = tmp_path / "big"
    with open(big, "wb") as sparse:  # a hole, not 300 MB of disk
        sparse.truncate(300 << 20)
    code, _, err = run([a.format(big=big, out=tmp_path / "p.opb") for a in argv])
    one_line_error(code, err, 1, f"too large for a {what}")
