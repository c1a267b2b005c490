"""Turning two passes into the report's rows (per source and per set) and routing drift, and ``report.md``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from usaf.artifacts.eval_report import Difference, Estimate, EvalSummary, LayerDrift, ResultRow
from usaf.engine.routing import changed_tokens, expert_counts, load_summary
from usaf.stages.eval.inputs import DATA, HELD_OUT, EvalInput, sequences_fingerprint
from usaf.stages.eval.passes import PassResult
from usaf.stages.eval.stats import bootstrap_row, ppl, row_seed
from usaf.units import counted

ALL = "all"


def result_rows(
    inputs: Sequence[EvalInput],
    base: PassResult,
    tuned: PassResult | None,
    *,
    samples: int,
    seed: int,
) -> list[ResultRow]:
    """Per set: for each of its inputs a row per source, then the input's total (when the set has several
    inputs: A and B may be different kinds of text, one pooled number would hide that); then the set's
    overall row. Sequences without scored tokens are left out.

    ``base``/``tuned`` hold one entry per sequence, inputs in order.
    """
    groups: dict[tuple[int, int, int, str], list[int]] = {}  # (set order, input position, kind, source) -> idx
    meta: dict[tuple[int, int, int, str], tuple[str, str | None]] = {}  # the same key -> (set, input path)
    per_set = Counter(item.set for item in inputs)
    seen: Counter[str] = Counter()  # inputs of each set so far
    flat = [s for item in inputs for s in item.sequences]
    i = 0
    for item in inputs:
        order, position = _SET_ORDER.get(item.set, 2), seen[item.set]
        seen[item.set] += 1
        for s in item.sequences:
            keys = [((order, position, _SOURCE, s.source), (item.set, str(item.path)))]
            if per_set[item.set] > 1:
                keys.append(((order, position, _INPUT, ALL), (item.set, str(item.path))))
            keys.append(((order, len(inputs), _SET, ALL), (item.set, None)))  # after every input of the set
            if int(base.tokens[i]) > 0:
                for key, about in keys:
                    groups.setdefault(key, []).append(i)
                    meta[key] = about
            i += 1
    return [
        _row(key, meta[key], groups[key], base, tuned, samples=samples,
             seed=row_seed(seed, sequences_fingerprint(flat[i] for i in groups[key])))
        for key in sorted(groups)
    ]  # fmt: skip


_SET_ORDER = {DATA: 0, HELD_OUT: 1}
# An input's kind as the report names it: "text" is whatever eval packed itself (text files, text or chat JSONL), so the
# word alone called a chat JSONL text (found in review).
_KIND_SHOWN = {"tokens": "tokens", "tokens-jsonl": "pre-tokenized JSONL", "text": "tokenized by eval"}

_SOURCE, _INPUT, _SET = 0, 1, 2  # row kinds, in their order within an input and within a set


def _row(key, about, indices: list[int], base: PassResult, tuned: PassResult | None, *, samples, seed) -> ResultRow:
    (_, _, kind, source), (set_name, path) = key, about
    idx = torch.tensor(indices)
    stats = bootstrap_row(
        base.nll[idx],
        tuned.nll[idx] if tuned is not None else None,
        base.tokens[idx],
        samples=samples,
        seed=seed,
    )
    return ResultRow(
        set=set_name,
        source=source,
        overall=kind != _SOURCE,  # a source may be called "all" too
        input=path,
        sequences=stats.sequences,
        tokens=stats.tokens,
        base=_estimate(stats.base_nll, stats.base_ci),
        tuned=_estimate(stats.tuned_nll, stats.tuned_ci) if stats.tuned_nll is not None else None,
        delta=_difference(stats) if stats.delta_nll is not None else None,
    )


def shown_rows(rows: Sequence[ResultRow]) -> list[ResultRow]:
    """The rows a table shows: a total is left out where it covers one source, whose row it repeats (the same
    sequences, so the same numbers and interval): an input's, and a set's (it was shown; found in review);
    ``report.json`` keeps them for scripts."""
    sources = Counter((r.set, r.input) for r in rows if not r.overall)
    in_set = Counter(r.set for r in rows if not r.overall)
    return [r for r in rows if not (r.overall and (sources[(r.set, r.input)] == 1 if r.input is not None
                                                   else in_set[r.set] == 1))]  # fmt: skip


def row_label(row: ResultRow, rows: Sequence[ResultRow], *, short: bool = False) -> str:
    """What a row is about: its source, an input's total (``all: PATH``), or its set's (``all`` / ``all inputs``).

    ``short``: an input by its file or directory name (a terminal table; the report has the whole path).
    """
    if not row.overall:
        return row.source
    if row.input is not None:
        return f"all: {Path(row.input).name if short else row.input}"
    several = any(r.overall and r.input is not None and r.set == row.set for r in rows)
    return "all inputs" if several else ALL


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
        lines.append(f"- checkpoint applied: max |Δ logit| on the longest batch = {s.max_logit_change:.3g}")
    how = "reused from the cache" if s.base_cached else "computed"
    lines.append(f"- base pass: {how}" + (f" (`{s.base_cache}`)" if s.base_cache else " (cache off)"))
    ran = not (s.base_cached and s.checkpoint is None)  # a base-only report from the cache ran no forward (review)
    lines.append("- experts: " + ("none computed: no pass ran" if not ran else "dequantized once (resident)"
                                  if s.experts_resident else "dequantized per forward")  # fmt: skip
                 + (f"; computed in {s.compute_dtype}" if s.compute_dtype else ""))  # fmt: skip
    for item in s.inputs:
        sample = f" (a seeded sample of its {item.sampled_from:,})" if item.sampled_from else ""
        unscored = f" ({item.unscored:,} with no scored token, so in no row)" if item.unscored else ""
        kind = _KIND_SHOWN.get(item.kind, item.kind)
        lines.append(f"- {item.flag} `{item.path}` ({kind}): {counted(item.sequences, 'sequence')}{sample}{unscored}, "
                     f"{item.tokens:,} scored tokens")  # fmt: skip
    if s.overlap_note is not None:
        lines.append(("- **warning**: " if s.heldout_in_training else "- ") + s.overlap_note)
    lines.append(
        f"- intervals: {pct} % percentile bootstrap over sequences, {s.bootstrap_samples} resamples, seed {s.seed}"
        + ("; Δ = fine-tuned − base, paired" if s.checkpoint is not None else "")  # no Δ in a base-only report
    )
    lines += ["", "## Perplexity", ""]
    if s.checkpoint is None:
        lines += ["| set | source | sequences | tokens | base PPL | 95 % CI |", "|---|---|---:|---:|---:|---|"]
        for r in shown_rows(s.rows):
            lines.append(
                f"| {r.set} | {_source(r, s.rows)} | {r.sequences:,} | {r.tokens:,} | {r.base.ppl:.3f} | "
                f"{plain_ci(r.base.ppl_ci)} |"
            )
    else:
        lines += [
            f"| set | source | sequences | tokens | base PPL | tuned PPL | Δ PPL [{pct} % CI] | Δ NLL [{pct} % CI] |",
            "|---|---|---:|---:|---:|---:|---|---|",
        ]
        for r in shown_rows(s.rows):
            d = r.delta
            lines.append(
                f"| {r.set} | {_source(r, s.rows)} | {r.sequences:,} | {r.tokens:,} | {r.base.ppl:.3f} | "
                f"{r.tuned.ppl:.3f} | {d.ppl:+.3f} {fmt_ci(d.ppl_ci, 3)} | {d.nll:+.4f} {fmt_ci(d.nll_ci, 4)} |"
            )
    lines += ["", "## Routing drift", ""]
    if s.checkpoint is not None:
        lines += ["| layer | entropy base → tuned | max share base → tuned | dead experts base → tuned | top-k set "
                  "changed |", "|---:|---|---|---|---:|"]  # fmt: skip
    else:  # a base-only report: one model, no change to show (its headers said "base → tuned"; found in review)
        lines += ["| layer | entropy | max share | dead experts |", "|---:|---|---|---|"]
    for d in s.routing:
        tuned = d.tuned_entropy is not None
        lines.append(
            f"| {d.layer} | {d.base_entropy:.3f}" + (f" → {d.tuned_entropy:.3f}" if tuned else "")
            + f" | {d.base_max_share:.3f}" + (f" → {d.tuned_max_share:.3f}" if tuned else "")
            + f" | {d.base_dead}" + (f" → {d.tuned_dead}" if tuned else "")
            + (" | " + (f"{100 * d.changed_fraction:.2f} %" if d.changed_fraction is not None else "-")
               if s.checkpoint is not None else "") + " |"
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


def plain_ci(ci: list[float] | None, digits: int = 3) -> str:
    """An interval of values (a base PPL's), unsigned: :func:`fmt_ci` signs a change's."""
    return f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else "(n < 2)"


def _source(row, rows) -> str:
    """A row's label, escaped for a table cell; total rows in bold."""
    label = row_label(row, rows).replace("|", "\\|")
    return f"**{label}**" if row.overall else label
