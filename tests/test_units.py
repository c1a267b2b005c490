"""usaf.units: the counts and sizes messages print."""

from __future__ import annotations

from usaf.units import counted


def test_counted_says_one_thing_and_many_things():
    """Messages said "1 files held no text", "1 documents" and "2 entrys" (found in review)."""
    assert counted(1, "file") == "1 file" and counted(3, "file") == "3 files"
    assert counted(2, "entry") == "2 entries" and counted(1, "entry") == "1 entry"
    assert counted(2, "day") == "2 days"  # the control: a vowel before the y keeps it
    assert counted(12_345, "byte") == "12,345 bytes"
