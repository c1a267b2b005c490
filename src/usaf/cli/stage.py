"""The body every stage command shares: settings → stage → JSON or a human summary."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def run_stage(
    name: str,
    *,
    cli: Mapping[str, Any],
    config_file: Path | None,
    json_output: bool,
    verbose: bool,
    summary: Callable[[Any, Any, Path], None],
) -> None:
    """Resolve ``usaf.stages.<name>``'s settings, run it with a progress bar, print the result.

    Args:
        name: the stage module (``"tokenize"``); its ``<Name>Config`` class and ``run`` are used, and
            ``name`` is also its ``--config`` TOML table.
        cli: flag values by setting name (``None`` = not given).
        config_file: the ``--config`` file.
        json_output: print the manifest (and the path) as JSON instead of ``summary``.
        verbose: tracebacks on errors.
        summary: ``summary(console, manifest, path)`` prints the human-readable result.

    A stage module may define ``LEGACY_ENV`` (the original tool's variable names it honours).
    """
    from usaf.cli.console import handle_errors

    with handle_errors(verbose):
        from usaf.cli.console import out, print_json
        from usaf.cli.progress import RichProgress
        from usaf.config import resolve_config

        stage = importlib.import_module(f"usaf.stages.{name}")
        config_class = getattr(stage, f"{name.capitalize()}Config")
        settings = resolve_config(
            config_class,
            section=name,
            cli=dict(cli),
            config_file=config_file,
            legacy_env=getattr(stage, "LEGACY_ENV", None),
        )
        manifest, path = stage.run(settings, progress=RichProgress())
        if json_output:
            print_json({"path": str(path), **manifest.model_dump(mode="json")})
        else:
            summary(out, manifest, path)
