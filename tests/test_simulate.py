"""The simulator: closed forms, memory semantics, and a precise error for each invalid schedule."""

from __future__ import annotations

import json

import pytest
from conftest import uniform_problem

from optpipe.core.errors import ScheduleError
from optpipe.core.idle import idle_phases
from optpipe.core.problem import Offload
from optpipe.core.schedule import Op, OpKind, Schedule, parse_op
from optpipe.core.simulate import op_times, simulate, try_simulate
from optpipe.solvers import generate

F, B, W, BW, OFF, REL = OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD
SHAPES = [(2, 2), (4, 8), (4, 4), (8, 16), (8, 32), (3, 7)]


@pytest.mark.parametrize("p, m", SHAPES)
@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
def test_closed_form_makespan_and_bubble(name, p, m):
    t = 2.0
    problem = uniform_problem(p, m, f=t, b=t, w=t)
    timeline = simulate(problem, generate(name, problem))
    assert timeline.makespan == pytest.approx((m + p - 1) * 3 * t)
    assert timeline.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m", SHAPES)
def test_closed_form_peaks(p, m):
    problem = uniform_problem(p, m, act=100, keep=50)
    one_f_one_b = simulate(problem, generate("1F1B", problem))
    gpipe = simulate(problem, generate("GPipe", problem))
    assert one_f_one_b.peak_memory[0] == min(p, m) * 100
    assert one_f_one_b.peak_memory == tuple(min(p - d, m) * 100 for d in range(p))
    assert gpipe.peak_memory[0] == m * 100


def test_p2p_adds_latency_across_devices_only():
    problem = uniform_problem(4, 8, p2p=0.5)
    gpipe = simulate(problem, generate("GPipe", problem))
    # GPipe's critical path crosses three device boundaries forward and three back, 0.5 ms each
    assert gpipe.makespan == pytest.approx((8 + 3) * 3 + 6 * 0.5)
    # 1F1B's steady state pays the latency on every round trip, so it cannot be faster
    assert simulate(problem, generate("1F1B", problem)).makespan >= gpipe.makespan


def _two_device(ops0, ops1, **kwargs) -> tuple:
    problem = uniform_problem(2, 1, **kwargs)
    return problem, Schedule.of("hand", [ops0, ops1])


def test_idle_splits_at_the_first_op_the_first_backward_and_the_last_op():
    # p = 2, m = 1, every op 1 ms: device 0 runs F [0, 1], B [3, 4], W [4, 5]; device 1 F [1, 2],
    # B [2, 3], W [3, 4]. Device 0 waits 2 ms for its backward (fill); device 1 starts 1 ms late
    # and ends 1 ms early.
    problem = uniform_problem(2, 1)
    schedule = Schedule.of("one", [[Op(F, 0, 0), Op(B, 0, 0), Op(W, 0, 0)], [Op(F, 1, 0), Op(B, 1, 0), Op(W, 1, 0)]])
    first, second = idle_phases(simulate(problem, schedule))
    assert (first.head, first.fill, first.steady, first.tail) == pytest.approx((0, 2, 0, 0))
    assert (second.head, second.fill, second.steady, second.tail) == pytest.approx((1, 0, 0, 1))


def test_split_backward_memory_frees_in_two_steps():
    problem, schedule = _two_device([Op(F, 0, 0), Op(B, 0, 0), Op(W, 0, 0)], [Op(F, 1, 0), Op(B, 1, 0), Op(W, 1, 0)],
                                    act=100, keep=30)
    timeline = simulate(problem, schedule)
    held = [bytes_ for _, bytes_ in timeline.memory[0]]
    assert held == [100, 30, 0]


def test_offload_frees_at_its_end_and_reload_holds_from_its_start():
    offload = Offload(True, d2h_bandwidth=100_000.0, h2d_bandwidth=100_000.0, host_budget=10**9)  # 1 ms per 100 B
    problem = uniform_problem(2, 1, act=100, keep=50, offload=offload)
    schedule = Schedule.of("hand", [
        [Op(F, 0, 0), Op(OFF, 0, 0), Op(REL, 0, 0), Op(BW, 0, 0)],
        [Op(F, 1, 0), Op(BW, 1, 0)],
    ])
    timeline = simulate(problem, schedule)
    by = timeline.by_op
    assert by[Op(OFF, 0, 0)].start == pytest.approx(1.0) and by[Op(OFF, 0, 0)].end == pytest.approx(2.0)
    assert by[Op(REL, 0, 0)].start == pytest.approx(2.0)
    assert by[Op(BW, 0, 0)].start == pytest.approx(4.0)  # B(1) ends at 4, reload at 3
    assert timeline.memory[0] == ((0.0, 100), (2.0, 100), (6.0, 0))  # freed and reloaded at the same instant
    assert timeline.host_peak[0] == 100


