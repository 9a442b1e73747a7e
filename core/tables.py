"""Checks on one parsed TOML table, shared by the problem file reader and the cost model.

Both read tables of the same file, so an unknown key, a missing table or a bad ``enabled`` reads
the same whichever of them finds it; this module sits below both, so neither needs the other.
"""

from __future__ import annotations

from optpipe.core.errors import ProblemError
from optpipe.core.errors import shown as _shown

__all__ = ["check_keys", "table_of", "enabled"]


def check_keys(table: dict, allowed: set[str], where: str) -> None:
    """Refuse a key the table does not know, naming the ones it does."""
    for key in table:
        if key not in allowed:
            path = f"{where}.{key}" if where else key
            raise ProblemError(f"{path}: unknown key; expected one of {', '.join(sorted(allowed))}")


def table_of(data: dict, key: str, required: bool) -> dict:
    """``data[key]`` as a table; an empty one when it is optional and absent."""
    value = data.get(key)
    if value is None:
        if required:
            raise ProblemError(f"[{key}]: missing table; see the problem-file format in README.md")
        return {}
    if not isinstance(value, dict):
        raise ProblemError(f"{key}: expected a table [{key}], got {type(value).__name__}")
    return value


def enabled(table: dict, where: str) -> bool:
    """``enabled`` of an optional table: true by default once the table is there."""
    value = table.get("enabled", bool(table))
    if not isinstance(value, bool):
        raise ProblemError(f"{where}.enabled: expected true or false, got {_shown(value)}")
    return value
