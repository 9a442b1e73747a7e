"""The live solve line: elapsed time, incumbent, bound, gap and what the search last did.

It goes to stderr and stays off when ``quiet`` (``compile`` sets that for ``--json`` and piped
output), so what a command prints on stdout stays clean; ``compile`` and ``demo`` both use it.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live
from rich.text import Text

from optpipe.solvers.compile import compile_problem

__all__ = ["compile_live"]


def compile_live(problem, *, solver: str = "cpsat", time_limit_s: float = 60.0, seed: int = 0,
                 workers: int | None = None, quiet: bool = False, starts=()):
    """compile_problem with the live progress line on stderr (none when ``quiet``)."""
    with _live_progress(problem, solver, time_limit_s, quiet) as on_progress:
        return compile_problem(problem, solver=solver, time_limit_s=time_limit_s, seed=seed, workers=workers,
                               on_progress=on_progress, starts=starts)


class _live_progress:
    """A context that yields ``on_progress`` and shows it live on stderr (silent when ``quiet``)."""

    def __init__(self, problem, solver: str, time_limit_s: float, quiet: bool):
        self.problem, self.solver, self.time_limit_s, self.quiet = problem, solver, time_limit_s, quiet
        self.began = time.monotonic()
        self.latest = None
        self.live = None

    def _render(self) -> Text:
        elapsed = time.monotonic() - self.began
        p = self.latest
        # the numbers first, so that an 80-column terminal shows them all; what the search did last after
        text = Text(f"{self.solver} {elapsed:5.1f}s/{self.time_limit_s:g}s", style="bold")
        if p is not None:
            incumbent = f"{p.incumbent_ms:,.1f} ms" if p.incumbent_ms is not None else "-"
            bound = f"{p.bound_ms:,.1f}" if p.bound_ms is not None else "-"
            gap = f"{p.gap:.2%}" if p.gap is not None else "-"
            text.append(f"  best {incumbent}  bound {bound}  gap {gap}  ", style="")
            text.append(p.message, style="dim")
        return text

    def __call__(self, progress) -> None:
        self.latest = progress
        if self.live is not None:
            self.live.update(self._render())

    def __enter__(self):
        if not self.quiet:
            self.live = Live(self._render(), console=Console(stderr=True), refresh_per_second=4, transient=True,
                             get_renderable=self._render)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