def test_op_times_are_the_timelines_times():
    """The timing-only pass (for passes that drop transfers round by round) and the simulator agree."""
    offload = Offload(True, d2h_bandwidth=100_000.0, h2d_bandwidth=100_000.0, host_budget=10**9)
    problem = uniform_problem(2, 1, act=100, keep=50, offload=offload)
    schedule = Schedule.of("hand", [
        [Op(F, 0, 0), Op(OFF, 0, 0), Op(REL, 0, 0), Op(BW, 0, 0)],
        [Op(F, 1, 0), Op(BW, 1, 0)],
    ])
    assert op_times(problem, schedule) == [(t.op, t.device, t.start, t.end) for t in simulate(problem, schedule).timings]


def test_problems_with_other_costs_are_timed_by_their_own_rules():
    """The simulator keeps each problem's op rules between calls; a problem that differs only in
    its costs must not be timed by another's."""
    schedule = generate("1F1B", uniform_problem(2, 2, f=1, b=1, w=1))
    fast = simulate(uniform_problem(2, 2, f=1, b=1, w=1), schedule)
    slow = simulate(uniform_problem(2, 2, f=2, b=2, w=2), schedule)
    assert slow.makespan == pytest.approx(2 * fast.makespan)


def test_reload_waits_for_the_compute_listed_before_it():
    offload = Offload(True, d2h_bandwidth=1e9, h2d_bandwidth=1e9, host_budget=10**9)
    problem = uniform_problem(1, 2, act=100, keep=50, offload=offload, f=1, b=1, w=1)
    schedule = Schedule.of("hand", [[Op(F, 0, 0), Op(OFF, 0, 0), Op(F, 0, 1), Op(BW, 0, 1), Op(REL, 0, 0), Op(BW, 0, 0)]])
    timeline = simulate(problem, schedule)
    assert timeline.by_op[Op(REL, 0, 0)].start == pytest.approx(4.0)  # after BW(0,1) ends


BROKEN = [
    ("missing op", [[Op(F, 0, 0)], [Op(F, 1, 0), Op(BW, 1, 0)]], "missing op B0:0"),
    ("missing W", [[Op(F, 0, 0), Op(B, 0, 0)], [Op(F, 1, 0), Op(BW, 1, 0)]], "missing op W0:0"),
    ("duplicate", [[Op(F, 0, 0), Op(F, 0, 0), Op(BW, 0, 0)], [Op(F, 1, 0), Op(BW, 1, 0)]], "duplicate op F0:0"),
    ("wrong device", [[Op(F, 0, 0), Op(BW, 0, 0), Op(F, 1, 0)], [Op(BW, 1, 0)]], "F1:0 is on the wrong device"),
    ("split and fused", [[Op(F, 0, 0), Op(BW, 0, 0), Op(W, 0, 0)], [Op(F, 1, 0), Op(BW, 1, 0)]], "use one or the other"),
    ("cycle", [[Op(BW, 0, 0), Op(F, 0, 0)], [Op(F, 1, 0), Op(BW, 1, 0)]], "dependency cycle"),
    ("bad stage", [[Op(F, 0, 0), Op(BW, 0, 0), Op(F, 9, 0)], [Op(F, 1, 0), Op(BW, 1, 0)]], "names stage 9"),
    ("bad microbatch", [[Op(F, 0, 0), Op(BW, 0, 0), Op(F, 0, 3)], [Op(F, 1, 0), Op(BW, 1, 0)]], "names microbatch 3"),
]


@pytest.mark.parametrize("label, devices, message", BROKEN, ids=[b[0] for b in BROKEN])
def test_invalid_schedules(label, devices, message):
    problem = uniform_problem(2, 1)
    with pytest.raises(ScheduleError, match=message):
        simulate(problem, Schedule.of("broken", devices))


@pytest.mark.parametrize("enabled", [True, False])
def test_the_cycle_collector_is_left_as_it_was_after_a_simulation_that_fails_or_not(enabled):
    import gc

    problem = uniform_problem(2, 1)
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        simulate(problem, generate("1F1B", problem))
        assert gc.isenabled() is enabled
        assert try_simulate(problem, Schedule.of("broken", BROKEN[0][1])) is None
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_cycle_names_the_ops_that_wait_on_each_other():
    problem = uniform_problem(2, 2)
    schedule = Schedule.of("crossed", [
        [Op(F, 0, 0), Op(BW, 0, 1), Op(F, 0, 1), Op(BW, 0, 0)],
        [Op(F, 1, 0), Op(BW, 1, 0), Op(F, 1, 1), Op(BW, 1, 1)],
    ])
    with pytest.raises(ScheduleError) as error:
        simulate(problem, schedule)
    text = str(error.value)
    assert "BW0:1 (device 0)" in text and "F0:1 (device 0)" in text and "F1:1 (device 1)" in text


OFFLOAD = Offload(True, 1e9, 1e9, 10**12)
TRANSFER_BROKEN = [
    ("reload without offload", [Op(F, 0, 0), Op(REL, 0, 0), Op(BW, 0, 0)], "REL0:0 without OFF0:0"),
    ("offload without reload", [Op(F, 0, 0), Op(OFF, 0, 0), Op(BW, 0, 0)], "OFF0:0 without REL0:0"),
    ("offload before its F", [Op(OFF, 0, 0), Op(F, 0, 0), Op(REL, 0, 0), Op(BW, 0, 0)], "listed before its F0:0"),
    ("B before its reload", [Op(F, 0, 0), Op(OFF, 0, 0), Op(BW, 0, 0), Op(REL, 0, 0)], "BW0:0 is listed before its REL0:0"),
]


