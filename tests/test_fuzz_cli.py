"""Fuzzing the command line (issue 15): problem-file values, options, schedule JSON and CSV.

Every generated case runs ``main(argv)`` in this process and must end with an exit code in the
documented set (0, 1, 2, 64), no traceback (an exception escaping ``main`` fails the case), no
case slower than ``OPTPIPE_FUZZ_TIMEOUT`` seconds (a hang), stdout that is strict JSON whenever
``--json`` was given and something was printed, and no temporary file left beside an output.

CI runs a small, derandomized sample. The big run (5,000+ cases, random):

    OPTPIPE_FUZZ_EXAMPLES=1100 .venv/bin/python -m pytest tests/test_fuzz_cli.py -p no:cacheprovider \\
        --hypothesis-show-statistics

(``OPTPIPE_FUZZ_EXAMPLES`` is per test; there are five, so that is 5,500 generated cases, each
running one to four commands; the big run prints how many commands ran in all.)
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import tempfile
from pathlib import Path

import pytest

from conftest import PROBLEM_DIR
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from optpipe.cli.main import main
from optpipe.core.problem_file import load_problem
from optpipe.plan.torch_csv import schedule_to_torch_csv
from optpipe.solvers import generate

EXAMPLES = int(os.environ.get("OPTPIPE_FUZZ_EXAMPLES", "0")) or None
TIMEOUT = float(os.environ.get("OPTPIPE_FUZZ_TIMEOUT", "120"))
CODES = {0, 1, 2, 64}
BALANCED = str(PROBLEM_DIR / "balanced-p4-m8.toml")
SCHEDULES = ["GPipe", "1F1B", "1F1B-capped", "ZB-H1", "ZB-H2", "GIS", "PO-H", "V-Half", "nope"]

FUZZ = settings(
    max_examples=EXAMPLES or 12,
    derandomize=EXAMPLES is None,  # CI: the same small sample every run
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

CASES = {"count": 0}


@pytest.fixture(scope="module", autouse=True)
def _count_commands(request):
    yield
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if EXAMPLES and capture is not None:
        with capture.global_and_fixture_disabled():
            print(f"\nfuzz: {CASES['count']:,} commands run, every one within the invariants")


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"a case ran for more than {TIMEOUT:g} s")


def run_case(argv: list[str], folder: Path | None = None) -> tuple[int, str, str]:
    """main(argv) under the invariants; returns (code, stdout, stderr)."""
    CASES["count"] += 1
    out, err = io.StringIO(), io.StringIO()
    before = set(os.listdir(folder)) if folder else set()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    stdout, stderr = out.getvalue(), err.getvalue()
    event(f"{argv[0]} exit {code}")
    assert code in CODES, (argv, code, stderr)
    assert "Traceback" not in stderr, (argv, stderr)
    if code == 1 or code == 64:
        assert stderr.strip().startswith("error: "), (argv, stderr)
    if "--json" in argv and (stdout.strip() or code == 0):
        json.loads(stdout, parse_constant=lambda name: (_ for _ in ()).throw(AssertionError(f"{name}: {argv}")))
    if folder is not None:
        left = {name for name in set(os.listdir(folder)) - before if name.endswith(".tmp")}
        assert not left, (argv, left)
    return code, stdout, stderr


# --------------------------------------------------------------------------- values as TOML text

def _float_text(x: float) -> str:
    if x != x:
        return "nan"
    if x in (float("inf"), float("-inf")):
        return "inf" if x > 0 else "-inf"
    text = repr(x)
    return text if any(c in text for c in ".e") else text + ".0"


NUMBER_WORDS = ["nan", "inf", "-inf", "1e400", "-1", "0", "0.0", "1", "2", "0.5", "1e-9", "18.5", "1e300",
                "99999999999999999999", "-0", "4", "8", "65534", "65535", "100000", "9223372036854775807"]
UNITS = ["", "B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB", "XB", "gigs"]

small_ints = st.integers(min_value=-3, max_value=9).map(str)
wide_ints = st.integers(min_value=-(10**20), max_value=10**20).map(str)
huge_ints = st.builds(lambda sign, n: sign + "9" * n, st.sampled_from(["", "-"]),
                      st.integers(min_value=20, max_value=6000))
floats = st.floats(allow_nan=True, allow_infinity=True).map(_float_text)
sizes = st.builds(lambda n, u, bw: json.dumps(f"{n}{u}" + ("/s" if bw else "")),
                  st.sampled_from(NUMBER_WORDS) | st.floats(min_value=0, max_value=1e20).map(repr),
                  st.sampled_from(UNITS), st.booleans())
texts = st.text(max_size=30).map(lambda s: json.dumps(s))
scalars = st.one_of(small_ints, small_ints, wide_ints, huge_ints, floats, sizes, sizes, texts,
                    st.sampled_from(["true", "false", '"A100-80GB"', '"H100-80GB"', '"vshape"', '"interleaved"']))
plausible = st.one_of(st.integers(min_value=1, max_value=8).map(str),
                      st.floats(min_value=0.05, max_value=50).map(_float_text),
                      st.builds(lambda n, u: json.dumps(f"{n}{u}"), st.integers(min_value=1, max_value=4096),
                                st.sampled_from(["MiB", "GiB", "MB/s", "GB/s", "GiB/s"])))
toml_values = plausible | plausible | st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=5).map(lambda xs: "[" + ", ".join(xs) + "]"), max_leaves=8)

PLAIN = {
    "": {"name": '"fuzz"'},
    "pipeline": {"devices": "2", "chunks_per_device": "1", "placement": '"interleaved"', "microbatches": "4"},
    "costs": {"forward": "2.0", "backward_input": "2.0", "backward_weight": "1.0", "p2p": "0.1"},
    "memory": {"activation": '"1GiB"', "weight_activation": '"0.5GiB"', "budget": '"3GiB"'},
    "offload": {"enabled": "true", "d2h_bandwidth": '"24GB/s"', "h2d_bandwidth": '"24GB/s"',
                "host_budget": '"64GiB"'},
}
MODEL = {
    "": {"name": '"fuzz-model"'},
    "pipeline": {"devices": "2", "microbatches": "4"},
    "model": {"layers": "4", "hidden": "256", "heads": "4", "seq_len": "128", "micro_batch_size": "1",
              "vocab": "1000", "flash_attention": "false"},
    "hardware": {"preset": '"A100-80GB"', "tflops": "312", "mfu": "0.4", "memory": '"80GiB"',
                 "pcie_bandwidth": '"25GB/s"', "p2p_bandwidth": '"25GB/s"', "reserve": '"4GiB"'},
    "memory": {"budget": '"20GiB"'},
}


def _render(tables: dict[str, dict[str, str]]) -> str:
    lines = [f"{key} = {value}" for key, value in tables.get("", {}).items()]
    for table, entries in tables.items():
        if table:
            lines.append(f"[{table}]")
            lines += [f"{key} = {value}" for key, value in entries.items()]
    return "\n".join(lines) + "\n"


@st.composite
def problem_texts(draw) -> str:
    base = draw(st.sampled_from([PLAIN, MODEL]))
    tables = {table: dict(entries) for table, entries in base.items()}
    slots = [(table, key) for table, entries in base.items() for key in entries]
    slots += [("pipeline", "colour"), ("costs", "latency"), ("memory", "activation"), ("", "extra")]
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        table, key = draw(st.sampled_from(slots))
        if draw(st.integers(0, 9)) == 0:
            tables.setdefault(table, {}).pop(key, None)  # a missing key
        else:
            tables.setdefault(table, {})[key] = draw(toml_values)
    return _render(tables)


PROBLEM_COMMANDS = [
    ["check"], ["compare", "--json"], ["compare"], ["show", "--schedule", "1F1B", "--width", "60"],
    ["compile", "--solver", "heuristic:1F1B-capped", "--json"], ["compile", "--solver", "heuristic:GPipe"],
]


@FUZZ
@given(text=problem_texts(), command=st.sampled_from(PROBLEM_COMMANDS))
def test_fuzz_problem_values(text, command):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "p.toml"
        path.write_text(text)
        run_case([command[0], str(path), *command[1:]], Path(folder))


@FUZZ
@given(text=problem_texts())
def test_fuzz_problem_values_compile_to_files(text):
    """A problem that loads also compiles to a schedule file and a plan, written atomically."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "p.toml"
        path.write_text(text)
        code, _, _ = run_case(["check", str(path)])
        if code == 0:
            schedule, plan = Path(folder) / "s.json", Path(folder) / "p.opb"
            code, _, _ = run_case(["compile", str(path), "--solver", "heuristic:1F1B-capped", "--schedule-out",
                                   str(schedule), "-o", str(plan), "--json"], Path(folder))
            if code == 0:  # what was written reads back whole
                assert run_case(["verify", str(plan), "--problem", str(path)])[0] == 0
                assert run_case(["simulate", str(path), str(schedule), "--json"])[0] == 0


