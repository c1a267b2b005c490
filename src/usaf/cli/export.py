"""``usaf export``: a trained change as a Hugging Face model directory (merged), or as a shareable delta."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from usaf.cli.flags import settings_command


def _run(cli: dict[str, Any], *, config: Path | None, json_output: bool, verbose: bool) -> None:
    from usaf.cli.stage import run_stage

    run_stage("export", cli=cli, config_file=config, json_output=json_output, verbose=verbose, summary=_print_summary)


command = settings_command(
    "usaf.settings.export:ExportConfig",
    _run,
    doc="""Write a trained change into a Hugging Face model directory (or the change alone), verified by a reload.

    Never re-quantizes: trained weights are base + delta in the original's dtype.
    """,
)


def _print_summary(console, manifest, path: Path) -> None:
    from usaf.units import counted  # lazy: the command's own imports load with it

    s = manifest.summary
    if manifest.kind == "delta":
        console.print(
            f"delta → {path}: {counted(s.expert_entries, 'delta entry')} in {counted(len(s.tensors), 'tensor')} + "
            f"{counted(s.router_tensors, 'router tensor')} ({counted(s.router_params, 'weight')}), layers "
            f"{s.trainable_layers}; "
            f"apply it with usaf export --checkpoint {path}"
        )
        return
    base = f"--base {s.base_path}" if s.base == "original" else "dequantized base"
    if s.change_source is None:
        applied = "the dequantized base alone (--no-checkpoint)"
    else:
        applied = (
            f"{counted(s.expert_entries, 'delta entry')} applied to {counted(s.expert_tensors_changed, 'tensor')}, "
            f"{counted(s.router_tensors, 'router tensor')} replaced, {counted(s.tensors_copied, 'tensor')} copied as "
            f"they were ({base})"  # changed: experts, attention
        )
    console.print(
        f"export → {path}: {counted(len(s.shards), 'shard')}, {s.bytes / 2**20:,.1f} MiB, "
        f"{counted(s.tensors, 'tensor')}; {applied}"
    )
    if s.verify is not None:
        console.print(_verified_line(s.verify, alone=s.change_source is None))
    else:
        console.print("not verified (--no-verify)")
    for note in s.notes:
        console.print(f"note: {note}")


def _verified_line(v, *, alone: bool) -> str:
    """What the reload showed: the exact check, then the change's effect against the engine's."""
    line = (
        f"verified: reloaded with transformers, max |Δlogit| vs the same weights built in memory "
        f"({'dequantized base' if alone else v.reference}) = {v.max_abs_diff:.3g} (tolerance {v.tolerance:.3g})"
    )
    if alone:
        line += f"; vs the engine's quantized base {v.engine_max_abs_diff:.3g} (the export dtype's rounding)"
    elif v.change_effect_tolerance is not None:
        line += (
            f"; the change moves logits by up to {v.change_max_abs_effect:.3g} (RMS {v.change_rms:.3g} in the "
            f"engine), as exported vs as trained RMS {v.change_effect_diff_rms:.3g} (tolerance "
            f"{v.change_effect_tolerance:.3g}; the export dtype's rounding of the model alone: "
            f"RMS {v.rounding_rms:.3g})"
        )
    elif v.engine_max_abs_diff is not None:
        line += (
            f"; the change moves logits by up to {v.change_max_abs_effect:.3g}; vs the quantized engine "
            f"{v.engine_max_abs_diff:.3g}"
        )
    return line
