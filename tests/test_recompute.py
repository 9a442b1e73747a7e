"""Recomputation (issue 14): the [recompute] table, the RECOMPUTE op, and schedules that use it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import uniform_problem
from optpipe.core.errors import NotApplicable, ProblemError, ScheduleError
from optpipe.core.problem import Offload, Recompute
from optpipe.core.problem_file import dumps_problem, loads_problem
from optpipe.core.schedule import Op, OpKind, Schedule, parse_op
from optpipe.core.simulate import simulate
from optpipe.solvers.registry import generate
from optpipe.solvers.result import SolveStatus

F, B, W, BW, OFF, REL, RC = (OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD,
                             OpKind.RECOMPUTE)

_BASE = """
name = "rc"
[pipeline]
devices = 2
microbatches = 4
[costs]
forward = 2
backward_input = 2
backward_weight = 1
[memory]
activation = 100
weight_activation = 40
budget = 1000
"""


def test_full_and_selective_recompute_load_and_round_trip():
    full = loads_problem(_BASE + '[recompute]\ntime = 0.5\nresident = 10\n')
    assert full.recompute == Recompute(True, (1.0, 1.0), (10, 10))
    assert loads_problem(dumps_problem(full)) == full
    selective = loads_problem(_BASE + '[recompute]\nmode = "selective"\nselective_time = 0.25\nselective_memory = 0.6\n')
    assert selective.recompute == Recompute(True, (0.5, 0.5), (40, 40))
    assert loads_problem(_BASE).recompute == Recompute()
    assert "[recompute]" not in dumps_problem(loads_problem(_BASE))  # plan hashes of old problems stay


@pytest.mark.parametrize("table, message", [
    ('resident = 200\n', "more than its activation"),
    ('time = -1\n', "expected a fraction"),
    ('time = inf\n', "expected a fraction from 0 to 10, got inf"),
    ('time = ' + '9' * 300 + '\n', "got an integer of"),  # was an OverflowError traceback
    ('mode = ' + '9' * 300 + '\n', "got an integer of"),
    ('enabled = ' + '9' * 300 + '\n', "recompute.enabled: expected true or false, got an integer of"),
    ('time = 1\ntime_ms = 2\n', "give one"),
    ('mode = "partial"\n', 'expected "full" or "selective"'),
    ('mode = "selective"\nselective_time = 0.2\n', "needs both"),
    ('selective_memory = 0.2\n', 'only for mode = "selective"'),
    ('colour = 1\n', "unknown key"),
])
def test_bad_recompute_tables_say_what_is_wrong(table, message):
    with pytest.raises(ProblemError, match=message):
        loads_problem(_BASE + "[recompute]\n" + table)


def _problem(resident=10, time_ms=2.0, **kw):
    problem = uniform_problem(2, 2, act=100, keep=40, f=2, b=2, w=1, **kw)
    return replace(problem, recompute=Recompute(True, (time_ms,) * 2, (resident,) * 2))


def test_parse_and_print_a_recompute_op():
    assert parse_op("RC3:1") == Op(RC, 3, 1) and str(Op(RC, 3, 1)) == "RC3:1"


def test_recompute_holds_only_the_resident_bytes_between_f_and_the_recompute():
    problem = _problem()
    schedule = Schedule.of("hand", [
        [Op(F, 0, 0), Op(F, 0, 1), Op(RC, 0, 0), Op(B, 0, 0), Op(W, 0, 0), Op(RC, 0, 1), Op(B, 0, 1), Op(W, 0, 1)],
        [Op(F, 1, 0), Op(B, 1, 0), Op(W, 1, 0), Op(F, 1, 1), Op(B, 1, 1), Op(W, 1, 1)],
    ])
    timeline = simulate(problem, schedule)
    by = timeline.by_op
    # F0:0 0..2, F0:1 2..4; device 1: F1:0 2..4, B1:0 4..6; RC0:0 4..6, B0:0 waits for B1:0: 6..8.
    assert by[Op(RC, 0, 0)].start == pytest.approx(4.0) and by[Op(B, 0, 0)].start == pytest.approx(6.0)
    curve = dict(timeline.memory[0])
    assert curve[0.0] == 100  # F0:0 holds the whole activation while it runs
    assert curve[2.0] == 110  # F0:0 keeps 10; F0:1 holds 100
    assert curve[4.0] == 110  # F0:1 keeps 10; RC0:0 takes the other 90 again
    assert curve[8.0] == 10 + 40  # B0:0 frees all but weight_activation
    assert timeline.peak_memory[0] == 110
    assert timeline.busy[0] == pytest.approx(2 * (2 + 2 + 2 + 1))  # the recompute is compute


def test_fused_backward_with_recompute():
    problem = _problem(resident=0)
    schedule = Schedule.of("hand", [
        [Op(F, 0, 0), Op(F, 0, 1), Op(RC, 0, 0), Op(BW, 0, 0), Op(RC, 0, 1), Op(BW, 0, 1)],
        [Op(F, 1, 0), Op(BW, 1, 0), Op(F, 1, 1), Op(BW, 1, 1)],
    ])
    timeline = simulate(problem, schedule)
    assert timeline.peak_memory[0] == 100
    assert timeline.memory[0][-1][1] == 0


@pytest.mark.parametrize("rows, message", [
    ([[Op(RC, 0, 0), Op(F, 0, 0), Op(BW, 0, 0)], [Op(F, 1, 0), Op(BW, 1, 0)]], "comes after F"),
    ([[Op(F, 0, 0), Op(BW, 0, 0), Op(RC, 0, 0)], [Op(F, 1, 0), Op(BW, 1, 0)]], "must come before the backward"),
])
def test_misplaced_recompute_is_refused(rows, message):
    problem = replace(_problem(), pipeline=replace(_problem().pipeline, microbatches=1))
    with pytest.raises(ScheduleError, match=message):
        simulate(problem, Schedule.of("bad", rows))


def test_recompute_needs_the_table_and_excludes_offload():
    problem = uniform_problem(2, 1, offload=Offload(True, 1e5, 1e5, 10**9))
    rows = [[Op(F, 0, 0), Op(RC, 0, 0), Op(BW, 0, 0)], [Op(F, 1, 0), Op(BW, 1, 0)]]
    with pytest.raises(ScheduleError, match="recompute is not enabled"):
        simulate(problem, Schedule.of("x", rows))
    problem = replace(problem, recompute=Recompute(True, (1.0, 1.0), (0, 0)))
    rows = [[Op(F, 0, 0), Op(OFF, 0, 0), Op(REL, 0, 0), Op(RC, 0, 0), Op(BW, 0, 0)], [Op(F, 1, 0), Op(BW, 1, 0)]]
    with pytest.raises(ScheduleError, match="kept, offloaded or recomputed"):
        simulate(problem, Schedule.of("x", rows))


def test_capped_recompute_fits_where_capped_cannot_run_deep():
    problem = replace(uniform_problem(4, 8, act=100, keep=50, budget=150, f=1, b=1, w=1),
                      recompute=Recompute(True, (1.0,) * 4, (10,) * 4))
    capped = simulate(problem, generate("1F1B-capped", problem))
    recomputed = simulate(problem, generate("1F1B-capped-RC", problem))
    assert capped.fits and recomputed.fits
    assert recomputed.makespan < capped.makespan  # 5 microbatches in flight instead of 1
    assert generate("1F1B-capped-RC", problem).recomputed


def test_recompute_schedules_need_the_table():
    problem = uniform_problem(4, 8)
    with pytest.raises(NotApplicable, match="recompute is not enabled"):
        generate("1F1B-capped-RC", problem)


def test_po_h_recompute_recomputes_what_the_link_cannot_hide():
    slow = Offload(True, 100 / 8e-3, 100 / 8e-3, 10**9)  # k = 8: a round trip takes 16 ms, F + B = 2
    problem = replace(uniform_problem(4, 8, v=2, act=100, keep=50, budget=10**6, offload=slow),
                      recompute=Recompute(True, (1.0,) * 8, (10,) * 8))
    po_h = simulate(problem, generate("PO-H", problem))
    mixed_schedule = generate("PO-H-RC", problem)
    mixed = simulate(problem, mixed_schedule)
    assert mixed_schedule.recomputed
    assert mixed.peak <= po_h.peak and sum(mixed.peak_memory) < sum(po_h.peak_memory)


# ------------------------------------------------------------------ plans


def _capped_rc_problem():
    return replace(uniform_problem(4, 8, act=100, keep=50, budget=150, f=1, b=1, w=1),
                   recompute=Recompute(True, (1.0,) * 4, (10,) * 4))


def test_a_recompute_plan_lowers_encodes_as_format_2_and_verifies():
    from optpipe.plan.bytecode import decode, encode
    from optpipe.plan.disasm import disassemble
    from optpipe.plan.lower import lower, raise_schedule
    from optpipe.plan.program import Opcode
    from optpipe.plan.verify import verify

    problem = _capped_rc_problem()
    schedule = generate("1F1B-capped-RC", problem)
    program = lower(problem, schedule)
    data = encode(program)
    assert int.from_bytes(data[8:10], "little") == 2
    assert decode(data) == program
    assert raise_schedule(program) == schedule
    verify(program)
    assert "RECOMPUTE" in disassemble(program)
    plain = lower(problem, generate("1F1B-capped", problem))
    assert int.from_bytes(encode(plain)[8:10], "little") == 1  # older readers still read plans without it
    assert not any(ins.opcode is Opcode.RECOMPUTE for stream in plain.ranks for ins in stream)


def test_a_recompute_opcode_in_a_format_1_file_is_refused():
    import struct
    import zlib

    from optpipe.plan.bytecode import decode, encode
    from optpipe.core.errors import PlanError
    from optpipe.plan.lower import lower

    problem = _capped_rc_problem()
    data = bytearray(encode(lower(problem, generate("1F1B-capped-RC", problem))))
    data[8:10] = struct.pack("<H", 1)
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    with pytest.raises(PlanError, match="new in plan format 2"):
        decode(bytes(data))


def test_verifier_refuses_a_recompute_after_its_backward():
    from optpipe.core.errors import PlanError
    from optpipe.plan.lower import lower
    from optpipe.plan.program import Opcode, Program
    from optpipe.plan.verify import verify

    problem = _capped_rc_problem()
    program = lower(problem, generate("1F1B-capped-RC", problem))
    stream = list(program.ranks[0])
    at = next(k for k, ins in enumerate(stream) if ins.opcode is Opcode.RECOMPUTE)
    rc = stream.pop(at)
    back = next(k for k, ins in enumerate(stream) if ins.opcode is Opcode.BACKWARD and
                (ins.stage, ins.microbatch) == (rc.stage, rc.microbatch))
    stream.insert(back + 1, rc)
    with pytest.raises(PlanError, match="comes before the backward"):
        verify(Program(program.header, (tuple(stream),) + program.ranks[1:]))


def test_gantt_and_trace_show_recomputes():
    import json

    from optpipe.core.render.trace import chrome_trace
    from optpipe.core.render.gantt import gantt_lines

    problem = _capped_rc_problem()
    timeline = simulate(problem, generate("1F1B-capped-RC", problem))
    assert "recompute" in "".join(str(line) for line in gantt_lines(timeline))
    assert "recompute" in json.dumps(chrome_trace(timeline))


# ------------------------------------------------------------------ solvers


def test_cpsat_chooses_recompute_where_keeping_cannot_fill_the_pipeline():
    from optpipe.solvers.bounds import makespan_lower_bound
    from optpipe.solvers.compare import compare
    from optpipe.solvers.cpsat import solve_cpsat
    from optpipe.solvers.result import fastest_fitting
    from optpipe.solvers.warmstart import warm_starts

    problem = replace(uniform_problem(4, 6, act=100, keep=50, budget=150, f=1, b=1, w=1),
                      recompute=Recompute(True, (1.0,) * 4, (10,) * 4))
    start = fastest_fitting(warm_starts(problem, compare(problem)))
    result = solve_cpsat(problem, time_limit_s=20, hint=start.schedule, workers=2, seed=1)
    assert result.timeline.fits and result.schedule.recomputed
    # keeping alone needs 49 ms here (capped); recomputing all but the last stage's, 33
    assert result.makespan_ms <= start.timeline.makespan < 49.0
    assert result.makespan_ms == pytest.approx(simulate(problem, result.schedule).makespan)
    assert makespan_lower_bound(problem).value <= result.lower_bound_ms <= result.makespan_ms + 1e-9


def test_bounds_stay_below_what_recompute_achieves():
    from optpipe.solvers.bounds import makespan_lower_bound, memory_lower_bound

    problem = replace(uniform_problem(4, 8, v=2, act=100, keep=50, budget=120, f=1, b=1, w=1),
                      recompute=Recompute(True, (1.0,) * 8, (10,) * 8))
    timeline = simulate(problem, generate("1F1B-capped-RC", problem))
    assert timeline.fits
    assert makespan_lower_bound(problem).value <= timeline.makespan
    assert memory_lower_bound(problem).value <= timeline.peak


def test_model_problems_derive_the_stage_input_and_selective_shares():
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "core" / "data" / "default.toml").read_text()
    text = text.replace("flash_attention = true", "flash_attention = false")  # scores saved: selective frees them
    text = text.replace('budget = "12GiB"', 'budget = "40GiB"')
    plain = loads_problem(text)
    full = loads_problem(text + "\n[recompute]\nenabled = true\n")
    selective = loads_problem(text + '\n[recompute]\nmode = "selective"\n')
    for s in range(plain.stages):
        act, f = plain.memory.activation[s], plain.costs.forward[s]
        assert 0 < full.recompute.resident[s] < act and full.recompute.time_ms[s] == pytest.approx(f)
        assert 0 < selective.recompute.time_ms[s] < f / 2  # the attention core is the cheap part
        assert full.recompute.resident[s] < selective.recompute.resident[s] < act


def test_capped_recompute_offload_trades_recomputes_the_link_hides():
    from optpipe.core.problem_file import load_problem

    from conftest import PROBLEM_DIR

    base = load_problem(PROBLEM_DIR / "balanced-p4-m8-tight.toml")  # k = 0.5
    act = base.memory.activation
    problem = replace(base, recompute=Recompute(True, base.costs.forward, tuple(a // 20 for a in act))
                      ).with_budget(int(2.5 * act[0]))
    recomputed = simulate(problem, generate("1F1B-capped-RC", problem))
    mixed_schedule = generate("1F1B-capped-RC/OFF", problem)
    mixed = simulate(problem, mixed_schedule)
    assert mixed.fits and mixed_schedule.offloaded and mixed_schedule.recomputed
    assert mixed.makespan < recomputed.makespan


def test_the_mix_is_never_slower_than_the_pure_strategies_it_solves_first(monkeypatch):
    """The pure strategies are seen where compile solves them, not off progress lines, which
    come only when CP-SAT beats the start in its second or so (on a loaded machine it may not).
    The repairs of overflowing starts are left out: they took 1.3 s of the 4 here."""
    from optpipe.solvers import compile as compile_module
    from optpipe.solvers import starts

    monkeypatch.setattr(starts, "repair_candidates", lambda problem, candidates, deadline: [])
    solved, answers = [], []

    def run(sub, *args, **kwargs):
        solved.append((sub.offload.enabled, sub.recompute.enabled))
        return real_run(sub, *args, **kwargs)

    def pure_strategies(*args, **kwargs):
        out, both = real_pure(*args, **kwargs)
        answers.extend(out)
        return out, both

    real_run, real_pure = compile_module._run, compile_module._pure_strategies
    monkeypatch.setattr(compile_module, "_run", run)
    monkeypatch.setattr(compile_module, "_pure_strategies", pure_strategies)
    problem = _link_problem()
    seen = []
    result = compile_module.compile_problem(problem, time_limit_s=4, workers=1, on_progress=seen.append)
    # recompute-only first (its capped start is the faster), offload-only next, then the mix
    assert solved[:3] == [(False, True), (True, False), (True, True)]
    assert all(c.timeline.fits and not (c.schedule.offloaded and c.schedule.recomputed) for c in answers)
    assert result.judged.fits
    assert result.makespan_ms <= min(c.timeline.makespan for c in answers) + 1e-9
    assert all(p.bound_ms <= result.makespan_ms + 1e-9 for p in seen)  # the whole problem's bound, not a pure one's


def _link_problem(budget=150):
    """p = 4, m = 6, k = 2 (4 ms a round trip), room for one and a half activations."""
    return replace(uniform_problem(4, 6, act=100, keep=50, budget=budget, f=1, b=1, w=1,
                                   offload=Offload(True, 5e4, 5e4, 10**6)),
                   recompute=Recompute(True, (1.0,) * 4, (10,) * 4))


def test_a_mixed_neighbour_offloads_one_pair_of_a_recompute_only_schedule():
    from optpipe.solvers.recompute import mixed_neighbour

    problem = _link_problem(budget=250)  # an offload holds the whole activation while it leaves
    recomputing = generate("1F1B-capped-RC", problem)
    assert recomputing.recomputed and not recomputing.offloaded
    neighbour = mixed_neighbour(problem, recomputing)
    assert neighbour is not None and len(neighbour.offloaded) == 1 and neighbour.recomputed
    assert len(neighbour.offloaded | neighbour.recomputed) == len(recomputing.recomputed | neighbour.offloaded)
    assert simulate(problem, neighbour).fits
    assert mixed_neighbour(problem, neighbour) is neighbour  # mixed already
    assert mixed_neighbour(problem, generate("1F1B-capped", problem)) is None  # keeps all: two changes away
    assert mixed_neighbour(problem.without_offload(), recomputing) is None


def test_a_search_among_mixes_returns_a_mix_and_claims_no_bound_of_its_own():
    """Pure schedules are outside the search, so its own bound proves nothing about the problem."""
    from optpipe.solvers.bounds import makespan_lower_bound
    from optpipe.solvers.cpsat import solve_cpsat
    from optpipe.solvers.recompute import mixed_neighbour

    problem = _link_problem(budget=250)
    hint = mixed_neighbour(problem, generate("1F1B-capped-RC", problem))
    result = solve_cpsat(problem, time_limit_s=10, hint=hint, workers=2, seed=0, mixes_only=True)
    assert result.schedule.offloaded and result.schedule.recomputed and result.timeline.fits
    assert result.makespan_ms <= simulate(problem, hint).makespan + 1e-9
    assert result.status is not SolveStatus.OPTIMAL
    assert result.lower_bound_ms == pytest.approx(makespan_lower_bound(problem).value)


def test_the_window_search_decides_recompute_too():
    """lns.improve on a schedule that recomputes (no window model places a RECOMPUTE) and on one
    that does not, with [recompute]: keep / offload / recompute flips judged by the simulator."""
    from optpipe.solvers.lns import improve

    problem = replace(uniform_problem(4, 6, act=100, keep=50, budget=150, f=1, b=1, w=1,
                                      offload=Offload(True, 5e4, 5e4, 10**6)),
                      recompute=Recompute(True, (1.0,) * 4, (10,) * 4))
    everything = add_recomputes_everywhere(problem)
    start = simulate(problem, everything)
    assert start.fits
    search = improve(problem, everything, time_limit_s=2, workers=1, seed=0)
    assert search.best.fits and search.best.makespan_ms < start.makespan  # some recomputes were not needed
    assert len(search.best.schedule.recomputed) < len(everything.recomputed)
    capped = generate("1F1B-capped", problem)  # keeps everything: recomputing lets more microbatches in flight?
    search = improve(problem, capped, time_limit_s=2, workers=1, seed=0)
    assert search.best.fits and search.best.makespan_ms <= simulate(problem, capped).makespan


def add_recomputes_everywhere(problem):
    from optpipe.solvers.recompute import add_recomputes

    return add_recomputes(problem, generate("1F1B-capped-RC", problem),
                          [(s, i) for s in range(problem.stages) for i in range(problem.microbatches)])
