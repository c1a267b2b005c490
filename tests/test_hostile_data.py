"""The hostile token data and corpus layouts of :mod:`usaf.testing.hostile_data`, each through the real CLI."""

from __future__ import annotations

from usaf.testing import hostile, hostile_data

CASES = hostile_data.cases()


def test_the_catalogue_covers_its_readers_and_is_distinct():
    by_reader = {r: [c.name for c in CASES if c.reader == r] for r in hostile_data.READERS}
    assert all(len(names) >= 4 for names in by_reader.values()), {r: len(n) for r, n in by_reader.items()}
    assert len({(c.reader, c.name) for c in CASES}) == len(CASES)
    assert not set(hostile_data.READERS) & set(hostile.READERS)
