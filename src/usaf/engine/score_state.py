"""The state dict of a :class:`usaf.engine.scores.ScoreAccumulator`: checkpoints and data-parallel gathers.

Plain ints, strings, bools and CPU tensors (copies: a saved state must not change while the accumulator
keeps adding), so ``torch.load(weights_only=True)`` reads it back. Restoring checks the configuration
(shape, statistic, mode, capacity) first and moves the state to the accumulator's device.

The pool is saved as it is, not cut back to ``capacity`` (saving must not change what the run does
next): flat indices grouped by expert, each expert's entries in their live order, with the admission
``floor``. A state saved before the pool was held per expert (no ``floor``: one flat pool, never over
``capacity``) restores with the floor it would have had, its minimum when full.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from usaf.engine.scores import ScoreAccumulator


def accumulator_state(acc: ScoreAccumulator) -> dict[str, Any]:
    state: dict[str, Any] = {
        "shape": tuple(acc.shape),
        "candidates": acc.candidates,
        "statistic": acc.statistic,
        "pool_factor": acc.pool_factor,
        "exact": acc.exact,
        "batches": acc.batches,
        "counts": _cpu_copy(acc.counts),
        "closed_loss": _cpu_copy(acc._closed_loss),
        "epoch_loss": _cpu_copy(acc._epoch_loss),
    }
    indices, scores = acc._pool()  # exact mode: empty
    state.update(indices=_cpu_copy(indices), scores=_cpu_copy(scores), floor=_cpu_copy(acc._floor))
    if acc._dense is not None:
        state["dense"] = _cpu_copy(acc._dense)
    return state


def restore_accumulator(acc: ScoreAccumulator, state: dict[str, Any]) -> None:
    mine = (tuple(acc.shape), acc.statistic, acc.exact, acc.capacity)
    theirs = (tuple(int(d) for d in state["shape"]), state["statistic"], bool(state["exact"]))
    theirs += (min(int(state["pool_factor"]) * int(state["candidates"]), acc.numel),)
    if mine != theirs:
        raise ValueError(f"state (shape, statistic, exact, capacity) {theirs} does not match {mine}")
    where = acc.device or torch.device("cpu")
    acc.batches = int(state["batches"])
    # per-expert bookkeeping lives in host memory (see ScoreAccumulator.__init__); copies, never the state's own
    acc.counts = state["counts"].to("cpu", torch.int64, copy=True)
    acc._closed_loss = state["closed_loss"].to("cpu", torch.float32, copy=True)
    acc._epoch_loss = state["epoch_loss"].to("cpu", torch.float32, copy=True)
    indices, scores = state["indices"].to(where, torch.int64), state["scores"].to(where, torch.float32)
    acc._set_pool(indices, scores)
    if "floor" in state:
        acc._floor = state["floor"].to(where, torch.float32).reshape(())
    else:
        full = indices.numel() >= acc.capacity
        acc._floor = scores.min() if full else torch.zeros((), dtype=torch.float32, device=where)
    acc._dense = state["dense"].to(where, torch.float32) if "dense" in state else None


def _cpu_copy(t: Tensor) -> Tensor:
    # A copy even on CPU: a state dict must not change when the accumulator keeps adding.
    return t.detach().to("cpu", copy=True)
