"""``usaf generate``: sampled text from the quantized model with a trained change, streamed to stdout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from usaf.cli.flags import settings_command


def _run(cli: dict[str, Any], *, config: Path | None, json_output: bool, verbose: bool) -> None:
    from usaf.cli.console import handle_errors

    with handle_errors(verbose):
        from usaf.cli.console import note, print_json
        from usaf.cli.progress import RichProgress
        from usaf.config import resolve_config
        from usaf.settings.generate import GenerateConfig
        from usaf.stages.generate import run
        from usaf.units import counted

        settings = resolve_config(GenerateConfig, section="generate", cli=cli, config_file=config)
        # Plain writes, not rich: generated text may contain [markup] that rich would interpret.
        streamed: list[bool] = []

        def stream(text: str) -> None:
            streamed.append(True)
            typer.echo(text, nl=False)

        try:
            result = run(settings, on_text=None if json_output else stream, progress=RichProgress())
        except KeyboardInterrupt:  # the text ends its line: "interrupted: ..." was glued to it (found in review)
            if streamed:
                typer.echo("")
            raise
        if json_output:
            print_json({k: str(v) if isinstance(v, Path) else v for k, v in result.__dict__.items()})
            return
        typer.echo("")
        rate = result.new_tokens / max(result.seconds, 1e-9)
        moved = result.streamed and not result.unified_memory  # on a CPU it said so after "moves nothing" (review)
        change = f"change {result.checkpoint}" if result.checkpoint is not None else "no change (untrained)"
        note(
            f"{counted(result.new_tokens, 'token')} in {result.seconds:.1f} s ({rate:.1f} tok/s) on {result.device} "
            f"({result.dtype}{', experts streamed from host memory' if moved else ''}); "
            f"{result.model}, {change}"
            # a base model (the demo's, pretrained on code) continues text: say how to get that
            + ("; chat template applied (--no-chat: continue the prompt as plain text)" if result.chat_template else "")
        )


command = settings_command(
    "usaf.settings.generate:GenerateConfig",
    _run,
    doc="Generate text with the trained change applied (streamed), to see what training changed.",
)
