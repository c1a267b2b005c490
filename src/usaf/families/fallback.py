"""The structural fallback: a spec for any transformers-v5 model type with fused 3-D experts.

The model is instantiated on the meta device from its config, and its MoE layers are found by
structure: a module ``<layers>.<i>.<block>.experts`` holding 3-D ``gate_up_proj``/``down_proj`` and the
layout flags of ``@use_experts_implementation`` (``is_transposed``, ``is_concatenated``, ``has_bias``,
``has_gate``). The router is the block's other tensor of shape [E, H]; shared experts are the block's
children whose name contains "shared". The on-disk naming comes from transformers' own conversion
mapping for the model type (the renames and per-expert patterns it applies when loading).

Checked on glm4_moe, ernie4_5_moe, hunyuan_v1_moe, flex_olmo, granitemoe, phimoe, minimax (transformers
5.24). Routing math is not inferred: the router kind is ``MODEL_DEFINED`` (usaf keeps the model's router).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from usaf.families import fields
from usaf.families.meta import meta_model
from usaf.families.spec import (
    DiskLayout,
    DiskSpec,
    ExpertsLayout,
    FamilySpec,
    PerExpertNaming,
    RouterKind,
    RouterSpec,
    SharedExpertSpec,
)

_EXPERTS_RE = re.compile(r"^(?P<prefix>.+)\.(?P<layer>\d+)\.(?P<block>[\w.]+?)\.experts$")
_REGEX_META = re.compile(r"[\^$()\[\]{}*+?|\\]")


def structural_spec(config: Mapping[str, Any]) -> FamilySpec | None:
    """A spec found by instantiating the model on the meta device; None if it has no fused experts."""
    model = meta_model(config)
    found: dict[int, tuple[str, str, Any]] = {}
    for name, module in model.named_modules():
        m = _EXPERTS_RE.match(name)
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if m and getattr(gate_up, "ndim", 0) == 3 and getattr(down, "ndim", 0) == 3:
            found[int(m["layer"])] = (m["prefix"], m["block"], module)
    if not found:
        return None
    model_type = fields.model_type_of(config)
    prefixes = {(p, b) for p, b, _ in found.values()}
    if len(prefixes) != 1:
        raise _refuse(config, f"its MoE blocks sit under several paths {sorted(prefixes)}")
    layers_prefix, block = prefixes.pop()
    first = found[min(found)][2]
    flags = {k: getattr(first, k, None) for k in ("is_transposed", "is_concatenated", "has_bias", "has_gate")}
    if None in flags.values():
        raise _refuse(config, "its experts module does not declare its layout (@use_experts_implementation flags)")
    if not flags["has_gate"]:
        raise _refuse(config, "its experts have no gate projection (up_proj only)")
    layout = ExpertsLayout(
        transposed=bool(flags["is_transposed"]),
        interleaved=not flags["is_concatenated"],
        has_bias=bool(flags["has_bias"]),
    )
    shapes = {tuple(m.gate_up_proj.shape) + tuple(m.down_proj.shape) for _, _, m in found.values()}
    if len(shapes) != 1:
        raise _refuse(config, f"its MoE layers have different expert shapes {sorted(shapes)}")
    gate_up, down = tuple(first.gate_up_proj.shape), tuple(first.down_proj.shape)
    if layout.transposed:  # gate_up [E, H, 2I], down [E, I, H]
        e, h, i = gate_up[0], gate_up[1], down[1]
    else:  # gate_up [E, 2I, H], down [E, H, I]
        e, h, i = gate_up[0], gate_up[2], down[2]
    if layout.gate_up_shape(e, i, h) != gate_up or layout.down_shape(e, i, h) != down:
        raise _refuse(config, f"its expert shapes {gate_up} / {down} do not match its declared layout")

    layer = min(found)
    block_module = model.get_submodule(f"{layers_prefix}.{layer}.{block}")
    router = _find_router(config, block_module, e, h)
    shared = _find_shared(block_module)
    layers_module = model.get_submodule(layers_prefix)
    num_layers = len(layers_module)
    moe = tuple(sorted(found))
    dense = tuple(i for i in range(num_layers) if i not in found)
    text, nested = fields.text_config(config)
    top_k = _top_k(block_module, router.module, text)
    return FamilySpec(
        family="structural",
        model_type=model_type,
        architectures=fields.architectures(config),
        num_layers=num_layers,
        moe_layers=moe,
        dense_layers=dense,
        num_experts=e,
        top_k=top_k,
        expert_width=i,
        hidden_size=h,
        dense_width=text.get("intermediate_size") if dense else None,
        router=router,
        shared=shared,
        layout=layout,
        disk=_disk_spec(model_type, layout),
        activation=str(text.get("hidden_act", "model-defined")),
        layers_prefix=layers_prefix,
        moe_module=block,
        tie_word_embeddings=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        nested_in=nested,
        config=config,
    )


class StructureRefused(Exception):
    """The model has fused experts, but not in a shape usaf can map (the message says why)."""


def _refuse(config: Mapping[str, Any], reason: str) -> StructureRefused:
    return StructureRefused(reason)


def _find_router(config: Mapping[str, Any], block, e: int, h: int) -> RouterSpec:
    """The block's tensor of shape [E, H] outside experts and shared modules is the router weight."""
    candidates = [
        name
        for name, t in block.state_dict(keep_vars=True).items()
        if tuple(t.shape) == (e, h) and not name.startswith("experts.") and "shared" not in name
    ]
    if len(candidates) != 1:
        raise _refuse(config, f"cannot tell its router weight [E={e}, H={h}] (candidates: {candidates or 'none'})")
    module = candidates[0].rsplit(".", 1)[0]
    params = tuple(
        name[len(module) + 1 :] for name in block.state_dict(keep_vars=True) if name.startswith(module + ".")
    )
    return RouterSpec(kind=RouterKind.MODEL_DEFINED, module=module, params=params)


