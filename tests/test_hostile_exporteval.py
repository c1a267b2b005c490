"""Hostile inputs of ``usaf export`` and ``usaf eval`` (usaf.testing.hostile_exporteval) through the real CLI:
one error line naming the input, exit 2, nothing left behind."""

from __future__ import annotations

from helpers import invoke
from usaf.testing import hostile_exporteval

CASES = hostile_exporteval.cases()


def test_the_cases_are_distinct_and_name_their_reader():
    assert len({c.name for c in CASES}) == len(CASES) >= 8
    assert {c.reader for c in CASES} == set(hostile_exporteval.READERS)


def test_negative_control_the_unforged_delta_exports(bench, tmp_path):
    """The forged deltas fail for what they break: the same delta unbroken exports and verifies."""
    delta = hostile_exporteval.write_delta(bench, tmp_path / "delta")
    result = invoke("export", "--model", bench.quantized, "--checkpoint", delta, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "verified" in result.stdout and "3 delta entries" in result.stdout
    said = " ".join(result.stdout.split())  # counts say one of a thing: "1 shards", "1 routers replaced" (review)
    assert "1 shard," in said and "1 shards" not in said, said
    # a base quantized at 3 or 8 bits was said "4-bit"; gpt-oss's router weight and bias "2 routers" (review)
    assert "4-bit" not in said and "0 router tensors replaced" in said and "(dequantized base)" in said, said
