"""usaf.families.modules: transformers 4.x's in-memory layout seen through usaf's names.

These run with either transformers: the 4.x names of a family's tensors are its on-disk names
(transformers 4.x applies no load-time renames), so a checkpoint's names and shapes are what a 4.x
model's ``state_dict`` holds, and ``usaf_view(..., major=4)`` of them must be the v5 names and shapes.
"""

from __future__ import annotations

import dataclasses

import pytest

from conftest import FAMILIES
from usaf.errors import UsafError
from usaf.families import load_model_config, read_checkpoint, resolve_family
from usaf.families.meta import expected_tensors
from usaf.families.modules import ModuleLayout, module_layout, per_expert_module_names, usaf_view


@pytest.mark.parametrize("family", FAMILIES)
def test_the_4x_names_of_a_checkpoint_are_the_v5_names_in_usaf_view(family, tiny_model):
    path = tiny_model(family)
    spec = resolve_family(load_model_config(path))
    on_disk = {name: tuple(info.shape) for name, info in read_checkpoint(path).items()}
    assert usaf_view(spec, on_disk, major=4) == expected_tensors(spec.config, spec)
    assert usaf_view(spec, on_disk, major=5) == on_disk  # v5: the identity


def test_layouts_by_major_version(tiny_model):
    qwen = resolve_family(load_model_config(tiny_model("qwen3_moe")))
    gpt = resolve_family(load_model_config(tiny_model("gpt_oss")))
    assert module_layout(qwen, 5) is ModuleLayout.FUSED and module_layout(gpt, 5) is ModuleLayout.FUSED
    assert module_layout(qwen, 4) is ModuleLayout.PER_EXPERT_MODULES
    assert module_layout(gpt, 4) is ModuleLayout.FUSED_NO_REGISTRY
    structural = dataclasses.replace(qwen, family="structural", legacy=None)
    with pytest.raises(UsafError, match="transformers >= 5 only"):
        module_layout(structural, 4)


def test_mixtral_per_expert_names_are_the_on_disk_ones(tiny_model):
    spec = resolve_family(load_model_config(tiny_model("mixtral")))
    names = per_expert_module_names(spec, 1)
    assert names["gate"][2] == "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    assert names["up"][2] == "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    assert names["down"][0] == "model.layers.1.block_sparse_moe.experts.0.w2.weight"


def test_a_missing_or_misshaped_expert_is_an_error_not_a_silent_gap(tiny_model):
    path = tiny_model("qwen3_moe")
    spec = resolve_family(load_model_config(path))
    on_disk = {name: tuple(info.shape) for name, info in read_checkpoint(path).items()}
    dropped = dict(on_disk)
    del dropped["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(UsafError, match="layer 1.*up"):
        usaf_view(spec, dropped, major=4)
    bent = {**on_disk, "model.layers.0.mlp.experts.0.down_proj.weight": (spec.expert_width, spec.hidden_size)}
    with pytest.raises(UsafError, match="layer 0.*down"):
        usaf_view(spec, bent, major=4)


def test_config_fields_transformers_5_renamed_are_given_their_4x_names(tiny_model):
    from usaf.families.modules import legacy_config_fields

    spec = resolve_family(load_model_config(tiny_model("qwen3_moe")))
    v5_style = {"model_type": "qwen3_moe", "num_local_experts": 4}
    assert legacy_config_fields(spec, v5_style, major=4) == {"num_experts": 4}
    assert legacy_config_fields(spec, {**v5_style, "num_experts": 4}, major=4) == {}  # 4.x name present: kept
    assert legacy_config_fields(spec, v5_style, major=5) == {}


def test_a_transformers_5_config_builds_the_same_model(tiny_model):
    """A config.json written by transformers 5 (Qwen3-MoE: num_local_experts) gives E experts on either version."""
    from usaf.families.meta import expected_tensors

    config = load_model_config(tiny_model("qwen3_moe"))
    count = config.pop("num_experts", None) or config.pop("num_local_experts")
    v5_style = {**config, "num_local_experts": count}
    spec = resolve_family(v5_style)
    assert spec.num_experts == count
    shapes = expected_tensors(v5_style, spec)
    assert shapes[spec.gate_up_name(0)][0] == count and shapes[spec.router_weight_name(0)][0] == count


def test_a_tokenizer_saved_by_transformers_5_loads():
    """The packaged demo tokenizer names transformers 5's TokenizersBackend class, which 4.x lacks."""
    import json
    from pathlib import Path

    import usaf.demo
    from usaf.data.tokenizer import load_tokenizer

    model = Path(usaf.demo.__file__).parent / "model"
    assert json.loads((model / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    tokenizer = load_tokenizer(str(model))
    assert len(tokenizer) == 4096 and tokenizer.eos_token == "<|endoftext|>" and tokenizer.chat_template
    assert tokenizer("def f(x):\n    return x")["input_ids"]
