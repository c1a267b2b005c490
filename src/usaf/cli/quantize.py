"""``usaf quantize MODEL``: 4-bit expert weights, everything else as it was."""

from __future__ import annotations

from pathlib import Path

from usaf.cli.stage import stage_command
from usaf.units import human_bytes


def _print_summary(console, manifest, path: Path) -> None:
    from rich.table import Table

    s = manifest.summary
    table = Table(title=f"quantized model → {path}", title_justify="left")
    for column in ("layer", "tensor", "shape", "group", "rel. error", "source", "quantized"):
        table.add_column(column, justify="left" if column == "tensor" else "right")
    rows = s.tensors if len(s.tensors) <= 16 else [*s.tensors[:8], None, *s.tensors[-8:]]
    for r in rows:
        if r is None:
            table.add_row("…", f"({len(s.tensors) - 16} more)", "", "", "", "", "")
            continue
        table.add_row(
            str(r.layer),
            r.name.rsplit(".", 1)[-1],
            "×".join(map(str, r.shape)),
            str(r.group_size),
            f"{r.rel_error:.4f}",
            human_bytes(r.source_bytes),
            human_bytes(r.quantized_bytes),
        )
    console.print(table)
    console.print(
        f"{s.source.family}: {len(s.moe_layers)} MoE layers, {s.tensors_quantized} expert tensors "
        f"({s.params_quantized:,} weights) {s.quant.method} {s.quant.nbits}-bit: "
        f"{human_bytes(s.experts_source_bytes)} → {human_bytes(s.experts_quantized_bytes)} "
        f"(×{s.compression_ratio:.2f}); relative error mean {s.mean_rel_error:.4f}, max {s.max_rel_error:.4f}; "
        f"{s.tensors_kept} other tensors kept ({human_bytes(s.base_bytes)})"
    )
    adjusted = s.group_sizes_adjusted
    if adjusted:
        # the table shows 16 tensors at most: the rest are in the manifest (it said "the table gives each"; review)
        more = f" and {len(adjusted) - 4} more (usaf inspect {path} --json lists each)" if len(adjusted) > 4 else ""
        console.print(f"group size adjusted to divide the input width: {', '.join(adjusted[:4])}{more}")


command = stage_command(
    "quantize",
    summary=_print_summary,
    doc="""Quantize a MoE model's expert weights (HQQ 4-bit by default) into a self-contained directory.

    Reads one MoE layer's experts at a time; an interrupted run resumes when the same command is rerun.
    """,
)
