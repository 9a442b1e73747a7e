"""The pace at which the devices before it can pass forwards on bounds a device's warm-up (pace.py)."""

from __future__ import annotations

import pytest

from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem, Recompute
from optpipe.solvers.bounds import data_paths, makespan_lower_bound, warm_up_pace
from optpipe.solvers.compile import compile_problem
from optpipe.solvers.fill import device_frees, memory_releases
from optpipe.solvers.pace import warm_up_pace_idle


def _pipeline(devices: int, microbatches: int, activation: tuple[int, ...], budget: int, bandwidth: float,
              forward: float = 1.0, keep: float = 0.5, placement: Placement = Placement.INTERLEAVED) -> Problem:
    """Two chunks a device, every op ``forward`` ms, offloads of 100 bytes taking 100 / bandwidth s."""
    stages = 2 * devices
    return Problem("pace", Pipeline(devices, 2, placement, microbatches),
                   Costs((forward,) * stages, (forward,) * stages, (forward,) * stages, 0.0),
                   Memory(activation, tuple(int(keep * a) for a in activation), budget),
                   Offload(True, bandwidth, bandwidth, 10**9), Recompute())


def _starved() -> Problem:
    """Device 0 holds two activations of 100 bytes and offloads one every 2 ms; device 1's are
    10 bytes, so its own budget never holds it back."""
    return _pipeline(2, 4, (100, 10, 100, 10), 200, 50e3)


def test_a_device_runs_its_forwards_no_faster_than_its_host_link_frees_room():
    """Device 0: forwards at 0 and 1 ms fill the budget; the third waits for the first offload
    (its forward's end at 1 ms, plus 2), the fourth for the second (5 ms), and its first backward
    comes no earlier than 5 ms (four forwards and B(3)). Busy 3 of those 5 ms."""
    assert warm_up_pace(_starved())[0] == pytest.approx(2.0)


def test_a_device_with_room_to_spare_still_waits_for_its_feeder():
    """Device 1 could hold every activation it gets, but each of its forwards follows one of
    device 0's by at least 1 ms: at 1, 2 and 4 ms, while its first backward can start at 4 ms.
    With room on device 0 as well, neither device idles."""
    problem = _starved()
    assert warm_up_pace(problem)[1] == pytest.approx(1.0)
    roomy = _pipeline(2, 4, (10, 10, 10, 10), 200, 50e3)
    assert warm_up_pace(roomy) == (0.0, 0.0)


def test_the_pace_raises_the_bound_and_stays_below_the_optimum():
    """Without the pace the analytic bound is 25 ms; with it 26; compile finds 27 ms and proves it
    optimal (with the whole model, in about a second)."""
    problem = _starved()
    bound = makespan_lower_bound(problem)
    assert bound.value == pytest.approx(26.0)
    compiled = compile_problem(problem, time_limit_s=20.0, seed=0)
    assert compiled.makespan_ms == pytest.approx(27.0)
    assert bound.value <= compiled.makespan_ms


def test_a_deeper_pipeline_bound_stays_below_its_proven_optimum():
    """p = 4, three activations a device, slow offloads: 82 ms, against 80 without the pace and
    84 proven optimal by compile (16 s on this machine, so not solved here)."""
    problem = _pipeline(4, 6, (100,) * 8, 300, 25e3, forward=2.0, keep=0.9)
    assert makespan_lower_bound(problem).value == pytest.approx(82.0)


def test_v_shape_devices_have_no_feeders_and_recompute_is_left_out():
    """In V placement a device's two stages take their forwards from the same stage of an earlier
    device, so no device feeds another one forward per forward; only the device's own pace counts."""
    v = _pipeline(2, 4, (100, 10, 10, 100), 200, 50e3, placement=Placement.VSHAPE)
    head = data_paths(v).head
    assert warm_up_pace_idle(v, head, device_frees(v, memory_releases(v, head))) == warm_up_pace(v)
    assert all(idle >= 0.0 for idle in warm_up_pace(v))
    recomputed = _starved()
    recomputed = Problem(recomputed.name, recomputed.pipeline, recomputed.costs, recomputed.memory,
                         recomputed.offload, Recompute(True, (1.0,) * 4, (10,) * 4))
    assert warm_up_pace(recomputed) == (0.0, 0.0)


def test_a_later_chunk_comes_with_an_earlier_one_so_mixes_are_averaged():
    """A microbatch's chunk-1 forward follows its chunk-0 forward on the device, so x forwards
    hold at least a prefix mix: with 100 then 60 bytes, 80 a forward on average (never 60 each);
    with 60 then 100, the first m can all be 60. Work is the mirror: 1 then 3 ms is at most 2 ms a
    forward on average, not 3."""
    from optpipe.solvers.pace import _envelope

    heavy_first = _envelope(4, [100.0, 60.0], upper=False)
    assert [heavy_first(x) for x in (1, 4, 8)] == pytest.approx([80.0, 320.0, 640.0])
    light_first = _envelope(4, [60.0, 100.0], upper=False)
    assert [light_first(x) for x in (1, 4, 6, 8)] == pytest.approx([60.0, 240.0, 440.0, 640.0])
    most = _envelope(4, [1.0, 3.0], upper=True)
    assert [most(x) for x in (1, 4, 8)] == pytest.approx([2.0, 8.0, 16.0])


def test_the_pace_can_meet_the_optimum(monkeypatch):
    """A random p = 3, m = 2 problem without offload: 33.0 ms without the pace, 34.5 with it, and
    CP-SAT proves 34.5 optimal without the pace under its model (without offload its in-order
    optimum is every schedule's)."""
    from optpipe.solvers import bounds
    from optpipe.solvers.cpsat import solve_cpsat
    from optpipe.solvers.result import SolveStatus

    problem = Problem("pace", Pipeline(3, 2, Placement.INTERLEAVED, 2),
                      Costs((2.0, 1.5, 3.0, 2.0, 3.0, 1.0), (1.0, 2.0, 1.0, 0.5, 2.0, 0.5),
                            (1.0, 3.0, 1.5, 0.5, 1.5, 1.0), 0.0),
                      Memory((60, 100, 80, 80, 80, 60), (30, 50, 8, 8, 8, 6), 240), Offload(), Recompute())
    assert makespan_lower_bound(problem).value == pytest.approx(34.5)
    monkeypatch.setattr(bounds, "warm_up_pace", lambda p: (0.0,) * p.devices)
    assert makespan_lower_bound(problem).value == pytest.approx(33.0)
    result = solve_cpsat(problem, time_limit_s=20.0, workers=1, seed=0)
    assert result.status is SolveStatus.OPTIMAL and result.makespan_ms == pytest.approx(34.5)
