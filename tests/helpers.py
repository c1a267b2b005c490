"""Small helpers shared by test modules (fixtures that build models live in usaf.testing)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from usaf.cli.app import app

runner = CliRunner()


def invoke(*args: str, env: dict[str, str] | None = None):
    """Run the real CLI in-process; returns click's Result (exit_code, stdout, stderr)."""
    return runner.invoke(app, [str(a) for a in args], env=env)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def leftovers(directory: Path) -> list[str]:
    """Hidden temporaries an interrupted or failed write might have left behind."""
    return sorted(p.name for p in directory.iterdir() if ".usaf-tmp-" in p.name or ".usaf-old-" in p.name)
