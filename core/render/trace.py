"""Chrome-trace (Perfetto) JSON of a simulated timeline.

One process per device with three tracks (compute, D2H, H2D) and the device's activation
memory as a counter, so ``ui.perfetto.dev`` or ``chrome://tracing`` shows where the bubbles and
the memory peaks are.
"""

from __future__ import annotations

import json
from pathlib import Path

from optpipe.core.files import write_atomic
from optpipe.core.schedule import OpKind
from optpipe.core.simulate import Timeline

__all__ = ["chrome_trace", "write_trace", "TRACKS"]

TRACKS = {"compute": 0, "d2h": 1, "h2d": 2}
_TRACK_OF = {OpKind.OFFLOAD: TRACKS["d2h"], OpKind.RELOAD: TRACKS["h2d"]}
_NAME = {OpKind.F: "forward", OpKind.B: "backward-input", OpKind.W: "backward-weight", OpKind.BW: "backward",
         OpKind.OFFLOAD: "offload", OpKind.RELOAD: "reload", OpKind.RECOMPUTE: "recompute"}


def chrome_trace(timeline: Timeline, label: str = "") -> dict:
    """Trace events with times in microseconds, as the format requires."""
    events: list[dict] = []
    title = label or timeline.schedule_name
    for device in range(timeline.problem.devices):
        events.append({"ph": "M", "pid": device, "name": "process_name", "args": {"name": f"device {device} ({title})"}})
        events.append({"ph": "M", "pid": device, "name": "process_sort_index", "args": {"sort_index": device}})
        for track, tid in TRACKS.items():
            events.append({"ph": "M", "pid": device, "tid": tid, "name": "thread_name", "args": {"name": track}})
    for t in timeline.timings:
        op = t.op
        events.append({
            "ph": "X", "pid": t.device, "tid": _TRACK_OF.get(op.kind, 0), "name": str(op), "cat": _NAME[op.kind],
            "ts": round(t.start * 1e3, 3), "dur": round((t.end - t.start) * 1e3, 3),
            "args": {"stage": op.stage, "microbatch": op.microbatch, "kind": _NAME[op.kind]},
        })
    for device, curve in enumerate(timeline.memory):
        for time, held in curve:
            events.append({"ph": "C", "pid": device, "name": "activation memory", "ts": round(time * 1e3, 3),
                           "args": {"bytes": held}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"problem": timeline.problem.name, "schedule": timeline.schedule_name,
                      "makespan_ms": timeline.makespan, "bubble_ratio": timeline.bubble_ratio},
    }


def write_trace(timeline: Timeline, path: str | Path, label: str = "") -> None:
    write_atomic(path, json.dumps(chrome_trace(timeline, label)), "trace file")
