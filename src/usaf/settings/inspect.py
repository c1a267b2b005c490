"""Settings of ``usaf inspect`` (command line only: no ``--config`` table)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from usaf.config import StageConfig
from usaf.settings.fields import cli


class InspectConfig(StageConfig):
    """Settings of ``usaf inspect``."""

    path: Path = Field(
        description="An artifact directory (has manifest.json), a model directory, or a workspace, unfinished run "
        "or interrupted output (what usaf left there, and how it resumes).",
        json_schema_extra=cli(argument=True),
    )
    no_hash: bool = Field(
        False, description="Check files' presence and sizes only (a checkpoint's: presence), not their sha256 (faster)."
    )
    verify: bool = Field(
        False,
        description="Verify only: re-hash every listed file, print one verdict line, exit 2 if any file is "
        "missing, truncated or modified (files the manifest does not list are named too).",
        json_schema_extra=cli(flag="--verify"),
    )
