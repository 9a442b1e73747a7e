"""Parsing and printing of sizes and bandwidths as people write them in problem files."""

from __future__ import annotations

import re

__all__ = ["parse_size", "parse_bandwidth", "format_size", "format_bandwidth"]

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


def _split(text: str) -> tuple[float, str] | None:
    match = _NUMBER_UNIT.match(text)
    if not match:
        return None
    return float(match.group(1)), match.group(2).upper()


def parse_size(value: object, key: str) -> int:
    """Bytes from an int or a string such as "1.5GiB", "512MiB", "24GB"; errors name ``key``."""
    from .errors import ProblemError

    if isinstance(value, bool):
        raise ProblemError(f'{key}: expected a size like "9GiB" or a number of bytes, got {value!r}')
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    elif isinstance(value, str) and (parsed := _split(value)) and parsed[1] in _SIZE_UNITS:
        number, unit = parsed
    else:
        raise ProblemError(
            f'{key}: expected a size like "9GiB" (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {value!r}'
        )
    size = round(number * _SIZE_UNITS[unit])
    if size <= 0:
        raise ProblemError(f"{key}: must be greater than zero, got {value!r}")
    return size


def parse_bandwidth(value: object, key: str) -> float:
    """Bytes per second from a string such as "24GB/s" or "12GiB/s", or a number of bytes/s."""
    from .errors import ProblemError

    if isinstance(value, str):
        text = value.strip()
        if not text.lower().endswith("/s"):
            raise ProblemError(f'{key}: expected a bandwidth like "24GB/s", got {value!r}')
        return float(parse_size(text[:-2], key))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(parse_size(value, key))
    raise ProblemError(f'{key}: expected a bandwidth like "24GB/s", got {value!r}')


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
