"""Turning two passes into the report's rows (per source and per set) and routing drift, and ``report.md``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from usaf.artifacts.eval_report import Difference, Estimate, EvalSummary, LayerDrift, ResultRow
from usaf.engine.routing import changed_tokens, expert_counts, load_summary
from usaf.stages.eval.inputs import DATA, HELD_OUT, EvalSequence
from usaf.stages.eval.passes import PassResult
from usaf.stages.eval.stats import bootstrap_row, ppl, row_seed

ALL = "all"


def result_rows(
    sequences: Sequence[EvalSequence],
    base: PassResult,
    tuned: PassResult | None,
    *,
    samples: int,
    seed: int,
) -> list[ResultRow]:
    """One row per (set, source), then each set's overall row; sequences without scored tokens left out."""
    groups: dict[tuple[str, bool, str], list[int]] = {}  # (set, overall, source) -> sequence indices
    for i, s in enumerate(sequences):
        if int(base.tokens[i]) > 0:
            groups.setdefault((s.set, False, s.source), []).append(i)
            groups.setdefault((s.set, True, ALL), []).append(i)  # a source may be called "all" too
    order = {DATA: 0, HELD_OUT: 1}
    rows = []
    for set_name, overall, source in sorted(groups, key=lambda k: (order.get(k[0], 2), k[1], k[2])):
        idx = torch.tensor(groups[(set_name, overall, source)])
        stats = bootstrap_row(
            base.nll[idx],
            tuned.nll[idx] if tuned is not None else None,
            base.tokens[idx],
            samples=samples,
            seed=row_seed(seed, idx),
        )
        rows.append(
            ResultRow(
                set=set_name,
                source=source,
                overall=overall,
                sequences=stats.sequences,
                tokens=stats.tokens,
                base=_estimate(stats.base_nll, stats.base_ci),
                tuned=_estimate(stats.tuned_nll, stats.tuned_ci) if stats.tuned_nll is not None else None,
                delta=_difference(stats) if stats.delta_nll is not None else None,
            )
        )
    return rows


def _estimate(nll: float, ci: tuple[float, float] | None) -> Estimate:
    return Estimate(
        nll=nll, ppl=ppl(nll), nll_ci=list(ci) if ci else None, ppl_ci=[ppl(ci[0]), ppl(ci[1])] if ci else None
    )


def _difference(stats) -> Difference:
    ci = stats.delta_ci
    return Difference(
        nll=stats.delta_nll,
        ppl=ppl(stats.tuned_nll) - ppl(stats.base_nll),
        nll_ci=list(ci) if ci else None,
        ppl_ci=list(stats.delta_ppl_ci) if stats.delta_ppl_ci else None,
        excludes_zero=(ci[0] > 0 or ci[1] < 0) if ci else None,
    )


def routing_drift(base: PassResult, tuned: PassResult | None, num_experts: dict[int, int]) -> list[LayerDrift]:
    """Per MoE layer: load of both models over the same tokens, and the share of changed top-k sets."""
    drift = []
    for layer in sorted(base.routing):
        experts = num_experts[layer]
        b = load_summary(expert_counts(base.routing[layer], experts))
        t = load_summary(expert_counts(tuned.routing[layer], experts)) if tuned is not None else None
        changed = None
        if tuned is not None:
            n = base.routing[layer].shape[0]
            changed = changed_tokens(base.routing[layer], tuned.routing[layer]) / max(n, 1)
        drift.append(
            LayerDrift(
                layer=layer,
                experts=experts,
                base_tokens_per_expert=b.tokens_per_expert,
                base_entropy=b.entropy,
                base_max_share=b.max_share,
                base_dead=b.dead_experts,
                tuned_tokens_per_expert=t.tokens_per_expert if t else None,
                tuned_entropy=t.entropy if t else None,
                tuned_max_share=t.max_share if t else None,
                tuned_dead=t.dead_experts if t else None,
                changed_fraction=changed,
            )
        )
    return drift


# -- text ------------------------------------------------------------------------------------------------


