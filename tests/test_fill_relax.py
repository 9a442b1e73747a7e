"""Each device's ends solved with the devices that feed it (solvers/fill_relax.py): above the
devices solved alone where a feeder's budget and host link bind. That it is never above an
optimum or a fitting schedule is tested with the ends alone (test_ends_relax.py) and in
test_bound_proofs.py (issue 11)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from optpipe.core.problem import Recompute
from optpipe.solvers.bounds import Bound, data_paths
from optpipe.solvers.compare import compare
from optpipe.solvers.compile import compile_problem
from optpipe.solvers.ends_relax import end_idle, ends_bound
from optpipe.solvers.phases import phase_idle
from optpipe.solvers.fill_relax import fed_applies, fed_bound, fed_cool_down_idle, fed_warm_up_idle

from benchmarks.problem_grid import generated

_EPS = 1e-6
_NONE = Bound(0.0, "none")


def _fed_by_device0():
    """p = 3, v = 2, m = 6, 0.2 of 1F1B-I's activations, k = 3: device 0 has room for few
    forwards and offloads them slowly, so devices 1 and 2 wait for theirs."""
    return generated(300, 3, 2, 6, 0.2, 3.0, seed=1)


def test_a_slow_feeder_raises_the_bound_above_each_device_alone():
    problem = _fed_by_device0()
    alone = ends_bound(problem, floor=_NONE, time_limit_s=4.0, workers=1)
    fed = fed_bound(problem, floor=alone, time_limit_s=4.0, workers=1)
    assert alone.value == pytest.approx(486.62, abs=0.01)
    assert fed.value == pytest.approx(493.28, abs=0.01)
    assert "devices that feed it, solved together at its ends" in fed.reason
    fitting = [e.judged.timeline.makespan for e in compare(problem) if e.judged is not None and e.fits]
    assert fed.value <= min(fitting) + _EPS


def test_with_feeders_the_ends_prove_at_least_what_each_device_alone_proves():
    """The model alone is the fed model without its feeders: where both are proved, no less, up
    to the rounding of their grids (each 1/4000 of its window, the fed one's from time 0)."""
    problem = generated(301, 4, 2, 8, 0.3, 1.6, seed=0)
    paths = data_paths(problem)
    jobs: dict = {}
    for device in range(problem.devices):
        alone = end_idle(problem, device, paths, time_limit_s=4.0, workers=1)
        warm_up, warm_proved = fed_warm_up_idle(problem, device, paths, time_limit_s=2.0, jobs=jobs, workers=1)
        cool_down, cool_proved = fed_cool_down_idle(problem, device, paths, time_limit_s=2.0, jobs=jobs, workers=1)
        units = 4 * phase_idle(problem, device, paths.head, paths.tail).value / 4000
        if alone.proved and warm_proved and cool_proved:
            assert warm_up >= alone.warm_up - units and cool_down >= alone.cool_down - units


def test_compile_reports_the_bound():
    compiled = compile_problem(_fed_by_device0(), time_limit_s=6.0, workers=2)
    assert compiled.lower_bound_ms >= 493.2
    assert compiled.lower_bound_ms <= compiled.makespan_ms + _EPS


def test_left_to_the_other_bounds_with_recompute_or_many_devices():
    problem = _fed_by_device0()
    recomputing = replace(problem, recompute=Recompute(True, (1.0,) * problem.stages, (20,) * problem.stages))
    assert fed_applies(problem) and not fed_applies(recomputing)
    assert fed_bound(recomputing, floor=_NONE, time_limit_s=1.0) is _NONE
    wide = generated(300, 12, 2, 24, 0.3, 1.6, seed=0)
    assert not fed_applies(wide) and fed_bound(wide, floor=_NONE, time_limit_s=1.0) is _NONE
