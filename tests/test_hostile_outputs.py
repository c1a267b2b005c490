"""Hostile output paths (usaf.testing.hostile_outputs) through the real CLI: one error line naming the reason,
exit 2, and the inputs, the user's files and links exactly as they were."""

from __future__ import annotations

import pytest

from usaf.testing import hostile, hostile_outputs

CASES = hostile_outputs.cases()


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return hostile.Bench.build(tmp_path_factory.mktemp("hostile-outputs-bench"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_hostile_output_is_refused_and_nothing_is_lost(bench, case, tmp_path):
    outcome = hostile.run_case(bench, case, tmp_path / "case")
    assert outcome.ok, (outcome.answer, outcome.message, outcome.problems)
    assert outcome.exit_code == 2


def test_every_writing_command_meets_every_shape():
    names = [c.name for c in CASES]
    for command in hostile_outputs.WRITERS:
        assert sum(n.startswith(f"{command}:") for n in names) >= 6, command
    assert len(set(names)) == len(names)
