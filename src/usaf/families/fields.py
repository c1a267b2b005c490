"""Reading MoE facts out of a ``config.json`` dict, whatever spelling a model uses.

Everything here works on plain dicts (no transformers import), so resolving a family is instant.
A family file states which spelling its modeling code reads first; the other spellings are accepted
too, and two spellings that disagree are an error rather than a silent pick (transformers 5 writes
Qwen3-MoE's expert count as ``num_local_experts`` where the hub configs say ``num_experts``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from usaf.errors import UsafError

# Every spelling seen in transformers 5.24 configs, most common first.
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k_experts", "moe_topk", "moe_k")
WIDTH_FIELDS = ("moe_intermediate_size", "intermediate_size")
DENSE_LAYER_FIELDS = ("mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace")
SHARED_FIELDS = ("shared_expert_intermediate_size", "n_shared_experts")
MOE_FIELDS = (*EXPERT_COUNT_FIELDS, *TOP_K_FIELDS, "moe_intermediate_size", *DENSE_LAYER_FIELDS, *SHARED_FIELDS)


def text_config(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str | None]:
    """The dict holding the text model's fields, and the key it was nested under (or None).

    Multimodal configs (e.g. Qwen3-VL-MoE) nest the language model under ``text_config``; a few
    older ones use ``language_config`` or ``llm_config``.
    """
    for key in ("text_config", "language_config", "llm_config"):
        nested = config.get(key)
        if isinstance(nested, Mapping) and any(f in nested for f in (*EXPERT_COUNT_FIELDS, "num_hidden_layers")):
            return nested, key
    return config, None


def model_type_of(config: Mapping[str, Any]) -> str:
    """The model type the family lookup uses: the nested text model's if it has one."""
    text, nested = text_config(config)
    if nested and isinstance(text.get("model_type"), str):
        return text["model_type"]
    return str(config.get("model_type") or "")


def pick(
    cfg: Mapping[str, Any],
    names: Sequence[str],
    *,
    what: str,
    default: Any = None,
    required: bool = False,
) -> Any:
    """The value of the first of ``names`` present in ``cfg``; an error if two spellings disagree.

    Args:
        cfg: the (text) config dict.
        names: accepted spellings, the one the family's modeling code reads first.
        what: what the value means, for messages ("expert count").
        default: returned when no spelling is present and ``required`` is false.
        required: raise when no spelling is present (a default would be a silent guess).
    """
    present = [(n, cfg[n]) for n in names if n in cfg and cfg[n] is not None]
    if not present:
        if required:
            raise UsafError(
                f"config.json has no {what} (looked for {', '.join(names)})",
                "the config is incomplete; use the model's original config.json",
            )
        return default
    values = {repr(v) for _, v in present}
    if len(values) > 1:
        listed = ", ".join(f"{n}={v!r}" for n, v in present)
        raise UsafError(
            f"config.json gives conflicting {what}: {listed}",
            f"keep one of {', '.join(n for n, _ in present)} (or make them equal)",
        )
    return present[0][1]


def positive_int(value: Any, *, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UsafError(f"config.json: {field} = {value!r} is not a positive integer", "fix config.json")
    return value


def int_list(value: Any, *, field: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise UsafError(f"config.json: {field} = {value!r} is not a list of layer indices", "fix config.json")
    return tuple(value)


def architectures(config: Mapping[str, Any]) -> tuple[str, ...]:
    archs = config.get("architectures") or ()
    return tuple(a for a in archs if isinstance(a, str))


def moe_fields_report(config: Mapping[str, Any]) -> str:
    """Which MoE fields a config has and which it lacks, for 'not a MoE model' errors."""
    text, nested = text_config(config)
    where = f" (in {nested})" if nested else ""
    found = [f"{f}={text[f]!r}" for f in MOE_FIELDS if f in text]
    missing = [f for f in MOE_FIELDS if f not in text]
    return (
        f"MoE fields present{where}: {', '.join(found) if found else 'none'}; "
        f"absent: {', '.join(missing) if missing else 'none'}"
    )
