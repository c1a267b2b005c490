"""``usaf eval``: base vs fine-tuned perplexity per source with bootstrap intervals, and routing drift."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from usaf.cli.options import (
    ConfigOpt,
    DeviceOpt,
    JsonOpt,
    OverwriteOpt,
    StreamExpertsOpt,
    VerboseOpt,
    WorkspaceOpt,
)

Opt = typer.Option


def command(
    model: Annotated[
        Path | None, Opt(help="Quantized model directory (default: the one --checkpoint was trained on, else newest).")
    ] = None,
    checkpoint: Annotated[
        Path | None,
        Opt(
            help="Run directory, unfinished run or checkpoints/step-N to evaluate. Not given: the base model only; "
            "with neither --model nor --checkpoint, the newest finished run for the workspace's newest model."
        ),
    ] = None,
    data: Annotated[
        list[Path] | None,
        Opt("--data", help="In-domain sequences: a tokens dir (its train.jsonl), tokens JSONL or text (repeatable)."),
    ] = None,
    held_out: Annotated[
        list[Path] | None,
        Opt(
            "--held-out",
            help="Held-out sequences: a tokens dir (its heldout.jsonl), tokens JSONL, JSONL of text, or text "
            "files/directories tokenized with the model's tokenizer (repeatable).",
        ),
    ] = None,
    out: Annotated[Path | None, Opt(help="Report directory (default: WORKSPACE/eval_report/<time>-<name>).")] = None,
    microbatch: Annotated[int | None, Opt(help="Sequences per forward (default: 8).")] = None,
    max_sequences: Annotated[
        int | None, Opt(help="Evaluate a seeded random sample of this many sequences per input (default: all).")
    ] = None,
    seq_len: Annotated[
        int | None, Opt(help="Raw text: tokens per packed sequence (default: 512, capped by the model's context).")
    ] = None,
    source_depth: Annotated[
        int | None, Opt(help="Raw text directories: path components that name a source (default: 1).")
    ] = None,
    text_field: Annotated[str | None, Opt(help="JSONL of text: the text field (default: text).")] = None,
    source_field: Annotated[
        str | None, Opt(help="JSONL of text: the field naming the source, else repo (default: source).")
    ] = None,
    bootstrap: Annotated[int | None, Opt(help="Bootstrap resamples per interval (default: 1000).")] = None,
    seed: Annotated[int | None, Opt(help="Seed of the bootstrap and of --max-sequences (default: 0).")] = None,
    base_cache: Annotated[
        bool | None,
        Opt("--base-cache/--no-base-cache", help="Reuse/store the base pass in WORKSPACE/cache (default: on)."),
    ] = None,
    plots: Annotated[
        bool | None, Opt("--plots/--no-plots", help="PNG plots, needs matplotlib (default: when it is installed).")
    ] = None,
    resident: Annotated[
        bool | None,
        Opt(
            "--resident/--streaming",
            help="Dequantize all experts once (fast; full-size memory) or the routed ones per forward (4-bit "
            "memory) (default: once when they fit in half the free memory).",
        ),
    ] = None,
    stream_experts: StreamExpertsOpt = None,
    overwrite: OverwriteOpt = False,
    device: DeviceOpt = None,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    json_output: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Compare the base and the fine-tuned model on the same sequences: perplexity per source with 95 %
    bootstrap intervals, and routing drift per MoE layer (a report for people and for scripts)."""
    from usaf.cli.stage import run_stage

    run_stage(
        "eval",
        cli={
            "model": model,
            "checkpoint": checkpoint,
            "data": data or None,
            "held_out": held_out or None,
            "out": out,
            "workspace": workspace,
            "microbatch": microbatch,
            "max_sequences": max_sequences,
            "seq_len": seq_len,
            "source_depth": source_depth,
            "text_field": text_field,
            "source_field": source_field,
            "bootstrap": bootstrap,
            "seed": seed,
            "base_cache": base_cache,
            "plots": plots,
            "resident": resident,
            "stream_experts": stream_experts,
            "device": device,
            "overwrite": overwrite or None,
        },
        config_file=config,
        json_output=json_output,
        verbose=verbose,
        summary=_print_summary,
    )


def _print_summary(console, manifest, path: Path) -> None:
    from rich.markup import escape
    from rich.table import Table

    from usaf.stages.eval.report import fmt_ci

    s = manifest.summary
    tuned = s.checkpoint is not None
    title = f"eval → {escape(str(path))}" + ("" if tuned else "  (base model only: no checkpoint)")
    table = Table(title=title, title_justify="left")
    columns = ["set", "source", "seqs", "tokens", "base PPL"]
    columns += ["tuned PPL", f"Δ PPL [{round(100 * s.confidence)} % CI]"] if tuned else ["95 % CI"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("set", "source") else "right")
    for r in s.rows:
        cells = [r.set, escape(r.source), f"{r.sequences:,}", f"{r.tokens:,}", f"{r.base.ppl:.2f}"]
        if tuned:
            d = r.delta
            style = "" if not d.excludes_zero else ("green" if d.nll < 0 else "red")
            delta = f"{d.ppl:+.2f} {fmt_ci(d.ppl_ci)}"
            cells += [f"{r.tuned.ppl:.2f}", f"[{style}]{delta}[/{style}]" if style else delta]
        else:
            cells.append(f"[{r.base.ppl_ci[0]:.3f}, {r.base.ppl_ci[1]:.3f}]" if r.base.ppl_ci else "(n < 2)")
        table.add_row(*cells, end_section=r.overall)
    console.print(table)

    drift = Table(title="routing drift per MoE layer", title_justify="left")
    for column in ("layer", "entropy", "max share", "dead experts", "top-k changed"):
        drift.add_column(column, justify="right")
    for d in s.routing:
        if d.tuned_entropy is None:
            drift.add_row(str(d.layer), f"{d.base_entropy:.3f}", f"{d.base_max_share:.3f}", str(d.base_dead), "-")
        else:
            drift.add_row(
                str(d.layer),
                f"{d.base_entropy:.3f} → {d.tuned_entropy:.3f}",
                f"{d.base_max_share:.3f} → {d.tuned_max_share:.3f}",
                f"{d.base_dead} → {d.tuned_dead}",
                f"{100 * d.changed_fraction:.2f} %",
            )
    console.print(drift)
    base = s.base_pass
    cached = f"reused from the cache {s.base_cache}" if s.base_cached else f"{base.tokens_per_s:,.0f} tokens/s"
    line = f"base pass: {cached}"
    if s.tuned_pass is not None:
        line += f"; fine-tuned pass: {s.tuned_pass.tokens_per_s:,.0f} tokens/s (max |Δ logit| {s.max_logit_change:.3g})"
    console.print(line, markup=False)
    if s.plots:
        console.print("plots: " + ", ".join(str(path / p) for p in s.plots), markup=False)
    elif s.plots_note:
        console.print(s.plots_note, markup=False)
    console.print(f"report: {path / 'report.md'}", markup=False)