def fmt_ci(ci: list[float] | None, digits: int = 2) -> str:
    return f"[{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]" if ci else "(n < 2)"


def markdown(summary: EvalSummary, *, model: str) -> str:
    """``report.md``: what was evaluated, the perplexity table, routing drift, plots."""
    s = summary
    pct = round(100 * s.confidence)
    lines = ["# usaf eval report", ""]
    lines.append(f"- model: `{model}` (fingerprint `{s.model_fingerprint[:16]}`)")
    if s.checkpoint is None:
        lines.append("- checkpoint: none; **base model only**")
    else:
        lines.append(f"- checkpoint: `{s.checkpoint}` (layers {s.trainable_layers})")
        lines.append(f"- checkpoint applied: max |Δ logit| on the first batch = {s.max_logit_change:.3g}")
    how = "reused from the cache" if s.base_cached else "computed"
    lines.append(f"- base pass: {how}" + (f" (`{s.base_cache}`)" if s.base_cache else " (cache off)"))
    lines.append("- experts: " + ("dequantized once (resident)" if s.experts_resident else "dequantized per forward"))
    for item in s.inputs:
        lines.append(
            f"- {item.flag} `{item.path}` ({item.kind}): {item.sequences:,} sequences, {item.tokens:,} scored tokens"
        )
    lines.append(
        f"- intervals: {pct} % percentile bootstrap over sequences, {s.bootstrap_samples} resamples, seed {s.seed}; "
        "Δ = fine-tuned − base, paired"
    )
    lines += ["", "## Perplexity", ""]
    if s.checkpoint is None:
        lines += ["| set | source | sequences | tokens | base PPL | 95 % CI |", "|---|---|---:|---:|---:|---|"]
        for r in s.rows:
            lines.append(
                f"| {r.set} | {_source(r)} | {r.sequences:,} | {r.tokens:,} | {r.base.ppl:.3f} | "
                f"{_plain_ci(r.base.ppl_ci)} |"
            )
    else:
        lines += [
            f"| set | source | sequences | tokens | base PPL | tuned PPL | Δ PPL [{pct} % CI] | Δ NLL [{pct} % CI] |",
            "|---|---|---:|---:|---:|---:|---|---|",
        ]
        for r in s.rows:
            d = r.delta
            lines.append(
                f"| {r.set} | {_source(r)} | {r.sequences:,} | {r.tokens:,} | {r.base.ppl:.3f} | "
                f"{r.tuned.ppl:.3f} | {d.ppl:+.3f} {fmt_ci(d.ppl_ci, 3)} | {d.nll:+.4f} {fmt_ci(d.nll_ci, 4)} |"
            )
    lines += ["", "## Routing drift", ""]
    lines += [
        "| layer | entropy base → tuned | max share base → tuned | dead experts base → tuned | top-k set changed |",
        "|---:|---|---|---|---:|",
    ]
    for d in s.routing:
        tuned = d.tuned_entropy is not None
        lines.append(
            f"| {d.layer} | {d.base_entropy:.3f}" + (f" → {d.tuned_entropy:.3f}" if tuned else "")
            + f" | {d.base_max_share:.3f}" + (f" → {d.tuned_max_share:.3f}" if tuned else "")
            + f" | {d.base_dead}" + (f" → {d.tuned_dead}" if tuned else "")
            + " | " + (f"{100 * d.changed_fraction:.2f} %" if d.changed_fraction is not None else "-") + " |"
        )  # fmt: skip
    lines.append("")
    lines.append("Entropy in nats (even load over E experts: log E). Top-k sets compared per token, order ignored.")
    if s.plots or s.plots_note:
        lines += ["", "## Plots", ""]
        lines += [f"![{p}]({p})" for p in s.plots]
        if s.plots_note:
            lines.append(s.plots_note)
    lines.append("")
    return "\n".join(lines)


def _plain_ci(ci: list[float] | None) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "(n < 2)"


def _source(row) -> str:
    """A source's name, escaped for a table cell; the overall row in bold."""
    return "**all**" if row.overall else row.source.replace("|", "\\|")
