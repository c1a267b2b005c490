"""``usaf generate``: sampled text from the quantized model with a trained change, streamed to stdout."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from usaf.cli.options import ConfigOpt, DeviceOpt, JsonOpt, VerboseOpt, WorkspaceOpt

Opt = typer.Option


def command(
    prompt: Annotated[str, typer.Argument(help="The prompt (a user message when the chat template is applied).")],
    model: Annotated[Path | None, Opt(help="Quantized model directory [default: newest in the workspace].")] = None,
    checkpoint: Annotated[
        Path | None, Opt(help="Run, checkpoints/step-N or delta directory [default: newest run for the model].")
    ] = None,
    no_checkpoint: Annotated[
        bool | None, Opt("--no-checkpoint", help="Use the untrained quantized model (to compare).")
    ] = None,
    temperature: Annotated[float | None, Opt(help="Sampling temperature; 0 = greedy [default: 0.7].")] = None,
    top_p: Annotated[float | None, Opt(help="Nucleus sampling mass [default: 0.95].")] = None,
    max_new_tokens: Annotated[int | None, Opt(help="Tokens to generate at most [default: 128].")] = None,
    seed: Annotated[int | None, Opt(help="Sampling seed: the same seed gives the same text [default: 0].")] = None,
    chat: Annotated[
        bool | None, Opt("--chat/--no-chat", help="Apply the tokenizer's chat template if it has one [default: on].")
    ] = None,
    device: DeviceOpt = None,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    json_output: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Generate text with the trained change applied (streamed), to see what training changed."""
    from usaf.cli.console import handle_errors

    with handle_errors(verbose):
        from usaf.cli.console import note, print_json
        from usaf.cli.progress import RichProgress
        from usaf.config import resolve_config
        from usaf.stages.generate import GenerateConfig, run

        settings = resolve_config(
            GenerateConfig,
            section="generate",
            cli={
                "prompt": prompt,
                "model": model,
                "checkpoint": checkpoint,
                "no_checkpoint": no_checkpoint,
                "workspace": workspace,
                "temperature": temperature,
                "top_p": top_p,
                "max_new_tokens": max_new_tokens,
                "seed": seed,
                "chat": chat,
                "device": device,
            },
            config_file=config,
        )
        # Plain writes, not rich: generated text may contain [markup] that rich would interpret.
        stream = None if json_output else (lambda text: typer.echo(text, nl=False))
        result = run(settings, on_text=stream, progress=RichProgress())
        if json_output:
            print_json({k: str(v) if isinstance(v, Path) else v for k, v in result.__dict__.items()})
            return
        typer.echo("")
        rate = result.new_tokens / max(result.seconds, 1e-9)
        change = f"change {result.checkpoint}" if result.checkpoint is not None else "no change (untrained)"
        note(
            f"{result.new_tokens} tokens in {result.seconds:.1f} s ({rate:.1f} tok/s) on {result.device}; "
            f"{result.model}, {change}" + ("; chat template applied" if result.chat_template else "")
        )
