"""OLMoE (OLMoE-1B-7B).

Verified in transformers 5.24 ``models/olmoe/modeling_olmoe.py``: every layer is MoE; the expert
width is ``intermediate_size`` (a ``moe_intermediate_size`` key, if present, is ignored by the model);
router ``mlp.gate.weight [E, H]``: softmax, top-k, renormalised iff ``norm_topk_prob`` (default False);
on disk ``mlp.experts.{e}.{gate,up,down}_proj.weight``. OLMoE-1B-7B has 2I == H (1024 * 2 == 2048),
so gate_up_proj is square: never infer its orientation from shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from usaf.families.registry import common_facts, layers_prefix, register
from usaf.families.spec import DiskLayout, DiskSpec, ExpertsLayout, FamilySpec, LegacyModules, RouterKind, RouterSpec

DEFAULTS = {"norm_topk_prob": False, "hidden_act": "silu"}


@register("olmoe")
def build(text: Mapping[str, Any], root: Mapping[str, Any], nested: str | None) -> FamilySpec:
    facts = common_facts(
        text, root, expert_fields=("num_experts", "num_local_experts"), width_fields=("intermediate_size",)
    )
    return FamilySpec(
        family="olmoe",
        **facts,
        moe_layers=tuple(range(facts["num_layers"])),
        dense_layers=(),
        dense_width=None,
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
        legacy=LegacyModules(layer_returns_tuple=True),
        config=root,
    )