@pytest.mark.parametrize("label, ops0, message", TRANSFER_BROKEN, ids=[b[0] for b in TRANSFER_BROKEN])
def test_invalid_transfers(label, ops0, message):
    problem = uniform_problem(2, 1, offload=OFFLOAD)
    with pytest.raises(ScheduleError, match=message):
        simulate(problem, Schedule.of("broken", [ops0, [Op(F, 1, 0), Op(BW, 1, 0)]]))


# One device, two microbatches, broken so that the simulator's bulk counts balance (as many B as
# W, B and BW one per pair, as many REL as OFF): the per-pair checks still name the first pair's error.
BALANCED_BROKEN = [
    ("B and BW here, W alone there", [Op(F, 0, 0), Op(B, 0, 0), Op(BW, 0, 0), Op(F, 0, 1), Op(W, 0, 1)],
     "BW0:0 and a split B/W of the same stage and microbatch"),
    ("OFF here, REL there", [Op(F, 0, 0), Op(OFF, 0, 0), Op(F, 0, 1), Op(REL, 0, 1), Op(BW, 0, 0), Op(BW, 0, 1)],
     "OFF0:0 without REL0:0"),
    ("both pairs misordered, the first named", [Op(OFF, 0, 1), Op(F, 0, 0), Op(OFF, 0, 0), Op(F, 0, 1), Op(BW, 0, 0),
                                                Op(REL, 0, 0), Op(REL, 0, 1), Op(BW, 0, 1)],
     "device 0 position 5: BW0:0 is listed before its REL0:0"),
]


@pytest.mark.parametrize("label, ops, message", BALANCED_BROKEN, ids=[b[0] for b in BALANCED_BROKEN])
def test_broken_pairs_are_named_in_order(label, ops, message):
    problem = uniform_problem(1, 2, offload=OFFLOAD)
    with pytest.raises(ScheduleError, match=message):
        simulate(problem, Schedule.of("broken", [ops]))


def test_offload_needs_offload_enabled():
    problem = uniform_problem(2, 1)
    schedule = Schedule.of("x", [[Op(F, 0, 0), Op(OFF, 0, 0), Op(REL, 0, 0), Op(BW, 0, 0)], [Op(F, 1, 0), Op(BW, 1, 0)]])
    with pytest.raises(ScheduleError, match="offload is not enabled"):
        simulate(problem, schedule)


def test_wrong_number_of_devices():
    with pytest.raises(ScheduleError, match="has 1 devices but the problem has 2"):
        simulate(uniform_problem(2, 1), Schedule.of("x", [[Op(F, 0, 0)]]))


def test_schedule_json_and_text_round_trip(tmp_path):
    from optpipe.core.schedule import dump_schedule, load_schedule

    problem = uniform_problem(4, 8)
    schedule = generate("1F1B", problem)
    path = tmp_path / "s.json"
    dump_schedule(schedule, path)
    assert load_schedule(path) == schedule
    assert Schedule.from_text(schedule.name, schedule.to_text()) == schedule
    assert json.loads(path.read_text())["devices"][0][0] == "F0:0"


@pytest.mark.parametrize("text", ["F0:0", "BW12:3", "OFF1:2", "REL0:7", "W3:0", "B0:0"])
def test_op_text_round_trip(text):
    assert str(parse_op(text)) == text


@pytest.mark.parametrize("bad", ["X1:2", "F1", "F-1:0", "F1:2:3", ""])
def test_op_text_errors(bad):
    with pytest.raises(ScheduleError, match="cannot parse op"):
        parse_op(bad)


def test_bad_schedule_json(tmp_path):
    from optpipe.core.schedule import load_schedule

    path = tmp_path / "bad.json"
    path.write_text('{"format": "optpipe-schedule", "version": 1, "name": "x", "devices": [["F0:0", "Q"]]}')
    with pytest.raises(ScheduleError, match=r"devices\[0\]: cannot parse op 'Q'"):
        load_schedule(path)
    path.write_text("{not json")
    with pytest.raises(ScheduleError, match="not valid JSON"):
        load_schedule(path)


@pytest.mark.parametrize("name", ["1F1B", "PO-H", "ZB-H1"])
def test_a_bar_to_beat_gives_the_same_timeline_or_none(name):
    problem = uniform_problem(4, 8, act=100, keep=50, offload=Offload(True, 1e5, 1e5, 10**9))
    schedule = generate(name, problem)
    timeline = simulate(problem, schedule)
    assert try_simulate(problem, schedule, timeline.makespan + 1e-6) == timeline
    assert try_simulate(problem, schedule, timeline.makespan) is None
    cycle = Schedule(schedule.name, (tuple(reversed(schedule.devices[0])),) + schedule.devices[1:])
    assert try_simulate(problem, cycle, float("inf")) is None
