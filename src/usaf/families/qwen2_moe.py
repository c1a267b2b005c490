"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

Verified in transformers 5.24 ``models/qwen2_moe/modeling_qwen2_moe.py``: the same layer rule, fused
experts and softmax top-k router as Qwen3-MoE (``norm_topk_prob`` defaults to False), plus in every
MoE block a shared expert ``mlp.shared_expert`` (gated MLP of width ``shared_expert_intermediate_size``)
whose output is scaled by ``sigmoid(mlp.shared_expert_gate(x))``, ``shared_expert_gate.weight [1, H]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from usaf.families import fields
from usaf.families.qwen3_moe import sparse_step_layers
from usaf.families.registry import common_facts, layers_prefix, register
from usaf.families.spec import (
    DiskLayout,
    DiskSpec,
    ExpertsLayout,
    FamilySpec,
    LegacyModules,
    RouterKind,
    RouterSpec,
    SharedExpertSpec,
)

DEFAULTS = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False, "hidden_act": "silu"}


@register("qwen2_moe")
def build(text: Mapping[str, Any], root: Mapping[str, Any], nested: str | None) -> FamilySpec:
    facts = common_facts(
        text, root, expert_fields=("num_experts", "num_local_experts"), width_fields=("moe_intermediate_size",)
    )
    moe, dense = sparse_step_layers(text, facts["num_layers"], facts["num_experts"])
    shared_width = fields.pick(text, ("shared_expert_intermediate_size",), what="shared expert width", required=True)
    return FamilySpec(
        family="qwen2_moe",
        **facts,
        moe_layers=moe,
        dense_layers=dense,
        dense_width=text.get("intermediate_size") if dense else None,
        router=RouterSpec(
            kind=RouterKind.SOFTMAX_TOPK,
            module="gate",
            renormalize=bool(text.get("norm_topk_prob", DEFAULTS["norm_topk_prob"])),
        ),
        shared=SharedExpertSpec(module="shared_expert", width=int(shared_width), gate="shared_expert_gate"),
        layout=ExpertsLayout(),
        disk=DiskSpec(canonical=DiskLayout.PER_EXPERT),
        activation=str(text.get("hidden_act", DEFAULTS["hidden_act"])),
        layers_prefix=layers_prefix(nested),
        nested_in=nested,
        legacy=LegacyModules(layer_returns_tuple=True),
        config=root,
    )
