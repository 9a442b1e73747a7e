"""How compile's warm-start phases share the time limit (solvers/starts.py)."""

from __future__ import annotations

import pytest

from optpipe.solvers.starts import _defer_reserve

from conftest import uniform_problem

WIDE = uniform_problem(12, 12, v=2, act=100, keep=50)  # W deferral pays from 12 devices on
NARROW = uniform_problem(4, 8, v=2, act=100, keep=50)


@pytest.mark.parametrize("simulate_s, reserve", [(0.001, 15.0), (0.1, 15.0), (0.4, 24.0), (2.0, 30.0)])
def test_w_deferral_keeps_a_quarter_or_sixty_simulations_up_to_half_the_limit(simulate_s, reserve):
    # grid24 (p = 32, m = 256): 0.46 s a simulation, about 50 rounds to the pass's end
    assert _defer_reserve(WIDE, 60.0, simulate_s) == pytest.approx(reserve)


def test_no_time_is_kept_where_compile_does_not_defer():
    assert _defer_reserve(NARROW, 60.0, 2.0) == 0.0
