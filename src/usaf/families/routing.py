"""Reference routers: the routing math of each :class:`RouterKind`, in plain torch.

These restate transformers 5.24's router forwards so that a spec's router facts can be checked
against the model (tests compare them with the model's own router output) and so that code which
needs routing decisions without running the model (scoring) has one place to get them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from usaf.families.modules import transformers_major
from usaf.families.spec import FamilySpec, RouterKind, RouterSpec

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


def dense_router_grad_refusal(spec: FamilySpec) -> str | None:
    """Why the dense router gradient (``--dense-router-grad``) cannot apply to this family, or None when it can."""
    if spec.router.kind is RouterKind.MODEL_DEFINED:
        return f"{spec.family}'s router is its model's own module (a structural fallback): usaf knows no scores for it"
    if spec.legacy is not None and spec.legacy.router_routes and transformers_major() < 5:
        return f"on transformers 4.x, {spec.family}'s router module returns its routing, not its logits"
    return None


def dense_weights(router: RouterSpec, logits: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """Every expert's routing weight ``(T, E)`` fp32, extending the family's top-k weights to all experts
    as DenseMixer does (its "partscale_fix_expert" normalisation).

    ``weight[t, e] = score[t, e] * c[t]``: the family's per-expert score (softmax over all experts, or
    DeepSeek-V3's sigmoid) times the factor that turns the kept scores into the family's top-k weights
    (``scaling_factor / sum of the kept scores`` when they are renormalised, else ``scaling_factor``).
    At the kept experts this equals the family's weight, with its gradient; at the others the factor
    is detached, so a non-selected expert's weight moves only with its own score. gpt-oss (top-k of the
    logits, softmax over those k) is the renormalised softmax case: ``softmax(top-k logits)_j`` equals
    ``p_j / sum_kept p`` for ``p = softmax(all logits)``, in value and in gradient.

    Args:
        logits: ``(T, E)`` router logits as the family's router returns them (gpt-oss: with its bias).
        top_k_index: ``(T, k)`` the experts each token was routed to.
    """
    # lazy: importing usaf.families stays free of torch
    import torch

    if router.kind is RouterKind.SIGMOID_GROUP_TOPK:
        scores, eps = logits.float().sigmoid(), 1e-20  # (T, E); transformers adds 1e-20 to the sum
    elif router.kind in (RouterKind.SOFTMAX_TOPK, RouterKind.TOPK_SOFTMAX):
        scores, eps = torch.softmax(logits.float(), dim=-1), 0.0  # (T, E)
    else:
        raise ValueError(f"no dense routing weights for router kind {router.kind.value}")
    # kept experts as a comparison, not one_hot/scatter (the DirectML path has none)
    experts = torch.arange(scores.shape[-1], device=scores.device)
    kept = (top_k_index.unsqueeze(-1) == experts).any(dim=1)  # (T, E) bool
    renormalise = router.renormalize or router.kind is RouterKind.TOPK_SOFTMAX
    factor = torch.full_like(scores[:, :1], router.scaling_factor)  # (T, 1)
    if renormalise:
        factor = factor / ((scores * kept).sum(dim=-1, keepdim=True) + eps)  # (T, 1), with its gradient
    # kept: score * factor (the family's weight and its gradient); others: the factor held constant
    return torch.where(kept, scores * factor, scores * factor.detach())  # (T, E)
