"""``usaf export``: a trained change as a Hugging Face model directory (merged), or as a shareable delta."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from usaf.cli.options import ConfigOpt, JsonOpt, OverwriteOpt, VerboseOpt, WorkspaceOpt

Opt = typer.Option


def command(
    model: Annotated[
        Path | None, Opt(help="Quantized model directory [default: the one the change was trained on].")
    ] = None,
    checkpoint: Annotated[
        Path | None, Opt(help="Run, checkpoints/step-N or delta directory [default: newest run for the model].")
    ] = None,
    out: Annotated[
        Path | None, Opt(help="Output directory [default: WORKSPACE/hf_export|delta/<time>-<name>].")
    ] = None,
    base: Annotated[
        str | None,
        Opt(
            help="Original model (directory or hub id, offline cache) to merge into [default: the "
            "dequantized 4-bit experts]."
        ),
    ] = None,
    format: Annotated[
        str | None, Opt("--format", help="hf (merged model directory, default) | delta (change alone).")
    ] = None,
    dtype: Annotated[
        str | None, Opt(help="float32 | bfloat16 | float16 for floating tensors [default: each keeps the original's].")
    ] = None,
    max_shard_gib: Annotated[float | None, Opt(help="Largest safetensors shard, in GiB [default: 2].")] = None,
    verify: Annotated[
        bool | None,
        Opt(
            "--verify/--no-verify", help="Reload with transformers and compare logits before committing [default: on]."
        ),
    ] = None,
    device: Annotated[str | None, Opt(help="Where verification runs (--format hf), in fp32 [default: cpu].")] = None,
    overwrite: OverwriteOpt = False,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    json_output: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Write a trained change into a Hugging Face model directory (or the change alone), verified by a reload.

    Never re-quantizes: trained weights are base + delta in the original's dtype.
    """
    from usaf.cli.stage import run_stage

    if device is not None and format == "delta":  # refused here, not in the settings: USAF_DEVICE sets it everywhere
        from usaf.cli.console import handle_errors
        from usaf.errors import UsafError

        with handle_errors(verbose):
            raise UsafError(
                "--device sets where --format hf verification runs; --format delta runs nothing on a device",
                "drop --device, or pass --format hf",
            )
    run_stage(
        "export",
        cli={
            "model": model,
            "checkpoint": checkpoint,
            "out": out,
            "workspace": workspace,
            "base": base,
            "format": format,
            "dtype": dtype,
            "max_shard_gib": max_shard_gib,
            "verify": verify,
            "device": device,
            "overwrite": overwrite or None,
        },
        config_file=config,
        json_output=json_output,
        verbose=verbose,
        summary=_print_summary,
    )


def _print_summary(console, manifest, path: Path) -> None:
    s = manifest.summary
    if manifest.kind == "delta":
        console.print(
            f"delta → {path}: {s.expert_entries:,} expert entries in {len(s.tensors)} tensors + "
            f"{s.router_tensors} router tensors ({s.router_params:,} weights), layers {s.trainable_layers}; "
            f"apply it with usaf export --checkpoint {path}"
        )
        return
    base = f"--base {s.base_path}" if s.base == "original" else "dequantized 4-bit base"
    console.print(
        f"export → {path}: {len(s.shards)} shards, {s.bytes / 2**20:,.1f} MiB, {s.tensors:,} tensors; "
        f"{s.expert_entries:,} delta entries applied to {s.expert_tensors_changed} expert tensors, "
        f"{s.router_tensors} routers replaced, {s.tensors_copied:,} tensors copied as they were ({base})"
    )
    if s.verify is not None:
        v = s.verify
        console.print(
            f"verified: reloaded with transformers, max |Δlogit| vs the {v.reference} = {v.max_abs_diff:.3g} "
            f"(tolerance {v.tolerance:.3g}; the change itself moves logits by up to {v.change_max_abs_effect:.3g}"
            + (f"; vs the 4-bit engine {v.engine_max_abs_diff:.3g}" if v.engine_max_abs_diff is not None else "")
            + ")"
        )
    else:
        console.print("not verified (--no-verify)")
    for note in s.notes:
        console.print(f"note: {note}")
