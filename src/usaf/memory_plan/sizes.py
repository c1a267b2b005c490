"""Byte sizes people type (``12GiB``, ``32GB``, ``512MiB``) and how the planner prints them."""

from __future__ import annotations

import re

from usaf.errors import UsafError

# Binary units are powers of 1024, decimal ones powers of 1000; a bare "G"/"GB" is decimal, as disk and
# RAM vendors write it. The one exception people expect: "12G" for a GPU usually means GiB, but guessing
# would make "32G" of RAM 7 % off either way, so the units are taken literally and printed back.
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([a-zA-Z]*)\s*$")
MAX_BYTES = 2**60  # 1 EiB: far past any machine, and finite
FORMS = "a number with a unit: 12GiB, 32GB, 512MiB, 1.5TiB (GiB/MiB = 1024-based, GB/MB = 1000-based)"


def parse_size(text: str, *, flag: str) -> int:
    """``"12GiB"`` -> 12884901888. A missing or unknown unit, or a non-positive amount, is one clear error."""
    match = _PATTERN.match(text or "")
    if not match:
        raise UsafError(f"{flag} {text!r}: not a size", f"pass {FORMS}")
    amount, unit = float(match.group(1)), match.group(2).lower()
    if not unit:
        raise UsafError(f"{flag} {text!r}: no unit", f"pass {FORMS}")
    if unit not in _UNITS:
        raise UsafError(f"{flag} {text!r}: unknown unit {match.group(2)!r}", f"pass {FORMS}")
    if amount * _UNITS[unit] > MAX_BYTES:  # a 310-digit amount is infinite as a float: int() raised (found in review)
        raise UsafError(f"{flag} {text!r}: more than 1 EiB", f"pass {FORMS}")
    size = int(amount * _UNITS[unit])
    if size <= 0:
        raise UsafError(f"{flag} {text!r}: must be more than 0 bytes", f"pass {FORMS}")
    return size


def gib(n: float) -> str:
    """Bytes as GiB with two decimals (the planner's one unit, so columns compare at a glance)."""
    return f"{n / 2**30:.2f}"
