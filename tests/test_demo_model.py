"""The packaged demo model (``usaf.demo``): it loads, it is pretrained (not random), it quantizes, and its
PROVENANCE.json describes it; the stdlib domains it was built from exist here and do not overlap."""

from __future__ import annotations

import json
import math
import re
import struct
import sys

import pytest
import torch

from usaf.demo import DEMO_DOMAIN, PRETRAIN_DOMAIN, demo_model_dir
from usaf.testing import stdlib_dir

MODEL = demo_model_dir()
# argparse.py is one of the pretraining domain's held-out sources: the model never trained on it.
# Measured at build time (Python 3.11): 3.69 nats/token for the model, 8.34 for a random init (ratio 0.44).
HELDOUT_FILE = "argparse.py"
SEQ = 256
WINDOWS = 8


@pytest.fixture(scope="module")
def tokenizer():
    # usaf's loader: on transformers 4.x it reads this transformers-5 tokenizer as a plain fast tokenizer
    from usaf.data.tokenizer import load_tokenizer

    return load_tokenizer(str(MODEL))


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    from usaf.families import load_model_config, resolve_family
    from usaf.families.modules import transformers_config

    # transformers 4.x: the config's num_local_experts (a transformers 5 name) under its 4.x name
    config = transformers_config(MODEL, resolve_family(load_model_config(MODEL)))
    return AutoModelForCausalLM.from_pretrained(MODEL, config=config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def heldout_batch(tokenizer):
    text = (stdlib_dir() / HELDOUT_FILE).read_text(encoding="utf-8")
    ids = tokenizer(text)["input_ids"][: WINDOWS * SEQ]
    assert len(ids) == WINDOWS * SEQ, f"{HELDOUT_FILE} is long enough for {WINDOWS} windows"
    ids = torch.tensor(ids).reshape(WINDOWS, SEQ)
    return ids, ids.clone()


@pytest.fixture(scope="module")
def provenance():
    return json.loads((MODEL / "PROVENANCE.json").read_text(encoding="utf-8"))


def mean_nll(model, ids, labels) -> float:
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)))


def test_packaged_files_load_with_transformers(model, tokenizer):
    assert model.config.model_type == "qwen3_moe"
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == model.config.eos_token_id
    assert tokenizer.pad_token_id == model.config.pad_token_id
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert len(tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])) == 2
    assert tokenizer.decode(tokenizer("def f(x):\n    return x\n")["input_ids"]) == "def f(x):\n    return x\n"


def test_stored_small_in_bf16():
    header_len = struct.unpack("<Q", (MODEL / "model.safetensors").read_bytes()[:8])[0]
    header = json.loads((MODEL / "model.safetensors").read_bytes()[8 : 8 + header_len])
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes == {"BF16"}
    assert sum(p.stat().st_size for p in MODEL.iterdir()) < 10e6


def test_pretrained_loss_far_below_random_init(model, heldout_batch):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    random_model = AutoModelForCausalLM.from_config(model.config).eval()  # negative control: same config
    trained = mean_nll(model, *heldout_batch)
    random = mean_nll(random_model, *heldout_batch)
    assert random > 0.9 * math.log(model.config.vocab_size), random  # a random model is near-uniform
    assert trained < 0.6 * random, (trained, random)


def test_quantized_engine_loss_close_to_full_precision(model, heldout_batch, tmp_path):
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize

    manifest, out = quantize(QuantizeConfig(model=str(MODEL), out=tmp_path / "q", method="rtn"))
    assert manifest.summary.quant.method == "rtn"
    loaded = load_quantized_model(out)
    engine = SparseEngine(loaded, trainable_layers=[loaded.spec.moe_layers[-1]])
    ids, labels = heldout_batch
    with torch.no_grad():
        quantized = float(engine.loss(ids, labels).ce)
    full = mean_nll(model, ids, labels)
    assert quantized != pytest.approx(full, abs=1e-4), "4-bit experts must change the loss a little"
    assert abs(quantized - full) < 0.02 * full, (quantized, full)  # measured: +0.2 % (RTN, group 128)


