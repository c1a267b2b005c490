"""Mixtral (8x7B, 8x22B).

Verified in transformers 5.24 ``models/mixtral/modeling_mixtral.py`` and ``conversion_mapping.py``:
- every layer is MoE; I = ``intermediate_size``; E = ``num_local_experts``;
- router ``mlp.gate.weight [E, H]``: softmax, top-k, always renormalised (no ``norm_topk_prob`` field);
  ``router_jitter_noise`` multiplies the input in training only;
- on disk: ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` with w1 = gate [I, H], w3 = up [I, H],
  w2 = down [H, I], and ``block_sparse_moe.gate.weight``; loading renames ``.block_sparse_moe.`` to ``.mlp.``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from usaf.families.registry import common_facts, layers_prefix, register
from usaf.families.spec import (
    DiskLayout,
    DiskSpec,
    ExpertsLayout,
    FamilySpec,
    LegacyModules,
    PerExpertNaming,
    RouterKind,
    RouterSpec,
)

MIXTRAL_NAMING = PerExpertNaming(gate="experts.{e}.w1.weight", up="experts.{e}.w3.weight", down="experts.{e}.w2.weight")


@register("mixtral")
def build(text: Mapping[str, Any], root: Mapping[str, Any], nested: str | None) -> FamilySpec:
    facts = common_facts(
        text, root, expert_fields=("num_local_experts", "num_experts"), width_fields=("intermediate_size",)
    )
    return FamilySpec(
        family="mixtral",
        **facts,
        moe_layers=tuple(range(facts["num_layers"])),
        dense_layers=(),
        dense_width=None,
        router=RouterSpec(kind=RouterKind.SOFTMAX_TOPK, module="gate", renormalize=True),
        shared=None,
        layout=ExpertsLayout(),
        disk=DiskSpec(
            canonical=DiskLayout.PER_EXPERT, per_expert=MIXTRAL_NAMING, renames=((".block_sparse_moe.", ".mlp."),)
        ),
        activation=str(text.get("hidden_act", "silu")),
        layers_prefix=layers_prefix(nested),
        nested_in=nested,
        legacy=LegacyModules(),
        config=root,
    )
