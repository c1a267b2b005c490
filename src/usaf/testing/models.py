"""Tiny random MoE models of every supported family, saved the way the family's real checkpoints are.

Widths are chosen so that no two of H, I, 2I and the dense width coincide (H=32, I=24, 2I=48, dense
40): a transposed or swapped tensor then fails on shape, not silently. Tensors that transformers
initialises to zero (biases, DeepSeek's correction bias) get small random values, so that a
mis-mapped tensor cannot hide behind zeros.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

from usaf.errors import UsafError
from usaf.testing.tokenizer import build_tiny_tokenizer

TINY_HIDDEN = 32
TINY_EXPERT_WIDTH = 24
TINY_DENSE_WIDTH = 40
TINY_EXPERTS = 4
TINY_TOP_K = 2
TINY_VOCAB = 512  # the tiny tokenizer's vocabulary (eos = pad = bos = id 0)

LAYOUTS = ("hf", "fused")  # "hf": save_pretrained's own on-disk layout; "fused": the in-memory names

_COMMON: dict[str, Any] = {
    "hidden_size": TINY_HIDDEN,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": TINY_VOCAB,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,  # inside the vocabulary (flex_olmo's default 100277 is not)
    "tie_word_embeddings": False,
}

# Per family: the fields that make it tiny, 4 experts (DeepSeek-V3's 8), top-2.
_FAMILY: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "num_experts": TINY_EXPERTS,
        "moe_intermediate_size": TINY_EXPERT_WIDTH,
        "intermediate_size": TINY_DENSE_WIDTH,
        "norm_topk_prob": True,
    },
    "qwen2_moe": {
        "num_experts": TINY_EXPERTS,
        "moe_intermediate_size": TINY_EXPERT_WIDTH,
        "intermediate_size": TINY_DENSE_WIDTH,
        "shared_expert_intermediate_size": 20,
    },
    "mixtral": {"num_local_experts": TINY_EXPERTS, "intermediate_size": TINY_EXPERT_WIDTH},
    "olmoe": {"num_experts": TINY_EXPERTS, "intermediate_size": TINY_EXPERT_WIDTH},
    "deepseek_v3": {
        # 8 in 2 groups of 4, top-2 of the chosen group: with 4 (groups of 2, top-2) every token took both experts
        # of its group and the choice within a group, which DeepSeek-V3 makes, was never tested (found in review)
        "n_routed_experts": 2 * TINY_EXPERTS,
        "moe_intermediate_size": TINY_EXPERT_WIDTH,
        "intermediate_size": TINY_DENSE_WIDTH,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,  # layer 0 dense, the rest MoE
        "n_group": 2,
        "topk_group": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "head_dim": 8,  # must equal qk_rope_head_dim or the rotary embedding fails (an explicit value wins)
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "num_key_value_heads": 4,  # MLA: keys have one head per query head; fewer breaks the forward
    },
    "gpt_oss": {
        "num_local_experts": TINY_EXPERTS,
        "intermediate_size": TINY_EXPERT_WIDTH,
        "sliding_window": 16,
        "max_position_embeddings": 131072,  # = yarn factor 32 x original 4096, else transformers warns
    },
    # Structural-fallback types (not supported families; for tests of the fallback).
    "glm4_moe": {
        "n_routed_experts": TINY_EXPERTS,
        "moe_intermediate_size": TINY_EXPERT_WIDTH,
        "intermediate_size": TINY_DENSE_WIDTH,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "partial_rotary_factor": 0.5,
    },
    "flex_olmo": {"num_experts": TINY_EXPERTS, "intermediate_size": TINY_EXPERT_WIDTH},
    "phimoe": {"num_local_experts": TINY_EXPERTS, "intermediate_size": TINY_EXPERT_WIDTH},
}

_TOKENIZER_CACHE: Path | None = None


def tiny_config_kwargs(family: str, num_layers: int = 2, **overrides: Any) -> dict[str, Any]:
    """The ``AutoConfig.for_model(family, **kwargs)`` arguments of a tiny model of ``family``."""
    if family not in _FAMILY:
        raise UsafError(f"no tiny config for {family!r}", f"choose one of {', '.join(sorted(_FAMILY))}")
    kwargs = {**_COMMON, "num_hidden_layers": num_layers, "num_experts_per_tok": TINY_TOP_K, **_FAMILY[family]}
    kwargs.update(overrides)
    n = kwargs["num_hidden_layers"]
    if family == "gpt_oss" and len(kwargs.get("layer_types") or ()) != n:
        # the config's own default alternates sliding/full; a stale list of another length breaks the model
        kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return kwargs


def _tokenizer_files() -> Path:
    """Train the tiny tokenizer once per process and reuse its files (training takes ~1 s)."""
    global _TOKENIZER_CACHE
    if _TOKENIZER_CACHE is None or not _TOKENIZER_CACHE.exists():
        path = Path(tempfile.mkdtemp(prefix="usaf-tiny-tokenizer-"))
        atexit.register(shutil.rmtree, path, True)
        build_tiny_tokenizer(path)
        _TOKENIZER_CACHE = path
    return _TOKENIZER_CACHE


def build_tiny_model(
    family: str,
    out_dir: Path,
    *,
    num_layers: int = 2,
    seed: int = 0,
    tokenizer: bool = True,
    layout: str = "hf",
    max_shard_size: int | str | None = None,
    dtype: str | None = None,
    **config_overrides: Any,
) -> Path:
    """Build a tiny random model of ``family`` and save it as a Hugging Face model directory.

    Args:
        family: a ``model_type`` (the supported families, or glm4_moe / flex_olmo / phimoe for the fallback).
        out_dir: where to save (created).
        num_layers: decoder layers.
        seed: torch seed for the random weights (same seed, same weights).
        tokenizer: also save the tiny tokenizer (vocab 512, eos id 0) beside the model.
        layout: "hf" = the family's real on-disk layout (``save_pretrained``), "fused" = the in-memory
            names and layout (``save_original_format=False``).
        max_shard_size: shard the weights (e.g. "20KB"), writing ``model.safetensors.index.json``.
        dtype: save in this dtype ("bfloat16", ...); default float32.
        **config_overrides: any config field (``mlp_only_layers=[0]``, ``decoder_sparse_step=2``, ...).

    Returns:
        ``out_dir``.
    """
    # lazy: usaf.testing's builders are imported by `usaf tiny-model` and the demo: torch/transformers on use
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's shard bar is noise for a model of kilobytes

    if layout not in LAYOUTS:
        raise UsafError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}", "use 'hf' or 'fused'")
    out_dir = Path(out_dir)
    kwargs = tiny_config_kwargs(family, num_layers, **config_overrides)
    config = AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point() and not tensor.any():
                tensor.normal_(0.0, 0.02)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    save_kwargs: dict[str, Any] = {"save_original_format": layout == "hf"}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    if tokenizer:
        for path in _tokenizer_files().iterdir():
            shutil.copy2(path, out_dir / path.name)
    return out_dir