# --------------------------------------------------------------------------- options

OPTION_VALUES = st.one_of(
    st.sampled_from(["1", "2", "0.5", "30", "600MiB", "2GiB", "20GiB", "1F1B", "ZB-H1", "GPipe"]),
    st.sampled_from(NUMBER_WORDS + ["", "abc", "6GiB", "1e400GiB", "-4", "0.001", "--json", "1" * 5000,
                                    "nanGiB", "100MiB", "20", "3"]),
    st.text(max_size=12))
OPTIONS = {
    "compile": ["--budget", "--time-limit", "--seed", "--workers", "--solver", "--json"],
    "compare": ["--budget", "--json"],
    "show": ["--budget", "--schedule", "--width"],
    "check": [],
    "simulate": ["--budget", "--json"],
    "disasm": ["--rank"],
    "profile": ["--devices", "--chunks", "--microbatches", "--micro-batch-size", "--p2p", "--repeats", "--threads",
                "--seed", "--placement", "--budget", "--dtype"],
}
FLAGS = {"--json"}


@st.composite
def command_lines(draw) -> list[str]:
    command = draw(st.sampled_from(sorted(OPTIONS) + ["compile", "compare", "show", "simulate"]))
    argv = [command]
    if command in ("compile", "compare", "show", "check", "simulate"):
        argv.append(BALANCED)
    if command == "simulate":
        argv.append("{schedule}")
    if command == "disasm":
        argv.append("{plan}")
    if command == "show":
        argv += ["--schedule", draw(st.sampled_from(SCHEDULES))]
    if command == "compile":
        argv += ["--solver", draw(st.sampled_from(["heuristic:1F1B-capped", "heuristic:ZB-H1", "heuristic:nope",
                                                   "nope", "cpsat"]))]
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        option = draw(st.sampled_from(OPTIONS[command] + ["--no-such-option"]))
        argv.append(option)
        if option not in FLAGS and option != "--no-such-option":
            argv.append(draw(OPTION_VALUES))
    if command == "compile" and "cpsat" in argv:
        argv += ["--time-limit", "0.5", "--workers", "1"]  # a real solve, but a short one
    if command == "profile":
        argv += ["--devices", "0"]  # always a usage error: profiling itself needs torch and minutes
    return argv


