"""The importance statistic of one expert slice (method §3, §4): what :mod:`usaf.engine.scores` accumulates.

The engine hands over one expert slice at a time: the dense weight gradient ``grad (O, I)`` of expert
``e``, with that slice's base ``weight (O, I)``. Each :meth:`usaf.engine.scores.ScoreAccumulator.add` turns
the slice into a non-negative statistic (``grad``: ``|g|``; ``grad2``: ``g²``; ``grad_x_weight``: ``|w·g|``) and adds
it to the score of the flat indices ``e*O*I + r*I + c`` (as in :mod:`usaf.engine.deltas`). The score of
an element is the sum of its statistic over **every slice added** — over K batches, and over the
microbatches within a batch: two slices of one expert in one batch count as two samples
(``|g1| + |g2|``, not ``|g1 + g2|``). Summing the microbatch gradients before taking the statistic
would need a dense buffer for every expert a batch touches, i.e. O(E·O·I); a caller that wants the
statistic of the whole-batch gradient must sum microbatches itself and add one slice per expert per
batch. ``counts[e]`` records how many slices of expert ``e`` were added (routing frequency; experts
that got no tokens produce no slice).
"""

from __future__ import annotations

import torch
from torch import Tensor

from usaf.backends.transfer import move

STATISTICS = ("grad", "grad2", "grad_x_weight")  # |g|, g², |w·g|


def slice_statistic(statistic: str, grad: Tensor, weight: Tensor | None = None, *, in_place: bool = False) -> Tensor:
    """The non-negative per-element statistic of one slice, fp32, of ``grad``'s shape.

    Args:
        statistic: one of :data:`STATISTICS`.
        grad: dense weight gradient of one expert slice, ``(O, I)``, any float dtype.
        weight: that slice's base weight ``(O, I)``; required for ``grad_x_weight``.
        in_place: ``grad`` may be overwritten (a scratch): an fp32 ``grad`` becomes the result.

    Returns:
        ``(O, I)`` fp32; a fresh tensor unless ``in_place`` (callers may modify it in place either way).
    """
    if statistic not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; expected one of {STATISTICS}")
    if statistic == "grad_x_weight":
        if weight is None:
            raise ValueError("statistic 'grad_x_weight' needs the slice's base weight")
        if weight.shape != grad.shape:
            raise ValueError(f"weight {tuple(weight.shape)} does not match grad {tuple(grad.shape)}")
    g = grad.detach().to(torch.float32)
    if not in_place and g.data_ptr() == grad.data_ptr():
        g = g.clone()  # an fp32 grad: to() returned it, and it is not ours to edit
    if statistic == "grad":
        return g.abs_()
    if statistic == "grad2":
        return g.square_()
    return g.mul_(move(weight.detach(), g.device, torch.float32)).abs_()
