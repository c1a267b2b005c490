"""Sparse deltas beyond the routed experts (``--targets attention,shared``), for every family: the engine's
forward and sparse gradients against dense autograd on a transformers model holding ``W + D``, folds, resume."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES
from helpers import reference_model
from helpers_engine import FAMILY_LAYERS, backward_with_random_deltas, hold_deltas, make_engine
from usaf.artifacts.run import run_settings_text
from usaf.engine.linear_target import LinearTarget
from usaf.families.modules import FusedView
from usaf.families.targets import linear_target_modules, parse_targets, target_of, targets_of


def _dense_loss(model, ids, labels):
    from usaf.engine.engine import IGNORE_INDEX

    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    targets = labels[:, 1:]
    tokens = (targets != IGNORE_INDEX).sum()
    flat = logits.reshape(-1, logits.shape[-1])
    return (
        torch.nn.functional.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        / tokens
    )


def _stored(view: FusedView, name: str, weight, *, grad: bool = False) -> torch.Tensor:
    """A target's dense tensor (or its gradient) in the stored (E, O, I) orientation, flattened."""
    t = view.get(name, grad=grad)
    if isinstance(weight, LinearTarget):
        return t.reshape(-1)
    return (t.transpose(1, 2) if weight.q.transposed else t).reshape(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_linear_targets_forward_and_gradients_equal_dense_autograd(family, tiny_model, quantized):
    engine = make_engine(quantized, family, targets="all")
    linear = {n: w for n, w in engine.weights.items() if isinstance(w, LinearTarget)}
    kinds = {target_of(n, engine.spec) for n in linear}
    assert "attention" in kinds
    assert ("shared" in kinds) == (engine.spec.shared is not None)
    selection, values, ids, labels, loss = backward_with_random_deltas(engine)

    reference = reference_model(tiny_model(family, num_layers=FAMILY_LAYERS), engine.loaded)
    view = FusedView(reference, engine.spec)
    hold_deltas(view, engine, selection, values)  # the reference holds base + delta as plain dense weights
    expected = _dense_loss(reference, ids, labels)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    expected.backward()
    for name, weight in engine.weights.items():
        dense = _stored(view, name, weight, grad=True)
        got = weight.delta.values.grad
        torch.testing.assert_close(got, dense[selection[name]], rtol=1e-4, atol=1e-6, msg=name)
        shifted = (selection[name] + 1) % dense.numel()  # negative control: one column over
        assert not torch.allclose(got, dense[shifted], rtol=1e-3, atol=1e-6), name
    # the frozen weights got no gradient anywhere: only the deltas and routers train
    trained = {id(p) for p in engine.routers.values()} | {id(d.values) for d in engine.deltas().values()}
    assert all(p.grad is None for p in engine.model.parameters() if id(p) not in trained)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_a_linear_targets_fold_is_exact_and_a_rebuilt_one_equal(family, quantized):
    engine = make_engine(quantized, family, targets=("attention",))
    assert all(isinstance(w, LinearTarget) for w in engine.weights.values())
    name, weight = next(iter(engine.weights.items()))
    original = weight.module.weight.detach().clone()
    idx = torch.tensor([0, 3, 7])
    weight.fold(idx, torch.tensor([0.5, -0.25, 1.0]))
    weight.fold(torch.tensor([3, 9]), torch.tensor([0.25, 2.0]))  # 3 again: sums; 9 new
    flat = weight.module.weight.detach().reshape(-1)
    expect = original.reshape(-1).clone()
    expect[torch.tensor([0, 3, 7, 9])] += torch.tensor([0.5, 0.0, 1.0, 2.0])
    torch.testing.assert_close(flat, expect)
    assert torch.equal(weight.frozen_indices, torch.tensor([0, 3, 7, 9]))
    # a fresh engine given the same record (a resume) holds the same weight, bit for bit
    fresh = make_engine(quantized, family, targets=("attention",))
    fresh.weights[name].fold(weight.frozen_indices, weight.frozen_values)
    assert torch.equal(fresh.weights[name].module.weight, weight.module.weight)


def test_targets_are_named_and_parsed(quantized):
    engine = make_engine(quantized, "qwen2_moe", targets=("experts", "shared"))
    spec = engine.spec
    layer = engine.trainable_layers[0]
    shared = linear_target_modules(engine.model, spec, layer, "shared")
    assert shared and all(".mlp.shared_expert" in n for n in shared)
    assert targets_of(engine.weights, spec) == ("experts", "shared")
    assert parse_targets("shared, experts") == ("experts", "shared")
    for bad in ("experts,mlp", "experts,experts", ""):
        with pytest.raises(ValueError):
            parse_targets(bad)
    with pytest.raises(ValueError):
        target_of(f"{spec.layer_prefix(layer)}.input_layernorm.weight", spec)


def test_a_run_with_every_target_resumes_exactly_and_generates(prepared, tmp_path, monkeypatch):
    """Through the CLI: score --targets experts,attention,shared, a RigL run interrupted inside a scoring window and
    resumed equals the straight run (losses, deltas, frozen records); generate and eval apply it."""
    from helpers import invoke
    from helpers_trained import straight_and_resumed
    from usaf.artifacts import PlanManifest, load_verified
    from usaf.artifacts.run import load_trained_change

    qdir, tokens, _ = prepared("qwen2_moe")
    plan = tmp_path / "plan"
    args = ("--frac", 0.05, "--calib-samples", 8, "--train-from", 2, "--targets", "shared,attention,experts")
    result = invoke("score", "--model", qdir, "--data", tokens, *args, "--no-stability", "--out", plan)
    assert result.exit_code == 0, result.output
    summary = load_verified(plan, PlanManifest).summary
    assert summary.targets == ["experts", "attention", "shared"]
    kinds = {name.split(".")[3] for name in (t.name for t in summary.tensors)}
    assert kinds == {"self_attn", "mlp"} and any("shared_expert" in t.name for t in summary.tensors)

    straight, resumed = straight_and_resumed(qdir, tokens, plan, tmp_path, monkeypatch)
    a, b = load_trained_change(straight), load_trained_change(resumed)
    linear = [n for n in a.deltas if ".self_attn." in n or "shared_expert" in n]
    assert linear and a.deltas.keys() == b.deltas.keys()
    for name in a.deltas:
        assert torch.equal(a.deltas[name][0], b.deltas[name][0]) and torch.equal(a.deltas[name][1], b.deltas[name][1])
    # reselection moved some linear target's entries: its frozen record is part of the change
    plan_masks = {t.name: t.selected for t in summary.tensors}
    assert any(a.deltas[n][0].numel() > plan_masks[n] for n in linear)

    out = invoke("generate", "hello", "--model", qdir, "--checkpoint", straight, "--max-new-tokens", 4, "--seed", 0)
    assert out.exit_code == 0, out.output


def test_a_target_the_model_lacks_is_one_error_and_no_plan(prepared, tmp_path):
    """qwen3_moe has no shared experts: --targets shared is refused, naming the flag, and writes nothing."""
    from helpers import invoke

    qdir, tokens, _ = prepared("qwen3_moe")
    out = tmp_path / "plan"
    result = invoke("score", "--model", qdir, "--data", tokens, "--targets", "experts,shared", "--calib-samples", 4,
                    "--no-stability", "--out", out)  # fmt: skip
    assert result.exit_code == 2
    assert "--targets experts,shared" in result.stderr and "no shared modules" in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # control: the same command with targets the model has succeeds
    result = invoke("score", "--model", qdir, "--data", tokens, "--targets", "experts,attention", "--calib-samples", 4,
                    "--no-stability", "--no-lr-test", "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("family", "expected"),
    [("qwen2_moe", ["experts", "attention", "shared"]), ("qwen3_moe", ["experts", "attention"])],
)
def test_without_targets_the_default_follows_the_model(family, expected, prepared, tmp_path):
    """No --targets: the experts and attention, and the shared experts where the model has them (qwen3_moe has
    none: the default adapts where a named target is refused); the plan records what was resolved."""
    from helpers import invoke
    from usaf.artifacts import PlanManifest, load_verified
    from usaf.families import load_model_config, resolve_family
    from usaf.families.targets import default_targets, resolve_targets

    qdir, tokens, _ = prepared(family)
    spec = resolve_family(load_model_config(qdir))
    assert list(default_targets(spec)) == expected and resolve_targets("experts", spec) == ("experts",)
    plan = tmp_path / "plan"
    result = invoke("score", "--model", qdir, "--data", tokens, "--calib-samples", 4, "--no-stability",
                    "--no-lr-test", "--out", plan)  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = load_verified(plan, PlanManifest).summary
    assert summary.targets == expected
    assert any("shared_expert" in t.name for t in summary.tensors) == ("shared" in expected)


def test_a_run_without_targets_records_them_as_before_the_default_followed_the_model(prepared, tmp_path, monkeypatch):
    """run-settings.json keeps "targets": "experts,attention" where --targets is not given (the plan's fingerprint
    pins what trains), as every run recorded before the default followed the model: an interrupted one resumes."""
    import json

    from helpers import invoke
    from helpers_trained import interrupt_at

    qdir, tokens, plan = prepared("qwen2_moe")  # its plan trains the shared expert too (the default here)

    def interrupted(out):
        interrupt_at(2, lambda: train(out), monkeypatch)
        return json.loads((out / "run-settings.json").read_text())

    def train(out):
        return invoke("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", out, "--steps", 4,
                      "--lr", 1e-2, "--save-every", 1)  # fmt: skip

    settings = interrupted(tmp_path / "a")
    assert settings["targets"] == "experts,attention"
    result = train(tmp_path / "a")
    assert result.exit_code == 0 and "resuming from" in result.stderr, result.output
    # the targets are the plan's (a selection setting): with the same plan another recorded spelling resumes; the
    # control, a record of another plan, is another run's
    interrupted(tmp_path / "b")
    (tmp_path / "b" / "run-settings.json").write_text(run_settings_text({**settings, "targets": "experts"}))
    result = train(tmp_path / "b")
    assert result.exit_code == 0 and "resuming from" in result.stderr, result.output
    interrupted(tmp_path / "c")
    other = {**settings, "targets": "experts", "plan_fingerprint": "0" * 64}
    (tmp_path / "c" / "run-settings.json").write_text(run_settings_text(other))
    result = train(tmp_path / "c")
    said = " ".join(result.stderr.split())
    assert result.exit_code != 0 and "holds another run" in said and "--targets experts, not" in said, said
