"""The problem file: loading, validation messages that name the key, and the TOML round trip."""

from __future__ import annotations

import pytest

from optpipe.core.errors import ProblemError
from optpipe.core.problem import Placement
from optpipe.core.problem_file import dumps_problem, load_problem, loads_problem
from optpipe.core.units import parse_bandwidth, parse_size

from conftest import BASE_PROBLEM, INSTANCES, uniform_problem

BASE = BASE_PROBLEM


def edited(old: str, new: str) -> str:
    assert old in BASE, old
    return BASE.replace(old, new)


def test_base_loads_with_exact_units():
    problem = loads_problem(BASE)
    assert problem.memory.activation == (200 * 2**20,) * 4
    assert problem.memory.budget == 2**30
    assert problem.offload.d2h_bandwidth == 24e9
    assert problem.offload_ms(0) == pytest.approx(200 * 2**20 / 24e9 * 1e3)
    assert problem.pipeline.placement is Placement.INTERLEAVED


@pytest.mark.parametrize("text, expected", [
    ("1.5GiB", int(1.5 * 2**30)), ("512MiB", 512 * 2**20), ("24GB", 24 * 10**9), ("1024", 1024),
    ("3 KiB", 3072), ("2kb", 2000),
])
def test_sizes(text, expected):
    assert parse_size(text, "k") == expected


def test_bandwidths():
    assert parse_bandwidth("24GB/s", "k") == 24e9
    assert parse_bandwidth("12GiB/s", "k") == 12 * 2**30


@pytest.mark.parametrize("old, new, message", [
    ('name = "t"', 'name = "t"\ncolour = 3', "colour: unknown key"),
    ("p2p = 0.5", "p2p = 0.5\nlatency = 1", "costs.latency: unknown key"),
    ("devices = 4", 'devices = "four"', "pipeline.devices: expected a positive integer"),
    ("devices = 4", "devices = 0", "pipeline.devices: must be greater than zero"),
    ("microbatches = 8", "microbatches = -2", "pipeline.microbatches: must be greater than zero"),
    ("forward = 20", "forward = -1", "costs.forward: must be greater than zero"),
    ("forward = 20", 'forward = "fast"', "costs.forward: expected a number of milliseconds"),
    ("forward = 20", "forward = [1, 2, 3]", "costs.forward: the list has 3 entries but the pipeline has 4 stages"),
    ('budget = "1GiB"', 'budget = "9 gigs"', 'memory.budget: expected a size like "9GiB"'),
    ('budget = "1GiB"', 'budget = "0GiB"', "memory.budget: must be greater than zero"),
    ('placement = "interleaved"', 'placement = "vshape"', '"vshape" needs chunks_per_device = 2'),
    ('placement = "interleaved"', 'placement = "zigzag"', "pipeline.placement: expected one of"),
    ('weight_activation = "100MiB"', 'weight_activation = "300MiB"', "memory.weight_activation: stage 0 keeps"),
    ('budget = "1GiB"', 'budget = "100MiB"', "memory.budget: 100MiB is below one stage's activation (200MiB)"),
    ('d2h_bandwidth = "24GB/s"\n', "", "offload.d2h_bandwidth: missing; offload is enabled"),
    ('d2h_bandwidth = "24GB/s"', 'd2h_bandwidth = "fast"', 'offload.d2h_bandwidth: expected a bandwidth like "24GB/s"'),
    ("[costs]", "[costs]\n[costs.x]", "costs.x: unknown key"),
    ("enabled = true", 'enabled = "yes"', "offload.enabled: expected true or false"),
])
def test_errors_name_the_key(old, new, message):
    with pytest.raises(ProblemError) as error:
        loads_problem(edited(old, new))
    assert message in str(error.value)


def test_missing_table_and_bad_toml():
    with pytest.raises(ProblemError, match=r"\[costs\]: missing table"):
        loads_problem(BASE.split("[costs]")[0])
    with pytest.raises(ProblemError, match="not valid TOML"):
        loads_problem("name = ")


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ProblemError, match="no such problem file"):
        load_problem(tmp_path / "nope.toml")


def test_per_stage_lists():
    problem = loads_problem(edited("forward = 20", "forward = [1, 2, 3, 4.5]"))
    assert problem.costs.forward == (1.0, 2.0, 3.0, 4.5)


def test_offload_disabled_needs_no_bandwidth():
    problem = loads_problem(BASE.split("[offload]")[0] + "[offload]\nenabled = false\n")
    assert not problem.offload.enabled


@pytest.mark.parametrize("path", INSTANCES, ids=lambda p: p.stem)
def test_round_trip(path):
    problem = load_problem(path)
    assert loads_problem(dumps_problem(problem)) == problem


def test_round_trip_of_per_stage_values():
    problem = loads_problem(edited("forward = 20", "forward = [1.25, 2, 3, 4.5]"))
    assert loads_problem(dumps_problem(problem)) == problem


def test_vshape_placement_maps_stages_to_a_v():
    problem = loads_problem(edited('placement = "interleaved"', 'placement = "vshape"').replace(
        "chunks_per_device = 1", "chunks_per_device = 2"))
    assert [problem.pipeline.device_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


@pytest.mark.parametrize("value, message", [
    (float("nan"), "finite"), (float("inf"), "finite"), ("1e400GiB", "finite"), ("inf", "expected a size"),
    (10**5000, "an integer of"), (2**61, "bytes is more than"), ("2EiB", "expected a size"),
    ("9" * 100, "expected a size"),
    (0.4, "greater than zero"), (-(10**5000), "greater than zero"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 20 else type(v).__name__)
def test_sizes_are_finite_and_sane(value, message):
    with pytest.raises(ProblemError, match=message) as error:
        parse_size(value, "memory.budget")
    assert str(error.value).startswith("memory.budget: ") and len(str(error.value)) < 200


def test_stages_on_matches_device_of():
    for text in (BASE, edited('placement = "interleaved"', 'placement = "vshape"').replace(
            "chunks_per_device = 1", "chunks_per_device = 2"), BASE.replace("chunks_per_device = 1",
                                                                            "chunks_per_device = 3")):
        pipe = loads_problem(text.replace('budget = "1GiB"', 'budget = "100GiB"')).pipeline
        for device in range(-1, pipe.devices + 1):
            assert pipe.stages_on(device) == tuple(s for s in range(pipe.stages) if pipe.device_of(s) == device)


def test_compute_ops_count_f_b_and_w_of_every_stage_and_microbatch():
    problem = uniform_problem(4, 8, v=2)  # 8 stages, two on each device
    assert problem.compute_ops == 3 * 8 * 8
    assert problem.compute_ops_per_device == 3 * 2 * 8
