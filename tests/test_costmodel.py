"""The cost model against values computed by hand from the formulas in its docstring."""

from __future__ import annotations

import pytest

from optpipe.core.errors import ProblemError
from optpipe.core.problem_file import loads_problem

MODEL = """
name = "gpt"
[pipeline]
devices = 4
chunks_per_device = 1
microbatches = 8
[model]
layers = 8
hidden = 1024
heads = 16
seq_len = 2048
micro_batch_size = 2
vocab = 32000
[hardware]
tflops = 100
mfu = 0.5
memory = "80GiB"
pcie_bandwidth = "20GB/s"
p2p_bandwidth = "50GB/s"
reserve = "2GiB"
[offload]
enabled = true
"""


def test_hand_computed_stage_costs():
    problem = loads_problem(MODEL)
    s, b, h, a, V = 2048, 2, 1024, 16, 32000
    rate = 100e12 * 0.5 / 1e3  # FLOPs per ms
    layer_f = 24 * b * s * h * h + 4 * b * s * s * h
    # two layers per stage; the last stage adds the output layer
    assert problem.costs.forward[0] == pytest.approx(2 * layer_f / rate, rel=1e-6)
    assert problem.costs.forward[3] == pytest.approx((2 * layer_f + 2 * b * s * h * V) / rate, rel=1e-6)
    assert problem.costs.backward_input[1] == pytest.approx(2 * (24 * b * s * h * h + 8 * b * s * s * h) / rate, rel=1e-6)
    assert problem.costs.backward_weight[1] == pytest.approx(2 * 24 * b * s * h * h / rate, rel=1e-6)
    assert problem.costs.p2p == pytest.approx(2 * s * b * h / 50e9 * 1e3, rel=1e-6)
    assert problem.memory.activation[0] == 2 * s * b * (34 * h + 5 * a * s)
    assert problem.memory.weight_activation[0] == 2 * 32 * s * b * h
    assert problem.memory.activation[3] == 2 * s * b * (34 * h + 5 * a * s) + 2 * s * b * h + 4 * s * b * V
    # budget: 80GiB - 16 bytes/param on the busiest device (the first: embeddings) - reserve
    params0 = 2 * (12 * h * h + 13 * h) + V * h + s * h
    assert problem.memory.budget == 80 * 2**30 - 16 * params0 - 2 * 2**30
    assert problem.offload.d2h_bandwidth == 20e9


def test_preset_and_budget_override():
    text = MODEL.replace("tflops = 100\nmfu = 0.5\nmemory = \"80GiB\"\npcie_bandwidth = \"20GB/s\"\n"
                         "p2p_bandwidth = \"50GB/s\"\nreserve = \"2GiB\"\n", 'preset = "H100-80GB"\n')
    text += '[memory]\nbudget = "20GiB"\n'
    problem = loads_problem(text)
    assert problem.memory.budget == 20 * 2**30
    assert problem.offload.d2h_bandwidth == 50e9


@pytest.mark.parametrize("old, new, message", [
    ("tflops = 100", 'preset = "TPU"', "hardware.preset: unknown preset 'TPU'"),
    ("layers = 8", "layers = 2", "model.layers: 2 layers cannot fill 4 stages"),
    ("heads = 16", "heads = 7", "model.heads: 7 does not divide"),
    ("mfu = 0.5", "mfu = 3", "hardware.mfu"),
    ("vocab = 32000", "vocab = 32000\ndepth = 3", "model.depth: unknown key"),
])
def test_cost_model_errors(old, new, message):
    with pytest.raises(ProblemError, match=message.replace("(", r"\(")):
        loads_problem(MODEL.replace(old, new))


def test_costs_and_model_together_is_an_error():
    with pytest.raises(ProblemError, match="either"):
        loads_problem(MODEL + "[costs]\nforward = 1\n")


def test_builtin_default_problem_loads():
    from optpipe.core.problem_file import default_problem

    problem = default_problem()
    assert problem.devices == 8 and problem.offload.enabled
