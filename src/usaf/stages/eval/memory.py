"""What eval's passes keep in RAM, checked before they run: the per-token routing sets of every MoE layer.

A pass keeps the sorted top-k set of every real token in every MoE layer (``engine.routing``), for the drift
report: Qwen3-30B-A3B's 48 layers of top-8 hold 384 bytes per token and pass, 15 GB for 20 M tokens evaluated
base and fine-tuned. It grows through the pass, so a run that cannot hold it fails hours in; it is refused before
the first pass instead, with the ``--max-sequences`` that fits (found in review, 2026-12-07).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import psutil

from usaf.engine.experts import LayerExperts
from usaf.engine.routing import kept_bytes_per_token
from usaf.errors import UsafError
from usaf.units import human_bytes

# Of the RAM available once the model is loaded, what the passes' routing sets may take: the rest is for the base
# pass's prefix states (``passes.PREFIX_RAM_SHARE`` of what is available then) and each forward's working memory.
ROUTING_RAM_SHARE = 0.75


def check_routing_fits(inputs: Sequence, experts: Mapping[int, LayerExperts], top_k: int, passes: int) -> None:
    """Refuse when ``passes`` passes over ``inputs`` (``EvalInput``) would keep more routing sets than
    ``ROUTING_RAM_SHARE`` of the available RAM; the message names the ``--max-sequences`` that fits."""
    per_token = kept_bytes_per_token(experts, top_k) * passes
    counts = [(len(item.sequences), sum(len(s.input_ids) for s in item.sequences)) for item in inputs]
    needed = per_token * sum(tokens for _, tokens in counts)
    available = psutil.virtual_memory().available
    room = ROUTING_RAM_SHARE * available
    if needed <= room:
        return
    fits = largest_sample(counts, int(room // per_token)) if per_token else 0
    what = "base and fine-tuned passes" if passes == 2 else "base pass"
    raise UsafError(
        f"eval: the {what} would keep {human_bytes(needed)} of routing sets in RAM (top-{top_k} of {len(experts)} "
        f"MoE layers for each of {sum(t for _, t in counts):,} tokens), over {ROUTING_RAM_SHARE:.0%} of the "
        f"{human_bytes(available)} available",
        f"pass --max-sequences {fits} (a seeded sample of each input)" if fits >= 1 else "free memory first",
    )


def largest_sample(counts: Sequence[tuple[int, int]], budget_tokens: int) -> int:
    """The largest per-input sample size whose tokens fit ``budget_tokens``: ``counts`` is each input's
    ``(sequences, tokens)``, a sample of ``m`` taking ``min(m, sequences)`` sequences of its mean length. 0: none."""

    def tokens_at(m: int) -> float:
        return sum(min(m, n) * tokens / n for n, tokens in counts if n)

    low, high = 0, max((n for n, _ in counts), default=0)
    while low < high:  # the largest m with tokens_at(m) <= budget (tokens_at grows with m)
        middle = (low + high + 1) // 2
        low, high = (middle, high) if tokens_at(middle) <= budget_tokens else (low, middle - 1)
    return low
