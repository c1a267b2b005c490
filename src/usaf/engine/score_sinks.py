"""Where a score-collecting step's dense slice gradients go: one accumulator, or several sharing one statistic.

A :class:`ScoreSink` is what ``TrainableTensor.score_sink`` holds. The engine hands it gradients in one of two forms:

* one expert at a time (the per-expert loop, :func:`usaf.engine.sparse_linear.sparse_delta_linear`): ``sink(expert)``
  is a ``sink(grad (O, I), weight (O, I))``;
* a block of consecutive experts at once (:mod:`usaf.engine.grouped_deltas`): :meth:`ScoreSink.add_block` takes
  ``grad (e, O, I)`` and turns it into statistics in a fixed number of ops, whatever ``e``
  (:meth:`usaf.engine.scores.ScoreAccumulator.add_block`).

Either way the statistic is computed once and added to every accumulator (``usaf score`` adds each batch to the
sample's accumulators and to its stability half's). The gradients are the caller's scratch: they are overwritten.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from usaf.engine.statistics import slice_statistic

if TYPE_CHECKING:  # scores.py builds sinks: no import at run time
    from usaf.engine.scores import ScoreAccumulator

__all__ = ["ScoreSink"]


class ScoreSink:
    """The dense slice gradients of one fused tensor ``(E, O, I)`` to ``accumulators`` (same shape and statistic)."""

    def __init__(self, *accumulators: ScoreAccumulator) -> None:
        if not accumulators:
            raise ValueError("a score sink needs at least one accumulator")
        first = accumulators[0]
        for other in accumulators[1:]:
            if (other.shape, other.statistic) != (first.shape, first.statistic):
                raise ValueError(f"cannot pair a {other.shape} {other.statistic!r} accumulator with {first.shape}")
        self.accumulators = accumulators

    def __call__(self, expert: int) -> Callable[[Tensor, Tensor | None], None]:
        """``sink(grad (O, I), weight (O, I))`` adding one slice of ``expert``; ``grad`` is a scratch it overwrites."""
        return lambda grad, weight: self.add(expert, grad, weight)

    @torch.no_grad()
    def add(self, expert: int, grad: Tensor, weight: Tensor | None) -> None:
        """One slice: ``grad (O, I)`` (overwritten) and its base ``weight (O, I)`` (for ``grad_x_weight``)."""
        first = self.accumulators[0]
        if tuple(grad.shape) != first.shape[1:]:
            raise ValueError(f"grad {tuple(grad.shape)} is not one {first.shape[1:]} expert slice")
        stat = slice_statistic(first.statistic, grad, weight, in_place=True).reshape(-1)  # (O*I,) fp32
        for acc in self.accumulators[1:]:
            acc.add_statistic(expert, stat.clone())  # add_statistic edits what it is given
        first.add_statistic(expert, stat)

    @torch.no_grad()
    def add_block(self, first_expert: int, grad: Tensor, base: Tensor | None, routed: Tensor) -> None:
        """Experts ``first_expert .. first_expert + e - 1`` at once.

        Args:
            first_expert: the block's first expert.
            grad: ``(e, O, I)`` their dense weight gradients, overwritten.
            base: ``(e, O, I)`` their base weights (for ``grad_x_weight``; may be None otherwise).
            routed: ``(e,)`` bool on the host: which experts had tokens. The others are not added (no slice, as in
                the loop), whatever their rows hold.
        """
        first = self.accumulators[0]
        e, o, i = grad.shape
        if (o, i) != first.shape[1:]:
            raise ValueError(f"grad {tuple(grad.shape)} is not a block of ({o}, {i}) expert slices")
        stats = slice_statistic(first.statistic, grad, base, in_place=True).view(e, o * i)  # (e, O*I) fp32
        for acc in self.accumulators[1:]:
            acc.add_block(first_expert, stats.clone(), routed)  # add_block edits what it is given
        first.add_block(first_expert, stats, routed)
