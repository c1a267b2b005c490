"""usaf's experts on transformers 4.x MoE blocks (the DirectML configuration: torch 2.4.1, transformers 4.57).

transformers 4.x has no experts-implementation registry, so usaf cannot plug in the way it does on
v5 (:mod:`usaf.engine.experts`). Instead, per MoE layer, :func:`adapt_block`:

1. registers the block under usaf's name (Mixtral 4.x calls it ``block_sparse_moe``; usaf, like v5,
   ``mlp``), keeping the 4.x attribute as an alias so the 4.x decoder layer still finds it;
2. replaces the block's experts (a ``ModuleList`` of per-expert MLPs, or gpt-oss's fused module) by a
   :class:`LegacyExperts`, which keeps v5's experts-module contract ``(x (T, H), top_k_index (T, k),
   top_k_weights (T, k)) -> (T, H)`` and runs :func:`usaf.engine.experts.usaf_experts_forward`, the same
   code as on v5;
3. replaces the block's forward by :func:`legacy_block_forward`: the family's router (its own module),
   the routing as 4.x computes it, usaf's experts, the shared experts, and the 4.x return convention.

After this the model's tensors carry usaf's names, so loading, training, scoring and export see the
same model on both transformers versions. Everything here uses torch 2.4 APIs only.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from usaf.engine.experts import usaf_experts_forward
from usaf.families import FamilySpec, RouterKind
from usaf.families.modules import EXPERT_BIAS_PARAMS


class LegacyExperts(nn.Module):
    """Stands in for a 4.x block's experts: v5's experts-module contract, computed by usaf.

    Attributes:
        num_experts: E.
        act_fn: the family's activation (from the replaced experts).
        interleaved: gate at even, up at odd columns of ``gate_up`` (gpt-oss); else gate then up halves.
        swiglu: ``(alpha, limit)`` of gpt-oss's clamped SwiGLU with ``(up + 1)``; None for ``act(gate) * up``.
        has_bias: ``gate_up_proj_bias (E, 2I)`` and ``down_proj_bias (E, H)`` parameters (gpt-oss).
        usaf_experts: the layer's :class:`~usaf.engine.experts.LayerExperts`, attached by the loader.
    """

    def __init__(
        self,
        num_experts: int,
        act_fn: nn.Module | None,
        *,
        interleaved: bool = False,
        swiglu: tuple[float, float] | None = None,
        biases: dict[str, nn.Parameter] | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.act_fn = act_fn
        self.interleaved = interleaved
        self.swiglu = swiglu
        self.has_bias = bool(biases)
        for name, param in (biases or {}).items():
            self.register_parameter(name, param)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``(t, 2I) -> (t, I)``: the family's gating, as transformers applies it."""
        if self.interleaved:
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # (t, I) each
        else:
            gate, up = gate_up.chunk(2, dim=-1)  # (t, I) each
        if self.swiglu is None:
            return self.act_fn(gate) * up
        alpha, limit = self.swiglu
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """``(T, H), (T, k), (T, k) -> (T, H)``."""
        return usaf_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def _legacy_attribute(spec: FamilySpec, layer: int) -> str:
    """The 4.x attribute of the MoE block on its decoder layer (the on-disk name: ``block_sparse_moe``)."""
    return spec.disk.to_disk(f"{spec.moe_prefix(layer)}.").rsplit(".", 2)[-2]


def _replacement_experts(spec: FamilySpec, old: nn.Module) -> LegacyExperts:
    if isinstance(old, nn.ModuleList):  # per-expert MLPs: take the activation of the first
        act_fn = getattr(old[0], "act_fn", None)
        if act_fn is None:
            raise TypeError(f"{spec.model_type}: the per-expert MLP has no act_fn")
        return LegacyExperts(spec.num_experts, act_fn)
    # fused (gpt-oss 4.x): the 3-D weights are replaced by usaf's quantized ones; the biases stay
    biases = {n: old._parameters[n] for n in EXPERT_BIAS_PARAMS if n in old._parameters}
    swiglu = (float(old.alpha), float(old.limit)) if hasattr(old, "alpha") and hasattr(old, "limit") else None
    act_fn = getattr(old, "act_fn", None)
    return LegacyExperts(spec.num_experts, act_fn, interleaved=spec.layout.interleaved, swiglu=swiglu, biases=biases)


def adapt_block(model: nn.Module, spec: FamilySpec, layer: int) -> LegacyExperts:
    """Make MoE layer ``layer`` of a transformers 4.x model run usaf's experts; returns its experts module."""
    decoder = model.get_submodule(spec.layer_prefix(layer))
    legacy, name = _legacy_attribute(spec, layer), spec.moe_module
    if legacy != name:
        block = decoder._modules.pop(legacy)
        decoder._modules[name] = block
        object.__setattr__(decoder, legacy, block)  # the 4.x forward calls self.<legacy>(...)
    block = decoder._modules[name]
    experts = _replacement_experts(spec, block.experts)
    block.experts = experts
    block.usaf_spec = spec
    block.forward = types.MethodType(legacy_block_forward, block)
    return experts


