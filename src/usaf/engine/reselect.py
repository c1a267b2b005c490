"""Dynamic reselection of the trainable set (method §5, RigL / SpIEL): drop, grow, keep every value.

Every ``reselect_every`` training steps each trainable tensor's active set is renewed:

* **Grow** — entries outside the active set, ranked by a gradient statistic accumulated over the last
  few training batches (:func:`collect_scores` installs the engine's score sinks around ordinary
  training steps), best score first.
* **Drop** — the same number of active entries with the smallest ``|delta|``, the active value only
  (what the entry learned since it last joined the set).
* **How many** — ``round(f × nnz)`` per tensor, where ``f`` = :func:`update_fraction` decays with a
  cosine to 0 at 75 % of training; never more than the non-active candidates with a positive score.
  The set size never changes.
* **Adam state** — kept entries keep their moments and per-element step counts at their new
  positions; grown entries start fresh (their own bias correction), via ``SparseAdamW.remap_state``.

Dropped values persist (the choice method §5 asks for)
-------------------------------------------------------
A dropped entry's learned delta is *folded*, not discarded: it is added to the tensor's frozen record
(:meth:`usaf.engine.trainable.TrainableTensor.fold`: sorted unique flat indices + fp32 values in the stored
``(E, O, I)`` orientation, duplicates summed) and written into the resident dequantized base, so the
forward includes it at no cost and the model computes the same function right after a reselection as
right before it. The record is what checkpoints and export read: the trained weight is
``base + frozen + active`` = ``base + cumulative_delta(weight)``. A re-grown entry starts a new active
delta at 0 on top of its folded value, and AdamW's decay then pulls it toward ``base + frozen``.
The resident base holds ``base + frozen`` rounded once to the compute dtype: exact up to fp32 rounding
in fp32; in bf16 the forward sees a folded value at bf16 resolution of its weight (a delta under half
an ulp of the base vanishes from the forward), while the record keeps the exact fp32 sum.

The alternative — resetting a dropped entry to the base, i.e. throwing its learned delta away — is
not what usaf does: it makes the loss jump at every reselection and silently loses training (the
original prototype lost dropped updates this way in checkpoints, on resume and in export). The cost
of folding is that the number of changed weights grows past ``nnz`` over a run (by at most the number
dropped), 12 bytes per folded entry.

A static mask (``reselect_every=0``) simply never calls :func:`reselect`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field

import torch

from usaf.engine.engine import SparseEngine
from usaf.engine.optim import SparseAdamW
from usaf.engine.scores import ScoreAccumulator, best_by_score
from usaf.engine.trainable import TrainableTensor

__all__ = [
    "ReselectCounts",
    "ReselectReport",
    "ScoreCollection",
    "collect_scores",
    "cumulative_delta",
    "reselect",
    "update_fraction",
]


def update_fraction(step: int, total_steps: int, initial: float, end: float = 0.75) -> float:
    """Share of each active set to replace at ``step``: cosine from ``initial`` to 0 at ``end × total_steps``.

    Args:
        step: training steps done (0-based).
        total_steps: planned training steps.
        initial: the fraction at step 0 (e.g. 0.2–0.3).
        end: where the fraction reaches 0, as a share of ``total_steps``; 0 from there on.

    Returns:
        ``initial × ½(1 + cos(π · step / (end · total_steps)))`` before the end, else ``0.0``.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0.0 <= initial <= 1.0:
        raise ValueError(f"initial fraction must be in [0, 1], got {initial}")
    if not 0.0 < end <= 1.0:
        raise ValueError(f"end must be in (0, 1], got {end}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    stop = end * total_steps
    if step >= stop:
        return 0.0
    return initial * 0.5 * (1.0 + math.cos(math.pi * step / stop))


# ---------------------------------------------------------------------------------------- scores


class ScoreCollection(Mapping[str, ScoreAccumulator]):
    """Score sinks installed on an engine's trainable tensors; a mapping name -> :class:`ScoreAccumulator`.

    While installed, every backward through a tensor with a delta also hands each expert slice's
    dense gradient ``(O, I)`` to its accumulator (one transient ``(O, I)`` per expert per matmul), so
    ordinary training steps collect grow scores. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        engine: SparseEngine,
        candidates: int | Mapping[str, int] | None = None,
        statistic: str = "grad",
        *,
        pool_factor: int = 4,
        exact: bool = False,
    ) -> None:
        self._weights: dict[str, TrainableTensor] = {}
        self.accumulators: dict[str, ScoreAccumulator] = {}
        busy = [name for name in engine.deltas() if engine.weights[name].score_sink is not None]
        if busy:
            raise RuntimeError(f"score sinks already installed on {busy}; close the other collection first")
        for name, delta in engine.deltas().items():
            weight = engine.weights[name]
            numel = weight.shape[0] * weight.shape[1] * weight.shape[2]
            if candidates is None:
                # The pool holds pool_factor × nnz: even if every active entry outranks every other
                # one, (pool_factor - 1) × nnz non-active candidates survive.
                k = min(max(delta.nnz, 1), numel)
            else:
                k = candidates if isinstance(candidates, int) else candidates[name]
            acc = ScoreAccumulator(weight.shape, k, statistic, pool_factor=pool_factor, exact=exact)
            self.accumulators[name] = acc
            self._weights[name] = weight
            weight.score_sink = acc.sink

    def end_batch(self) -> None:
        """Mark a batch boundary in every accumulator (counts batches for reports)."""
        for acc in self.accumulators.values():
            acc.end_batch()

    def close(self) -> None:
        """Remove the sinks (idempotent); the accumulators stay readable."""
        for weight in self._weights.values():
            weight.score_sink = None
        self._weights = {}

    def __enter__(self) -> ScoreCollection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> ScoreAccumulator:
        return self.accumulators[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.accumulators)

    def __len__(self) -> int:
        return len(self.accumulators)


def collect_scores(
    engine: SparseEngine,
    candidates: int | Mapping[str, int] | None = None,
    statistic: str = "grad",
    *,
    pool_factor: int = 4,
    exact: bool = False,
) -> ScoreCollection:
    """Install score sinks on every tensor with a delta; use around the training steps before a reselection.

    ``with collect_scores(engine) as scores: <train steps>`` then ``reselect(engine, opt, scores, f)``.

    Args:
        engine: the engine whose deltas will be reselected.
        candidates: accumulator size per tensor (int, or by name); default each tensor's ``nnz``.
        statistic: ``"grad"`` (|g|), ``"grad2"`` or ``"grad_x_weight"`` (see :mod:`usaf.engine.scores`).
        pool_factor: the pooled accumulator keeps ``pool_factor × candidates`` entries.
        exact: dense fp32 accumulators (``4·E·O·I`` bytes each): tests and tiny models.
    """
    return ScoreCollection(engine, candidates, statistic, pool_factor=pool_factor, exact=exact)


# ---------------------------------------------------------------------------------------- report


@dataclass(frozen=True)
class ReselectCounts:
    """True counts of one reselection, for one tensor or summed over all.

    Attributes:
        nnz: active-set size (unchanged by the reselection).
        target: ``round(fraction × nnz)``, what was asked for.
        kept: active entries that stayed (``nnz - dropped``).
        dropped: active entries folded into the frozen record and removed.
        grown: new entries (always ``== dropped``; ``< target`` only when candidates ran out).
        candidates: non-active entries with a positive score that were available to grow.
    """

    nnz: int
    target: int
    kept: int
    dropped: int
    grown: int
    candidates: int

    @property
    def turnover(self) -> float:
        """Share of the set replaced: ``grown / nnz``."""
        return self.grown / self.nnz if self.nnz else 0.0


@dataclass(frozen=True)
class ReselectReport:
    """One reselection: the fraction used, counts per tensor and in total."""

    fraction: float
    tensors: dict[str, ReselectCounts]
    total: ReselectCounts = field(init=False)

    def __post_init__(self) -> None:
        keys = ("nnz", "target", "kept", "dropped", "grown", "candidates")
        sums = {k: sum(getattr(c, k) for c in self.tensors.values()) for k in keys}
        object.__setattr__(self, "total", ReselectCounts(**sums))

    def to_dict(self) -> dict:
        """Plain numbers for a log line or a JSON record."""

        def row(counts: ReselectCounts) -> dict:
            return {**asdict(counts), "turnover": counts.turnover}

        return {
            "fraction": self.fraction,
            "total": row(self.total),
            "tensors": {name: row(c) for name, c in self.tensors.items()},
        }


# ---------------------------------------------------------------------------------------- reselection


@torch.no_grad()
def cumulative_delta(weight: TrainableTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Everything trained into ``weight``: frozen record ∪ active delta, summed where both.

    Returns:
        ``(indices, values)``: ``(m,)`` int64 flat indices into ``(E, O, I)``, sorted unique, and
        ``(m,)`` fp32 values; ``dequantize(q) + dense(values at indices)`` is the trained weight.
    """
    device = weight.frozen_indices.device if weight.delta is None else weight.delta.indices.device
    if not weight.index_ops:  # unique's inverse + index_add_ on host copies (Capabilities.index_ops, DirectML)
        device = torch.device("cpu")
    indices = [weight.frozen_indices.to(device)]
    values = [weight.frozen_values.to(device)]
    if weight.delta is not None:
        indices.append(weight.delta.indices.to(device))
        values.append(weight.delta.values.detach().to(torch.float32).to(device))
    unique, inverse = torch.unique(torch.cat(indices), return_inverse=True)
    summed = torch.zeros(unique.numel(), dtype=torch.float32, device=device)
    return unique, summed.index_add_(0, inverse, torch.cat(values))


@torch.no_grad()
def reselect(
    engine: SparseEngine,
    optimizer: SparseAdamW | None,
    scores: Mapping[str, ScoreAccumulator],
    fraction: float,
) -> ReselectReport:
    """Replace ``round(fraction × nnz)`` entries of every delta: drop smallest ``|delta|``, grow best-scored.

    Args:
        engine: its tensors with a delta are reselected; each needs an entry in ``scores``.
        optimizer: holds the deltas' Adam state (kept entries' state moves, grown entries' is fresh);
            ``None`` when nothing trains them yet.
        scores: grow statistic per tensor, e.g. from :func:`collect_scores` over recent batches.
        fraction: share of each set to replace, in ``[0, 1]`` (see :func:`update_fraction`).

    Returns:
        The true counts per tensor and in total.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    deltas = engine.deltas()
    missing = sorted(set(deltas) - set(scores))
    if missing:
        raise KeyError(f"no grow scores for {missing}")
    report = {}
    for name in deltas:
        report[name] = _reselect_tensor(engine.weights[name], optimizer, scores[name], fraction)
    return ReselectReport(fraction=fraction, tensors=report)


def _reselect_tensor(
    weight: TrainableTensor, optimizer: SparseAdamW | None, scores: ScoreAccumulator, fraction: float
) -> ReselectCounts:
    delta = weight.delta
    if tuple(scores.shape) != tuple(weight.shape):
        raise ValueError(f"scores of shape {tuple(scores.shape)} for a tensor of shape {tuple(weight.shape)}")
    # Without index ops on the device (Capabilities.index_ops, DirectML) the index arithmetic runs on
    # host copies; only the results go back (reindex, fold and remap_state do their own device writes).
    where = delta.indices.device if weight.index_ops else torch.device("cpu")
    old = delta.indices.to(where)  # (n,) sorted
    n = old.numel()
    pooled, pooled_scores = scores.pool_entries()  # (c,) unordered, positive scores only
    pooled, pooled_scores = pooled.to(old.device), pooled_scores.to(old.device)
    active = torch.zeros(pooled.shape, dtype=torch.bool, device=pooled.device)  # (c,) in the active set
    if n:
        active = old[torch.searchsorted(old, pooled).clamp(max=n - 1)] == pooled
    outside, outside_scores = pooled[~active], pooled_scores[~active]  # grow candidates
    target = round(fraction * n)
    k = min(target, outside.numel())
    if k == 0:
        return ReselectCounts(n, target, n, 0, 0, outside.numel())
    values = delta.values.detach().to(where)  # (n,) fp32
    # Smallest |delta| first, ties to the earlier position (deterministic), without sorting all n.
    positions = torch.arange(n, device=where)
    drop_pos = best_by_score(positions, -values.abs(), k)
    kept = torch.ones(n, dtype=torch.bool, device=where)
    kept[drop_pos] = False
    keep_pos = kept.nonzero().squeeze(1)  # (n - k,) old positions, ascending
    weight.fold(old[drop_pos], values[drop_pos])
    grown = outside[best_by_score(outside, outside_scores, k)]
    new = torch.cat([old[keep_pos], grown]).sort().values  # (n,) disjoint union: unique
    keep_dst = torch.searchsorted(new, old[keep_pos])  # where each kept entry lands
    new_values = torch.zeros_like(values)  # grown entries start at 0 on top of any folded value
    new_values[keep_dst] = values[keep_pos]
    delta.reindex(new, new_values)
    if optimizer is not None:
        optimizer.remap_state(delta.values, keep_pos, keep_dst, n)
    return ReselectCounts(n, target, n - k, k, k, outside.numel())
