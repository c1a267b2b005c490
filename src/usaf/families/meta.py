"""The in-memory model of a config, built on the meta device (no memory, no weights, ~10 ms).

transformers is the authority on which tensors a model holds; instantiating the model class on the
meta device gives their exact names and shapes. The structural fallback, the two-way mapping check
and config-only parameter counts all use it.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from usaf.errors import UsafError
from usaf.families.modules import legacy_config_fields, transformers_major, usaf_view


def build_config(config: Mapping[str, Any]):
    """A transformers config object from a ``config.json`` dict (as ``from_pretrained`` would build it)."""
    # lazy: importing usaf.families stays free of transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if not model_type or model_type not in CONFIG_MAPPING:
        raise UsafError(
            f"transformers {_tf_version()} does not know model_type={model_type!r}",
            "upgrade transformers, or use a model whose code ships with transformers (no trust_remote_code)",
        )
    cfg = dict(config)
    cfg.update(_legacy_fields(config))
    cfg.pop("model_type", None)
    cfg.pop("quantization_config", None)  # only from_pretrained applies it; the meta model is unquantized
    return AutoConfig.for_model(model_type, **cfg)


def _legacy_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """transformers 4.x: config fields renamed since (usaf.families.modules.legacy_config_fields)."""
    # lazy: a cycle: registry -> fallback -> meta -> registry
    from usaf.families.registry import registered_families, resolve_family

    if transformers_major() >= 5 or config.get("model_type") not in registered_families():
        return {}  # (a structural spec would build the meta model, i.e. come back here)
    return legacy_config_fields(resolve_family(config), config)


def _tf_version() -> str:
    # lazy: importing usaf.families stays free of transformers
    import transformers

    return transformers.__version__


@lru_cache(maxsize=16)
def _meta_model_cached(config_json: str):
    # lazy: importing usaf.families stays free of torch and transformers
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        cfg = build_config(json.loads(config_json))
        # Multimodal wrappers are not causal LMs for the Auto class; their image-text class is. Chosen by the
        # mapping, not by catching from_config's ValueError: that hid the real error of a config transformers
        # refuses behind a list of image-text classes (found in review).
        auto = AutoModelForCausalLM if type(cfg) in AutoModelForCausalLM._model_mapping else AutoModelForImageTextToText
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                return auto.from_config(cfg)
    except UsafError:
        raise
    except Exception as e:  # noqa: BLE001 (whatever transformers raises on a config it cannot build: a traceback)
        raise UsafError(
            f"config.json: transformers {_tf_version()} cannot build this model from it "
            f"({type(e).__name__}: {_first_line(e)})",
            "fix the field it names (or restore the model's original config.json)",
        ) from None


def _first_line(e: Exception) -> str:
    """The error's first line, and the next where the first only announces it ("Class validation error for validator
    'validate_layer_type':" named no field; found in review)."""
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not text:
        return "no message"
    said = f"{text[0]} {text[1]}" if text[0].endswith(":") and len(text) > 1 else text[0]
    return said[:300]


def meta_model(config: Mapping[str, Any]):
    """The model of ``config`` on the meta device (cached; treat it as read-only)."""
    return _meta_model_cached(json.dumps(config, sort_keys=True, default=str))


def in_usaf_names(config: Mapping[str, Any], shapes: dict[str, tuple[int, ...]], spec=None) -> dict[str, Any]:
    """``name -> shape`` of the installed transformers' model in usaf's names (identity on transformers >= 5).

    On transformers 4.x the per-expert weights become the fused tensors (:func:`usaf.families.modules.usaf_view`).
    """
    if transformers_major() >= 5:
        return shapes
    if spec is None:
        # lazy: a cycle: registry -> fallback -> meta -> registry
        from usaf.families.registry import resolve_family

        spec = resolve_family(config)
    return usaf_view(spec, shapes)


def expected_tensors(config: Mapping[str, Any], spec=None) -> dict[str, tuple[int, ...]]:
    """In-memory ``state_dict`` name -> shape of the model of ``config`` (parameters and persistent buffers).

    Names are usaf's (transformers >= 5's in-memory names, whichever transformers is installed).
    Tied parameters appear under every name that shares them, as in ``model.state_dict()``.
    """
    model = meta_model(config)
    return in_usaf_names(config, {name: tuple(t.shape) for name, t in model.state_dict().items()}, spec)


def tied_names(config: Mapping[str, Any]) -> dict[str, str]:
    """In-memory name -> the name it shares its tensor with, for tied parameters (lm_head -> embeddings)."""
    model = meta_model(config)
    first_by_id: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owner = first_by_id.setdefault(id(param), name)
        if owner != name:
            tied[name] = owner
    return tied


def unique_numels(config: Mapping[str, Any]) -> dict[str, int]:
    """In-memory name -> numel, counting tied parameters once (parameters and persistent buffers)."""
    model = meta_model(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    state = model.state_dict()
    for name, buf in model.named_buffers():
        if name in state and name not in shapes:
            shapes[name] = tuple(buf.shape)
    return {name: math.prod(shape) for name, shape in in_usaf_names(config, shapes).items()}
