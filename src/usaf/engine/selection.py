"""Turning importance scores into masks under a budget (method §2, §4).

The budget is ``frac`` of the expert weights of the trainable layers, spread by one of four modes:

* ``per-tensor`` (default): every fused tensor gets exactly ``floor(frac × numel)`` entries. It is the
  original prototype's behaviour, its memory is known before scoring, and it keeps both projections of
  every trainable layer trainable, whatever their gradient scales (``down_proj`` gradients are often
  smaller than ``gate_up_proj``'s, so a shared ranking would starve one of them).
* ``per-layer``: each layer's two tensors share ``floor(frac × layer numel)`` entries, ranked together.
* ``global``: all trainable tensors share ``floor(frac × total)``, ranked together.
* ``per-expert``: every expert slice of every tensor gets ``floor(frac × O × I)`` entries; an expert that
  received no calibration tokens has no evidence, so this mode refuses rather than pick at random.

A selection smaller than its budget is an error (the original tool once trained nothing for months).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from usaf.engine.scores import ScoreAccumulator

BUDGET_MODES = ("per-tensor", "per-layer", "global", "per-expert")


class SelectionError(ValueError):
    """The statistic does not support a selection of the asked size."""


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def pool_size(shapes: Mapping[str, tuple[int, int, int]], frac: float, mode: str, layer_of: Mapping[str, int]) -> dict:
    """Candidates each tensor's accumulator must be able to return for ``mode`` to be served exactly.

    A shared budget (per-layer, global) can exceed a small tensor's size (a k_proj next to fused experts): no
    tensor is asked for more candidates than it has weights.
    """
    if mode == "per-tensor":
        return {name: max(1, int(frac * numel(shape))) for name, shape in shapes.items()}
    if mode == "per-expert":  # every expert's own budget, at least one each: a tiny frac asked one for the tensor
        per_slice = {name: max(1, int(frac * numel(shape[1:]))) for name, shape in shapes.items()}
        return {name: min(numel(shape), shape[0] * per_slice[name]) for name, shape in shapes.items()}
    if mode == "per-layer":
        per_layer: dict[int, int] = {}
        for name, shape in shapes.items():
            per_layer[layer_of[name]] = per_layer.get(layer_of[name], 0) + numel(shape)
        return {name: min(numel(s), max(1, int(frac * per_layer[layer_of[name]]))) for name, s in shapes.items()}
    total = sum(numel(s) for s in shapes.values())
    return {name: min(numel(s), max(1, int(frac * total))) for name, s in shapes.items()}


def _shared_top(accumulators: Mapping[str, ScoreAccumulator], budget: int) -> dict[str, torch.Tensor]:
    """Rank the candidates of several tensors together and keep ``budget`` of them."""
    names, indices, scores = [], [], []
    for i, (name, acc) in enumerate(accumulators.items()):
        idx, sc = acc.ranked()
        names.append(name)
        indices.append(idx)
        scores.append(torch.stack([sc, torch.full_like(sc, float(i))]))
    if not indices or sum(i.numel() for i in indices) < budget:
        raise SelectionError(
            f"only {sum(i.numel() for i in indices)} candidates with a positive score for a budget of {budget}"
        )
    all_scores = torch.cat([s[0] for s in scores])
    owner = torch.cat([s[1] for s in scores]).long()
    flat = torch.cat(indices)
    keep = torch.topk(all_scores, budget).indices
    return {name: flat[keep][owner[keep] == i].sort().values for i, name in enumerate(names)}


def select(
    accumulators: Mapping[str, ScoreAccumulator],
    *,
    frac: float,
    mode: str = "per-tensor",
    layer_of: Mapping[str, int],
) -> dict[str, torch.Tensor]:
    """Sorted flat indices per tensor, exactly as many as ``mode``'s budget gives.

    Raises:
        SelectionError: fewer candidates with a positive score than the budget (e.g. no gradient
            reached a tensor, or an expert got no tokens in ``per-expert`` mode).
    """
    if mode not in BUDGET_MODES:
        raise ValueError(f"budget mode {mode!r} is not one of {BUDGET_MODES}")
    if mode == "per-tensor":
        out = {}
        for name, acc in accumulators.items():
            k = max(1, int(frac * numel(acc.shape)))
            idx, _ = acc.top(k)
            if idx.numel() < k:
                raise SelectionError(f"{name}: only {idx.numel()} weights have a positive score, the budget is {k}")
            out[name] = idx
        return out
    if mode == "per-expert":
        return {name: _per_expert(name, acc, frac) for name, acc in accumulators.items()}
    if mode == "global":
        return _shared_top(accumulators, max(1, int(frac * sum(numel(a.shape) for a in accumulators.values()))))
    out = {}
    for layer in sorted(set(layer_of.values())):
        group = {n: a for n, a in accumulators.items() if layer_of[n] == layer}
        out.update(_shared_top(group, max(1, int(frac * sum(numel(a.shape) for a in group.values())))))
    return out


def _per_expert(name: str, acc: ScoreAccumulator, frac: float) -> torch.Tensor:
    experts, rows, cols = acc.shape
    k = max(1, int(frac * rows * cols))
    if acc.exact:  # every score kept: each expert's own best (the tensor's best few held none of some; review)
        dense = acc.dense_map()
        scores, local = dense.reshape(experts, rows * cols).topk(k, dim=1)  # (E, k) each
        if (short := (scores <= 0).any(dim=1).nonzero()).numel():
            e = int(short[0])
            why = "it received no calibration token" if int(acc.counts[e]) == 0 else "its gradient was zero there"
            raise SelectionError(f"{name}: expert {e} has {int((dense[e] > 0).sum())} scored weights for a per-expert "
                                 f"budget of {k} ({why})")  # fmt: skip
        offsets = torch.arange(experts, device=local.device).unsqueeze(1) * (rows * cols)  # (E, 1): flat index bases
        return (local + offsets).flatten().sort().values
    indices, scores = acc.ranked()
    owner = indices // (rows * cols)
    chosen = []
    for e in range(experts):
        mine = indices[owner == e]  # already by score, descending
        if mine.numel() < k:
            # "it received too few calibration tokens" was said of any of these (found in review)
            why = ("it received no calibration token" if int(acc.counts[e]) == 0 else
                   "its scores were zero or fell out of the candidate pool; --full-maps keeps every score")
            raise SelectionError(f"{name}: expert {e} has {mine.numel()} scored weights for a per-expert budget of {k} "
                                 f"({why})")  # fmt: skip
        chosen.append(mine[:k])
    return torch.cat(chosen).sort().values


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    """|A ∩ B| / |A ∪ B| of two index sets (1.0 for two empty sets)."""
    if a.numel() == 0 and b.numel() == 0:
        return 1.0
    union = torch.unique(torch.cat([a, b])).numel()
    inter = a.numel() + b.numel() - union
    return inter / union
