"""sparse_delta_linear: equivalence with the dense ``x @ (W + D)^T + b`` and its autograd gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from usaf.engine.deltas import SparseDelta
from usaf.engine.sparse_linear import STRATEGIES, sparse_delta_linear

SHAPES = [  # (T, O, I, n)
    (5, 4, 3, 6),
    (17, 9, 13, 40),
    (33, 16, 8, 128),  # n = O * I: every weight has a delta
    (3, 40, 50, 30),  # few tokens: "auto" keeps the gathered forward
    (0, 6, 5, 7),  # no tokens
    (11, 6, 5, 0),  # no entries
    (0, 3, 4, 0),
]


def make_case(t, o, i, n, dtype=torch.float64, seed=0, bias=True):
    """Random x, weight, bias and a duplicate-free delta (sorted flat indices, as SparseDelta keeps them)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, i, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.randn(o, i, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn(o, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    flat = torch.randperm(o * i, generator=gen)[:n].sort().values
    rows, cols = flat // i, flat % i
    value_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    values = torch.randn(n, generator=gen, dtype=torch.float64).to(value_dtype)
    return x, weight, b, rows, cols, values


def dense_delta(o, i, rows, cols, values):
    d = torch.zeros(o, i, dtype=values.dtype)
    d[rows, cols] = values.detach()
    return d


def dense_reference(x, weight, b, rows, cols, values):
    """``(y, dx, dD, dW)`` by plain autograd on a dense delta, for the loss ``sum(y * probe)``."""
    o, i = weight.shape
    x = x.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    d = dense_delta(o, i, rows, cols, values).to(x.dtype).requires_grad_(True)
    y = x @ (w + d).t()
    if b is not None:
        y = y + b
    probe = torch.randn(y.shape, generator=torch.Generator().manual_seed(99), dtype=y.dtype)
    (y * probe).sum().backward()
    return y.detach(), x.grad, d.grad, w.grad, probe


def engine(x, weight, b, rows, cols, values, probe=None, **kwargs):
    """``(y, dx, dvalues)`` from sparse_delta_linear for the loss ``sum(y * probe)``."""
    x = x.detach().clone().requires_grad_(True)
    v = values.detach().clone().requires_grad_(True)
    y = sparse_delta_linear(x, weight, rows, cols, v, b, **kwargs)
    if probe is not None:
        (y * probe).sum().backward()
    return y.detach(), x.grad, v.grad


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_and_gradients_match_dense_fp64(shape, with_bias, strategy):
    x, weight, b, rows, cols, values = make_case(*shape, bias=with_bias)
    weight_before = weight.clone()
    y_ref, dx_ref, dd_ref, _, probe = dense_reference(x, weight, b, rows, cols, values)
    y, dx, dv = engine(x, weight, b, rows, cols, values, probe, strategy=strategy)
    assert torch.equal(weight, weight_before)  # the merge works on a copy
    assert y.shape == (shape[0], shape[1]) and y.dtype == torch.float64
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-12, atol=1e-12)
    assert dv.shape == values.shape and dv.dtype == values.dtype
    torch.testing.assert_close(dv, dd_ref[rows, cols], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shape", [(17, 9, 13, 40), (64, 32, 48, 300), (2, 32, 48, 10)])
def test_forward_and_gradients_match_dense_fp32(shape, strategy):
    x, weight, b, rows, cols, values = make_case(*shape, dtype=torch.float32)
    y_ref, dx_ref, dd_ref, _, probe = dense_reference(x, weight, b, rows, cols, values)
    y, dx, dv = engine(x, weight, b, rows, cols, values, probe, strategy=strategy)
    assert y.dtype == dx.dtype == dv.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dv, dd_ref[rows, cols], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gathered_at_shifted_indices_does_not_match(strategy):
    """Negative control: the equivalence test would catch an off-by-one in rows/cols."""
    t, o, i, n = 17, 9, 13, 40
    x, weight, b, rows, cols, values = make_case(t, o, i, n)
    _, _, dd_ref, _, probe = dense_reference(x, weight, b, rows, cols, values)
    _, _, dv = engine(x, weight, b, rows, cols, values, probe, strategy=strategy)
    assert not torch.allclose(dv, dd_ref[rows, (cols + 1) % i], rtol=1e-3, atol=1e-3)
    assert not torch.allclose(dv, dd_ref[(rows + 1) % o, cols], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradcheck_fp64(strategy):
    x, weight, b, rows, cols, values = make_case(6, 5, 7, 12)
    x.requires_grad_(True)
    values.requires_grad_(True)
    for chunk in (1, 4, 64):
        assert torch.autograd.gradcheck(
            lambda x_, v_, chunk=chunk: sparse_delta_linear(
                x_, weight, rows, cols, v_, b, chunk_tokens=chunk, strategy=strategy
            ),
            (x, values),
        )


@pytest.mark.parametrize("strategy", ["auto", "gather"])
def test_bf16_activations_and_weight(strategy):
    x, weight, b, rows, cols, values = make_case(24, 16, 32, 100, dtype=torch.bfloat16)
    y_ref, dx_ref, dd_ref, _, probe = dense_reference(
        x.double(), weight.double(), b.double(), rows, cols, values.double()
    )
    y, dx, dv = engine(x, weight, b, rows, cols, values, probe.to(torch.bfloat16), strategy=strategy)
    assert y.dtype == dx.dtype == torch.bfloat16
    assert dv.dtype == torch.float32  # values' dtype, accumulated in fp32
    scale = y_ref.abs().max()
    torch.testing.assert_close(y.double(), y_ref, rtol=2e-2, atol=2e-2 * scale)
    torch.testing.assert_close(dx.double(), dx_ref, rtol=2e-2, atol=2e-2 * dx_ref.abs().max())
    # dvalues sees bf16 inputs only (the probe is rounded once), so it is close to the fp64 answer.
    torch.testing.assert_close(dv.double(), dd_ref[rows, cols], rtol=2e-2, atol=2e-2 * dd_ref.abs().max())


def test_auto_never_merges_small_deltas_away_in_bf16():
    """A delta below a bf16 ulp of its weight still changes the output; a bf16 merge would erase it."""
    # y = 1 * (256 + 0.5) + 1 * (-256) = 0.5 exactly; 256.5 is not a bf16 number (the ulp at 256 is 2).
    weight = torch.tensor([[256.0, -256.0]], dtype=torch.bfloat16).expand(64, 2).contiguous()  # (O=64, I=2)
    rows, cols, values = torch.arange(64), torch.zeros(64, dtype=torch.int64), torch.full((64,), 0.5)
    for t in (1, 64):  # below and far above the "auto" merge threshold (T * n >= O * I / 2)
        x = torch.ones(t, 2, dtype=torch.bfloat16)
        assert bool((sparse_delta_linear(x, weight, rows, cols, values) == 0.5).all())
    x = torch.ones(64, 2, dtype=torch.bfloat16)
    merged = sparse_delta_linear(x, weight, rows, cols, values, strategy="merge")
    assert bool((merged == 0.0).all())  # documented: an explicit bf16 merge rounds W + D to bf16


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mixed_dtypes_compute_in_dtype_of_x(strategy):
    """fp32 x over a bf16 base: the weight is cast up, the output is fp32."""
    x, weight, b, rows, cols, values = make_case(9, 8, 10, 20, dtype=torch.float32)
    y, dx, dv = engine(
        x, weight.to(torch.bfloat16), b.to(torch.bfloat16), rows, cols, values, torch.ones(9, 8), strategy=strategy
    )
    assert y.dtype == dx.dtype == dv.dtype == torch.float32
    y_ref = x @ (weight.to(torch.bfloat16).float() + dense_delta(8, 10, rows, cols, values)).t() + b.bfloat16().float()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_autocast_does_not_change_the_compute_dtype(strategy):
    x, weight, b, rows, cols, values = make_case(9, 8, 10, 20, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_auto, dx_auto, dv_auto = engine(x, weight, b, rows, cols, values, torch.ones(9, 8), strategy=strategy)
    y, dx, dv = engine(x, weight, b, rows, cols, values, torch.ones(9, 8), strategy=strategy)
    assert y_auto.dtype == torch.float32
    assert torch.equal(y_auto, y) and torch.equal(dx_auto, dx) and torch.equal(dv_auto, dv)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("t", [1, 13, 40])
def test_chunking_does_not_change_results(t, strategy):
    x, weight, b, rows, cols, values = make_case(t, 12, 9, 50)
    probe = torch.randn(t, 12, dtype=torch.float64)
    results = [
        engine(x, weight, b, rows, cols, values, probe, chunk_tokens=c, strategy=strategy)
        for c in (1, 7, t, t + 5, 1024)
    ]
    y0, dx0, dv0 = results[0]
    for y, dx, dv in results[1:]:
        # Token rows are independent: y and dx are bitwise equal; dvalues sums over chunks in another order.
        assert torch.equal(y, y0) and torch.equal(dx, dx0)
        torch.testing.assert_close(dv, dv0, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_score_sink_receives_dense_weight_gradient(strategy):
    x, weight, b, rows, cols, values = make_case(21, 10, 14, 30)
    _, _, _, dw_ref, probe = dense_reference(x, weight, b, rows, cols, values)
    calls = []

    def sink(grad_w, w):
        calls.append((grad_w.clone(), w))

    _, _, dv_sink = engine(x, weight, b, rows, cols, values, probe, score_sink=sink, chunk_tokens=4, strategy=strategy)
    _, _, dv_plain = engine(x, weight, b, rows, cols, values, probe, chunk_tokens=4, strategy=strategy)
    assert len(calls) == 1
    grad_w, w_seen = calls[0]
    assert grad_w.shape == (10, 14) and grad_w.dtype == torch.float32
    torch.testing.assert_close(grad_w, dw_ref.float(), rtol=1e-5, atol=1e-5)
    assert w_seen.data_ptr() == weight.data_ptr() and w_seen.dtype == weight.dtype  # the original, not a copy
    assert torch.equal(dv_sink, dv_plain)  # the sink does not disturb the delta's gradient


def test_score_sink_not_called_without_tokens_and_works_with_no_entries():
    calls = []

    def sink(grad_w, w):
        calls.append(grad_w)

    x, weight, b, rows, cols, values = make_case(0, 5, 6, 4)
    engine(x, weight, b, rows, cols, values, torch.ones(0, 5), score_sink=sink)
    assert calls == []

    # n = 0 and x without grad (a frozen prefix): an empty SparseDelta slice still triggers backward.
    delta = SparseDelta((1, 5, 6), torch.zeros(0, dtype=torch.int64))
    r, c, v = delta.expert_entries(0)
    x, weight, b, *_ = make_case(8, 5, 6, 0, dtype=torch.float32)
    y = sparse_delta_linear(x, weight, r, c, v, b, score_sink=sink)
    y.sum().backward()
    assert len(calls) == 1
    torch.testing.assert_close(calls[0], torch.ones(8, 5).t() @ x)
    assert delta.values.grad is not None and delta.values.grad.shape == (0,)


class _AllocationRecorder(TorchDispatchMode):
    """Records ``(op, shape)`` of every strided tensor an op allocates while active (views are skipped)."""

    def __init__(self):
        super().__init__()
        self.allocations = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        strided = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        storages = {a.untyped_storage().data_ptr() for a in strided if a.layout == torch.strided}
        for leaf in torch.utils._pytree.tree_leaves(out):
            fresh = isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided
            if fresh and leaf.untyped_storage().data_ptr() not in storages:
                self.allocations.append((func.__name__.split(".")[0], tuple(leaf.shape)))
        return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_dense_gradient_without_sink(strategy):
    """No matmul yields an (O, I) tensor unless a sink asks for dW or "dense" reads dvalues from one; "gather"
    allocates no (O, I) at all."""
    t, o, i = 16, 7, 9
    x, weight, b, rows, cols, values = make_case(t, o, i, 20)
    probe = torch.ones(t, o, dtype=torch.float64)
    for sink, expected in ((None, 0), (lambda g, w: None, 1)):
        xg = x.clone().requires_grad_(True)
        v = values.clone().requires_grad_(True)
        with _AllocationRecorder() as recorder:
            y = sparse_delta_linear(xg, weight, rows, cols, v, b, score_sink=sink, chunk_tokens=5, strategy=strategy)
            (y * probe).sum().backward()
        dense = [op for op, shape in recorder.allocations if shape == (o, i)]
        products = [op for op in dense if op in ("mm", "addmm", "bmm", "matmul")]
        if strategy == "dense":  # dy^T x for dvalues (fp64 here, the sink's is fp32); D, in forward and for dx
            formed = [op for op, shape in recorder.allocations if shape == (o * i,)]  # D, made flat
            assert len(products) == 1 + expected and len(dense) == len(products), recorder.allocations
            assert formed == ["zeros", "zeros"], recorder.allocations
            continue
        assert len(products) == expected, recorder.allocations
        if strategy == "gather":
            assert len(dense) == expected, recorder.allocations
        else:  # the merged W + D, once in forward and once for dx
            assert len(dense) - len(products) == 2, recorder.allocations


def test_unsorted_entries():
    """Entries in any order (not row-major) give the same per-entry gradients, every strategy."""
    x, weight, b, rows, cols, values = make_case(12, 9, 11, 45)
    perm = torch.randperm(45, generator=torch.Generator().manual_seed(3))
    _, dx_ref, dd_ref, _, probe = dense_reference(x, weight, b, rows, cols, values)
    for strategy in STRATEGIES:
        _, dx, dv = engine(x, weight, b, rows[perm], cols[perm], values[perm], probe, strategy=strategy)
        torch.testing.assert_close(dx, dx_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dv, dd_ref[rows[perm], cols[perm]], rtol=1e-12, atol=1e-12)


def test_auto_strategy_choice(monkeypatch):
    """ "auto": dense where the backend declares dense_delta_terms (CUDA); elsewhere merge only in fp32/fp64 and
    only when the sparse terms outweigh an (O, I) merge; gather wherever the device lacks index ops, whatever was
    asked."""
    import dataclasses

    from usaf.backends import cpu
    from usaf.engine import sparse_linear
    from usaf.engine.sparse_linear import _MERGE_SHARE, _resolve

    weight = torch.zeros(32, 64)
    n = 64
    t_min = math.ceil(_MERGE_SHARE * weight.numel() / n)  # smallest T that merges
    for dtype, t, expected in [
        (torch.float32, t_min, "merge"),
        (torch.float32, t_min - 1, "gather"),
        (torch.float64, t_min, "merge"),
        (torch.bfloat16, 100 * t_min, "gather"),
        (torch.float16, 100 * t_min, "gather"),
    ]:
        assert _resolve("auto", torch.zeros(t, 64, dtype=dtype), weight, n, True) == expected
    assert _resolve("merge", torch.zeros(1, 64, dtype=torch.bfloat16), weight, 1, True) == "merge"
    assert _resolve("gather", torch.zeros(1000, 64), weight, 2048, True) == "gather"
    # a device whose backend declares dense_delta_terms, simulated on the CPU
    dense_caps = dataclasses.replace(cpu.capabilities(), dense_delta_terms=True)
    monkeypatch.setattr(sparse_linear, "device_capabilities", lambda device: dense_caps)
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    assert _resolve("auto", x, weight, 1, True) == "dense"
    assert _resolve("gather", x, weight, 1, True) == "gather"  # an explicit choice stands
    for strategy in STRATEGIES:  # DirectML: no index_put_ to form W + D or D
        assert _resolve(strategy, x, weight, 1, False) == "gather"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weight_and_bias_get_no_gradient(strategy):
    x, weight, b, rows, cols, values = make_case(5, 4, 3, 6)
    weight.requires_grad_(True)
    b.requires_grad_(True)
    v = values.clone().requires_grad_(True)
    sparse_delta_linear(x, weight, rows, cols, v, b, strategy=strategy).sum().backward()
    assert weight.grad is None and b.grad is None and v.grad is not None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_expert_slices_accumulate_into_one_parameter(strategy):
    """Two experts' slices of a SparseDelta in one graph: values.grad is the dense gradient at the indices."""
    e, o, i, t = 3, 6, 8, 10
    gen = torch.Generator().manual_seed(5)
    flat = torch.randperm(e * o * i, generator=gen)[:60].sort().values
    delta = SparseDelta((e, o, i), flat, torch.randn(60, generator=gen)).double()
    weights = torch.randn(e, o, i, generator=gen, dtype=torch.float64)
    xs = [torch.randn(t + k, i, generator=gen, dtype=torch.float64) for k in range(e)]
    used = (0, 2)  # expert 1 gets no tokens: its entries must get zero gradient

    loss = 0
    for k in used:
        r, c, v = delta.expert_entries(k)
        loss = loss + (sparse_delta_linear(xs[k], weights[k], r, c, v, strategy=strategy) ** 2).sum()
    loss.backward()

    dense = delta.dense().requires_grad_(True)  # (E, O, I)
    ref = sum(((xs[k] @ (weights[k] + dense[k]).t()) ** 2).sum() for k in used)
    ref.backward()
    torch.testing.assert_close(delta.values.grad, dense.grad.view(-1)[delta.indices], rtol=1e-12, atol=1e-12)
    start, end = delta.segment(1)
    assert end > start and torch.count_nonzero(delta.values.grad[start:end]) == 0


def test_rejects_bad_shapes():
    x, weight, b, rows, cols, values = make_case(4, 5, 6, 3)
    with pytest.raises(ValueError):
        sparse_delta_linear(x[:, :5], weight, rows, cols, values)
    with pytest.raises(ValueError):
        sparse_delta_linear(x, weight, rows[:2], cols, values)
    with pytest.raises(ValueError):
        sparse_delta_linear(x, weight, rows, cols, values, b[:4])
    with pytest.raises(ValueError):
        sparse_delta_linear(x, weight, rows, cols, values, chunk_tokens=0)
    with pytest.raises(ValueError):
        sparse_delta_linear(x, weight, rows, cols, values, strategy="sparse")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_the_gpus_dense_path_through_the_engine_equals_the_cpus(family, quantized, monkeypatch):
    """ "auto" picks "dense" on a GPU only: forced here on the CPU through a whole engine (every target the family
    has, routers, float32), its loss and sparse gradients equal the CPU's own path's; negative control: gradients
    at shifted positions differ."""
    from helpers_engine import FAMILY_LAYERS, batch, every_target, loss_and_grads, random_selection
    from usaf.engine import sparse_linear
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model

    loaded = load_quantized_model(quantized(family, num_layers=FAMILY_LAYERS))
    engine = SparseEngine(loaded, trainable_layers=[loaded.spec.moe_layers[-1]], targets=every_target(loaded.spec))
    engine.set_deltas(random_selection(engine))
    ids, labels = batch()
    runs = {}
    real = sparse_linear._resolve
    forced = []  # the dense path ran (the comparison is not of the CPU's path with itself)
    for name, resolve in (("cpu", real), ("dense", lambda *a: forced.append(a) or "dense")):
        monkeypatch.setattr(sparse_linear, "_resolve", resolve)
        loss, grads = loss_and_grads(engine, ids, labels)
        runs[name] = float(loss), grads
    assert forced
    assert runs["dense"][0] == pytest.approx(runs["cpu"][0], rel=1e-6)
    for name, reference in runs["cpu"][1].items():
        assert reference.abs().gt(0).any(), name
        torch.testing.assert_close(runs["dense"][1][name], reference, rtol=1e-4, atol=1e-7, msg=name)
        if reference.numel() > 1:
            assert not torch.allclose(runs["dense"][1][name], reference.roll(1), rtol=1e-4, atol=1e-7), name
