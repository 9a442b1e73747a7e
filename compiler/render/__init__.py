"""Pictures of a schedule: a terminal Gantt chart and a Chrome-trace/Perfetto JSON."""

from .gantt import gantt_lines, gantt_text
from .trace import chrome_trace, write_trace

__all__ = ["gantt_lines", "gantt_text", "chrome_trace", "write_trace"]
