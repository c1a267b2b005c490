"""DeepSeek-V3 / R1 (and Kimi-K2, which reuses its config).

Verified in transformers 5.24 ``models/deepseek_v3/``:
- layer i is MoE iff ``i >= first_k_dense_replace`` (``moe_layer_freq`` in hub configs is not read);
  dense layers use a gated MLP of width ``intermediate_size``;
- E = ``n_routed_experts`` (``num_local_experts`` is an alias), I = ``moe_intermediate_size``;
- router ``mlp.gate``: ``weight [E, H]`` and the buffer ``e_score_correction_bias [E]``, both kept in
  float32 (``_keep_in_fp32_modules_strict``). scores = sigmoid(logits); choice uses scores + bias;
  experts fall into ``n_group`` groups, a group's score is the sum of its top-2 choice scores, only the
  ``topk_group`` best groups are eligible; top-k by choice score; weights are the plain scores,
  renormalised iff ``norm_topk_prob`` (+1e-20), times ``routed_scaling_factor``;
- shared MLP ``mlp.shared_experts`` of width ``moe_intermediate_size * n_shared_experts`` (no gate);
- hub checkpoints carry ``num_nextn_predict_layers`` MTP layers at indices >= num_hidden_layers,
  which transformers does not load; hub weights are FP8 with ``weight_scale_inv`` (usaf refuses those).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from usaf.errors import UsafError
from usaf.families import fields
from usaf.families.registry import common_facts, layers_prefix, register, split_layers
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

# transformers' DeepseekV3Config defaults
DEFAULTS = {
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "n_shared_experts": 1,
    "num_nextn_predict_layers": 1,
    "hidden_act": "silu",
}


def _get(text: Mapping[str, Any], key: str) -> Any:
    return text[key] if key in text else DEFAULTS[key]


@register("deepseek_v3")
def build(text: Mapping[str, Any], root: Mapping[str, Any], nested: str | None) -> FamilySpec:
    facts = common_facts(
        text, root, expert_fields=("n_routed_experts", "num_local_experts"), width_fields=("moe_intermediate_size",)
    )
    first_dense = _get(text, "first_k_dense_replace")
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
        raise UsafError(f"config.json: first_k_dense_replace = {first_dense!r} is not a layer count", "fix config.json")
    moe, dense = split_layers(facts["num_layers"], lambda i: i >= first_dense)
    n_group = fields.positive_int(_get(text, "n_group"), field="n_group")
    topk_group = fields.positive_int(_get(text, "topk_group"), field="topk_group")
    if facts["num_experts"] % n_group or topk_group > n_group:
        raise UsafError(
            f"config.json: n_routed_experts={facts['num_experts']}, n_group={n_group}, topk_group={topk_group}: "
            "experts must split evenly into groups and topk_group <= n_group",
            "fix config.json",
        )
    n_shared = fields.positive_int(_get(text, "n_shared_experts"), field="n_shared_experts")
    mtp = fields.pick(text, ("num_nextn_predict_layers", "num_mtp_layers"), what="MTP layer count", default=1)
    return FamilySpec(
        family="deepseek_v3",
        **facts,
        moe_layers=moe,
        dense_layers=dense,
        dense_width=text.get("intermediate_size") if dense else None,
        router=RouterSpec(
            kind=RouterKind.SIGMOID_GROUP_TOPK,
            module="gate",
            params=("weight", "e_score_correction_bias"),
            renormalize=bool(_get(text, "norm_topk_prob")),
            scaling_factor=float(_get(text, "routed_scaling_factor")),
            n_group=n_group,
            topk_group=topk_group,
            fp32=True,
        ),
        shared=SharedExpertSpec(module="shared_experts", width=facts["expert_width"] * n_shared),
        layout=ExpertsLayout(),
        disk=DiskSpec(canonical=DiskLayout.PER_EXPERT),
        activation=str(_get(text, "hidden_act")),
        layers_prefix=layers_prefix(nested),
        mtp_layers=int(mtp or 0),
        nested_in=nested,
        legacy=LegacyModules(returns_router_logits=False, router_routes=True),
        config=root,
    )
