"""Lineage: every consumer refuses an artifact made for another model, tokenizer or layer set, naming both
fingerprints, and writes nothing; the same inputs with matching lineage are accepted (negative control)."""

from __future__ import annotations

import json

import pytest

from helpers import invoke, leftovers
from usaf.testing import build_tiny_model, build_tiny_tokenizer, crash, stdlib_dir


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Model A (3 layers) with tokens, plan and a 2-step run; model B (4 layers: another layer set); tokens made
    with another tokenizer."""
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize

    root = tmp_path_factory.mktemp("lineage")
    a = crash.build_setup(root / "a", num_layers=3)
    model_b = build_tiny_model("qwen3_moe", root / "b-model", tokenizer=True, num_layers=4)
    _, quantized_b = quantize(QuantizeConfig(model=str(model_b), out=root / "b", method="rtn", group_size=8))
    tokens_a, tokens_other = root / "tokens-a", root / "tokens-other"
    build_tiny_tokenizer(root / "other-tokenizer", vocab_size=300)
    for model, out in ((a.quantized, tokens_a), (root / "other-tokenizer", tokens_other)):
        result = invoke("tokenize", stdlib_dir() / "shlex.py", "--model", model, "--seq-len", 32, "--out", out)
        assert result.exit_code == 0, result.output
    run = root / "run-a"
    result = invoke("train", "--model", a.quantized, "--data", a.tokens, "--plan", a.plan, "--steps", 2, "--out", run)
    assert result.exit_code == 0, result.output
    plan_b = root / "plan-b"
    result = invoke("score", "--model", quantized_b, "--data", a.tokens, "--frac", 0.05, "--calib-samples", 4,
                    "--no-stability", "--out", plan_b)  # fmt: skip
    assert result.exit_code == 0, result.output
    return {"a": a.quantized, "b": quantized_b, "tokens_a": tokens_a, "tokens_other": tokens_other,
            "plan_a": a.plan, "plan_b": plan_b, "run_a": run, "jsonl": a.tokens, "root": root}  # fmt: skip


def _fp(path) -> str:
    return json.loads((path / "manifest.json").read_text())["fingerprint"][:16]


def _tokenizer_fp(tokens) -> str:
    return json.loads((tokens / "manifest.json").read_text())["summary"]["tokenizer"]["fingerprint"][:16]


CASES = {
    # name: (args with {placeholders}, fingerprints the message must name)
    "score --data from another tokenizer": (
        "score --model {a} --data {tokens_other} --calib-samples 4 --no-stability --out {out}",
        ("tok:tokens_other", "tok:tokens_a"),
    ),
    "train --data from another tokenizer": (
        "train --model {a} --data {tokens_other} --plan {plan_a} --steps 1 --out {out}",
        ("tok:tokens_other", "tok:tokens_a"),
    ),
    # a tokens artifact's file given by itself is checked as its directory is (it was not: found in review)
    "score --data TOKENS/train.jsonl from another tokenizer": (
        "score --model {a} --data {tokens_other}/train.jsonl --calib-samples 4 --no-stability --out {out}",
        ("tok:tokens_other", "tok:tokens_a"),
    ),
    "train --data TOKENS/train.jsonl from another tokenizer": (
        "train --model {a} --data {tokens_other}/train.jsonl --plan {plan_a} --steps 1 --out {out}",
        ("tok:tokens_other", "tok:tokens_a"),
    ),
    "eval --held-out TOKENS/train.jsonl from another tokenizer": (
        "eval --model {a} --checkpoint {run_a} --held-out {tokens_other}/train.jsonl --no-plots --no-base-cache "
        "--workspace {out}-ws --out {out}",
        ("tok:tokens_other", "tok:tokens_a"),
    ),
    "tokenize TOKENS/train.jsonl of another tokenizer": (
        "tokenize {tokens_other}/train.jsonl --model {a} --seq-len 32 --out {out}",
        ("tok:tokens_other", "tok:tokens_a"),
    ),
    "train --plan for another model (layer set)": (
        "train --model {a} --data {jsonl} --plan {plan_b} --steps 1 --out {out}",
        ("summary:plan_b", "fp:a"),
    ),
    "eval --data from another tokenizer": (
        "eval --model {a} --checkpoint {run_a} --data {tokens_other} --no-plots --no-base-cache "
        "--workspace {out}-ws --out {out}",
        ("tok:tokens_other", "tok:tokens_a"),
    ),
    "eval --checkpoint of another model (layer set)": (
        "eval --model {b} --checkpoint {run_a} --data {jsonl} --no-plots --no-base-cache "
        "--workspace {out}-ws --out {out}",
        ("run:run_a", "fp:b"),
    ),
    "export --checkpoint of another model (layer set)": (
        "export --model {b} --checkpoint {run_a} --out {out}",
        ("run:run_a", "fp:b"),
    ),
    "export --format delta --checkpoint of another model": (
        "export --model {b} --checkpoint {run_a} --format delta --out {out}",
        ("run:run_a", "fp:b"),
    ),
    "generate --checkpoint of another model": (
        "generate --model {b} --checkpoint {run_a} --max-new-tokens 2 hello",
        ("run:run_a", "fp:b"),
    ),
}


def _expected(world, spec: str) -> str:
    kind, name = spec.split(":")
    path = world[name]
    if kind == "fp":
        return _fp(path)
    if kind == "tok":
        return _tokenizer_fp(path)
    if kind == "summary":
        return json.loads((path / "manifest.json").read_text())["summary"]["model_fingerprint"][:16]
    return json.loads((path / "manifest.json").read_text())["summary"]["model_fingerprint"][:16]  # a run's model


@pytest.mark.parametrize("name", list(CASES))
def test_a_mismatched_artifact_is_refused_naming_both_fingerprints(world, name, tmp_path):
    template, fingerprints = CASES[name]
    out = tmp_path / "out"
    args = template.format(**{k: v for k, v in world.items()}, out=out).split()
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    error = next(line for line in result.stderr.splitlines() if line.startswith("error:"))
    expected = [_expected(world, spec) for spec in fingerprints]
    assert expected[0] != expected[1]
    assert all(fp in error for fp in expected), (error, expected)
    assert not out.exists() and leftovers(tmp_path) == []


def test_negative_control_matching_lineage_is_accepted(world, tmp_path):
    result = invoke("eval", "--model", world["a"], "--checkpoint", world["run_a"], "--data", world["tokens_a"],
                    "--no-plots", "--no-base-cache", "--workspace", tmp_path / "ws",
                    "--out", tmp_path / "eval")  # fmt: skip
    assert result.exit_code == 0, result.output
    for data in ("--data", world["tokens_a"] / "train.jsonl"), ("--held-out", world["tokens_a"] / "train.jsonl"):
        out = tmp_path / f"eval-{data[0]}"
        result = invoke("eval", "--model", world["a"], "--checkpoint", world["run_a"], *data, "--no-plots",
                        "--no-base-cache", "--workspace", tmp_path / "ws", "--out", out)  # fmt: skip
        assert result.exit_code == 0, result.output
    result = invoke("tokenize", world["tokens_a"] / "train.jsonl", "--model", world["a"], "--out", tmp_path / "again")
    assert result.exit_code == 0, result.output
    result = invoke("export", "--model", world["a"], "--checkpoint", world["run_a"], "--format", "delta",
                    "--out", tmp_path / "delta")  # fmt: skip
    assert result.exit_code == 0, result.output
