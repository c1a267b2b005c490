"""The hostile token data and corpus layouts of :mod:`usaf.testing.hostile_data`, each through the real CLI."""

from __future__ import annotations

import pytest

from usaf.testing import hostile, hostile_data

CASES = hostile_data.cases()


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return hostile.Bench.build(tmp_path_factory.mktemp("hostile-data-bench"))


@pytest.mark.parametrize("case", CASES, ids=[f"{c.reader}: {c.name}" for c in CASES])
def test_each_hostile_data_input_is_answered_cleanly(bench, case, tmp_path):
    outcome = hostile.run_case(bench, case, tmp_path / "case")
    assert outcome.ok, (outcome.answer, outcome.message, outcome.problems)
    if not case.may_pass:
        assert outcome.exit_code == 2
    else:
        assert outcome.exit_code == 0


def test_the_catalogue_covers_its_readers_and_is_distinct():
    by_reader = {r: [c.name for c in CASES if c.reader == r] for r in hostile_data.READERS}
    assert all(len(names) >= 4 for names in by_reader.values()), {r: len(n) for r, n in by_reader.items()}
    assert len({(c.reader, c.name) for c in CASES}) == len(CASES)
    assert not set(hostile_data.READERS) & set(hostile.READERS)