def _find_shared(block) -> SharedExpertSpec | None:
    names = [n for n, _ in block.named_children() if "shared" in n]
    if not names:
        return None
    gates = [n for n in names if n.endswith("gate")]
    mains = [n for n in names if n not in gates]
    main = (mains or names)[0]
    width = None
    proj = getattr(block.get_submodule(main), "gate_proj", None)
    if proj is not None and getattr(proj, "weight", None) is not None:
        width = int(proj.weight.shape[0])  # gate_proj.weight [I_shared, H]
    rest = tuple(n for n in names if n != main and n not in gates[:1])
    return SharedExpertSpec(module=main, width=width, gate=gates[0] if gates else None, extra_modules=rest)


def _top_k(block, router_module: str, text: Mapping[str, Any]) -> int:
    for owner in (block.get_submodule(router_module), block):
        for attr in ("top_k", "num_experts_per_tok"):
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return fields.positive_int(fields.pick(text, fields.TOP_K_FIELDS, what="top-k", required=True), field="top-k")


def _literal(pattern: str) -> str | None:
    unescaped = pattern.replace("\\.", ".")
    return None if _REGEX_META.search(unescaped) else unescaped


def _disk_spec(model_type: str, layout: ExpertsLayout) -> DiskSpec:
    """The renames and per-expert patterns transformers applies when loading this model type."""
    try:
        # lazy: transformers is heavy, and these modules exist only in transformers >= 5
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # transformers without conversion mappings: checkpoints hold the in-memory names
        return DiskSpec(canonical=DiskLayout.FUSED, per_expert=None)
    renames: list[tuple[str, str]] = []
    per_role: dict[str, str] = {}
    for transform in get_checkpoint_conversion_mapping(model_type) or []:
        # the patterns as written in conversion_mapping.py (the public ones are pre-processed regexes)
        sources = list(getattr(transform, "_original_source_patterns", transform.source_patterns))
        targets = list(getattr(transform, "_original_target_patterns", transform.target_patterns))
        if isinstance(transform, WeightRenaming) and len(sources) == 1 and len(targets) == 1:
            src, tgt = _literal(sources[0]), _literal(targets[0])
            if src and tgt:
                renames.append((src, tgt))
        elif isinstance(transform, WeightConverter) and len(targets) == 1:
            # e.g. ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"] -> "mlp.experts.gate_up_proj":
            # transformers concatenates the sources in this order, so the first is the gate.
            tails = [s.split("experts.*.", 1)[1] if "experts.*." in s else None for s in sources]
            if None in tails:
                continue
            if targets[0].endswith("experts.gate_up_proj") and len(tails) == 2:
                per_role["gate"], per_role["up"] = (f"experts.{{e}}.{t}" for t in tails)
            elif targets[0].endswith("experts.down_proj") and len(tails) == 1:
                per_role["down"] = f"experts.{{e}}.{tails[0]}"
    if set(per_role) == {"gate", "up", "down"} and not layout.has_bias:
        naming = PerExpertNaming(**per_role)
        return DiskSpec(canonical=DiskLayout.PER_EXPERT, per_expert=naming, renames=tuple(renames))
    return DiskSpec(canonical=DiskLayout.FUSED, per_expert=PerExpertNaming(), renames=tuple(renames))
