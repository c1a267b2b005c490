"""``usaf eval``: base vs fine-tuned perplexity per source with bootstrap intervals, and routing drift."""

from __future__ import annotations

from pathlib import Path

from usaf.cli.stage import stage_command


def _print_summary(console, manifest, path: Path) -> None:
    from rich.markup import escape
    from rich.table import Table

    from usaf.stages.eval.report import fmt_ci, plain_ci, row_label, shown_rows

    s = manifest.summary
    tuned = s.checkpoint is not None
    title = f"eval → {escape(str(path))}" + ("" if tuned else "  (base model only: no checkpoint)")
    table = Table(title=title, title_justify="left")
    columns = ["set", "source", "seqs", "tokens", "base PPL"]
    columns += ["tuned PPL", f"Δ PPL [{round(100 * s.confidence)} % CI]"] if tuned else ["95 % CI"]
    for column in columns:
        # a source wraps, never cut: "http/cooki…" was cookiejar.py and cookies.py alike on 80 columns (review)
        table.add_column(column, justify="left" if column in ("set", "source") else "right",
                         overflow="fold" if column == "source" else "ellipsis")  # fmt: skip
    rows = shown_rows(s.rows)
    hidden = _beyond_the_largest(rows)
    unsaid: dict[tuple, int] = {}  # a group's sources left out, said in a row after its last shown one

    def say_unsaid() -> None:
        for count in unsaid.values():
            table.add_row("", f"… {count} more: report.md", *[""] * (len(columns) - 2))
        unsaid.clear()

    for r in rows:
        group = (r.set, r.input)
        if unsaid and (r.overall or group not in unsaid):
            say_unsaid()
        if id(r) in hidden:
            unsaid[group] = unsaid.get(group, 0) + 1
            continue
        label = escape(row_label(r, s.rows, short=True))  # a source, or a total: of one input, of the set
        cells = [r.set, label, f"{r.sequences:,}", f"{r.tokens:,}", f"{r.base.ppl:.2f}"]
        if tuned:
            d = r.delta
            style = "" if not d.excludes_zero else ("green" if d.nll < 0 else "red")
            delta = f"{d.ppl:+.2f} {fmt_ci(d.ppl_ci)}"
            cells += [f"{r.tuned.ppl:.2f}", f"[{style}]{delta}[/{style}]" if style else delta]
        else:
            cells.append(plain_ci(r.base.ppl_ci, 2))  # the PPL's digits (the CI had 3: found in review)
        table.add_row(*cells, end_section=r.overall)
    say_unsaid()
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
        first = s.tuned_pass.first_layer  # from a later layer its rate is not the whole model's: say so
        scope = f" from layer {first} (below it, the base pass's states)" if first else ""
        line += f"; fine-tuned pass{scope}: {s.tuned_pass.tokens_per_s:,.0f} tokens/s"
        line += f" (max |Δ logit| {s.max_logit_change:.3g})"
    console.print(line, markup=False)
    if s.heldout_in_training:  # said again after the tables it qualifies
        console.print(f"warning: {s.overlap_note}", markup=False, style="yellow")
    if tuned and _held_out_is_the_training_tokens_alone(s.inputs):  # found in review: 41-136 % worse elsewhere, unsaid
        console.print("not measured: forgetting (what the change costs on other text). Every held-out sequence here "
                      "is of the tokens the run trained with; add --held-out FILES of text the model knew before "
                      "training (its pretraining domain) to see it", markup=False)  # fmt: skip
    if s.plots:
        console.print("plots: " + ", ".join(str(path / p) for p in s.plots), markup=False)
    elif s.plots_note:
        console.print(s.plots_note, markup=False)
    console.print(f"report: {path / 'report.md'}", markup=False)


SOURCES_SHOWN = 12  # per input: a corpus of 137 sources printed about 400 lines before its total (found in review)


def _beyond_the_largest(rows) -> set[int]:
    """The ids of the source rows a terminal table leaves out: past the :data:`SOURCES_SHOWN` with the most tokens of
    their input (report.md and report.json keep every one)."""
    groups: dict[tuple, list] = {}
    for r in rows:
        if not r.overall:
            groups.setdefault((r.set, r.input), []).append(r)
    return {id(r) for members in groups.values()
            for r in sorted(members, key=lambda r: -r.tokens)[SOURCES_SHOWN:]}  # fmt: skip


def _held_out_is_the_training_tokens_alone(inputs) -> bool:
    """Whether every held-out input is one of the in-domain (``--data``) inputs' tokens: then nothing measures the
    change on other text."""
    data = {i.path for i in inputs if i.set == "data"}
    held = [i.path for i in inputs if i.set == "held-out"]
    return bool(held) and all(path in data for path in held)


command = stage_command(
    "eval",
    summary=_print_summary,
    doc="""Compare the base and the fine-tuned model on the same sequences: perplexity per source with 95 %
    bootstrap intervals, and routing drift per MoE layer (a report for people and for scripts).""",
)