@FUZZ
@given(argv=command_lines())
def test_fuzz_options(argv):
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        problem = load_problem(BALANCED)
        schedule, plan = folder / "s.json", folder / "p.opb"
        from optpipe.plan.bytecode import write_plan
        from optpipe.plan.lower import lower
        from optpipe.core.schedule import dump_schedule

        one_f_one_b = generate("1F1B", problem)
        dump_schedule(one_f_one_b, schedule)
        write_plan(plan, lower(problem, one_f_one_b))
        argv = [a.replace("{schedule}", str(schedule)).replace("{plan}", str(plan)) for a in argv]
        code, _, _ = run_case(argv, folder)
        if argv[0] == "profile":
            assert code == 64


# --------------------------------------------------------------------------- schedule JSON

_PROBLEM = load_problem(BALANCED)
_VALID_SCHEDULE = generate("1F1B", _PROBLEM).to_json()
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
                         st.sampled_from(["F0:0", "B3:7", "W1:2", "BW0:0", "OFF0:0", "REL0:0", "F99999:0",
                                          "F0:" + "9" * 30]))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)


@st.composite
def schedule_texts(draw) -> str:
    data = json.loads(json.dumps(_VALID_SCHEDULE))
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3, 4]))):
        where = draw(st.sampled_from(["format", "version", "name", "devices", "device", "op", "drop", "extra",
                                      "swap", "swap", "swap", "swap"]))
        if where in ("format", "version", "name", "devices"):
            data[where] = draw(json_values)
        elif where == "extra":
            data[draw(st.text(max_size=8))] = draw(json_values)
        elif isinstance(data.get("devices"), list) and data["devices"]:
            devices = data["devices"]
            d = draw(st.integers(min_value=0, max_value=len(devices) - 1))
            if where == "device":
                devices[d] = draw(json_values)
            elif isinstance(devices[d], list) and devices[d]:
                k = draw(st.integers(min_value=0, max_value=len(devices[d]) - 1))
                if where == "op":
                    devices[d][k] = draw(json_values)
                elif where == "swap":  # another order of the same ops: valid, or a deadlock to report
                    j = min(k + 1, len(devices[d]) - 1)
                    devices[d][k], devices[d][j] = devices[d][j], devices[d][k]
                else:
                    del devices[d][k]
    text = json.dumps(data)
    raw = draw(st.sampled_from(["", "", "", "digits", "nan", "truncate", "deep"]))
    if raw == "digits":
        text = text.replace('"version": 1', '"version": ' + "1" * draw(st.integers(1, 6000)), 1)
    elif raw == "nan":
        text = text.replace('"version": 1', '"version": NaN', 1)
    elif raw == "truncate":
        text = text[:draw(st.integers(min_value=0, max_value=len(text)))]
    elif raw == "deep":
        depth = draw(st.integers(min_value=1, max_value=200_000))
        text = "[" * depth + "]" * depth
    return text


