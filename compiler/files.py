"""Reading the files users name on the command line, with errors that say which file and why."""

from __future__ import annotations

from pathlib import Path

from .errors import OptpipeError

__all__ = ["read_text", "read_bytes"]


def read_bytes(path: str | Path, what: str, error: type[OptpipeError]) -> bytes:
    """The file's bytes; a missing or unreadable file raises ``error`` naming ``what`` it should be."""
    path = Path(path)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except (IsADirectoryError, PermissionError) as why:
        raise error(f"{path}: cannot read the {what} ({why.__class__.__name__})") from None


def read_text(path: str | Path, what: str, error: type[OptpipeError]) -> str:
    data = read_bytes(path, what, error)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise error(f"{path}: cannot read the {what} (not UTF-8 text)") from None
