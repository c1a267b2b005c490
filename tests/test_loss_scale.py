"""fp16 compute with dynamic loss scaling: the scaler's policy, and gradients that would underflow."""

from __future__ import annotations

import pytest
import torch

from usaf.engine.loss_scale import DynamicLossScaler


def test_overflow_backs_off_and_clean_steps_grow_the_scale():
    scaler = DynamicLossScaler(1024.0, growth_interval=3)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1024.0, -2048.0, 512.0])
    assert scaler.unscale_([p]) and torch.equal(p.grad, torch.tensor([1.0, -2.0, 0.5]))
    p.grad = torch.tensor([float("inf"), 0.0, 0.0])
    assert not scaler.unscale_([p])
    scaler.update(False)
    assert scaler.scale == 512.0 and scaler.overflows == 1
    for _ in range(3):
        scaler.update(True)
    assert scaler.scale == 1024.0 and scaler.clean_steps == 0
    restored = DynamicLossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_fp16_gradients_underflow_without_scaling_and_match_fp32_with_it(quantized):
    """A loss scaled down by 1e-6 has sparse-value gradients below fp16's smallest subnormal (6e-8):
    without loss scaling they flush to zero; scaled by 2^20 they agree with the fp32 gradients."""
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model

    qdir = quantized("qwen3_moe", num_layers=3)
    ids = torch.randint(1, 500, (2, 24), generator=torch.Generator().manual_seed(1))

    def grads(dtype: torch.dtype, scale: float) -> torch.Tensor:
        engine = SparseEngine(load_quantized_model(qdir, compute_dtype=dtype), trainable_layers=[2])
        numel = {n: w.shape[0] * w.shape[1] * w.shape[2] for n, w in engine.weights.items()}
        engine.set_deltas({n: torch.arange(0, k, 7) for n, k in numel.items()})
        (engine.loss(ids, ids).loss * 1e-6 * scale).backward()
        params = [d.values for d in engine.deltas().values()] + list(engine.routers.values())
        scaler = DynamicLossScaler(scale)
        assert scaler.unscale_(params)
        return torch.cat([p.grad.flatten() for p in params])

    reference = grads(torch.float32, 1.0)
    unscaled, scaled = grads(torch.float16, 1.0), grads(torch.float16, 2.0**20)
    assert reference.abs().max() > 0
    assert (unscaled != 0).float().mean() < 0.2  # flushed to zero
    cosine = torch.nn.functional.cosine_similarity(scaled, reference, dim=0)
    assert cosine > 0.99 and (scaled - reference).norm() < 0.05 * reference.norm(), float(cosine)


def test_a_router_master_stays_fp32_under_half_compute(quantized):
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model

    engine = SparseEngine(load_quantized_model(quantized("qwen3_moe", num_layers=3), compute_dtype=torch.bfloat16),
                          trainable_layers=[2])  # fmt: skip
    ((name, master),) = engine.routers.items()
    module = engine.model.get_submodule(name.rsplit(".", 1)[0])
    assert master.dtype == torch.float32 and module.weight.dtype == torch.bfloat16
    engine.loss(*(torch.randint(1, 500, (1, 8)),) * 2).loss.backward()
    assert master.grad is not None and master.grad.dtype == torch.float32


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
