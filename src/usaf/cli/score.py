"""``usaf score``: masks, importance maps and routing statistics from calibration data."""

from __future__ import annotations

from pathlib import Path

from usaf.cli.stage import stage_command
from usaf.settings.train import DEFAULT_LR
from usaf.units import counted, human_bytes


def _measured(s) -> int:
    """The tensors whose stability was measured (not those nothing was selected from)."""
    return sum(1 for t in s.tensors if t.stability is not None)


def _print_summary(console, manifest, path: Path) -> None:
    from rich.table import Table

    from usaf.stages.lr_test import choose_lr, first_divergence  # lazy: it imports torch; `usaf --help` stays light

    s = manifest.summary
    table = Table(title=f"plan → {path}", title_justify="left")
    for column in ("layer", "tensor", "selected", "budget", "experts used", "stability"):
        table.add_column(column, justify="left" if column == "tensor" else "right")
    for t in s.tensors:
        used = sum(1 for n in t.per_expert if n)
        table.add_row(
            str(t.layer),
            _short_name(t.name, t.layer),
            f"{t.selected:,}",
            f"{t.budget:,}",
            f"{used}/{len(t.per_expert)}",
            "-" if t.stability is None else f"{t.stability:.3f}",
        )
    console.print(table)
    hottest = []
    for layer in s.routing:
        total = max(sum(layer.tokens_per_expert), 1)
        top = max(range(len(layer.tokens_per_expert)), key=lambda e: layer.tokens_per_expert[e])
        hottest.append(
            f"L{layer.layer}: expert {top} {layer.tokens_per_expert[top] / total:.0%}, {layer.dead_experts} dead"
        )
    console.print(
        f"{s.expert_entries:,} weights of the {'/'.join(s.targets or ['experts'])} + {s.router_params:,} router "
        f"weights = {s.trainable_params:,} trainable "
        f"({s.budget}, frac {s.frac:.4g}{_floor_note(s)}, |{s.statistic}| over {s.calib_samples} sequences / "
        f"{s.calib_tokens:,} tokens"
        + (f"; mask stability {s.stability_mean:.3f}, the mean over {_measured(s)} tensors of the overlap (Jaccard) of "
           "the masks chosen from the sample's two halves (1 = the same weights; a larger --calib-samples raises it)"
           if s.stability_mean is not None else "")  # fmt: skip
        + ")"
    )
    console.print("hottest experts: " + "; ".join(hottest))
    if s.lr_test is not None:
        t = s.lr_test
        ran = sorted(t.candidates)[: t.probes_run if t.probes_run is not None else len(t.candidates)]
        probes = ", ".join(f"{lr:g}: " + ("not run" if lr not in ran else "diverged" if loss is None else f"{loss:.4f}")
                           for lr, loss in zip(t.candidates, t.heldout_losses))  # fmt: skip
        if len(ran) < len(t.candidates):  # say why, in the test's terms: a divergence may be a small rise
            probes += f" (the larger lrs not run, past {first_divergence(t.base_loss, t.candidates, t.heldout_losses)})"
        console.print(
            f"lr test: lr {t.lr:.1e} for usaf train (held-back loss {t.base_loss:.4f} untrained; {probes}; "
            f"{t.steps} steps, {t.seconds:.1f} s)"
        )
        lowest = choose_lr(t.base_loss, t.candidates, t.heldout_losses)
        if lowest != t.lr and t.heldout_gap_se is not None:
            i, j = t.candidates.index(t.lr), t.candidates.index(lowest)
            console.print(
                f"lr test: {lowest:g} ended lowest, {t.lr:g} within one standard error of it "
                f"({t.heldout_losses[i] - t.heldout_losses[j]:.4f} ± {t.heldout_gap_se[i]:.4f} nats over the "
                f"held-back sequences): the smaller lr, which moves the model less (train --lr {lowest:g}: the other)"
            )
    else:  # off, or skipped for its sample (the note above said why): it said --no-lr-test for both (in review)
        why = "off (--no-lr-test)" if manifest.config.get("lr_test") is False else "skipped (see the note above)"
        console.print(f"lr test: {why}; usaf train uses --lr, else {DEFAULT_LR:g}")
    if s.prefix_cache is not None:
        c = s.prefix_cache
        whose = "every training sequence" if c.scope == "data" else "the calibration sample's; --cache: all"
        console.print(
            f"prefix cache: {counted(c.samples, 'sequence')} / {counted(c.tokens, 'token')} entering layer {c.start} "
            f"({human_bytes(c.bytes)}, {c.dtype}; {whose})"
        )


def _short_name(name: str, layer: int) -> str:
    """``model.layers.2.self_attn.q_proj.weight`` -> ``self_attn.q_proj`` (the layer has its own column)."""
    return name.split(f".{layer}.", 1)[-1].removesuffix(".weight")


def _floor_note(s) -> str:
    """Where the share came from, when the default rule chose it."""
    return " by default for these layers' size" if s.frac_given is False else ""


command = stage_command(
    "score",
    summary=_print_summary,
    doc="Pick the weights to train (--targets) by gradient importance on calibration data (a plan for usaf train). "
    "Ctrl-C saves the work done; the same command resumes it.",
)