def test_provenance_matches_the_files(model, tokenizer, provenance):
    for key, value in provenance["model_config"].items():
        assert getattr(model.config, key) == value, key
    assert provenance["parameters"] == sum(p.numel() for p in model.parameters())
    assert provenance["stored_dtype"] == "bfloat16"
    assert provenance["script"] == "scripts/build_demo_model.py"
    assert re.fullmatch(r"3\.\d+\.\d+", provenance["python_version"])  # whose stdlib it was trained on
    assert 0 < provenance["heldout_loss"] < provenance["demo_domain_heldout_loss_before_finetuning"] + 1.0
    assert provenance["heldout_perplexity"] == pytest.approx(math.exp(provenance["heldout_loss"]), rel=1e-3)
    assert provenance["steps"] == provenance["history"][-1]["step"]
    assert provenance["final_train_loss"] == provenance["history"][-1]["loss"]
    assert provenance["dead_experts"] == 0
    assert len(provenance["expert_load"]) == model.config.num_hidden_layers
    assert provenance["stdlib"]["pretrain_files"] > 100 and provenance["stdlib"]["pretrain_bytes"] > 1e6
    for recorded, domain in (
        (provenance["pretrain_domain"], PRETRAIN_DOMAIN),
        (provenance["demo_domain"], DEMO_DOMAIN),
    ):
        assert recorded["paths"] == list(domain.paths), "the domain changed since the model was built: rebuild it"
        assert recorded["include"] == list(domain.include)
        assert recorded["exclude"] == list(domain.exclude)
        assert recorded["held_out"] == list(domain.held_out)
        assert recorded["train_tokens"] > 0 and recorded["heldout_tokens"] > 0


@pytest.mark.skipif(not (3, 10) <= sys.version_info[:2] <= (3, 13), reason="domains are checked for CPython 3.10-3.13")
def test_domains_exist_here_and_are_disjoint():
    from usaf.data.corpus import discover
    from usaf.stages.tokenize import select_heldout

    assert not set(PRETRAIN_DOMAIN.paths) & set(DEMO_DOMAIN.paths)
    for domain in (PRETRAIN_DOMAIN, DEMO_DOMAIN):
        missing = [p for p in domain.paths if not (stdlib_dir() / p).exists()]
        assert not missing, missing
        assert all((stdlib_dir() / p).is_file() == p.endswith(".py") for p in domain.paths)
        options = domain.tokenize_options()
        corpus = discover(
            options["inputs"],
            include=options["include"],
            exclude=options["exclude"],
            source_depth=options["source_depth"],
        )
        sources = sorted({f.source for f in corpus.files})
        held = select_heldout(sources, options["held_out"], 0.0, 0)  # raises if a held-out source is missing
        assert held == set(domain.held_out)
        parts = [f.path.relative_to(stdlib_dir()).parts for f in corpus.files]
        assert not [
            p for p in parts if {"test", "tests"} & set(p) or p[-1].startswith("test_") or p[-1] == "__main__.py"
        ]


def test_demo_domain_tokenizes_into_a_fine_tuning_task(tmp_path):
    from usaf.stages.tokenize import TokenizeConfig
    from usaf.stages.tokenize import run as tokenize

    config = TokenizeConfig(model=str(MODEL), seq_len=512, out=tmp_path / "tokens", **DEMO_DOMAIN.tokenize_options())
    manifest, _ = tokenize(config)
    s = manifest.summary
    assert s.heldout_sources == sorted(DEMO_DOMAIN.held_out)
    assert s.train_tokens > 450_000 and s.heldout_tokens > 50_000, (s.train_tokens, s.heldout_tokens)
    assert {src.split for src in s.sources} == {"train", "heldout"}


def test_cpp_domain_reads_torchs_headers_with_a_heldout_source():
    """The evidence benchmark's second domain: C++ headers of the installed torch wheel, one source per directory."""
    from usaf.data.corpus import discover
    from usaf.demo import CPP_DOMAIN, torch_include_dir
    from usaf.stages.tokenize import select_heldout

    assert torch_include_dir().is_dir()
    options = CPP_DOMAIN.tokenize_options()
    assert all(p.is_dir() for p in options["inputs"]) and options["include"] == ["*.h"]
    corpus = discover(options["inputs"], include=options["include"], exclude=options["exclude"], source_depth=0)
    sources = sorted({f.source for f in corpus.files})
    assert sources == ["c10", "fmt", "pybind11"]
    held = select_heldout(sources, options["held_out"], 0.0, 0)
    assert sorted(held) == ["pybind11"]
    assert all(f.path.suffix == ".h" for f in corpus.files)
    assert not set(CPP_DOMAIN.paths) & set(PRETRAIN_DOMAIN.paths)  # nothing the demo model was pretrained on
