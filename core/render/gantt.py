"""A terminal Gantt chart: one row per device, time left to right.

Each op is drawn as a block labelled with its kind and microbatch (``F3``, ``B3``, ``W3``,
``BW3``); the second model chunk on a device is in lower case (``f3``). Devices that move
activations get a second row: ``>`` blocks are offloads, ``<`` blocks reloads. Idle time is
``.``. ``gantt_text`` is plain text (for tests and pipes); ``gantt_lines`` is coloured.
"""

from __future__ import annotations

from rich.text import Text

from optpipe.core.schedule import OpKind
from optpipe.core.simulate import Timeline

__all__ = ["gantt_lines", "gantt_text"]

_STYLE = {OpKind.F: "bold white on blue", OpKind.B: "bold black on green", OpKind.W: "bold black on yellow",
          OpKind.BW: "bold white on magenta", OpKind.OFFLOAD: "black on cyan", OpKind.RELOAD: "black on bright_cyan",
          OpKind.RECOMPUTE: "bold white on red"}
_MEANING = {OpKind.F: "forward", OpKind.B: "backward-input", OpKind.W: "backward-weight", OpKind.BW: "fused backward",
            OpKind.OFFLOAD: "offload", OpKind.RELOAD: "reload", OpKind.RECOMPUTE: "recompute"}
_LABEL = {OpKind.F: "F", OpKind.B: "B", OpKind.W: "W", OpKind.BW: "BW", OpKind.OFFLOAD: ">", OpKind.RELOAD: "<",
          OpKind.RECOMPUTE: "R"}


def _columns(timeline: Timeline, width: int | None) -> float:
    """Milliseconds per character: wide enough that the shortest compute op shows its label."""
    shortest = min((t.end - t.start for t in timeline.timings if t.op.is_compute and t.end > t.start), default=1.0)
    per_char = shortest / 3
    if width is not None and timeline.makespan / per_char > width:
        per_char = timeline.makespan / width
    return per_char


def _label(timeline: Timeline, op) -> str:
    label = f"{_LABEL[op.kind]}{op.microbatch}"
    return label.lower() if timeline.problem.pipeline.chunk_of(op.stage) % 2 == 1 else label


def _row(timeline: Timeline, device: int, per_char: float, length: int, transfers: bool) -> tuple[list[str], list[str | None]]:
    chars = ["."] * length if not transfers else [" "] * length
    styles: list[str | None] = [None] * length
    for t in timeline.timings:
        if t.device != device or t.op.is_compute == transfers:
            continue
        first = int(round(t.start / per_char))
        last = max(first + 1, int(round(t.end / per_char)))
        label = _label(timeline, t.op)
        for k in range(first, min(last, length)):
            offset = k - first
            chars[k] = label[offset] if offset < len(label) else " "
            styles[k] = _STYLE[t.op.kind]
        if last - first < len(label) and first < length:
            chars[first] = label[0]  # too short for the whole label: keep the kind
    return chars, styles


def _render(timeline: Timeline, width: int | None):
    per_char = _columns(timeline, width)
    length = max(1, int(round(timeline.makespan / per_char)))
    moves = {t.device for t in timeline.timings if not t.op.is_compute}
    rows = []
    for device in range(timeline.problem.devices):
        rows.append((f"d{device}", *_row(timeline, device, per_char, length, transfers=False)))
        if device in moves:
            rows.append(("   ", *_row(timeline, device, per_char, length, transfers=True)))
    return per_char, rows


def _header(timeline: Timeline, per_char: float) -> str:
    return (f"{timeline.schedule_name}: makespan {timeline.makespan:,.1f} ms, bubble {timeline.bubble_ratio:.1%}, "
            f"one column = {per_char:.3g} ms")


def gantt_text(timeline: Timeline, width: int | None = 160) -> str:
    per_char, rows = _render(timeline, width)
    lines = [_header(timeline, per_char)]
    lines += [f"{name:>3} |{''.join(chars).rstrip()}" for name, chars, _ in rows]
    return "\n".join(lines)


def gantt_lines(timeline: Timeline, width: int | None = 160) -> list[Text]:
    per_char, rows = _render(timeline, width)
    out = [Text(_header(timeline, per_char), style="bold")]
    for name, chars, styles in rows:
        line = Text(f"{name:>3} |")
        for char, style in zip(chars, styles):
            line.append(char, style=style or "dim")
        out.append(line)
    legend = Text("  ")
    kinds = (OpKind.F, OpKind.B, OpKind.W, OpKind.BW, OpKind.OFFLOAD, OpKind.RELOAD)
    if any(t.op.kind is OpKind.RECOMPUTE for t in timeline.timings):
        kinds += (OpKind.RECOMPUTE,)
    for kind in kinds:
        legend.append(f" {_LABEL[kind]} ", style=_STYLE[kind])
        legend.append(f" {_MEANING[kind]}  ")
    out.append(legend)
    return out
