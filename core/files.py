"""Reading the files users name on the command line, and writing the files optpipe makes.

Reads fail with an error that says which file and why. Writes are atomic: the bytes go to a
temporary file in the same folder, are flushed to disk, and replace the target by a rename, so
a reader sees the old file or the new one, never a torn or truncated one, and a full disk or a
killed process leaves the user's existing file as it was. ``check_writable`` checks an output
path up front, so a long solve does not end in a FileNotFoundError that loses its result.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from optpipe.core.errors import OptpipeError

__all__ = ["read_text", "read_bytes", "write_atomic", "check_writable"]


# Larger input files are not what their name says (a problem file of a gigabyte) and would only
# exhaust memory while being parsed; the largest real ones are a few megabytes.
MAX_INPUT = 1 << 30


def read_bytes(path: str | Path, what: str, error: type[OptpipeError], limit: int = MAX_INPUT) -> bytes:
    """The file's bytes; a missing, unreadable or oversized file raises ``error`` naming ``what`` it should be."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > limit:
            raise error(f"{path}: {size / 2**20:,.0f}MiB is too large for a {what} (at most {limit / 2**20:,.0f}MiB); "
                        f"check that this is the right file")
        return path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except (IsADirectoryError, PermissionError) as why:
        raise error(f"{path}: cannot read the {what} ({why.__class__.__name__})") from None
    except OSError as why:
        raise error(f"{path}: cannot read the {what} ({why.strerror or why.__class__.__name__})") from None


def read_text(path: str | Path, what: str, error: type[OptpipeError], limit: int = MAX_INPUT) -> str:
    data = read_bytes(path, what, error, limit)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise error(f"{path}: cannot read the {what} (not UTF-8 text)") from None


def check_writable(path: str | Path, flag: str) -> Path:
    """Raise OptpipeError, naming ``flag``, unless ``path`` can be written; before any long work."""
    path = Path(path)
    if str(path) == "" or path.name in ("", ".", ".."):
        raise OptpipeError(f"{flag}: {str(path)!r} is not a file name; give a path such as out/plan.opb")
    if len(os.fsencode(path.name)) > 255:
        raise OptpipeError(f"{flag}: the file name is {len(os.fsencode(path.name))} bytes long, more than the 255 "
                           f"a file system allows; give a shorter name")
    folder = path.parent
    if not folder.exists():
        raise OptpipeError(f"{flag}: folder {str(folder)!r} does not exist; create it (mkdir -p {folder}) "
                           f"or write somewhere else")
    if not folder.is_dir():
        raise OptpipeError(f"{flag}: {str(folder)!r} is not a folder, so {str(path)!r} cannot be written")
    if path.is_dir():
        raise OptpipeError(f"{flag}: {str(path)!r} is a folder; give a file name inside it, "
                           f"such as {str(path / 'out')!r}")
    if path.exists() and not path.is_file():
        raise OptpipeError(f"{flag}: {str(path)!r} is not a regular file; give a file name")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OptpipeError(f"{flag}: no permission to write in folder {str(folder)!r}; write somewhere else")
    return path


def write_atomic(path: str | Path, data: bytes | str, what: str = "file") -> None:
    """Write ``data`` to ``path`` all at once or not at all (temporary file, fsync, rename)."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else bytes(data)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        mode = path.stat().st_mode & 0o7777 if path.is_file() else _default_mode()
        fd, temporary = tempfile.mkstemp(prefix=f".{path.name[:40]}.", suffix=".tmp", dir=folder)
    except OSError as why:
        raise OptpipeError(f"{path}: cannot write the {what} ({why.strerror or why.__class__.__name__})") from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException as why:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        if isinstance(why, OSError):
            raise OptpipeError(f"{path}: cannot write the {what} ({why.strerror or why.__class__.__name__}); "
                               f"any existing {path.name} is unchanged") from None
        raise
    _sync_folder(folder)


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable where the platform allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
