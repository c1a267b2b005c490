"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B).

Verified in transformers 5.24 ``models/qwen3_moe/modeling_qwen3_moe.py``:
- layer i is MoE iff ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``,
  else a dense ``Qwen3MoeMLP`` of width ``intermediate_size``;
- ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first), ``down_proj [E, H, I]``, I = moe_intermediate_size;
- router ``mlp.gate.weight [E, H]``: softmax over E, top-k, renormalised iff ``norm_topk_prob``;
- on disk (``save_pretrained``): ``mlp.experts.{e}.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from usaf.families import fields
from usaf.families.registry import common_facts, layers_prefix, register, split_layers
from usaf.families.spec import DiskLayout, DiskSpec, ExpertsLayout, FamilySpec, LegacyModules, RouterKind, RouterSpec

# transformers' Qwen3MoeConfig defaults for the fields a hand-written config may omit
DEFAULTS = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False, "hidden_act": "silu"}


def sparse_step_layers(text: Mapping[str, Any], num_layers: int, num_experts: int):
    """The Qwen2/Qwen3-MoE rule for which layers are MoE; returns (moe, dense)."""
    step = fields.positive_int(
        text.get("decoder_sparse_step") or DEFAULTS["decoder_sparse_step"], field="decoder_sparse_step"
    )
    mlp_only = set(fields.int_list(text.get("mlp_only_layers"), field="mlp_only_layers"))
    return split_layers(num_layers, lambda i: i not in mlp_only and num_experts > 0 and (i + 1) % step == 0)


@register("qwen3_moe")
def build(text: Mapping[str, Any], root: Mapping[str, Any], nested: str | None) -> FamilySpec:
    facts = common_facts(
        text, root, expert_fields=("num_experts", "num_local_experts"), width_fields=("moe_intermediate_size",)
    )
    moe, dense = sparse_step_layers(text, facts["num_layers"], facts["num_experts"])
    return FamilySpec(
        family="qwen3_moe",
        **facts,
        moe_layers=moe,
        dense_layers=dense,
        dense_width=text.get("intermediate_size") if dense else None,
        router=RouterSpec(
            kind=RouterKind.SOFTMAX_TOPK,
            module="gate",
            renormalize=bool(text.get("norm_topk_prob", DEFAULTS["norm_topk_prob"])),
        ),
        shared=None,
        layout=ExpertsLayout(),
        disk=DiskSpec(canonical=DiskLayout.PER_EXPERT),
        activation=str(text.get("hidden_act", DEFAULTS["hidden_act"])),
        layers_prefix=layers_prefix(nested),
        nested_in=nested,
        legacy=LegacyModules(config_renames=(("num_local_experts", "num_experts"),)),
        config=root,
    )
