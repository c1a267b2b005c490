"""`usaf export` of the packaged *pretrained* demo model (bf16 on disk), where the export dtype's rounding
is far larger than on random tiny models: a correct export verifies in bf16, fp16 and fp32, every kind of
broken export is refused in each, and the quantized base exports alone (``--no-checkpoint``)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers import invoke, leftovers
from usaf.artifacts import HfExportManifest, load_verified
from usaf.demo import demo_model_dir
from usaf.families import read_checkpoint
from usaf.testing import stdlib_dir

DTYPES = ("bfloat16", "float16", "float32")  # bfloat16 is the demo model's own: also the default's


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo model quantized (RTN), and a short run at a high learning rate on its top layer and router."""
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize

    root = tmp_path_factory.mktemp("export-demo")
    _, qdir = quantize(QuantizeConfig(model=str(demo_model_dir()), out=root / "q", method="rtn"))
    tokens, plan, run = root / "tokens", root / "plan", root / "run"
    for args in (
        ("tokenize", stdlib_dir() / "textwrap.py", stdlib_dir() / "shlex.py", "--model", qdir, "--seq-len", 64,
         "--held-out", "shlex.py", "--out", tokens),
        ("score", "--model", qdir, "--data", tokens, "--frac", 0.01, "--calib-samples", 8, "--train-from", 3,
         "--no-stability", "--out", plan),
        ("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", run, "--lr", 0.01,
         "--router-lr", 0.01, "--steps", 6, "--save-every", 6),
    ):  # fmt: skip
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    return {"q": qdir, "run": run, "tokens": tokens}


