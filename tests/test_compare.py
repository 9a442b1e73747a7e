"""compare under a deadline (compile's share of its time limit): cheap generators first, the
costly ones left out once the deadline has passed, but never the only schedule that fits."""

from __future__ import annotations

import time

from optpipe.core.problem import Offload
from optpipe.core.schedule import Op, Schedule
from optpipe.solvers.compare import compare
from optpipe.core.simulate import simulate
from optpipe.solvers.heuristics._deadline import building_until, out_of_time, variants_pay
from optpipe.solvers.heuristics._greedy import cost_aware
from optpipe.solvers.heuristics.zero_bubble import zb_h1_order
from optpipe.solvers.registry import generators

from conftest import uniform_problem

# v = 1, uneven costs (so cost_aware tries its variants) and room for 1F1B: most generators fit.
ROOMY = uniform_problem(4, 8, f=1.0, b=1.3, w=0.7, p2p=0.1, budget=100 * 8)
# Only one activation fits per device: none of the generators fits but the capped list schedule.
ONE_SLOT = uniform_problem(4, 8, f=1.0, b=1.3, w=0.7, p2p=0.1, budget=150)
_PAST = -1.0


def _by_name(entries):
    return {e.name: e for e in entries}


def test_without_a_deadline_every_generator_is_built():
    entries = compare(ROOMY)
    assert {e.name for e in entries} == {g.name for g in generators()}
    assert not any(e.reason.startswith("not built") for e in entries)


def test_past_the_deadline_the_costly_generators_are_left_out_once_one_fits():
    seen = []
    entries = compare(ROOMY, deadline=time.monotonic() + _PAST, on_built=lambda e, k, n: seen.append((e.name, k, n)))
    by_name = _by_name(entries)
    assert {e.name for e in entries} == {g.name for g in generators()}
    # the first generator is always built; once one fits, no generator is started any more
    order = [name for name, _, _ in seen]
    first_fit = next(k for k, name in enumerate(order) if by_name[name].fits)
    assert all(by_name[name].reason.startswith("not built") for name in order[first_fit + 1:])
    assert all(not by_name[name].reason.startswith("not built") for name in order[:first_fit + 1])
    # cheapest first, and the progress counts every generator once
    efforts = {g.name: (g.effort, g.fallback) for g in generators()}
    assert [efforts[name] for name in order] == sorted(efforts[name] for name in order)
    assert [k for _, k, _ in seen] == list(range(1, len(order) + 1)) and {n for _, _, n in seen} == {len(order)}
    left_out = by_name[order[-1]]
    assert left_out.judged is None and "--time-limit" in left_out.reason


def test_the_deadline_never_costs_the_only_schedule_that_fits():
    fitting = [e.name for e in compare(ONE_SLOT) if e.fits]
    assert fitting == ["1F1B-capped"]
    cut = _by_name(compare(ONE_SLOT, deadline=time.monotonic() + _PAST))
    assert cut["1F1B-capped"].fits
    assert [name for name, e in cut.items() if e.fits] == ["1F1B-capped"]


def test_variant_searches_stop_at_the_deadline():
    pipe = ROOMY.pipeline
    closed = Schedule.of("ZB-H1", [[Op(kind, d, i) for kind, i in zb_h1_order(pipe.devices, pipe.microbatches, d)]
                                   for d in range(pipe.devices)])
    assert not out_of_time()
    with building_until(time.monotonic() + _PAST):
        assert out_of_time()
        assert cost_aware(ROOMY, closed) is closed  # no variant tried: the order as written down
    assert not out_of_time()  # the deadline holds only inside
    with building_until(None):
        assert not out_of_time()


def test_orders_past_the_peak_cap_get_no_variants():
    """Variants keep their order's peak: past compile's cap (the farthest tier repairs prefer)
    they could not become a start, so none is built; the cap holds only inside."""
    from benchmarks.problem_grid import grid
    from optpipe.solvers.heuristics.interleaved_zb import _device_order

    problem = grid(0, True)[1]  # p = 4, v = 2, m = 16, uneven costs: ZB-I's variants reorder it
    pipe = problem.pipeline
    written = Schedule.of("ZB-I", [_device_order(pipe.devices, pipe.chunks_per_device, pipe.microbatches, d)
                                   for d in range(pipe.devices)])
    peak = simulate(problem, written).peak
    assert cost_aware(problem, written) is not written
    with building_until(None, peak_cap=peak - 1):
        assert not variants_pay(peak) and cost_aware(problem, written) is written
    with building_until(None, peak_cap=peak):
        assert cost_aware(problem, written) is not written
    assert variants_pay(peak)
    built = _by_name(compare(problem, ["ZB-I"], peak_cap=peak - 1))["ZB-I"].judged.schedule
    assert built.devices == written.devices


def test_an_offload_problem_keeps_its_fitting_entries_sorted_first():
    link = Offload(True, 100 / 1.5 * 1e3, 100 / 1.5 * 1e3, 10**9)
    problem = uniform_problem(4, 8, v=2, f=1.0, b=1.2, w=0.8, budget=500, offload=link)
    entries = compare(problem, deadline=time.monotonic() + _PAST)
    fits = [e.fits for e in entries]
    assert fits == sorted(fits, reverse=True) and fits[0]


def test_compile_reports_each_heuristic_as_it_is_built():
    from optpipe.solvers.compile import compile_problem

    messages = []
    compile_problem(ROOMY, time_limit_s=0.5, workers=2, on_progress=lambda p: messages.append(p.message))
    built = [m for m in messages if m.startswith("heuristics: ")]
    n = len(generators())
    assert len(built) == n and built[-1].endswith(f"({n} of {n})")
    assert messages.index(built[-1]) < min(k for k, m in enumerate(messages) if m.startswith("warm start"))
