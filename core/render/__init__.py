"""Pictures of a schedule: a terminal Gantt chart and a Chrome-trace/Perfetto JSON."""

from optpipe.core.render.gantt import gantt_lines, gantt_text
from optpipe.core.render.trace import chrome_trace, write_trace

__all__ = ["gantt_lines", "gantt_text", "chrome_trace", "write_trace"]
