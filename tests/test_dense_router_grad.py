"""DenseMixer's router gradient (``SparseEngine(dense_router_grad=True)``, ``usaf train --dense-router-grad``).

The forward is the top-k forward, bit for bit; the routers' gradient is the one of the dense mixture over
all experts with the experts' outputs held constant and the non-kept experts' normalisation detached
(DenseMixer's straight-through estimator); the experts' delta gradients are unchanged. Checked per family
against a plain-torch dense mixture on the dequantized weights, with a negative control (the default
top-k gradient differs from it) and the index-free (DirectML) path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import FAMILIES
from helpers_engine import batch, make_engine, random_selection
from usaf.engine.experts import ExpertWeight
from usaf.families.modules import expert_biases
from usaf.families.spec import RouterKind


def _engine(quantized, family, *, dense: bool, seed: int = 0, **kwargs):
    engine = make_engine(quantized, family, dense_router_grad=dense, **kwargs)
    selection = random_selection(engine, frac=0.2, seed=seed)
    g = torch.Generator().manual_seed(seed)
    values = {name: 0.05 * torch.randn(idx.numel(), generator=g) for name, idx in selection.items()}
    engine.set_deltas(selection, values)  # non-zero deltas: the experts' outputs include them
    return engine


def _grads(engine):
    routers = {name: p.grad.clone() for name, p in engine.routers.items()}
    deltas = {name: d.values.grad.clone() for name, d in engine.deltas().items()}
    return routers, deltas


def _train_backward(engine, seed: int = 0):
    ids, labels = batch(seed)
    engine.model.zero_grad(set_to_none=True)
    for delta in engine.deltas().values():
        delta.values.grad = None
    parts = engine.loss(ids, labels)
    parts.loss.backward()
    return parts.loss.detach(), *_grads(engine)


# -- the layer-level reference: a plain-torch dense mixture on the dequantized weights -------------------


def _expert_mlp(experts_module, state, x: torch.Tensor, expert: int) -> torch.Tensor:
    """``x (T, H) -> (T, H)`` with expert ``expert``'s dequantized base + dense delta (no usaf code path)."""

    def weight(w: ExpertWeight) -> torch.Tensor:  # (O, I)
        dense = w.base(expert, x.device).float()
        return dense + w.delta.dense(expert) if w.delta is not None else dense

    gate_up_bias, down_bias = expert_biases(experts_module, expert)
    h = F.linear(x, weight(state.gate_up), gate_up_bias)  # (T, 2I)
    h = experts_module._apply_gate(h)  # (T, I): the family's gate, transformers' own
    return F.linear(h, weight(state.down), down_bias)  # (T, H)


def _reference_router_grads(engine, x: torch.Tensor, probe: torch.Tensor) -> dict[str, torch.Tensor]:
    """d<probe, dense mixture>/d(router params), DenseMixer's construction written out per router kind."""
    spec = engine.spec
    layer = engine.trainable_layers[-1]
    block = engine.model.get_submodule(spec.moe_prefix(layer))
    router = engine.model.get_submodule(spec.router_prefix(layer))
    state = engine.loaded.experts[layer]
    names = spec.router_names(layer)
    params = {n: engine.routers[n].detach().clone().requires_grad_(True) for n in names if n in engine.routers}
    weight = params[spec.router_weight_name(layer)]
    bias = params.get(f"{spec.router_prefix(layer)}.bias")
    with torch.no_grad():
        index = router(x)[2]  # (T, k): the model's own routing decision
    logits = F.linear(x, weight, bias)  # (T, E)
    kept = F.one_hot(index, spec.num_experts).sum(dim=1).bool()  # (T, E)
    r = spec.router
    if r.kind is RouterKind.SIGMOID_GROUP_TOPK:
        scores, eps = logits.sigmoid(), 1e-20
    else:
        scores, eps = torch.softmax(logits, dim=-1), 0.0
    if r.renormalize or r.kind is RouterKind.TOPK_SOFTMAX:
        total = (scores * kept).sum(dim=-1, keepdim=True) + eps  # (T, 1)
        mix = scores * kept / total + scores * ~kept / total.detach()  # DenseMixer's partscale_fix_expert
    else:
        mix = scores
    mix = mix * r.scaling_factor  # (T, E)
    with torch.no_grad():
        outputs = torch.stack([_expert_mlp(block.experts, state, x, e) for e in range(spec.num_experts)], 1)
    dense = (mix.unsqueeze(-1) * outputs).sum(dim=1)  # (T, H), experts' outputs held constant
    return dict(zip(params, torch.autograd.grad((probe * dense).sum(), list(params.values()))))


