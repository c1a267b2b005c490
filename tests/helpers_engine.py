"""Engine helpers shared by the engine, reselection and DirectML tests: a tiny engine, batches, selections, a step."""

from __future__ import annotations

import torch

from usaf.engine.engine import IGNORE_INDEX, SparseEngine
from usaf.engine.loading import load_quantized_model

FAMILY_LAYERS = 3  # a frozen prefix below the trainable top layer for every family (deepseek: layer 0 dense)


def batch(seed: int = 0, size: tuple[int, int] = (2, 20)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 512, size, generator=g)
    labels = ids.clone()
    labels[0, :3] = IGNORE_INDEX  # some unscored positions
    return ids, labels


def random_selection(engine: SparseEngine, frac: float = 0.1, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    selection = {}
    for name, weight in engine.weights.items():
        numel = weight.shape[0] * weight.shape[1] * weight.shape[2]
        selection[name] = torch.randperm(numel, generator=g)[: max(1, int(frac * numel))].sort().values
    return selection


def every_target(spec) -> tuple[str, ...]:
    """Every target the family has: experts, attention, and shared where it has shared experts."""
    return ("experts", "attention", "shared") if spec.shared is not None else ("experts", "attention")


def make_engine(quantized, family, **kwargs):
    """The family's tiny engine, its top layer trainable; ``targets="all"``: :func:`every_target`."""
    loaded = load_quantized_model(quantized(family, num_layers=FAMILY_LAYERS))
    top = loaded.spec.moe_layers[-1]
    if kwargs.get("targets") == "all":
        kwargs["targets"] = every_target(loaded.spec)
    return SparseEngine(loaded, trainable_layers=[top], **kwargs)


def train_step(engine, optimizer, ids, labels) -> float:
    engine.model.zero_grad(set_to_none=True)
    for delta in engine.deltas().values():
        delta.values.grad = None
    parts = engine.loss(ids, labels)
    parts.loss.backward()
    assert optimizer.step().applied
    return parts.loss.item()
