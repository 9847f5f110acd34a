"""Numbers as people read them."""

from __future__ import annotations


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
