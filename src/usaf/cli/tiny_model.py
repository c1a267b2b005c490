"""``usaf tiny-model OUT``: a tiny random MoE model + tokenizer, to try the pipeline offline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from usaf.cli.options import JsonOpt, OverwriteOpt, VerboseOpt


def command(
    out: Annotated[Path, typer.Argument(help="Directory to write the Hugging Face model directory to.")],
    family: Annotated[str, typer.Option(help="Model family (config.json model_type).")] = "qwen3_moe",
    layers: Annotated[int, typer.Option(min=1, max=64, help="Decoder layers.")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    overwrite: OverwriteOpt = False,
    json_output: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Write a tiny random MoE model (family's real on-disk layout) with a tokenizer trained on stdlib text.

    Random weights: for trying commands and tests without a download, not for quality.
    """
    from usaf.cli.console import handle_errors

    with handle_errors(verbose):
        from usaf.artifacts import ArtifactWriter
        from usaf.cli.console import out as stdout
        from usaf.cli.console import print_json
        from usaf.errors import UsafError
        from usaf.families import SUPPORTED_FAMILIES, describe_model
        from usaf.testing import build_tiny_model

        if family not in SUPPORTED_FAMILIES:
            raise UsafError(
                f"--family {family}: not a supported family", f"choose one of {', '.join(SUPPORTED_FAMILIES)}"
            )
        with ArtifactWriter(out, flag="OUT", overwrite=overwrite) as art:
            build_tiny_model(family, art.dir, num_layers=layers, seed=seed)
            path = art.commit_foreign()
        description = describe_model(path)
        if json_output:
            print_json({"path": str(path), "model": description.to_dict()})
        else:
            stdout.print(f"wrote a tiny random {family} model ({layers} layers) with its tokenizer to {path}")
