"""ZB-I and DualPipeV (the schedules PyTorch names ScheduleInterleavedZeroBubble and ScheduleDualPipeV):
shape rules, memory, and what they gain over their neighbours. Order equality with PyTorch's own
lists is in test_torch_csv.py; training with them in test_runtime_gloo.py."""

from __future__ import annotations

import pytest
from conftest import uniform_problem

from optpipe.core.errors import NotApplicable
from optpipe.core.problem import Placement
from optpipe.core.simulate import simulate
from optpipe.solvers.registry import generate


@pytest.mark.parametrize("p, v, m", [(4, 2, 8), (4, 3, 12), (8, 2, 16), (8, 2, 32)])
def test_zb_i_holds_fewer_activations_and_is_faster_than_interleaved_1f1b(p, v, m):
    problem = uniform_problem(p, m, v=v)
    zb, fused = simulate(problem, generate("ZB-I", problem)), simulate(problem, generate("1F1B-I", problem))
    assert zb.peak_memory[0] == ((v - 1) * p + p) * 100  # (v-1)g + p stage activations, g = p here
    assert zb.makespan < fused.makespan


def test_zb_i_uses_real_costs_without_passing_its_peak():
    problem = uniform_problem(8, 16, v=2, f=12, b=16, w=8, p2p=2)
    plain = uniform_problem(8, 16, v=2)
    assert simulate(problem, generate("ZB-I", problem)).peak <= simulate(plain, generate("ZB-I", plain)).peak


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (8, 16)])
def test_dualpipe_v_peak_and_speed_next_to_zbv(p, m):
    problem = uniform_problem(p, m, v=2, placement=Placement.VSHAPE)
    dual, zbv = simulate(problem, generate("DualPipeV", problem)), simulate(problem, generate("ZBV", problem))
    assert dual.peak_memory[0] == (2 * p + 1) * 100  # one chunk activation more than ZBV's 2p
    assert dual.makespan == zbv.makespan  # without overlap the pairs cost what ZBV's passes cost


@pytest.mark.parametrize("name, problem, reason", [
    ("ZB-I", uniform_problem(4, 8), "v >= 2"),
    ("ZB-I", uniform_problem(4, 8, v=2, placement=Placement.VSHAPE), 'placement = "interleaved"'),
    ("ZB-I", uniform_problem(4, 9, v=2), "equal rounds"),
    ("DualPipeV", uniform_problem(4, 8, v=2), '"vshape"'),
    ("DualPipeV", uniform_problem(4, 7, v=2, placement=Placement.VSHAPE), "at least 2p = 8 microbatches"),
])
def test_not_applicable_says_why(name, problem, reason):
    with pytest.raises(NotApplicable, match=reason):
        generate(name, problem)
