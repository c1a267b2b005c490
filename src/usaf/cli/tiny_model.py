"""``usaf tiny-model OUT``: a tiny random MoE model + tokenizer, to try the pipeline offline."""

from __future__ import annotations

from typing import Any

from usaf.cli.flags import settings_command
from usaf.cli.options import COMMAND_EXTRAS
from usaf.errors import UsafError

TINY_MODEL = "tiny model"  # the kind its usaf-made marker names (what OUT --overwrite may replace)


def _run(cli: dict[str, Any], *, json_output: bool, verbose: bool) -> None:
    from usaf.cli.console import handle_errors

    with handle_errors(verbose):
        from usaf.artifacts import ArtifactWriter
        from usaf.cli.console import out as stdout
        from usaf.cli.console import print_json
        from usaf.config import resolve_config
        from usaf.families import SUPPORTED_FAMILIES, describe_model
        from usaf.settings.tiny_model import TinyModelConfig
        from usaf.testing import build_tiny_model

        # a bad value is one line naming its flag, as in every stage (a --seed of -1 was a pydantic traceback)
        settings = resolve_config(TinyModelConfig, section="tiny-model", cli=cli, env={})  # flags only
        family, layers = settings.family, settings.layers
        if family not in SUPPORTED_FAMILIES:
            raise UsafError(
                f"--family {family}: not a supported family", f"choose one of {', '.join(SUPPORTED_FAMILIES)}"
            )
        with ArtifactWriter(settings.out, kinds=(TINY_MODEL,), flag="OUT", overwrite=settings.overwrite) as art:
            build_tiny_model(family, art.dir, num_layers=layers, seed=settings.seed)
            try:  # before the commit: a model usaf cannot train was left written, its rerun refused (found in review)
                description = describe_model(art.dir)
            except UsafError as e:
                raise UsafError(f"--family {family} --layers {layers}: {e.message}", "pass more --layers") from None
            path = art.commit_foreign(TINY_MODEL)
        if json_output:  # described at its path: it named the temporary directory it was built in (review)
            print_json({"path": str(path), "model": {**description.to_dict(), "model_dir": str(path)}})
        else:
            from usaf.units import counted  # lazy: usaf --help stays instant

            layered = counted(layers, "layer")  # "1 layers" (review)
            stdout.print(f"wrote a tiny random {family} model ({layered}) with its tokenizer to {path}")


command = settings_command(
    "usaf.settings.tiny_model:TinyModelConfig",
    _run,
    extras=COMMAND_EXTRAS,
    doc="""Write a tiny random MoE model (family's real on-disk layout) with a tokenizer trained on stdlib text.

    Random weights: for trying commands and tests without a download, not for quality.
    """,
)
