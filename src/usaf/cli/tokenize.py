"""``usaf tokenize``: the first stage."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from usaf.cli.options import ConfigOpt, JsonOpt, OverwriteOpt, VerboseOpt, WorkspaceOpt


def command(
    inputs: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Text files, directories (recursive) and JSONL files (text, chat 'messages', or input_ids).",
            show_default=False,
        ),
    ] = None,
    model: Annotated[str | None, typer.Option(help="Model directory or hub id whose tokenizer to use.")] = None,
    out: Annotated[
        Path | None, typer.Option(help="Output directory [default: WORKSPACE/tokens/<time>-<name>].")
    ] = None,
    seq_len: Annotated[int | None, typer.Option(help="Tokens per sequence [default: 512].")] = None,
    stride: Annotated[
        int | None,
        typer.Option(help="Overlap of consecutive sequences (tokens); overlapped tokens get label -100 [default: 0]."),
    ] = None,
    held_out: Annotated[
        list[str] | None,
        typer.Option("--held-out", help="Hold out this source (glob; repeatable): its sequences go to heldout.jsonl."),
    ] = None,
    held_out_frac: Annotated[
        float | None, typer.Option(help="Hold out this fraction of sources, chosen by --seed [default: 0].")
    ] = None,
    source_depth: Annotated[
        int | None,
        typer.Option(help="Path components under a directory input that name a file's source [default: 1]."),
    ] = None,
    include: Annotated[list[str] | None, typer.Option("--include", help="Only files matching this glob.")] = None,
    exclude: Annotated[list[str] | None, typer.Option("--exclude", help="Skip files matching this glob.")] = None,
    text_field: Annotated[str | None, typer.Option(help="JSONL field holding the text [default: text].")] = None,
    source_field: Annotated[
        str | None,
        typer.Option(help="JSONL field naming the source (else 'repo', else the file) [default: source]."),
    ] = None,
    decode_errors: Annotated[
        str | None,
        typer.Option(help="Non-UTF-8 text files: strict (error) | replace | skip [default: strict]."),
    ] = None,
    fix_shifted_labels: Annotated[
        bool | None,
        typer.Option("--fix-shifted-labels", help="Unshift pre-shifted labels in pre-tokenized JSONL input."),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the --held-out-frac choice [default: 0].")] = None,
    trust_remote_code: Annotated[
        bool | None,
        typer.Option("--trust-remote-code", help="Allow a hub tokenizer's own Python code to run."),
    ] = None,
    overwrite: OverwriteOpt = False,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    json_output: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Tokenize text into packed sequences (train.jsonl, heldout.jsonl), held out by source."""
    from usaf.cli.stage import run_stage

    run_stage(
        "tokenize",
        cli={
            "inputs": inputs or None,
            "model": model,
            "out": out,
            "workspace": workspace,
            "seq_len": seq_len,
            "stride": stride,
            "held_out": held_out or None,
            "held_out_frac": held_out_frac,
            "source_depth": source_depth,
            "include": include or None,
            "exclude": exclude or None,
            "text_field": text_field,
            "source_field": source_field,
            "decode_errors": decode_errors,
            "fix_shifted_labels": fix_shifted_labels,
            "seed": seed,
            "trust_remote_code": trust_remote_code,
            "overwrite": overwrite or None,
        },
        config_file=config,
        json_output=json_output,
        verbose=verbose,
        summary=_print_summary,
    )


def _print_summary(console, manifest, path: Path) -> None:
    from rich.table import Table

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
    extras = [f"{s.documents:,} documents", f"{s.input_bytes:,} bytes", f"seq_len {s.seq_len}"]
    if s.skipped_binary_files:
        extras.append(f"{s.skipped_binary_files} binary files skipped")
    if s.skipped_empty_documents:
        extras.append(f"{s.skipped_empty_documents} empty documents skipped")
    if s.relabelled_shifted_lines:
        extras.append(f"{s.relabelled_shifted_lines} pre-shifted lines unshifted")
    console.print(", ".join(extras))
    if s.heldout_sources:
        shown = ", ".join(s.heldout_sources[:8]) + (" ..." if len(s.heldout_sources) > 8 else "")
        console.print(f"held out: {shown}")
