"""A Chrome trace of a training step: each rank's measured instructions beside the prediction.

Measured events come from the interpreter's records (host clock); ranks on one machine share
the clock, so their rows line up; each rank's row starts where its own step started, and the
earliest start is time zero. The predicted half is the simulator's timeline of the same
schedule, for the problem the plan was compiled for, or, without one, for a problem built
from this run's own median op times and activation sizes (with no p2p time, which a run
cannot separate from waiting).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from optpipe.plan.lower import raise_schedule
from optpipe.core.problem import Costs, Memory, Offload, Pipeline, Placement, Problem
from optpipe.plan.program import COMPUTE, TRACE_KIND, TRACE_NAME, Opcode, Program
from optpipe.core.render.trace import chrome_trace
from optpipe.core.simulate import Timeline, simulate

__all__ = ["run_trace", "measured_problem"]

_MEASURED_PID = 1000  # predicted devices keep pids 0..p-1, measured ranks come after


def measured_problem(program: Program, reports) -> Problem:
    """Median measured time per stage and kind (a fused backward split evenly), measured sizes."""
    header = program.header
    durations: dict[tuple[str, int], list[float]] = defaultdict(list)
    sizes: dict[int, tuple[int, int]] = {}
    for report in reports:
        sizes.update(report.activation_bytes)
        per_op: dict[tuple[str, int, int], float] = defaultdict(float)
        for record in report.records:
            kind = TRACE_KIND.get(record.opcode)
            if kind is not None:  # the loss belongs to the last stage's forward
                per_op[(kind, record.stage, record.microbatch)] += (record.end_ns - record.start_ns) / 1e6
        for (kind, stage, _), ms in per_op.items():
            durations[(kind, stage)].append(ms)

    def median(kind: str, stage: int) -> float | None:
        values = durations.get((kind, stage))
        return statistics.median(values) if values else None

    forward, backward_input, backward_weight = [], [], []
    for s in range(header.stages):
        f, b, w, bw = median("F", s), median("B", s), median("W", s), median("BW", s)
        if b is None and bw is not None:
            b = w = bw / 2
        forward.append(max(f or 0.0, 1e-6))
        backward_input.append(max(b or 0.0, 1e-6))
        backward_weight.append(max(w if w is not None else (b or 0.0), 1e-6))
    activation = tuple(max(sizes.get(s, (1, 1))[0], 1) for s in range(header.stages))
    kept = tuple(min(sizes.get(s, (1, 1))[1], activation[s]) for s in range(header.stages))
    devices, chunks = header.world_size, header.chunks
    placement = Placement.INTERLEAVED
    if chunks == 2 and any(header.stage_ranks[s] != s % devices for s in range(header.stages)):
        placement = Placement.VSHAPE
    offload = Offload()
    if any(ins.opcode is Opcode.OFFLOAD for stream in program.ranks for ins in stream):
        offload = Offload(True, 1e12, 1e12, 2**50)  # transfers are not timed here; they take no time
    return Problem(
        name=f"measured ({header.schedule_name})",
        pipeline=Pipeline(devices, chunks, placement, header.microbatches),
        costs=Costs(tuple(forward), tuple(backward_input), tuple(backward_weight), 0.0),
        memory=Memory(activation, kept, sum(activation) * header.microbatches),
        offload=offload,
    )


def run_trace(program: Program, reports, problem: Problem | None = None) -> dict:
    """Trace events (microseconds) of the measured step and of the simulator's prediction."""
    if problem is None:
        problem = measured_problem(program, reports)
    timeline: Timeline = simulate(problem, raise_schedule(program))
    trace = chrome_trace(timeline, label=f"predicted: {problem.name}")
    events = trace["traceEvents"]
    origin = min(r.step_started_ns for r in reports)
    for report in reports:
        pid = _MEASURED_PID + report.rank
        events.append({"ph": "M", "pid": pid, "name": "process_name",
                       "args": {"name": f"rank {report.rank} (measured)"}})
        events.append({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}})
        shift = report.step_started_ns - origin
        for record in report.records:
            short = TRACE_NAME.get(record.opcode)
            name = f"{short}{record.stage}:{record.microbatch}" if short else record.opcode.name
            events.append({
                "ph": "X", "pid": pid, "tid": 0 if record.opcode in COMPUTE else 1, "name": name,
                "cat": record.opcode.name.lower(),
                "ts": round((shift + record.start_ns) / 1e3, 3),
                "dur": round((record.end_ns - record.start_ns) / 1e3, 3),
                "args": {"stage": record.stage, "microbatch": record.microbatch},
            })
        events.append({"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "compute"}})
        events.append({"ph": "M", "pid": pid, "tid": 1, "name": "thread_name",
                       "args": {"name": "communication, transfers"}})
    ends = [(r.step_started_ns - origin) + max((x.end_ns for x in r.records), default=0) for r in reports]
    measured_ms = max(ends) / 1e6
    trace["otherData"].update({"measured_step_ms": measured_ms, "predicted_makespan_ms": timeline.makespan,
                               "prediction_for": problem.name})
    return trace
