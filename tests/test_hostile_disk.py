"""The disk cases of the hostile-input catalogue (usaf.testing.hostile_disk) through the real CLI.

A full, over-quota, read-only or forbidden disk at one write of each stage: one error line naming the
output and the cause, exit 2, no output or temporaries left (``hostile.run_case`` judges).
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from usaf.cli.app import app
from usaf.testing import hostile_disk

pytestmark = pytest.mark.slow
CASES = hostile_disk.cases()


def test_the_disk_cases_are_distinct_and_cover_every_writing_stage():
    assert len({c.name for c in CASES}) == len(CASES) and {c.reader for c in CASES} == set(hostile_disk.READERS)
    stages = {c.name.split(":")[0] for c in CASES}
    assert stages == {"tokenize", "quantize", "score", "train", "eval", "export"}


def test_negative_control_without_the_fault_each_command_succeeds(bench, tmp_path):
    """The cases fail because of the disk: each command, with the disk left alone, finishes."""
    builders = {c.name.split(":")[0]: c.build for c in CASES}
    for number, (stage, build) in enumerate(sorted(builders.items())):
        case_dir = tmp_path / f"c{number}"
        case_dir.mkdir()
        result = CliRunner().invoke(app, build(bench, case_dir))
        assert result.exit_code == 0, (stage, result.output[-800:])