def export(*args) -> dict:
    result = invoke("export", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_correct_export_of_a_pretrained_model_verifies_in_every_dtype(demo, dtype, tmp_path):
    out = tmp_path / "hf"
    export("--model", demo["q"], "--checkpoint", demo["run"], "--out", out, "--dtype", dtype)
    v = load_verified(out, HfExportManifest).summary.verify
    assert v.reference == "dequantized+change" and v.max_abs_diff == 0.0  # the same weights: the same logits
    assert v.change_effect_diff_rms <= v.change_effect_tolerance
    assert v.change_max_abs_effect > 1.0 and v.change_rms > 0.1  # the change is visible, and was exported
    if dtype == "bfloat16":  # the rounding that the old fixed tolerance (sized on random models) refused
        assert v.engine_max_abs_diff > 0.3 and v.rounding_rms > 1e-2
    if dtype == "float32":
        assert v.rounding_rms == pytest.approx(0.0, abs=1e-5) and v.engine_max_abs_diff < 1e-4


def _shift_one_expert(indices: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
    """The same positions one expert further on (wrapping): the delta lands in the wrong expert."""
    per_expert = memory[0].numel()
    return torch.sort((indices + per_expert) % memory.numel()).values


BUGS = {  # writer bugs the counts do not see: merge_delta's (memory, indices, values) mangled
    "delta dropped": lambda merge: lambda m, i, v, **k: merge(m, i, v * 0, **k),
    "delta applied twice": lambda merge: lambda m, i, v, **k: merge(m, i, v * 2, **k),
    "delta with the wrong sign": lambda merge: lambda m, i, v, **k: merge(m, i, -v, **k),
    "delta in the wrong expert": lambda merge: lambda m, i, v, **k: merge(m, _shift_one_expert(i, m), v, **k),
}


def _untrained_router(self, name, original):
    self.counts.router_tensors += 1  # counted as applied: only the verification can tell
    return self.cast(original)


# every bug in the two half-precision dtypes (where rounding is largest); fp32 gets the subtlest one
BROKEN = [(bug, dtype) for dtype in DTYPES[:2] for bug in [*BUGS, "router not applied"]]
BROKEN.append(("delta in the wrong expert", "float32"))


@pytest.mark.parametrize(("bug", "dtype"), BROKEN)
def test_a_broken_export_is_refused_in_every_dtype(demo, bug, dtype, tmp_path, monkeypatch):
    from usaf.stages import export_sources

    if bug == "router not applied":  # the original's router written instead of the trained one
        monkeypatch.setattr(export_sources.ExportSource, "router", _untrained_router)
    else:
        monkeypatch.setattr(export_sources, "merge_delta", BUGS[bug](export_sources.merge_delta))
    out = tmp_path / "hf"
    result = invoke("export", "--model", demo["q"], "--checkpoint", demo["run"], "--out", out, "--dtype", dtype)
    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split())
    assert "verification failed: the reloaded export's logits differ" in message, message
    assert "nothing was written" in message and not out.exists() and not leftovers(tmp_path)


@pytest.mark.parametrize("dtype", DTYPES[:2])
def test_an_export_that_disagrees_with_the_engine_is_refused(demo, dtype, tmp_path, monkeypatch):
    """A mistake the writer and the in-memory reference would share (say, how a delta's index is read)
    passes the exact check; against the engine it shows: here the engine runs the change negated."""
    from usaf.stages import export_verify

    engine = export_verify.model_with_change

    def negated(model_dir, change, **kwargs):
        if change is not None:
            change = dataclasses.replace(change, deltas={n: (i, -v) for n, (i, v) in change.deltas.items()})
        return engine(model_dir, change, **kwargs)

    monkeypatch.setattr(export_verify, "model_with_change", negated)
    out = tmp_path / "hf"
    result = invoke("export", "--model", demo["q"], "--checkpoint", demo["run"], "--out", out, "--dtype", dtype)
    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split())
    assert "moves the reloaded export's logits differently from the engine it was trained in" in message, message
    assert not out.exists() and not leftovers(tmp_path)


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_quantized_base_exports_alone_and_evaluates_like_the_engine(demo, dtype, tmp_path):
    from transformers import AutoModelForCausalLM

    from usaf.stages.change import model_with_change

    workspace = tmp_path / "ws"  # a workspace with a quantized model and no run: nothing else to pick
    (workspace / "quantized_model").mkdir(parents=True)
    (workspace / "quantized_model" / "q").symlink_to(demo["q"], target_is_directory=True)
    printed = export("--no-checkpoint", "--workspace", workspace, "--dtype", dtype)
    out = printed["path"]
    manifest = load_verified(out, HfExportManifest)
    s = manifest.summary
    assert [i.role for i in manifest.inputs] == ["model"] and s.change_source is None and s.change_fingerprint is None
    assert s.expert_entries == 0 and s.router_tensors == 0 and s.verify.max_abs_diff == 0.0
    assert out.endswith("-base") and {i.dtype for i in read_checkpoint(out).values()} == {
        {"bfloat16": "BF16", "float32": "F32"}[dtype]
    }
    # plain transformers on held-out text: the engine's quantized base, up to the export dtype's rounding
    lines = (demo["tokens"] / "heldout.jsonl").read_text().splitlines()[:8]
    ids = torch.tensor([json.loads(line)["input_ids"] for line in lines])  # (8, 64)
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(input_ids=ids).logits
        engine = model_with_change(demo["q"], None, device=torch.device("cpu"))(input_ids=ids).logits
    gap = abs(_nll(exported, ids) - _nll(engine, ids))
    assert gap < (1e-5 if dtype == "float32" else 1e-2 * _nll(engine, ids)), gap
    if dtype == "float32":
        torch.testing.assert_close(exported, engine, rtol=0, atol=1e-4)


def test_no_checkpoint_refuses_what_it_cannot_mean(demo, tmp_path):
    out = tmp_path / "out"
    for args, expected in (
        (("--checkpoint", demo["run"]), "pass either --checkpoint or --no-checkpoint"),
        (("--format", "delta"), "--no-checkpoint with --format delta would write an empty change"),
        (("--base", str(demo_model_dir())), "--no-checkpoint with --base would copy the original unchanged"),
    ):
        result = invoke("export", "--model", demo["q"], "--no-checkpoint", *args, "--out", out)
        assert result.exit_code == 2 and expected in " ".join(result.stderr.split()), result.output
        assert not out.exists()
