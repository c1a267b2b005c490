"""``usaf export``: a trained change as a Hugging Face model directory (merged), or as a shareable delta."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from usaf.cli.flags import settings_command
from usaf.errors import UsafError


def _run(cli: dict[str, Any], *, config: Path | None, json_output: bool, verbose: bool) -> None:
    from usaf.cli.stage import run_stage

    # Refused here, not in the settings: USAF_DEVICE and [defaults] set --device for every command.
    if cli["device"] is not None and cli["format"] == "delta":
        from usaf.cli.console import handle_errors

        with handle_errors(verbose):
            raise UsafError(
                "--device sets where --format hf verification runs; --format delta runs nothing on a device",
                "drop --device, or pass --format hf",
            )
    run_stage("export", cli=cli, config_file=config, json_output=json_output, verbose=verbose, summary=_print_summary)


command = settings_command(
    "usaf.settings.export:ExportConfig",
    _run,
    doc="""Write a trained change into a Hugging Face model directory (or the change alone), verified by a reload.

    Never re-quantizes: trained weights are base + delta in the original's dtype.
    """,
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