def _select(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values.gather(1, index)`` for ``values (T, E)``, ``index (T, k)``, without a scatter in the backward.

    Each output is a sum with one non-zero term, so the values are exact.
    """
    chosen = index.unsqueeze(-1) == torch.arange(values.shape[-1], device=values.device)  # (T, k, E)
    return (values.unsqueeze(1) * chosen).sum(dim=-1)  # (T, k)


def _route_without_scatter(router: nn.Module, spec: FamilySpec, x: torch.Tensor):
    """transformers 4.57's DeepSeek-V3 and gpt-oss routing, restated without scatter/gather (DirectML)."""
    r = spec.router
    if r.kind is RouterKind.SIGMOID_GROUP_TOPK:  # DeepseekV3TopkRouter.forward
        scores = torch.nn.functional.linear(x.float(), router.weight.float()).sigmoid()  # (T, E)
        t, e = scores.shape
        groups, keep = r.n_group or 1, r.topk_group or 1
        choice = scores.detach() + router.e_score_correction_bias  # (T, E), for the choice only
        group_scores = choice.view(t, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)  # (T, groups)
        group_idx = torch.topk(group_scores, k=keep, dim=-1, sorted=False)[1]  # (T, keep)
        group_mask = (group_idx.unsqueeze(-1) == torch.arange(groups, device=x.device)).any(dim=1)  # (T, groups)
        score_mask = group_mask.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)
        index = torch.topk(choice.masked_fill(~score_mask, 0.0), k=spec.top_k, dim=-1, sorted=False)[1]
        weights = _select(scores, index)  # (T, k)
        if r.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return None, weights * r.scaling_factor, index
    if r.kind is RouterKind.TOPK_SOFTMAX:  # GptOssTopKRouter.forward; its dense scores built by comparison
        logits = torch.nn.functional.linear(x, router.weight, router.bias)  # (T, E)
        index = torch.topk(logits.detach(), spec.top_k, dim=-1)[1]  # (T, k)
        weights = torch.softmax(_select(logits, index), dim=1)  # (T, k)
        chosen = index.unsqueeze(-1) == torch.arange(logits.shape[-1], device=x.device)  # (T, k, E)
        scores = (weights.unsqueeze(-1) * chosen).sum(dim=1)  # (T, E), zero off the top-k
        return scores, weights, index
    raise ValueError(f"{spec.model_type}: no 4.x routing for router kind {r.kind.value}")


def _route(block: nn.Module, spec: FamilySpec, x: torch.Tensor):
    """Router output for tokens ``x (T, H)``: ``(router_logits or None, weights (T, k), index (T, k))``."""
    router = getattr(block, spec.router.module)
    index_ops = block.experts.usaf_experts.index_ops
    if spec.legacy is not None and spec.legacy.router_routes and not index_ops:
        return _route_without_scatter(router, spec, x)
    if spec.legacy is not None and spec.legacy.router_routes:
        if spec.router.kind is RouterKind.SIGMOID_GROUP_TOPK:  # DeepSeek-V3: (indices, fp32 weights)
            index, weights = router(x)
            return None, weights, index
        if spec.router.kind is RouterKind.TOPK_SOFTMAX:  # gpt-oss: (scores (T, E) zero off the top-k, indices)
            scores, index = router(x)
            return scores, scores.gather(1, index), index
        raise ValueError(f"{spec.model_type}: no 4.x routing for router kind {spec.router.kind.value}")
    logits = router(x)  # (T, E)
    probs = torch.softmax(logits, dim=1, dtype=torch.float)  # (T, E)
    if index_ops:
        weights, index = torch.topk(probs, spec.top_k, dim=-1)  # (T, k)
    else:  # topk's backward is a scatter: select by comparison instead (the same values, exactly)
        index = torch.topk(probs.detach(), spec.top_k, dim=-1).indices  # (T, k)
        weights = _select(probs, index)  # (T, k)
    if spec.router.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(x.dtype), index


def legacy_block_forward(self: nn.Module, hidden_states: torch.Tensor):
    """A 4.x MoE block's forward with usaf's experts: ``(B, S, H) -> (B, S, H)`` [, router logits (B*S, E)]."""
    spec: FamilySpec = self.usaf_spec
    batch, seq, hidden = hidden_states.shape
    jitter = float(getattr(self, "jitter_noise", 0.0) or 0.0)  # Mixtral: input noise in training only
    if self.training and jitter > 0:
        hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
    x = hidden_states.reshape(-1, hidden)  # (T, H)
    logits, weights, index = _route(self, spec, x)
    out = self.experts(x, index, weights)  # (T, H)
    if spec.shared is not None:
        shared = getattr(self, spec.shared.module)(x)  # (T, H)
        if spec.shared.gate:
            shared = torch.sigmoid(getattr(self, spec.shared.gate)(x)) * shared
        out = out + shared
    out = out.reshape(batch, seq, hidden)
    return (out, logits) if spec.legacy is not None and spec.legacy.returns_router_logits else out