@FUZZ
@given(text=schedule_texts(), as_json=st.booleans())
def test_fuzz_schedule_json(text, as_json):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "s.json"
        path.write_text(text)
        trace = Path(folder) / "t.json"
        run_case(["simulate", BALANCED, str(path), "--trace", str(trace)] + (["--json"] if as_json else []),
                 Path(folder))


# --------------------------------------------------------------------------- PyTorch CSV

_VALID_ROWS = [row.split(",") for row in schedule_to_torch_csv(generate("ZB-H1", _PROBLEM)).splitlines()]
cells = st.one_of(st.sampled_from(["", "0F0", "1I3", "2W1", "3B0", "0UNSHARD", "1REDUCE_GRAD", "0SEND_F0",
                                   "(0F1;0I0)OVERLAP_F_B", "((0F1)OVERLAP_F_B)OVERLAP_F_B", "0F" + "1" * 5000,
                                   "9F0", "0F99", "x" * 200_000, "\x00", '"quoted, cell"']),
                  st.text(max_size=10))


@st.composite
def csv_texts(draw) -> str:
    rows = [list(row) for row in _VALID_ROWS]
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3, 5]))):
        action = draw(st.sampled_from(["cell", "cell", "drop", "row", "swap", "adjacent", "adjacent", "adjacent"]))
        r = draw(st.integers(min_value=0, max_value=len(rows) - 1)) if rows else 0
        if action == "cell" and rows and rows[r]:
            rows[r][draw(st.integers(min_value=0, max_value=len(rows[r]) - 1))] = draw(cells)
        elif action == "drop" and rows:
            rows.pop(r)
        elif action == "row":
            rows.insert(r, draw(st.lists(cells, max_size=4)))
        elif action == "swap" and rows and rows[r]:
            rows[r].reverse()
        elif action == "adjacent" and rows and len(rows[r]) > 1:  # another order: valid, or a deadlock
            k = draw(st.integers(min_value=0, max_value=len(rows[r]) - 2))
            rows[r][k], rows[r][k + 1] = rows[r][k + 1], rows[r][k]
    return "\n".join(",".join(row) for row in rows) + "\n"


@FUZZ
@given(text=csv_texts(), over_budget=st.booleans())
def test_fuzz_torch_csv(text, over_budget):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "s.csv"
        path.write_text(text)
        argv = ["import", str(path), "--problem", BALANCED, "-o", str(Path(folder) / "p.opb")]
        code, _, _ = run_case(argv + (["--allow-over-budget"] if over_budget else []), Path(folder))
        if code in (0, 2) and (Path(folder) / "p.opb").exists():
            assert run_case(["export", str(Path(folder) / "p.opb"), "-o", str(Path(folder) / "back.csv")],
                            Path(folder))[0] == 0