def _engine_router_grads(engine, x: torch.Tensor, probe: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same gradient through the engine's MoE block (transformers' router, usaf's experts)."""
    layer = engine.trainable_layers[-1]
    block = engine.model.get_submodule(engine.spec.moe_prefix(layer))
    engine.model.zero_grad(set_to_none=True)
    out = block(x.unsqueeze(0))
    out = out[0] if isinstance(out, tuple) else out  # gpt-oss's block also returns its router scores
    (probe * out.reshape(x.shape)).sum().backward()
    names = [n for n in engine.spec.router_names(layer) if n in engine.routers]
    return {n: engine.routers[n].grad.clone() for n in names}


def _layer_inputs(engine, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = engine.model.get_input_embeddings().embedding_dim
    return torch.randn(24, hidden, generator=g), torch.randn(24, hidden, generator=g)  # x (T, H), probe (T, H)


@pytest.mark.parametrize("family", FAMILIES)
def test_router_gradient_equals_the_dense_mixture_reference(family, quantized):
    x, probe = _layer_inputs(dense_engine := _engine(quantized, family, dense=True))
    reference = _reference_router_grads(dense_engine, x, probe)
    ours = _engine_router_grads(dense_engine, x, probe)
    for name, grad in reference.items():
        assert grad.abs().max() > 0
        torch.testing.assert_close(ours[name], grad, rtol=1e-4, atol=1e-6)
    # negative control: the default (top-k only) router gradient is not the dense one
    sparse = _engine_router_grads(_engine(quantized, family, dense=False), x, probe)
    weight = dense_engine.spec.router_weight_name(dense_engine.trainable_layers[-1])
    gap = (sparse[weight] - reference[weight]).abs().max() / reference[weight].abs().max()
    assert gap > 1e-2, f"{family}: the top-k gradient is within {gap:.2e} of the dense one"


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_delta_gradients_are_unchanged_router_gradient_is_not(family, quantized):
    loss0, routers0, deltas0 = _train_backward(_engine(quantized, family, dense=False))
    loss1, routers1, deltas1 = _train_backward(_engine(quantized, family, dense=True))
    assert torch.equal(loss0, loss1)  # the forward is the top-k forward, bit for bit
    assert deltas0.keys() == deltas1.keys() and deltas0
    for name in deltas0:
        assert torch.equal(deltas0[name], deltas1[name]), name
    assert any(not torch.allclose(routers0[n], routers1[n], rtol=1e-3, atol=1e-7) for n in routers0)


@pytest.mark.parametrize("family", FAMILIES)
def test_index_free_path_gives_the_same_gradients(family, quantized):
    results = []
    for index_ops in (True, False):
        engine = _engine(quantized, family, dense=True)
        for state in engine.loaded.experts.values():
            state.set_index_ops(index_ops)
        results.append(_train_backward(engine))
    (loss0, routers0, deltas0), (loss1, routers1, deltas1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    for name in routers0:
        torch.testing.assert_close(routers1[name], routers0[name], rtol=1e-4, atol=1e-7)
    for name in deltas0:
        torch.testing.assert_close(deltas1[name], deltas0[name], rtol=1e-4, atol=1e-7)


def test_extra_pass_only_in_training_and_only_on_trainable_layers(quantized, monkeypatch):
    """The dense pass costs 2 x E expert products per trainable layer in a backward, nothing in no_grad."""
    calls = {"n": 0}
    original = ExpertWeight.linear

    def counting(self, *args, **kwargs):
        calls["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ExpertWeight, "linear", counting)
    counts = {}
    for dense in (False, True):
        engine = _engine(quantized, "qwen3_moe", dense=dense)
        ids, labels = batch(0)
        calls["n"] = 0
        with torch.no_grad():
            engine.loss(ids, labels)
        counts[dense, "eval"] = calls["n"]
        calls["n"] = 0
        engine.loss(ids, labels).loss.backward()
        counts[dense, "train"] = calls["n"]
        assert all(state.router_logits is None for state in engine.loaded.experts.values())  # none kept
        trainable = len(engine.trainable_layers)
        assert len(engine.spec.moe_layers) > trainable  # frozen MoE layers exist, and get no hook
    assert counts[True, "eval"] == counts[False, "eval"]
    assert counts[True, "train"] == counts[False, "train"] + 2 * engine.spec.num_experts * trainable


def test_refused_without_router_training_and_for_model_defined_routers(quantized, tiny_model):
    from usaf.families import load_model_config, resolve_family
    from usaf.families.routing import dense_router_grad_refusal

    def spec_of(path):
        return resolve_family(load_model_config(path))

    with pytest.raises(ValueError, match="train_router"):
        make_engine(quantized, "mixtral", train_router=False, dense_router_grad=True)
    spec = spec_of(tiny_model("glm4_moe"))
    assert spec.router.kind is RouterKind.MODEL_DEFINED
    assert "structural fallback" in dense_router_grad_refusal(spec)
    assert all(dense_router_grad_refusal(spec_of(tiny_model(f))) is None for f in FAMILIES)


# -- usaf train --dense-router-grad ------------------------------------------------------------------------


def _train(qdir, tokens, plan, out, *extra):
    from helpers import invoke

    args = ["--model", qdir, "--data", tokens, "--plan", plan, "--out", out, "--lr", 0.05, "--save-every", 0]
    return invoke("train", *args, *extra)


def test_train_option_is_recorded_trains_the_routers_differently_and_resumes_exactly(prepared, tmp_path, monkeypatch):
    import json

    from safetensors.torch import load_file

    from usaf.stages.train import trainer

    qdir, tokens, plan = prepared("qwen3_moe")
    args = ["--steps", 12, "--reselect-every", 5, "--router-lr", 1e-2]
    plain, straight, resumed = tmp_path / "plain", tmp_path / "straight", tmp_path / "resumed"
    assert _train(qdir, tokens, plan, plain, *args).exit_code == 0
    result = _train(qdir, tokens, plan, straight, *args, "--dense-router-grad")
    assert result.exit_code == 0, result.output
    assert json.loads((straight / "run-settings.json").read_text())["dense_router_grad"] is True
    assert "dense_router_grad" not in json.loads((plain / "run-settings.json").read_text())  # off: as before it

    def routers(run):
        return load_file(str(run / "final" / "routers.safetensors"))

    a, b = routers(plain), routers(straight)
    assert a.keys() == b.keys() and any(not torch.allclose(a[k], b[k], atol=1e-6) for k in a)

    real_step = trainer.Trainer.step

    def interrupt(self):
        if self.state.step == 7:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(trainer.Trainer, "step", interrupt)
    assert _train(qdir, tokens, plan, resumed, *args, "--dense-router-grad").exit_code == 130
    monkeypatch.setattr(trainer.Trainer, "step", real_step)
    result = _train(qdir, tokens, plan, resumed, *args, "--dense-router-grad")
    assert result.exit_code == 0 and "resuming from" in result.stderr, result.output
    losses = lambda run: [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()  # noqa: E731
                          if "loss" in json.loads(line)]  # fmt: skip
    assert losses(resumed) == losses(straight)
    c = routers(resumed)
    assert all(torch.equal(b[k], c[k]) for k in b)


def test_train_refuses_it_with_no_router_and_for_a_model_defined_router(prepared, quantized, tmp_path):
    qdir, tokens, plan = prepared("mixtral")
    result = _train(qdir, tokens, plan, tmp_path / "run", "--steps", 2, "--dense-router-grad", "--no-router")
    assert result.exit_code != 0 and "--no-router trains none" in result.output + result.stderr
    assert not (tmp_path / "run").exists()
    fallback = quantized("glm4_moe")
    result = _train(fallback, tokens, plan, tmp_path / "run2", "--steps", 2, "--dense-router-grad")
    assert result.exit_code != 0 and "--dense-router-grad: " in result.stderr, result.output
    assert "structural fallback" in result.stderr and "Traceback" not in result.output + result.stderr


def test_train_refuses_a_load_balancing_loss_for_a_family_without_one(prepared, tmp_path):
    """``--aux-loss-coef`` on DeepSeek-V3 (no load-balancing loss: its routing bias balances) scored a plan, loaded
    the model and crashed at the first step with a traceback, exit 1, leaving an unfinished run (found in review).
    Refused before anything runs now. The control: Mixtral has one, and trains with it."""
    qdir, tokens, plan = prepared("deepseek_v3")
    result = _train(qdir, tokens, plan, tmp_path / "run", "--steps", 2, "--aux-loss-coef", 0.01)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "error: --aux-loss-coef 0.01: deepseek_v3 has no load-balancing loss" in said
    assert "Traceback" not in result.output + result.stderr and not (tmp_path / "run").exists()
    qdir, tokens, plan = prepared("mixtral")
    done = _train(qdir, tokens, plan, tmp_path / "mixtral", "--steps", 2, "--aux-loss-coef", 0.01)
    assert done.exit_code == 0, done.output


class _Rejected(RuntimeError):
    pass


# the aten ops torch-directml rejects (tests/test_directml.py's list)
_REJECTED = ("nonzero", "index_add", "scatter", "scatter_add", "scatter_reduce", "index_put", "_unsafe_index_put",
             "one_hot", "masked_scatter", "index_copy")  # fmt: skip


class _RejectOps(TorchDispatchMode):
    """Raise on every rejected aten op, forward and backward."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1].rstrip("_")
        if name in _REJECTED or name.lstrip("_") in _REJECTED:
            raise _Rejected(f"{func} (DirectML rejects it)")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_index_free_dense_pass_avoids_rejected_ops(family, quantized):
    """The experts forward and backward with the dense router gradient, index-free: no op DirectML rejects."""
    from usaf.engine.experts import usaf_experts_forward
    from usaf.families.routing import dense_weights

    engine = _engine(quantized, family, dense=True)
    layer = engine.trainable_layers[-1]
    state = engine.loaded.experts[layer]
    state.set_index_ops(False)
    experts = engine.model.get_submodule(engine.spec.experts_prefix(layer))
    x, probe = _layer_inputs(engine)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(x.shape[0], engine.spec.num_experts, generator=g).requires_grad_(True)  # (T, E)
    index = logits.detach().topk(engine.spec.top_k, dim=-1).indices  # (T, k)
    weights = dense_weights(engine.spec.router, logits.detach(), index).gather(1, index).requires_grad_(True)
    with pytest.raises(_Rejected), _RejectOps():  # negative control: the guard sees one_hot
        F.one_hot(index, engine.spec.num_experts)
    with _RejectOps():
        state.router_logits = logits
        out = usaf_experts_forward(experts, x, index, weights)  # (T, H)
        (probe * out).sum().backward()
    assert logits.grad is not None and logits.grad.abs().max() > 0  # the dense pass ran
