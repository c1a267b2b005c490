"""``usaf tokenize``: the first stage."""

from __future__ import annotations

from pathlib import Path

from usaf.cli.stage import stage_command


def _print_summary(console, manifest, path: Path) -> None:
    from rich.table import Table

    from usaf.units import counted

    s = manifest.summary
    table = Table(title=f"tokens → {path}", title_justify="left")
    for column in ("split", "sources", "sequences", "tokens", "loss tokens"):
        table.add_column(column, justify="right" if column != "split" else "left")
    for split in ("train", "heldout"):
        n_sources = sum(1 for c in s.sources if c.split == split)
        table.add_row(
            split,
            f"{n_sources:,}",
            f"{getattr(s, f'{split}_sequences'):,}",
            f"{getattr(s, f'{split}_tokens'):,}",
            f"{getattr(s, f'{split}_loss_tokens'):,}",
        )
    console.print(table)
    extras = [counted(s.documents, "document"), counted(s.input_bytes, "byte"), f"seq_len {s.seq_len}"]
    if s.skipped_binary_files:
        extras.append(f"{counted(s.skipped_binary_files, 'binary file')} skipped")
    if s.skipped_wide_files:
        extras.append(f"{counted(s.skipped_wide_files, 'UTF-16/UTF-32 file')} skipped")
    if s.skipped_by_default:
        extras.append(f"{counted(sum(s.skipped_by_default.values()), 'path')} skipped by default (--all-files)")
    if s.skipped_empty_documents:
        extras.append(f"{counted(s.skipped_empty_documents, 'empty document')} skipped")
    if s.relabelled_shifted_lines:
        extras.append(f"{counted(s.relabelled_shifted_lines, 'pre-shifted line')} unshifted")
    console.print(", ".join(extras))
    if s.heldout_sources:
        shown = ", ".join(s.heldout_sources[:8]) + (" ..." if len(s.heldout_sources) > 8 else "")
        console.print(f"held out: {shown}")


command = stage_command(
    "tokenize",
    summary=_print_summary,
    doc="Tokenize text into packed sequences (train.jsonl, heldout.jsonl), held out by source.",
)
