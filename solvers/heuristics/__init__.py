"""Published heuristic schedules, one module per family; importing registers them all."""

from . import gpipe, one_f_one_b  # noqa: F401
