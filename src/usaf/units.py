"""Formatting quantities for people."""

from __future__ import annotations

from collections.abc import Iterable


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``; binary units, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def counted(n: int, thing: str) -> str:
    """``counted(1, "file") -> '1 file'``, ``counted(3, "file") -> '3 files'``, ``counted(2, "entry") -> '2
    entries'``."""
    if n == 1:
        return f"{n:,} {thing}"
    plural = thing[:-1] + "ies" if thing.endswith("y") and thing[-2:-1] not in "aeiou" else thing + "s"
    return f"{n:,} {plural}"


def first_few(items: Iterable[object], n: int = 3) -> str:
    """``first_few(["a", "b", "c", "d"]) -> 'a, b, c, ...'``: the first ``n`` of a list named in a message."""
    shown = [str(item) for item in items]
    return ", ".join(shown[:n]) + (", ..." if len(shown) > n else "")
