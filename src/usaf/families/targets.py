"""Which weights of a trainable MoE layer may carry a sparse delta: the ``--targets`` of score and train.

* ``experts``: the fused routed-expert tensors (``experts.gate_up_proj``, ``experts.down_proj``), whose frozen
  base is the 4-bit code;
* ``attention``: every ``nn.Linear`` of the layer's attention module (q/k/v/o, DeepSeek-V3's MLA
  projections ``q_a_proj``/``q_b_proj``/``kv_a_proj_with_mqa``/``kv_b_proj``, gpt-oss's with their biases);
* ``shared``: every ``nn.Linear`` of the layer's shared expert(s) and shared-expert gate (Qwen2-MoE,
  DeepSeek-V3); a family without shared experts has none;
* ``dense``: every ``nn.Linear`` of the MLP of a *dense* layer (DeepSeek-V3's first layers, Qwen's
  ``mlp_only_layers``). Dense layers have no experts or router: with this target, the dense layers at or above
  the first trainable layer (``--train-from``) train too, carrying the targets they have (``dense``, and
  ``attention`` when asked); a family or a layer range without dense layers has none.

Without ``--targets`` the targets are :func:`default_targets`: the experts and the attention, and the shared
experts where the model has them (docs/ARCHITECTURE.md, "Defaults set by the evidence benchmark"); a target asked
for by name that the model lacks is refused, never dropped.

The non-expert targets' frozen base is the weight as the quantized directory stores it (``base-*.safetensors``,
unquantized). Each is handled as a one-"expert" tensor ``(1, O, I)`` in ``nn.Linear``'s own ``(out, in)``
orientation, so masks, scores, reselection, checkpoints and exports address all targets alike.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from usaf.families.spec import FamilySpec
from usaf.settings.fields import DEFAULT_TARGETS, EXPERTS_ONLY, TARGETS, parse_targets

__all__ = [
    "DEFAULT_TARGETS",
    "EXPERTS_ONLY",
    "TARGETS",
    "attention_prefix",
    "default_targets",
    "dense_mlp_prefix",
    "index_free_refusal",
    "linear_target_modules",
    "parse_targets",
    "resolve_targets",
    "target_of",
    "targets_of",
]

ATTENTION_MODULE = "self_attn"  # the attention module's attribute on a decoder layer, in every supported family


def default_targets(spec: FamilySpec) -> tuple[str, ...]:
    """The targets without ``--targets``: :data:`DEFAULT_TARGETS`, and ``shared`` where the family has shared
    experts (at an equal count they helped in-domain on every seed of both domains; BENCHMARKS.md, "The third
    model")."""
    return parse_targets(DEFAULT_TARGETS + (("shared",) if spec.shared is not None else ()))


def resolve_targets(text: str | None, spec: FamilySpec) -> tuple[str, ...]:
    """``--targets`` as given (parsed), or the model's :func:`default_targets` where it was not given (``None``)."""
    return default_targets(spec) if text is None else parse_targets(text)


def attention_prefix(spec: FamilySpec, layer: int) -> str:
    return f"{spec.layer_prefix(layer)}.{ATTENTION_MODULE}"


def dense_mlp_prefix(spec: FamilySpec, layer: int) -> str:
    """The MLP of a dense layer: the attribute the MoE block has in a MoE layer (``model.layers.{i}.mlp``)."""
    return f"{spec.layer_prefix(layer)}.{spec.moe_module}"


def linear_target_modules(model: Any, spec: FamilySpec, layer: int, target: str) -> list[str]:
    """In-memory names of the ``nn.Linear`` modules of ``target`` (``attention``, ``shared`` or ``dense``) in ``layer``.

    Read off the model's modules (any device, meta included), in module order. ``shared`` exists in MoE layers
    only, ``dense`` in dense layers only.
    """
    import torch  # lazy: importing usaf.families stays free of torch

    if target == "attention":
        prefixes = (attention_prefix(spec, layer),)
    elif target == "shared":
        prefixes = spec.shared_prefixes(layer) if spec.is_moe(layer) else ()
    elif target == "dense":
        prefixes = (dense_mlp_prefix(spec, layer),) if layer in spec.dense_layers else ()
    else:
        raise ValueError(f"{target!r} is not a linear target (attention, shared, dense)")
    names = []
    for prefix in prefixes:
        try:
            root = model.get_submodule(prefix)
        except AttributeError:
            continue  # e.g. a shared gate the family's config switches off
        names += [
            f"{prefix}.{name}" if name else prefix
            for name, module in root.named_modules()
            if isinstance(module, torch.nn.Linear)
        ]
    return names


def index_free_refusal(spec: FamilySpec, targets: Iterable[str]) -> str | None:
    """Why ``targets`` cannot train on a device without index ops (DirectML), or None when they can.

    gpt-oss runs its own eager attention (for its sinks), whose row max has a scatter backward: a gradient
    through it, which an attention target needs, reaches an op DirectML rejects.
    """
    if "attention" in targets and spec.family == "gpt_oss":
        return (
            "gpt-oss's attention takes a row max whose backward is a scatter, which this device rejects: "
            "drop attention from --targets here"
        )
    return None


def target_of(name: str, spec: FamilySpec) -> str:
    """The target kind of a trainable tensor's in-memory name (a delta's key).

    Raises:
        ValueError: the name is none of a MoE layer's targets.
    """
    layer = spec.layer_of(name)
    if layer in spec.dense_layers and name.startswith(dense_mlp_prefix(spec, layer) + "."):
        return "dense"
    if name in (spec.gate_up_name(layer), spec.down_name(layer)):
        return "experts"
    if name.startswith(attention_prefix(spec, layer) + "."):
        return "attention"
    if any(name.startswith(prefix + ".") for prefix in spec.shared_prefixes(layer)):
        return "shared"
    raise ValueError(f"{name!r} is not a sparse-delta target ({', '.join(TARGETS)})")


def targets_of(names: Iterable[str], spec: FamilySpec, layers: Iterable[int] = ()) -> tuple[str, ...]:
    """The target kinds present among delta names, in :data:`TARGETS` order (``experts`` when there are none).

    ``layers``: the layers a change trains; a dense one among them means the dense target, whatever its MLP's
    deltas hold (a shared ranking may give a tensor no entry).
    """
    found = {target_of(name, spec) for name in names}
    if set(layers) & set(spec.dense_layers):
        found.add("dense")
    return tuple(t for t in TARGETS if t in found) or EXPERTS_ONLY
