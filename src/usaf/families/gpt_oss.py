"""gpt-oss (20b, 120b).

Verified in transformers 5.24 ``models/gpt_oss/modeling_gpt_oss.py`` (``@use_experts_implementation(
is_concatenated=False, is_transposed=True, has_bias=True)``):
- every layer is MoE; E = ``num_local_experts``, I = ``intermediate_size``;
- ``mlp.experts.gate_up_proj [E, H, 2I]`` applied as ``x @ W[e]``, gate at even and up at odd columns;
  ``gate_up_proj_bias [E, 2I]`` in the same order; ``down_proj [E, I, H]`` (also input-major, unlike the
  ``[E, H, I]`` of the other families); ``down_proj_bias [E, H]``;
- activation: gate clamped to <= limit, up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate),
  so the output is affine (not linear) in the up half;
- router ``mlp.router``: ``weight [E, H]`` and ``bias [E]``; top-k of the biased logits, softmax over those k;
- transformers has no key conversion for gpt-oss: ``save_pretrained`` writes the in-memory names.
  Hub checkpoints store the expert weights as MXFP4 ``*_blocks``/``*_scales`` (biases in bf16), which
  ``transformers.integrations.mxfp4.convert_moe_packed_tensors`` decodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from usaf.families.registry import common_facts, layers_prefix, register
from usaf.families.spec import DiskLayout, DiskSpec, ExpertsLayout, FamilySpec, LegacyModules, RouterKind, RouterSpec

DEFAULTS = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


@register("gpt_oss")
def build(text: Mapping[str, Any], root: Mapping[str, Any], nested: str | None) -> FamilySpec:
    facts = common_facts(
        text,
        root,
        expert_fields=("num_local_experts", "num_experts"),
        width_fields=("intermediate_size",),
        top_k_fields=("num_experts_per_tok", "experts_per_token", "num_experts_per_token"),
    )
    alpha = text.get("swiglu_alpha", DEFAULTS["swiglu_alpha"])
    limit = text.get("swiglu_limit", DEFAULTS["swiglu_limit"])
    return FamilySpec(
        family="gpt_oss",
        **facts,
        moe_layers=tuple(range(facts["num_layers"])),
        dense_layers=(),
        dense_width=None,
        router=RouterSpec(kind=RouterKind.TOPK_SOFTMAX, module="router", params=("weight", "bias")),
        shared=None,
        layout=ExpertsLayout(transposed=True, interleaved=True, has_bias=True),
        disk=DiskSpec(canonical=DiskLayout.FUSED, per_expert=None, accepts_mxfp4=True),
        activation=f"gpt_oss_swiglu(alpha={alpha}, limit={limit})",
        layers_prefix=layers_prefix(nested),
        nested_in=nested,
        legacy=LegacyModules(experts="fused", router_routes=True),
        config=root,
    )
