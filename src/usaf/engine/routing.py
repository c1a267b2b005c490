"""Per-token routing decisions of every MoE layer, captured during a forward, and the drift between two models.

``RoutingCapture`` sets each layer's ``LayerExperts.routing_sink`` (called from the experts forward with the
``(T, k)`` top-k expert indices the family's own router chose, ``T = B * S`` tokens flattened row-major)
and keeps, per layer, the sorted top-k set of each *real* token (padding removed with the attention
mask), so two passes over the same sequences in the same batches line up token by token.

Drift definitions (documented in docs/ARCHITECTURE.md):

- *load*: tokens routed to each expert (each token counts once per chosen expert), its entropy in nats,
  the largest expert's share, and the experts that got no token;
- *changed fraction*: the share of tokens whose top-k **set** differs (order and weights ignored).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from usaf.engine.experts import LayerExperts


def set_dtype(num_experts: int) -> torch.dtype:
    """The dtype a kept top-k set's expert indices are stored in: uint8 up to 256 experts, else int16."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def kept_bytes_per_token(experts: Mapping[int, LayerExperts], top_k: int) -> int:
    """Bytes a :class:`RoutingCapture` keeps per real token of one pass: a top-k set of every MoE layer."""
    return sum(top_k * set_dtype(state.num_experts).itemsize for state in experts.values())


class RoutingCapture:
    """Context manager collecting sorted top-k sets per MoE layer for the real tokens of each batch.

    Example::

        with RoutingCapture(loaded.experts) as capture:
            model(input_ids, attention_mask=mask)
            sets = capture.take(mask)  # {layer: (n_real, k) uint8/int16}
    """

    def __init__(self, experts: Mapping[int, LayerExperts]) -> None:
        self.experts = dict(experts)
        self._pending: dict[int, list[torch.Tensor]] = {}

    def __enter__(self) -> RoutingCapture:
        for state in self.experts.values():
            state.routing_sink = self._sink
        return self

    def __exit__(self, *exc: object) -> None:
        for state in self.experts.values():
            state.routing_sink = None
        self._pending.clear()

    def _sink(self, layer: int, top_k_index: torch.Tensor) -> None:
        # Sorted, so a set compares equal whatever order the router listed it in. Stored small (uint8 up to 256
        # experts, else int16): a pass keeps k of them per token and layer, and the base cache stores them.
        dtype = set_dtype(self.experts[layer].num_experts)
        self._pending.setdefault(layer, []).append(top_k_index.detach().sort(dim=-1).values.to("cpu", dtype))

    def take(self, attention_mask: torch.Tensor) -> dict[int, torch.Tensor]:
        """The sets recorded since the last call, ``{layer: (n_real, k)}`` uint8/int16, padding dropped.

        Args:
            attention_mask: ``(B, S)`` of the forward(s) since the last call, 1 on real tokens.
        """
        real = attention_mask.reshape(-1).to("cpu", torch.bool)  # (B*S,)
        out = {}
        for layer in self.experts:
            chunks = self._pending.pop(layer, [])
            if not chunks:
                raise RuntimeError(f"MoE layer {layer} routed no tokens in this forward")
            sets = torch.cat(chunks)  # (B*S, k)
            if sets.shape[0] != real.numel():
                raise RuntimeError(
                    f"layer {layer}: {sets.shape[0]} routed rows for {real.numel()} positions; "
                    "this family does not flatten tokens as (B*S)"
                )
            out[layer] = sets[real]
        return out


@dataclass(frozen=True)
class LoadSummary:
    tokens_per_expert: list[int]
    entropy: float  # nats; log(E) is perfectly even
    max_share: float
    dead_experts: int


def load_summary(counts: torch.Tensor) -> LoadSummary:
    """Entropy, max share and dead experts of per-expert token counts ``(E,)``."""
    total = int(counts.sum())
    shares = counts.double() / max(total, 1)
    nonzero = shares[shares > 0]
    entropy = float(-(nonzero * nonzero.log()).sum()) if total else 0.0
    return LoadSummary(counts.tolist(), entropy, float(shares.max()) if total else 0.0, int((counts == 0).sum()))


def expert_counts(sets: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert ``(E,)`` int64 from top-k sets ``(n, k)``."""
    return torch.bincount(sets.reshape(-1).long(), minlength=num_experts)[:num_experts]


def changed_tokens(base: torch.Tensor, tuned: torch.Tensor) -> int:
    """How many tokens' top-k sets differ between two ``(n, k)`` sorted-set tensors of the same tokens."""
    if base.shape != tuned.shape:
        raise ValueError(f"routing of different tokens: {tuple(base.shape)} vs {tuple(tuned.shape)}")
    return int((base != tuned).any(dim=-1).sum())
