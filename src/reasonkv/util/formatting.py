"""Numbers as people read them."""

from __future__ import annotations

import re


def format_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB'; None -> '-'."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def format_or_dash(value: object, spec: str) -> str:
    """format(value, spec), or '-' for a missing number (None)."""
    return "-" if value is None else format(value, spec)


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512MiB', '1.5GB' (decimal units), '4096' or '4096B' (bytes).
    Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024), any case.
    A fraction of a byte is rounded down. Anything else, or less than one byte, is a
    ValueError that repeats the text."""
    match = _SIZE.fullmatch(text)
    unit = _BYTE_UNITS.get(match.group(2).lower()) if match else None
    if unit is None:
        raise ValueError(f"expected a size like 2GiB, 512MiB, 1.5GB or a number of bytes, got {text!r}")
    number = match.group(1)
    # Whole numbers stay exact integers; a fraction is scaled exactly, then rounded down.
    if "." in number:
        whole, _, frac = number.partition(".")
        value = (int(whole or 0) * 10 ** len(frac) + int(frac or 0)) * unit // 10 ** len(frac)
    else:
        value = int(number) * unit
    if value < 1:
        raise ValueError(f"a size must be at least one byte, got {text!r}")
    return value
