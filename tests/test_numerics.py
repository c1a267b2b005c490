"""Numerical robustness: fp16 overflow in one expert stays with its own tokens, and a non-finite step changes nothing.

The original tool computed every expert on every token and multiplied by the routing weight: an expert
overflowing to inf in fp16 on a token *not* routed to it gave inf * 0 = NaN in that token's output. usaf
computes an expert only on the tokens routed to it and accumulates in fp32, so the overflow cannot spread.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from usaf.engine.experts import ExpertWeight, LayerExperts, usaf_experts_forward


@pytest.fixture
def fp16_layer(quantized):
    """The first MoE layer of a tiny fp16 model, with expert 0's weights blown up 10^4 times (a hot expert)."""
    from usaf.engine.loading import load_quantized_model

    loaded = load_quantized_model(quantized("qwen3_moe", num_layers=3), compute_dtype=torch.float16)
    layer = loaded.spec.moe_layers[0]
    module = loaded.model.get_submodule(loaded.spec.experts_prefix(layer))
    cool = module.usaf_experts

    def hot(weight: ExpertWeight) -> ExpertWeight:
        scale = weight.q.scale.clone()
        scale[0] *= 1e4
        return ExpertWeight(dataclasses.replace(weight.q, scale=scale), compute_dtype=torch.float16, device="cpu")

    module.usaf_experts = LayerExperts(layer, hot(cool.gate_up), hot(cool.down))
    hidden = (torch.randn(6, cool.gate_up.shape[2], generator=torch.Generator().manual_seed(0)) * 300).half()
    return module, cool, hidden


def _dense(module, state: LayerExperts, hidden, index, weights):
    """The original's way: every expert on every token, times its routing weight (0 when not routed)."""
    dense = torch.zeros(state.num_experts, hidden.shape[0], device=hidden.device, dtype=torch.float16)
    for k in range(index.shape[1]):
        dense[index[:, k], torch.arange(hidden.shape[0])] = weights[:, k].half()
    out = torch.zeros_like(hidden)
    for e in range(state.num_experts):
        y = state.down.linear(module._apply_gate(state.gate_up.linear(hidden, e, None)), e, None)
        out = out + y * dense[e, :, None]
    return out


def test_an_expert_overflowing_on_tokens_not_routed_to_it_cannot_poison_them(fp16_layer):
    module, cool, hidden = fp16_layer
    index = torch.tensor([[1, 2]] * hidden.shape[0])  # no token goes to the hot expert 0
    weights = torch.full((hidden.shape[0], 2), 0.5, dtype=torch.float16)
    with torch.no_grad():
        out = usaf_experts_forward(module, hidden, index, weights)
        dense = _dense(module, module.usaf_experts, hidden, index, weights)
        hot_alone = module.usaf_experts.gate_up.linear(hidden, 0, None)
    assert not torch.isfinite(hot_alone).all()  # the large inputs do overflow expert 0 in fp16
    assert torch.isnan(dense).any()  # negative control: inf * 0 = NaN, the original's failure
    assert torch.isfinite(out).all()
    module_cool = module.usaf_experts
    module.usaf_experts = cool  # expert 0 back to normal: the output does not change, it never ran
    with torch.no_grad():
        assert torch.equal(usaf_experts_forward(module, hidden, index, weights), out)
    module.usaf_experts = module_cool


def test_an_overflow_stays_with_the_tokens_routed_to_it(fp16_layer):
    module, _, hidden = fp16_layer
    index = torch.tensor([[1, 2]] * hidden.shape[0])
    index[0, 0] = 0  # token 0 only goes to the hot expert
    weights = torch.full((hidden.shape[0], 2), 0.5, dtype=torch.float16)
    with torch.no_grad():
        out = usaf_experts_forward(module, hidden, index, weights)
        clean = usaf_experts_forward(module, hidden[1:], index[1:], weights[1:])
    assert not torch.isfinite(out[0]).all()  # a real overflow is not hidden: the step will be skipped
    assert torch.equal(out[1:], clean)  # and no other token's output changed


@pytest.mark.parametrize(("dtype", "magnitude"), [(torch.float32, 3e38), (torch.float16, 1e19)])
def test_a_step_with_non_finite_values_never_reaches_the_weights(quantized, dtype, magnitude):
    """Embeddings at the edge of the compute dtype's range (3e38 in fp32; 1e19, beyond fp16's 65504) make the
    gradients non-finite: the optimizer skips the step and every delta, router and optimizer moment stays
    bit-identical. (Large but representable inputs, 1e4 to 1e30, are absorbed by the RMSNorms: finite steps.)"""
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model
    from usaf.engine.optim import SparseAdamW

    engine = SparseEngine(
        load_quantized_model(quantized("qwen3_moe", num_layers=3), compute_dtype=dtype),
        trainable_layers=[1, 2],
        train_router=True,
    )
    numel = {n: w.shape[0] * w.shape[1] * w.shape[2] for n, w in engine.weights.items()}
    engine.set_deltas({n: torch.arange(0, k, 5) for n, k in numel.items()})
    optimizer = SparseAdamW(engine.parameter_groups(lr=1e-2, router_lr=1e-3, weight_decay=0.0), max_grad_norm=1.0)
    ids = torch.randint(1, 500, (2, 16), generator=torch.Generator().manual_seed(2))

    def step() -> tuple[torch.Tensor, object]:
        loss = engine.loss(ids, ids).loss
        loss.backward()
        report = optimizer.step()
        optimizer.zero_grad()
        engine.model.zero_grad(set_to_none=True)
        return loss.detach(), report

    def snapshot() -> list[torch.Tensor]:
        state = optimizer.state_dict()
        tensors = [d.values.detach().clone() for d in engine.deltas().values()]
        tensors += [p.detach().clone() for p in engine.routers.values()]
        return tensors + [t.clone() for t in _tensors(state)]

    loss, report = step()
    assert torch.isfinite(loss) and report.applied  # a clean step moves the weights
    before = snapshot()
    embed = engine.model.get_input_embeddings()
    with torch.no_grad():
        embed.weight[ids.unique()] = magnitude
    loss, report = step()
    assert not (torch.isfinite(loss) and report.grad_norm == report.grad_norm)  # the step is non-finite (NaN norm)
    assert report.skipped_nonfinite and not report.applied
    after = snapshot()
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def _tensors(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
