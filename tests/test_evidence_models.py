"""The evidence benchmark's committed models (``scripts/build_demo_model.py --size large|shared``): they load, they
are pretrained (not random), their PROVENANCE.json describes them, and usaf sees the layers each is there for (the
third model: a shared expert in every MoE layer and a dense layer 0, for the shared and dense targets)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from usaf.testing import stdlib_dir

MODELS = Path(__file__).resolve().parents[1] / "benchmarks" / "models"
HELDOUT_FILE = "argparse.py"  # a held-out source of the pretraining domain (test_demo_model.py)
SEQ, WINDOWS = 256, 4


def load(name: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODELS / name, dtype=torch.float32).eval()


def heldout_ids(name: str) -> torch.Tensor:
    from usaf.data.tokenizer import load_tokenizer

    text = (stdlib_dir() / HELDOUT_FILE).read_text(encoding="utf-8")
    ids = load_tokenizer(str(MODELS / name))(text)["input_ids"][: WINDOWS * SEQ]
    return torch.tensor(ids).reshape(WINDOWS, SEQ)  # (B, T)


def mean_nll(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()  # (B, T-1, V)
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


@pytest.mark.parametrize("name", ["evidence-large", "evidence-shared"])
def test_pretrained_and_described_by_its_provenance(name):
    from transformers import AutoModelForCausalLM

    provenance = json.loads((MODELS / name / "PROVENANCE.json").read_text(encoding="utf-8"))
    model = load(name)
    for key, value in provenance["model_config"].items():
        assert getattr(model.config, key) == value, key
    assert provenance["parameters"] == sum(p.numel() for p in model.parameters())
    moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert [row["layer"] for row in provenance["expert_load"]] == moe_layers
    assert provenance["dead_experts"] == 0
    torch.manual_seed(0)
    random_model = AutoModelForCausalLM.from_config(model.config).eval()  # negative control: same config
    ids = heldout_ids(name)
    trained, random = mean_nll(model, ids), mean_nll(random_model, ids)
    assert random > 0.9 * math.log(model.config.vocab_size), random  # a random model is near-uniform
    assert trained < 0.6 * random, (trained, random)


def test_the_third_model_has_shared_experts_and_a_dense_layer():
    from usaf.families import load_model_config, resolve_family
    from usaf.families.targets import linear_target_modules

    config = load_model_config(MODELS / "evidence-shared")
    spec = resolve_family(config)
    assert spec.dense_layers == (0,) and tuple(spec.moe_layers) == (1, 2, 3, 4)
    assert spec.shared is not None and spec.shared.width == 128
    model = load("evidence-shared")
    assert linear_target_modules(model, spec, 4, "shared") == [
        "model.layers.4.mlp.shared_expert.gate_proj",
        "model.layers.4.mlp.shared_expert.up_proj",
        "model.layers.4.mlp.shared_expert.down_proj",
        "model.layers.4.mlp.shared_expert_gate",
    ]
    assert linear_target_modules(model, spec, 0, "dense") == [
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
    ]
    assert linear_target_modules(model, spec, 4, "dense") == []  # negative control: a MoE layer has no dense MLP
