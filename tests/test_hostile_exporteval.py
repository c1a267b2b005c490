"""Hostile inputs of ``usaf export`` and ``usaf eval`` (usaf.testing.hostile_exporteval) through the real CLI:
one error line naming the input, exit 2, nothing left behind."""

from __future__ import annotations

import pytest

from helpers import invoke
from usaf.testing import hostile, hostile_exporteval

CASES = hostile_exporteval.cases()


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return hostile.Bench.build(tmp_path_factory.mktemp("hostile-exporteval"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_hostile_export_or_eval_input_is_answered_cleanly(bench, case, tmp_path):
    outcome = hostile.run_case(bench, case, tmp_path / "case")
    assert outcome.ok, (outcome.answer, outcome.message, outcome.problems)
    assert outcome.exit_code == 2


def test_the_cases_are_distinct_and_name_their_reader():
    assert len({c.name for c in CASES}) == len(CASES) >= 8
    assert {c.reader for c in CASES} == set(hostile_exporteval.READERS)


def test_negative_control_the_unforged_delta_exports(bench, tmp_path):
    """The forged deltas fail for what they break: the same delta unbroken exports and verifies."""
    delta = hostile_exporteval.write_delta(bench, tmp_path / "delta")
    result = invoke("export", "--model", bench.quantized, "--checkpoint", delta, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "verified" in result.stdout and "3 delta entries" in result.stdout
