"""PNG plots of a report (the ``plot`` extra: matplotlib): training curves and expert load before/after.

matplotlib is imported only here, only when plots are made, with the non-interactive Agg backend (no
display needed, nothing opens a window).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from usaf.artifacts.eval_report import LayerDrift
from usaf.artifacts.run import METRICS_FILE, read_metrics

CURVES_FILE = "training_curves.png"
LOAD_FILE = "expert_load.png"
INSTALL_HINT = "pip install 'usaf[plot]' (matplotlib)"


@dataclass(frozen=True)
class RunCurves:
    """A run's logged losses, read when its change is (:func:`run_curves`)."""

    run: str  # the run directory's name, for the title
    train: list[tuple[int, float]]  # (step, loss)
    held: list[tuple[int, float]]  # (step, held-out loss)
    evaluated_step: int | None  # the checkpoint evaluated, where it is not the run's end


def run_curves(source: Path, *, step: int | None) -> RunCurves | None:
    """The curves of the run that ``source`` (a run directory, or one of its ``checkpoints/step-N``) is in, or None
    where it logged none. Read with the change, not after the passes: an ``--overwrite`` of the run meanwhile drew
    the new run's curves beside the old run's numbers (found in review)."""
    run_dir = source if (source / METRICS_FILE).is_file() else source.parent.parent
    if not (run_dir / METRICS_FILE).is_file():
        return None
    train, held = read_metrics(run_dir / METRICS_FILE)
    return RunCurves(run_dir.name, train, held, step) if train or held else None


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    # lazy: optional dependency (the plot extra)
    import matplotlib

    matplotlib.use("Agg")
    # lazy: optional dependency; after matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(curves: RunCurves, out: Path, *, base_heldout: float | None = None) -> None:
    """Training loss per step and held-out loss.

    ``base_heldout``: the base model's held-out NLL from this eval, drawn as the line to beat (it is on the
    same scale as the run's held-out loss only when the held-out sets are the same, as the label says).
    ``curves.evaluated_step``: the checkpoint evaluated, where it is not the run's end: marked, so a curve that goes
    on past it is not read as the state evaluated (found in review).
    """
    train, held, evaluated_step = curves.train, curves.held, curves.evaluated_step
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="training loss (per step)", linewidth=1)
    if held:
        ax.plot(*zip(*held), "o-", label="held-out loss", linewidth=1.5)
    if base_heldout is not None:
        ax.axhline(base_heldout, color="gray", linestyle="--", linewidth=1, label="base model, this eval's held-out")
    title = f"training curves: {curves.run}"
    if evaluated_step is not None:
        ax.axvline(evaluated_step, color="black", linestyle=":", linewidth=1, label=f"evaluated: step {evaluated_step}")
        title += f" (evaluated at step {evaluated_step})"
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_load(routing: list[LayerDrift], out: Path) -> None:
    """Expert-load shares per layer (rows) and expert (columns): base, fine-tuned, and their difference."""
    plt = _pyplot()
    experts = max(d.experts for d in routing)

    def shares(counts: list[list[int]]):
        grid = torch.zeros(len(counts), experts, dtype=torch.float64)  # (layers, E)
        for i, row in enumerate(counts):
            c = torch.tensor(row, dtype=torch.float64)
            grid[i, : c.numel()] = c / max(float(c.sum()), 1.0)
        return grid.numpy()

    panels = [("base", shares([d.base_tokens_per_expert for d in routing]))]
    if routing[0].tuned_tokens_per_expert is not None:
        tuned = shares([d.tuned_tokens_per_expert for d in routing])
        panels += [("fine-tuned", tuned), ("fine-tuned − base", tuned - panels[0][1])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 1.2 + 0.35 * len(routing)), squeeze=False)
    top = max(float(p.max()) for _, p in panels[:2])
    for ax, (title, grid) in zip(axes[0], panels):
        if title.endswith("base") and "−" in title:
            bound = max(float(abs(grid).max()), 1e-9)
            image = ax.imshow(grid, aspect="auto", cmap="RdBu_r", vmin=-bound, vmax=bound, interpolation="nearest")
        else:
            image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0, vmax=top, interpolation="nearest")
        ax.set_title(f"expert load share: {title}", fontsize=9)
        ax.set_xlabel("expert")
        ax.set_ylabel("MoE layer")
        ax.set_yticks(range(len(routing)), [str(d.layer) for d in routing])
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
