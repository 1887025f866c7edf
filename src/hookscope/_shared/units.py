"""Numbers as tables show them: ``format_number(0.012345) == '0.01235'``, byte sizes as people
write them: ``format_bytes(1536) == '1.5 KiB'``, ``parse_bytes('2GiB')``."""

from __future__ import annotations

import math
import re

from hookscope.errors import SpecError

__all__ = ["counted", "format_bytes", "format_number", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def format_number(value: float | None, *, digits: int = 4, missing: str = "") -> str:
    """``digits`` significant digits, ``nan``/``inf``/``-inf`` spelt out, ``missing`` for None.

    >>> format_number(0.012345), format_number(float("-inf")), format_number(None, missing="-")
    ('0.01235', '-inf', '-')
    """
    if value is None:
        return missing
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}g}"


def format_bytes(count: int) -> str:
    """Binary units, three significant digits (whole numbers from 100 up, never an exponent).

    >>> format_bytes(512), format_bytes(1536), format_bytes(3 * 2**30), format_bytes(1000 * 1024)
    ('512 B', '1.5 KiB', '3 GiB', '1000 KiB')
    """
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" or abs(value) >= 100 else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def counted(count: int, noun: str) -> str:
    """``count`` and the noun, plural unless one: ``1 site``, ``2 sites``, ``1,024 rows``.

    >>> counted(1, "site"), counted(3, "tensor"), counted(1024, "row")
    ('1 site', '3 tensors', '1,024 rows')
    """
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def parse_bytes(size: int | str) -> int:
    """An int of bytes, or text like ``"512MiB"``, ``"2 GB"``, ``"1.5G"`` (k/M/G alone are binary).

    >>> parse_bytes("512MiB"), parse_bytes("2GB"), parse_bytes(100)
    (536870912, 2000000000, 100)
    """
    if isinstance(size, bool):
        raise SpecError(f"size {size!r} is a bool; expected bytes as an int or text such as '512MiB'")
    if isinstance(size, int):
        if size <= 0:
            raise SpecError(f"size {size} must be positive; expected bytes, e.g. 2**30 or '1GiB'")
        return size
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None or match[2].lower() not in _UNITS:
        raise SpecError(f"size {size!r} is not understood; expected an int of bytes or text such as '512MiB', '2GB'")
    return parse_bytes(int(float(match[1]) * _UNITS[match[2].lower()]))
