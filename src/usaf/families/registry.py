"""Family lookup: ``config.json`` -> :class:`FamilySpec`.

Each family file registers one builder under its ``model_type``. :func:`resolve_family` tries the
registered builder first and the structural fallback second (any transformers-v5 model type whose
MoE layers hold fused 3-D ``gate_up_proj``/``down_proj`` experts); anything else is refused with a
message that lists what the config does and does not contain.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from usaf.errors import UsafError, not_a
from usaf.families import fields
from usaf.families.fallback import StructureRefused, structural_spec
from usaf.families.modules import installed_transformers, transformers_major
from usaf.families.spec import FamilySpec

# (text config, root config, key the text config is nested under or None) -> spec
Builder = Callable[[Mapping[str, Any], Mapping[str, Any], "str | None"], FamilySpec]

_BUILDERS: dict[str, Builder] = {}


def register(model_type: str) -> Callable[[Builder], Builder]:
    """Decorator: the builder of the spec for configs with this ``model_type``."""

    def wrap(builder: Builder) -> Builder:
        if model_type in _BUILDERS:  # two files claiming one model type is a bug, not a user error
            raise RuntimeError(f"family {model_type!r} registered twice")
        _BUILDERS[model_type] = builder
        return builder

    return wrap


def registered_families() -> tuple[str, ...]:
    return tuple(sorted(_BUILDERS))


def load_model_config(model_dir: Path) -> dict[str, Any]:
    """Read ``model_dir/config.json`` as a dict, with one clear error for each way it can fail."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise UsafError(f"model {model_dir}: {not_a(model_dir, 'directory')}", "pass the directory holding config.json")
    path = model_dir / "config.json"
    if not path.is_file():
        raise UsafError(
            f"model {model_dir}: no config.json",
            "a Hugging Face model directory has config.json beside its *.safetensors files",
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsafError(f"{path}: not valid JSON ({e})", "restore the model's original config.json") from None
    if not isinstance(config, dict):
        raise UsafError(f"{path}: expected a JSON object, got {type(config).__name__}", "restore config.json")
    return config


def resolve_family(config: Mapping[str, Any]) -> FamilySpec:
    """The family spec of a model, from its ``config.json`` dict.

    Raises:
        UsafError: not a MoE model, or a MoE model usaf cannot map; the message lists the
            model_type, architectures, MoE fields present/absent and the supported families.
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"resolve_family expects the config.json dict, got {type(config).__name__}")
    text, nested = fields.text_config(config)
    model_type = fields.model_type_of(config)
    builder = _BUILDERS.get(model_type)
    if builder is not None:
        return builder(text, config, nested)

    reason = "model_type is empty" if not model_type else None
    if reason is None and transformers_major() < 5:
        reason = (
            f"it has no family file, and the structural fallback needs transformers >= 5's fused experts "
            f"(installed: transformers {installed_transformers() or 'none'})"
        )
    if reason is None:
        try:
            spec = structural_spec(config)
        except StructureRefused as e:
            reason = str(e)
        except UsafError as e:  # e.g. transformers does not know the model type
            reason = e.message
        except Exception as e:  # any failure to build the model means "cannot use it"
            reason = f"transformers could not build it from the config ({type(e).__name__}: {e})"
        else:
            if spec is not None:
                return spec
            reason = "transformers builds it without fused 3-D experts (gate_up_proj/down_proj), i.e. as a dense model"
    raise unsupported_error(config, reason)


def unsupported_error(config: Mapping[str, Any], reason: str) -> UsafError:
    model_type = fields.model_type_of(config) or "(none)"
    archs = ", ".join(fields.architectures(config)) or "(none)"
    return UsafError(
        f"unsupported model: model_type={model_type}, architectures={archs}: {reason}. "
        f"{fields.moe_fields_report(config)}. "
        f"Supported families: {', '.join(registered_families())}, plus any transformers-v5 model type with "
        f"fused gate_up_proj/down_proj experts",
        "usaf fine-tunes Mixture-of-Experts models; pass a MoE model directory",
    )


# -- helpers shared by the family files ------------------------------------------------------------------


def common_facts(
    text: Mapping[str, Any],
    root: Mapping[str, Any],
    *,
    expert_fields: tuple[str, ...],
    width_fields: tuple[str, ...],
    top_k_fields: tuple[str, ...] = fields.TOP_K_FIELDS,
) -> dict[str, Any]:
    """num_layers, hidden_size, num_experts, top_k, expert_width, with the family's preferred spellings."""
    num_layers = fields.positive_int(
        fields.pick(text, ("num_hidden_layers", "n_layer", "num_layers"), what="layer count", required=True),
        field="num_hidden_layers",
    )
    hidden = fields.positive_int(
        fields.pick(text, ("hidden_size", "d_model", "n_embd"), what="hidden size", required=True), field="hidden_size"
    )
    experts = fields.positive_int(
        fields.pick(text, expert_fields, what="expert count", required=True), field=expert_fields[0]
    )
    top_k = fields.positive_int(fields.pick(text, top_k_fields, what="top-k", required=True), field=top_k_fields[0])
    width = fields.positive_int(
        fields.pick(text, width_fields, what="expert width", required=True), field=width_fields[0]
    )
    if top_k > experts:
        raise UsafError(f"config.json: top-k {top_k} > expert count {experts}", "fix config.json")
    tie = text.get("tie_word_embeddings", root.get("tie_word_embeddings", False))
    return {
        "model_type": str(text.get("model_type") or root.get("model_type")),
        "architectures": fields.architectures(root),
        "num_layers": num_layers,
        "hidden_size": hidden,
        "num_experts": experts,
        "top_k": top_k,
        "expert_width": width,
        "tie_word_embeddings": bool(tie),
    }


def split_layers(num_layers: int, is_moe: Callable[[int], bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    moe = tuple(i for i in range(num_layers) if is_moe(i))
    dense = tuple(i for i in range(num_layers) if not is_moe(i))
    if not moe:
        raise UsafError(
            f"config.json makes all {num_layers} layers dense (no MoE layer)",
            "check mlp_only_layers / decoder_sparse_step / first_k_dense_replace",
        )
    return moe, dense


def layers_prefix(nested: str | None) -> str:
    # Multimodal wrappers keep the language model under `model.language_model` in transformers v5.
    return "model.language_model.layers" if nested else "model.layers"
