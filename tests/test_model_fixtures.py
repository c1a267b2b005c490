"""usaf.testing.build_tiny_model: tiny models that load, run, tokenize and are reproducible."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FAMILIES
from usaf.errors import UsafError
from usaf.families import read_checkpoint
from usaf.testing import build_tiny_model
from usaf.testing.models import TINY_DENSE_WIDTH, TINY_EXPERT_WIDTH, TINY_HIDDEN, TINY_VOCAB


def test_widths_are_pairwise_distinct():
    # so a transposed or gate/up-swapped tensor fails on shape instead of passing silently
    widths = [TINY_HIDDEN, TINY_EXPERT_WIDTH, 2 * TINY_EXPERT_WIDTH, TINY_DENSE_WIDTH]
    assert len(set(widths)) == len(widths)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_loads_and_runs_with_its_tokenizer(family, tiny_model, loaded_model):
    from transformers import AutoTokenizer

    path = tiny_model(family, tokenizer=True)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == family
    assert config["vocab_size"] == TINY_VOCAB
    assert (config["eos_token_id"], config["bos_token_id"], config["pad_token_id"]) == (0, 0, 0)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == TINY_VOCAB and tok.eos_token_id == 0
    ids = tok("def f(x):\n    return x + 1\n", return_tensors="pt")["input_ids"]
    model = loaded_model(family, tokenizer=True)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], TINY_VOCAB)
    assert torch.isfinite(logits).all()


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, tiny_model):
    from safetensors.torch import load_file

    a = load_file(tiny_model("olmoe") / "model.safetensors")
    b = load_file(build_tiny_model("olmoe", tmp_path / "again", tokenizer=False) / "model.safetensors")
    c = load_file(build_tiny_model("olmoe", tmp_path / "other", seed=1, tokenizer=False) / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_zero_initialised_tensors_are_randomised(loaded_model):
    state = loaded_model("gpt_oss").state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj_bias"].abs().sum() > 0
    assert loaded_model("deepseek_v3").state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"].any()


def test_layouts_write_different_names(tiny_model):
    hf = set(read_checkpoint(tiny_model("mixtral")))
    fused = set(read_checkpoint(tiny_model("mixtral", layout="fused")))
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in hf
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    assert not any("block_sparse_moe" in n for n in fused)


def test_sharding_writes_an_index(tiny_model):
    path = tiny_model("qwen3_moe", max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(index["weight_map"]) == set(read_checkpoint(path))


def test_config_overrides_and_dtype(tmp_path):
    path = build_tiny_model(
        "qwen3_moe", tmp_path / "m", num_layers=3, mlp_only_layers=[1], dtype="bfloat16", tokenizer=False
    )
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["mlp_only_layers"] == [1]
    assert {i.dtype for i in read_checkpoint(path).values()} == {"BF16"}


def test_gpt_oss_layer_types_follow_num_layers(tmp_path):
    path = build_tiny_model("gpt_oss", tmp_path / "g", num_layers=3, tokenizer=False)
    assert len(json.loads((path / "config.json").read_text())["layer_types"]) == 3


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(UsafError, match="layout"):
        build_tiny_model("qwen3_moe", tmp_path / "x", layout="sideways")
    with pytest.raises(UsafError, match="no tiny config"):
        build_tiny_model("llama", tmp_path / "y")


def test_the_tiny_deepseek_routes_within_a_group_as_well_as_between_groups(loaded_model):
    """With 4 experts in 2 groups and top-2, every token took both experts of its chosen group, so the choice within a
    group, which DeepSeek-V3 makes, was never tested (found in review). With 8 in groups of 4 tokens take pairs that
    are not whole groups. The control: each token's pair lies in one group (topk_group 1), as the family routes."""
    model = loaded_model("deepseek_v3")
    gate = model.model.layers[1].mlp.gate
    with torch.no_grad():
        _, _, chosen = gate(torch.randn(256, model.config.hidden_size))  # (tokens, top_k)
    size = model.config.n_routed_experts // model.config.n_group
    assert size > model.config.num_experts_per_tok
    pairs = {tuple(sorted(row)) for row in chosen.tolist()}
    assert all(a // size == b // size for a, b in pairs)  # the control: one group each
    assert len(pairs) > model.config.n_group  # more pairs than groups: experts chosen within a group
