"""Token-weighted mean NLL with percentile-bootstrap intervals over sequences, and the paired difference.

The statistic is ratio-of-sums, ``sum(nll_i) / sum(tokens_i)`` over the sequences of a row, exactly the
held-out loss training reports. A bootstrap resample draws sequences with replacement (sequences, not
tokens: tokens of one sequence are correlated) and recomputes the ratio. The difference fine-tuned −
base uses the *same* resample for both models (paired), so the shared difficulty of the sequences
cancels and the interval measures the change, not the spread of the data. Percentile intervals are
invariant under exp, so the perplexity interval is exp of the NLL interval; the perplexity difference
gets its own percentiles of ``exp(tuned_b) - exp(base_b)``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

CONFIDENCE = 0.95
_DRAWS_PER_CHUNK = 1 << 22  # sequence indices drawn at once (32 MiB of int64), whatever the row's size


@dataclass(frozen=True)
class RowStats:
    sequences: int
    tokens: int
    base_nll: float
    base_ci: tuple[float, float] | None
    tuned_nll: float | None = None
    tuned_ci: tuple[float, float] | None = None
    delta_nll: float | None = None
    delta_ci: tuple[float, float] | None = None
    delta_ppl_ci: tuple[float, float] | None = None


def row_seed(seed: int, sequences_fingerprint: str) -> int:
    """A row's bootstrap seed from ``--seed`` and the fingerprint of the row's sequences (their content, in order): a
    row's interval does not depend on which other rows or inputs exist, nor on their order, and two rows of the same
    sequences (a set with one source) get the same one. Seeded by the sequences' positions in the run, an input's
    interval changed with the inputs given before it (found in review)."""
    return int(hashlib.sha256(f"{seed}:{sequences_fingerprint}".encode()).hexdigest()[:15], 16)


def bootstrap_row(
    base: torch.Tensor,
    tuned: torch.Tensor | None,
    tokens: torch.Tensor,
    *,
    samples: int,
    seed: int,
    confidence: float = CONFIDENCE,
) -> RowStats:
    """Point estimates and intervals for one row.

    Args:
        base: ``(n,)`` summed NLL per sequence, base model.
        tuned: ``(n,)`` the same for the fine-tuned model, or ``None`` (base only).
        tokens: ``(n,)`` scored tokens per sequence (> 0; rows drop sequences without any).
        samples: bootstrap resamples.
        seed: the resampling seed.
        confidence: central interval mass.
    """
    base, tokens = base.double(), tokens.double()
    tuned = tuned.double() if tuned is not None else None
    n = int(tokens.numel())
    total = float(tokens.sum())
    point_base = float(base.sum()) / total
    point_tuned = float(tuned.sum()) / total if tuned is not None else None
    stats = RowStats(n, int(total), point_base, None)
    if n < 2:  # one sequence: no spread to resample
        if tuned is None:
            return stats
        return RowStats(n, int(total), point_base, None, point_tuned, None, point_tuned - point_base, None, None)

    generator = torch.Generator().manual_seed(seed)
    base_b, tuned_b = [], []
    per_chunk = max(1, _DRAWS_PER_CHUNK // n)
    for start in range(0, samples, per_chunk):
        count = min(per_chunk, samples - start)
        idx = torch.randint(n, (count, n), generator=generator)  # (count, n) sequence draws
        tok = tokens[idx].sum(dim=1)  # (count,)
        base_b.append(base[idx].sum(dim=1) / tok)
        if tuned is not None:
            tuned_b.append(tuned[idx].sum(dim=1) / tok)
    lo, hi = (1 - confidence) / 2, 1 - (1 - confidence) / 2
    base_all = torch.cat(base_b)
    base_ci = _interval(base_all, lo, hi)
    if tuned is None:
        return RowStats(n, int(total), point_base, base_ci)
    tuned_all = torch.cat(tuned_b)
    return RowStats(
        n,
        int(total),
        point_base,
        base_ci,
        point_tuned,
        _interval(tuned_all, lo, hi),
        point_tuned - point_base,
        _interval(tuned_all - base_all, lo, hi),
        _interval(tuned_all.exp() - base_all.exp(), lo, hi),
    )


def _interval(values: torch.Tensor, lo: float, hi: float) -> tuple[float, float]:
    q = torch.quantile(values, torch.tensor([lo, hi], dtype=values.dtype))
    return float(q[0]), float(q[1])


def ppl(nll: float) -> float:
    """exp(nll), inf instead of an overflow error for a hopeless model."""
    try:
        return math.exp(nll)
    except OverflowError:
        return math.inf
