"""Parsing of the human units used in configs and on the command line ("512MiB", "800ms")."""

from __future__ import annotations

import re
from fractions import Fraction

_SIZE_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def _check_ascii(text: str, what: str) -> None:
    # the pattern's \d and \s also match other scripts' digits and spaces (full-width "32MiB"),
    # which Fraction and float accept too: such a value loaded, though it reads as another
    if not text.isascii():
        raise ValueError(f"{text!r} is not a {what}: write it with ASCII digits and units")


def parse_size(text: str) -> int:
    """Bytes in a size such as ``"4KiB"``, ``"1.5GiB"`` or ``"4096"``; `ValueError` otherwise."""
    _check_ascii(text, "size")
    match = _NUMBER_UNIT.match(text)
    if not match or match.group(2) not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size (use B, KiB, MiB, GiB or TiB)")
    value = Fraction(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if value.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``"800ms"``, ``"5s"`` or ``"2min"``; `ValueError` otherwise."""
    _check_ascii(text, "duration")
    match = _NUMBER_UNIT.match(text)
    if not match or match.group(2) not in _DURATION_UNITS:
        raise ValueError(f"{text!r} is not a duration (use ns, us, ms, s, min or h)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def format_size(nbytes: float) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if nbytes >= _SIZE_UNITS[unit]:
            return f"{nbytes / _SIZE_UNITS[unit]:.4g}{unit}"
    return f"{nbytes:.0f}B"
