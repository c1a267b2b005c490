"""Reference routers: the routing math of each :class:`RouterKind`, in plain torch.

These restate transformers 5.24's router forwards so that a spec's router facts can be checked
against the model (tests compare them with the model's own router output) and so that code which
needs routing decisions without running the model (scoring) has one place to get them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from usaf.families.spec import RouterKind, RouterSpec

if TYPE_CHECKING:
    import torch


def route(
    router: RouterSpec,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    top_k: int,
    bias: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, k] and expert indices [T, k] for tokens ``hidden`` [T, H].

    Args:
        router: the spec's router.
        weight: router weight [E, H].
        top_k: experts per token.
        bias: router bias [E] (gpt-oss).
        correction_bias: ``e_score_correction_bias`` [E] (DeepSeek-V3), used for the choice only.
    """
    # lazy: importing usaf.families stays free of torch
    import torch
    import torch.nn.functional as F

    if router.kind is RouterKind.SOFTMAX_TOPK:
        logits = F.linear(hidden, weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        values, indices = torch.topk(probs, top_k, dim=-1)
        if router.renormalize:
            values = values / values.sum(dim=-1, keepdim=True)
        return values.to(logits.dtype), indices
    if router.kind is RouterKind.TOPK_SOFTMAX:
        logits = F.linear(hidden, weight, bias)  # [T, E]
        values, indices = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=values.dtype), indices
    if router.kind is RouterKind.SIGMOID_GROUP_TOPK:
        logits = F.linear(hidden.float(), weight.float())  # [T, E], float32 like the model
        scores = logits.sigmoid()
        choice = scores + (correction_bias if correction_bias is not None else 0.0)
        t, e = choice.shape
        groups, keep = router.n_group or 1, router.topk_group or 1
        group_scores = choice.view(t, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)  # [T, groups]
        group_idx = torch.topk(group_scores, k=keep, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        indices = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
        values = scores.gather(1, indices)
        if router.renormalize:
            values = values / (values.sum(dim=-1, keepdim=True) + 1e-20)
        return values * router.scaling_factor, indices
    raise ValueError(f"router kind {router.kind.value} is defined by the model; run its router module instead")
