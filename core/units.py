"""Parsing and printing of sizes and bandwidths as people write them in problem files."""

from __future__ import annotations

import math
import re

from optpipe.core.errors import ProblemError
from optpipe.core.errors import shown as _shown

__all__ = ["MAX_SIZE", "parse_size", "parse_bandwidth", "format_size", "format_bandwidth"]

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


# Larger than any device or host memory, link or budget that exists; beyond it a value is a typo
# (or inf/1e400 by accident) and would only turn into overflowing arithmetic downstream.
MAX_SIZE = 2**60  # 1 EiB
_MAX_SIZE_TEXT = "1EiB"
_MAX_TEXT = 64  # characters in a size string; longer is not a size (and would only slow the parser)


def _split(text: str) -> tuple[float, str] | None:
    if len(text) > _MAX_TEXT:
        return None
    match = _NUMBER_UNIT.match(text)
    if not match:
        return None
    return float(match.group(1)), match.group(2).upper()


def parse_size(value: object, key: str) -> int:
    """Bytes from an int or a string such as "1.5GiB", "512MiB", "24GB"; errors name ``key``."""
    if isinstance(value, bool):
        raise ProblemError(f'{key}: expected a size like "9GiB" or a number of bytes, got {_shown(value)}')
    if isinstance(value, int):
        if value > MAX_SIZE:
            raise ProblemError(f"{key}: {_shown(value)} bytes is more than {_MAX_SIZE_TEXT}; "
                               f'give a real size such as "9GiB"')
        if value <= 0:
            raise ProblemError(f"{key}: must be greater than zero (at least one byte), got {_shown(value)}")
        return value
    elif isinstance(value, float):
        number, unit = value, ""
    elif isinstance(value, str) and (parsed := _split(value)) and parsed[1] in _SIZE_UNITS:
        number, unit = parsed
    else:
        raise ProblemError(
            f'{key}: expected a size like "9GiB" (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {_shown(value)}'
        )
    if not math.isfinite(number):
        raise ProblemError(f'{key}: expected a finite size like "9GiB", got {_shown(value)}')
    if number * _SIZE_UNITS[unit] > MAX_SIZE:
        raise ProblemError(f"{key}: {_shown(value)} is more than {_MAX_SIZE_TEXT}; "
                           f'give a real size such as "9GiB"')
    size = round(number * _SIZE_UNITS[unit])
    if size <= 0:
        raise ProblemError(f"{key}: must be greater than zero (at least one byte), got {_shown(value)}")
    return size


def parse_bandwidth(value: object, key: str) -> float:
    """Bytes per second from a string such as "24GB/s" or "12GiB/s", or a number of bytes/s."""
    expected = f'{key}: expected a bandwidth like "24GB/s" (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB per second)'
    if isinstance(value, str):
        text = value.strip()
        if not text.lower().endswith("/s") or not (parsed := _split(text[:-2])) or parsed[1] not in _SIZE_UNITS:
            raise ProblemError(f"{expected}, got {_shown(value)}")
        return float(parse_size(text[:-2], key))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(parse_size(value, key))
    raise ProblemError(f"{expected}, got {_shown(value)}")


def format_size(size: float) -> str:
    """Binary units, three significant figures: 1.23GiB, 512MiB."""
    size = float(size)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            value = size / scale
            return f"{value:.3g}{unit}" if value < 1000 else f"{value:.0f}{unit}"
    return f"{size:.0f}B"


def format_bandwidth(bytes_per_second: float) -> str:
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bytes_per_second >= scale:
            return f"{bytes_per_second / scale:.4g}{unit}"
    return f"{bytes_per_second:.4g}B/s"
