"""Hostile settings values and tampered checkpoints (usaf.testing.hostile_settings) through the real CLI.

Each is answered with one error line naming where the value came from (the flag, the USAF_* or legacy
variable, the --config table) or the checkpoint file, exit 2, no traceback, nothing left behind, no code run.
"""

from __future__ import annotations

import shutil

from usaf.testing import hostile_settings

CASES = hostile_settings.cases()


def test_the_catalogue_is_distinct_and_covers_its_readers():
    assert len({(c.reader, c.name) for c in CASES}) == len(CASES)
    by_reader = {r: sum(c.reader == r for c in CASES) for r in hostile_settings.READERS}
    assert all(n >= 10 for n in by_reader.values()), by_reader


def test_negative_control_the_untampered_run_is_read_and_resumed(bench, tmp_path):
    """The checkpoint cases fail because of what they break: the same commands on an intact copy succeed."""
    from helpers import invoke

    run = hostile_settings.finished_run(bench)
    result = invoke(*hostile_settings._export(bench, tmp_path, run))
    assert result.exit_code == 0, result.output
    result = invoke(*hostile_settings._generate(bench, tmp_path, run))
    assert result.exit_code == 0, result.output
    interrupted = hostile_settings._unfinish(shutil.copytree(run, tmp_path / "run"))
    result = invoke(*hostile_settings._resumed(bench, tmp_path, interrupted))
    assert result.exit_code == 0, result.output
    assert "resuming from" in result.output and (interrupted / "manifest.json").is_file()
