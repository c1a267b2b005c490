"""The shape of a model's attention, read off its modules (on the meta device: no weights).

The memory planner (:mod:`usaf.memory_plan.activations`) needs what one decoder layer's attention saves for
backward; that depends on the attention modules' projections (grouped-query, MLA's latents, per-head
norms), whose Hugging Face names only this package spells.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from usaf.families.spec import FamilySpec


@dataclass(frozen=True)
class AttentionShape:
    """What one decoder layer's attention saves for backward depends on these (``usaf.memory_plan.activations``).

    Dims are per token: ``q_dim = heads * qk_head_dim``; ``k_dim``/``v_dim`` before any repetition for
    grouped-query attention. ``core`` is ``"fused"`` when torch's fused attention can run (it saves the
    output and a log-sum-exp, linear in T); ``"math"`` when SDPA falls back to its math kernel because
    the value head dim differs from the query's (MLA, DeepSeek), ``"eager"`` when the model runs its own
    attention (gpt-oss, for its sinks): both save the (T, T) probabilities.
    """

    heads: int
    kv_heads: int
    q_dim: int
    k_dim: int
    v_dim: int
    qk_head_dim: int
    v_head_dim: int
    qk_norm: str | None  # "head": RMSNorm per head (Qwen3), "full": over the whole projection (OLMoE)
    latent_dims: tuple[int, ...]  # MLA: widths of the low-rank projections that are normalised (DeepSeek)
    core: str  # "fused" | "math" | "eager"
    sinks: bool  # gpt-oss: one extra logit column per head


def attention_shape(model: Any, spec: FamilySpec) -> AttentionShape:
    """The top MoE layer's attention shape, read off the meta model's modules."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    layer = model.get_submodule(spec.layer_prefix(spec.moe_layers[-1]))
    attn = getattr(layer, "self_attn", None)
    hidden = spec.hidden_size
    if attn is None:  # an unfamiliar token mixer: count it like multi-head attention of width H
        return AttentionShape(
            heads, heads, hidden, hidden, hidden, hidden // heads, hidden // heads, None, (), "fused", False
        )
    latent: tuple[int, ...] = ()
    if hasattr(attn, "kv_b_proj"):  # MLA (DeepSeek): K and V come out of a normalised low-rank latent
        qk_head = int(config.qk_nope_head_dim + config.qk_rope_head_dim)
        v_head = int(config.v_head_dim)
        q_dim, k_dim, v_dim = heads * qk_head, heads * qk_head, heads * v_head
        kv_heads = heads
        latent = (int(attn.kv_a_proj_with_mqa.out_features),)
        if hasattr(attn, "q_a_layernorm"):
            latent = (int(attn.q_a_layernorm.weight.numel()), *latent)
    else:
        q_dim = int(attn.q_proj.out_features)
        k_dim, v_dim = int(attn.k_proj.out_features), int(attn.v_proj.out_features)
        qk_head, v_head = q_dim // heads, v_dim // kv_heads
    qk_norm = None
    if hasattr(attn, "q_norm"):
        qk_norm = "head" if attn.q_norm.weight.numel() == qk_head else "full"
    # Eager when the model does not use SDPA (gpt-oss, for its sinks); torch's fused SDPA kernels need equal
    # query and value head dims, else SDPA runs its math kernel (MLA).
    implementation = getattr(model.config, "_attn_implementation", "sdpa")
    core = "eager" if implementation != "sdpa" else "fused" if qk_head == v_head else "math"
    return AttentionShape(
        heads=heads,
        kv_heads=kv_heads,
        q_dim=q_dim,
        k_dim=k_dim,
        v_dim=v_dim,
        qk_head_dim=qk_head,
        v_head_dim=v_head,
        qk_norm=qk_norm,
        latent_dims=latent,
        core=core,
        sinks=hasattr(attn, "sinks"),
    )
