"""The DirectML backend's capability logic, with a stand-in torch_directml (no DirectML device exists here).

What is checked: the flags and dtype policy a DirectML device gets, that code paths follow the flags
(index-free experts forward, resident bases in expert chunks under the allocation limit, two-call ``.to``), and
that the index-free forward really avoids the ops DirectML rejects (they are made to raise) while
computing the same thing as the default forward. Running on a DirectML GPU is not tested anywhere.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import FAMILIES, TRANSFORMERS_V5
from helpers import LargestAllocation
from usaf.backends import directml, resolve_backend
from usaf.backends.testing import hide_accelerators, simulate_directml
from usaf.backends.transfer import clear_cache, device_capabilities, move


@pytest.fixture
def dml(monkeypatch):
    hide_accelerators(monkeypatch)
    simulate_directml(monkeypatch)
    clear_cache()
    yield
    clear_cache()


def test_directml_flags_and_dtype_policy(dml):
    backend = resolve_backend("directml")
    caps, policy = backend.capabilities, backend.policy
    assert not caps.bf16 and caps.fp16 and not caps.autocast
    assert (policy.compute, policy.master, policy.autocast, policy.loss_scaling) == (
        torch.float16,
        torch.float32,
        None,
        True,
    )
    assert not caps.index_ops and not caps.to_device_and_dtype and not caps.direct_load
    assert caps.max_allocation_bytes == directml.MAX_ALLOCATION_BYTES
    assert not caps.grouped_mm and not caps.torch_compile
    # amp off: fp32 everywhere, no loss scaling
    off = resolve_backend("directml", amp=False).policy
    assert (off.compute, off.loss_scaling) == (torch.float32, False)


def test_device_capabilities_follow_the_device(dml):
    assert device_capabilities(torch.device("privateuseone", 0)) == directml.capabilities(
        sys.modules["torch_directml"], 0
    )
    cpu = device_capabilities("cpu")
    assert cpu.index_ops and cpu.to_device_and_dtype and cpu.max_allocation_bytes is None


def test_move_splits_device_and_dtype_where_the_flag_says(monkeypatch):
    calls = []

    class Spy(torch.Tensor):
        pass

    def spy_to(self, *args, **kwargs):
        calls.append((args, kwargs))
        return torch.Tensor.to(self.as_subclass(torch.Tensor), *args, **kwargs).as_subclass(Spy)

    monkeypatch.setattr(Spy, "to", spy_to)
    x = torch.ones(3).as_subclass(Spy)
    out = move(x, "cpu", torch.float16)
    assert out.dtype == torch.float16 and len(calls) == 1  # CPU: one joint call
    clear_cache()
    from usaf.backends import transfer

    split = dataclass_replace(device_capabilities("cpu"), to_device_and_dtype=False)
    monkeypatch.setattr(transfer, "device_capabilities", lambda device: split)
    calls.clear()
    out = move(x, "cpu", torch.float16)
    assert out.dtype == torch.float16 and len(calls) == 2  # cast, then transfer
    assert calls[0] == ((), {"dtype": torch.float16})
    clear_cache()


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_check_allocation_names_the_tensor(monkeypatch):
    from usaf.backends import transfer
    from usaf.errors import UsafError

    limited = dataclass_replace(device_capabilities("cpu"), max_allocation_bytes=1000)
    monkeypatch.setattr(transfer, "device_capabilities", lambda device: limited)
    transfer.check_allocation(1000, "cpu", "x")
    with pytest.raises(UsafError, match="embed_tokens.*per-allocation limit"):
        transfer.check_allocation(1001, "cpu", "model.embed_tokens.weight")


# -- the index-free experts forward ------------------------------------------------------------------------


class _Forbidden(RuntimeError):
    pass


# aten ops torch-directml rejects ("partially modified dimensions"), by their overload packet name
_REJECTED = ("nonzero", "index_add", "scatter", "scatter_add", "scatter_reduce", "index_put", "_unsafe_index_put")
_REJECTED += ("one_hot", "masked_scatter", "index_copy")


class _RejectedOps(TorchDispatchMode):
    """Raise on every rejected aten op, whoever calls it (Python, C++, autograd's backward)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1].rstrip("_")
        if name in _REJECTED or name.lstrip("_") in _REJECTED:
            raise _Forbidden(f"{func} (DirectML rejects it)")
        return func(*args, **(kwargs or {}))


def forbid_rejected_ops():
    return _RejectedOps()


def _skip_v5_router_scatter(family: str) -> None:
    if family == "deepseek_v3" and TRANSFORMERS_V5:
        pytest.skip(
            "transformers >= 5 routes DeepSeek-V3 with its own code (group mask by scatter_); the DirectML "
            "configuration runs transformers 4.x, where usaf's block forward routes without scatter"
        )


def test_the_op_guard_catches_what_it_should():
    with pytest.raises(_Forbidden), forbid_rejected_ops():
        torch.zeros(3).index_add_(0, torch.tensor([0]), torch.ones(1))
    with pytest.raises(_Forbidden), forbid_rejected_ops():
        torch.nn.functional.one_hot(torch.tensor([1]), 3)
    with pytest.raises(_Forbidden), forbid_rejected_ops():
        torch.tensor([0, 1]).nonzero()
    x = torch.zeros(4)
    with pytest.raises(_Forbidden), forbid_rejected_ops():
        x[torch.tensor([1])] = 1.0  # index_put through __setitem__
    with forbid_rejected_ops():
        torch.ones(4).index_select(0, torch.tensor([2, 0])).sum()  # gathers are allowed


@pytest.mark.parametrize("family", FAMILIES)
def test_index_free_forward_equals_the_default_and_avoids_rejected_ops(family, quantized):
    _skip_v5_router_scatter(family)
    from usaf.engine.loading import load_quantized_model

    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    loaded = load_quantized_model(quantized(family))
    with torch.no_grad():
        reference = loaded.model(input_ids=ids).logits
    for state in loaded.experts.values():
        state.set_index_ops(False)
    # negative control: with the flag on, the default forward hits a forbidden op
    loaded.experts[loaded.spec.moe_layers[0]].set_index_ops(True)
    with pytest.raises(_Forbidden), torch.no_grad(), forbid_rejected_ops():
        loaded.model(input_ids=ids)
    loaded.experts[loaded.spec.moe_layers[0]].set_index_ops(False)
    with torch.no_grad(), forbid_rejected_ops():
        ours = loaded.model(input_ids=ids).logits
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)


def test_index_free_forward_gradients_equal_the_default(quantized):
    """Training through the index-free path: the router and hidden-state gradients match the default path."""
    from usaf.engine.loading import load_quantized_model

    loaded = load_quantized_model(quantized("mixtral"))
    layer = loaded.spec.moe_layers[-1]
    router = loaded.model.get_submodule(loaded.spec.router_prefix(layer))
    router.weight.requires_grad_(True)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(4))
    grads = []
    for index_ops in (True, False):
        for state in loaded.experts.values():
            state.set_index_ops(index_ops)
        router.weight.grad = None
        loaded.model(input_ids=ids).logits.square().mean().backward()
        grads.append(router.weight.grad.clone())
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_index_free_sparse_delta_kernel_equals_the_default(dtype):
    from usaf.engine.sparse_linear import sparse_delta_linear

    g = torch.Generator().manual_seed(0)
    t, o, i, n = 37, 24, 32, 90
    weight = torch.randn(o, i, generator=g).to(dtype)
    flat = torch.randperm(o * i, generator=g)[:n].sort().values
    rows, cols = flat // i, flat % i  # several entries per row and per column
    x0 = torch.randn(t, i, generator=g).to(dtype)
    v0 = torch.randn(n, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    dy = torch.randn(t, o, generator=g).to(dtype)
    results = []
    for index_ops in (True, False):
        x, v = x0.clone().requires_grad_(), v0.clone().requires_grad_()
        with forbid_rejected_ops() if not index_ops else contextlib.nullcontext():
            y = sparse_delta_linear(x, weight, rows, cols, v, chunk_tokens=5, strategy="gather", index_ops=index_ops)
            y.backward(dy)
        results.append((y.detach(), x.grad, v.grad))
    tol = {"rtol": 2e-3, "atol": 2e-3} if dtype == torch.float16 else {"rtol": 1e-5, "atol": 1e-6}
    for ours, default in zip(results[1], results[0]):
        torch.testing.assert_close(ours, default, **tol)
    if dtype == torch.float64:  # and exact in the gradcheck sense
        x, v = x0.clone().requires_grad_(), v0.clone().requires_grad_()
        fn = lambda x_, v_: sparse_delta_linear(x_, weight, rows, cols, v_, chunk_tokens=4, index_ops=False)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (x, v))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_step_avoids_the_ops_directml_rejects(family, quantized):
    """Forward, backward (deltas and, on transformers 4.x, routers) and an optimizer step with index_ops=False,
    with every op DirectML rejects made to raise at the aten level."""
    _skip_v5_router_scatter(family)
    from helpers_engine import every_target, train_step
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model
    from usaf.engine.optim import SparseAdamW

    loaded = load_quantized_model(quantized(family))
    for state in loaded.experts.values():
        state.set_index_ops(False)
    # On transformers >= 5 the router is transformers' own code, and topk's backward is a scatter; the
    # DirectML configuration runs transformers 4.x, where usaf's block forward selects without one.
    # 4.x also trains the linear targets: their backward reaches the MoE block's input, whose routing (topk)
    # has a scatter backward in transformers >= 5's own router code, as above
    targets = ("experts",) if TRANSFORMERS_V5 else every_target(loaded.spec)
    if family == "gpt_oss" and not TRANSFORMERS_V5:  # refused (its eager attention's max has a scatter backward)
        with pytest.raises(ValueError, match="drop attention from --targets"):
            SparseEngine(loaded, trainable_layers=[loaded.spec.moe_layers[-1]], targets=targets)
        targets = ("experts",)
    engine = SparseEngine(
        loaded, trainable_layers=[loaded.spec.moe_layers[-1]], targets=targets, train_router=not TRANSFORMERS_V5
    )
    linear = [w for w in engine.weights.values() if w.shape[0] == 1]
    assert len(targets) == 1 or (linear and not any(w.index_ops for w in linear))
    g = torch.Generator().manual_seed(0)
    engine.set_deltas(
        {
            name: torch.randperm(w.shape[0] * w.shape[1] * w.shape[2], generator=g)[:200].sort().values
            for name, w in engine.weights.items()
        }
    )
    optimizer = SparseAdamW(engine.parameter_groups(lr=0.05, router_lr=1e-2, weight_decay=0.0), max_grad_norm=1.0)
    ids = torch.randint(1, 512, (2, 16), generator=g)
    with forbid_rejected_ops():
        losses = [train_step(engine, optimizer, ids, ids.clone()) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in engine.routers.values())
    for target in linear[:1]:
        before = target.module.weight.detach().clone().reshape(-1)
        # a reselection's fold into a linear target's weight: the record's arithmetic runs on the host (which the op
        # guard cannot tell from the device here), the weight is rewritten by a whole copy
        target.fold(torch.tensor([0, 5]), torch.tensor([0.5, -0.5]))
        after = target.module.weight.detach().reshape(-1)[[0, 5]]
        assert torch.equal(after, before[[0, 5]] + torch.tensor([0.5, -0.5]))
    # negative control: the same step with the device's index ops on hits a rejected op
    for state in loaded.experts.values():
        state.set_index_ops(True)
    with pytest.raises(_Forbidden), forbid_rejected_ops():
        engine.loss(ids, ids.clone()).loss.backward()


# -- imports ----------------------------------------------------------------------------------------------


def test_importing_usaf_never_imports_torch_directml():
    code = (
        "import sys, usaf, usaf.cli.app, usaf.engine.engine, usaf.engine.loading, usaf.backends; "
        "usaf.backends.probe('cpu'); print('torch_directml' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_broken_torch_directml_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_directml", None)  # import fails: "not installed"
    assert directml.load() == (None, "torch-directml is not installed")
    monkeypatch.delitem(sys.modules, "torch_directml")
    import builtins

    real_import = builtins.__import__

    def importer(name, *args, **kwargs):
        if name == "torch_directml":
            raise OSError("DLL load failed while importing torch_directml_native")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", importer)
    module, why = directml.load()
    assert module is None and "failed to import" in why and "DLL load failed" in why
    probe = directml.probe()
    assert not probe.available and "DLL load failed" in probe.reason


def test_doctor_reports_the_configuration_and_the_directml_limits(dml):
    from usaf.cli.doctor import configuration_report
    from usaf.families.modules import transformers_major

    conf = configuration_report(resolve_backend("directml").capabilities)
    assert conf["transformers_major"] == transformers_major()
    assert ("per-expert" in conf["layout"]) == (transformers_major() < 5)
    assert any("index_add_" in line for line in conf["can"]) and not any("vmap" in line for line in conf["cannot"])
    assert any("a chunk of positions at a time" in line for line in conf["can"])
    assert any("single tensor above 800 MiB" in line for line in conf["cannot"])
    assert any("stored in chunks of whole experts" in line for line in conf["can"])
    cpu = configuration_report(resolve_backend("cpu").capabilities)  # negative control: no DirectML limits
    assert not any(w in line for w in ("scatter", "chunk", "single tensor") for line in cpu["cannot"] + cpu["can"])


def _limit_allocations(monkeypatch, max_bytes: int | None) -> None:
    """Every device (here: the CPU) declares ``max_allocation_bytes=max_bytes``."""
    from usaf.backends import transfer

    caps = dataclass_replace(transfer.device_capabilities("cpu"), max_allocation_bytes=max_bytes)
    monkeypatch.setattr(transfer, "_capabilities", lambda kind, index: caps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_resident_base_chunks_equal_the_whole_base(quantized, dtype):
    from usaf.engine.loading import load_quantized_model
    from usaf.engine.resident import ResidentBase
    from usaf.quant import dequantize

    q = load_quantized_model(quantized("qwen3_moe")).experts[1].gate_up.q
    e, o, i = q.shape
    whole = dequantize(q, dtype=dtype, memory_layout=False)  # (E, O, I)
    limit = o * i * 4 + 1  # one expert's fp32 transient; the stored chunks hold 1 (fp32) or 2 (fp16) experts
    guard = LargestAllocation()
    with guard:
        chunked = ResidentBase.dequantized(q, dtype=dtype, device=torch.device("cpu"), max_bytes=limit)
    per_chunk = 4 // whole.element_size()
    assert chunked.per_chunk == per_chunk and len(chunked.chunks) == -(-e // per_chunk) > 1
    assert all(c.numel() * c.element_size() <= limit for c in chunked.chunks)
    assert guard.largest <= limit  # no transient above the limit either
    assert torch.equal(chunked.dense(), whole) and chunked.nbytes == whole.numel() * whole.element_size()
    assert all(torch.equal(chunked.expert(x), whole[x]) for x in range(e))
    chunked.expert(e - 1).fill_(7)  # the expert view writes the stored base
    assert (chunked.chunks[-1][-1] == 7).all()
    with LargestAllocation() as unlimited:  # negative control: without a limit the base is one tensor
        ResidentBase.dequantized(q, dtype=dtype, device=torch.device("cpu"))
    assert unlimited.largest > limit


def test_a_resident_base_above_the_allocation_limit_trains_in_chunks(quantized, monkeypatch):
    """A limit below the whole base (Qwen3-30B-A3B's 805 MB gate_up on DirectML): the engine stores it in expert
    chunks, allocates nothing above the limit while building it, and trains exactly as with one tensor."""
    from helpers_engine import batch, random_selection
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model

    ids, labels = batch()
    runs = []
    for limited in (False, True):
        loaded = load_quantized_model(quantized("qwen3_moe"))
        top = loaded.spec.moe_layers[-1]
        e, o, i = loaded.experts[top].gate_up.shape
        limit = 2 * o * i * 4  # two experts of gate_up (fp32 on CPU): the base is E/2 chunks
        guard = LargestAllocation()
        with monkeypatch.context() as m:  # the limit while the bases are built (the loss's chunks would follow it too)
            if limited:
                _limit_allocations(m, limit)
            with guard:
                engine = SparseEngine(loaded, trainable_layers=[top])
        engine.set_deltas(random_selection(engine, frac=0.05))
        parts = engine.loss(ids, labels)
        parts.loss.backward()
        grads = {n: d.values.grad.clone() for n, d in engine.deltas().items()}
        for weight in engine.weights.values():  # a reselection's fold: the record written into the base
            delta = weight.delta
            weight.fold(delta.indices[::3], delta.values.detach()[::3] + 0.25)
        with torch.no_grad():
            after = engine.loss(ids, labels).loss.item()
        chunks = {n: len(w.resident.chunks) for n, w in engine.weights.items()}
        bases = {n: w.resident.dense().clone() for n, w in engine.weights.items()}
        runs.append((guard.largest, chunks, parts.loss.item(), grads, after, bases))
        if limited:
            assert chunks[loaded.spec.gate_up_name(top)] == e // 2
            assert guard.largest <= limit
        else:  # negative control: one tensor per base, larger than the limit
            assert set(chunks.values()) == {1} and guard.largest > limit
    (_, _, loss_a, grads_a, after_a, bases_a), (_, _, loss_b, grads_b, after_b, bases_b) = runs
    assert loss_b == loss_a and after_b == after_a and after_a != loss_a
    for name in grads_a:
        assert torch.equal(grads_b[name], grads_a[name]), name
        assert torch.equal(bases_b[name], bases_a[name]), name


def test_one_expert_above_the_allocation_limit_is_refused_by_name(quantized, monkeypatch):
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model
    from usaf.errors import UsafError

    loaded = load_quantized_model(quantized("qwen3_moe"))
    top = loaded.spec.moe_layers[-1]
    _, o, i = loaded.experts[top].gate_up.shape
    _limit_allocations(monkeypatch, o * i * 4 - 1)  # one expert's fp32 slice does not fit
    with pytest.raises(UsafError, match=rf"one expert of the resident base of {loaded.spec.gate_up_name(top)}"):
        SparseEngine(loaded, trainable_layers=[top])
    _limit_allocations(monkeypatch, o * i * 4)  # negative control: exactly one expert fits
    engine = SparseEngine(loaded, trainable_layers=[top])
    assert len(engine.weights[loaded.spec.gate_up_name(top)].resident.chunks) == loaded.experts[top].num_experts


def _assert_resident_holds_the_record(weight) -> None:
    from usaf.quant import dequantize

    base = dequantize(weight.q, dtype=torch.float32, memory_layout=False).view(-1)  # (E*O*I,)
    idx = weight.frozen_indices
    assert idx.numel() > 0
    expected = (base[idx] + weight.frozen_values).to(weight.resident.dtype)
    assert torch.equal(weight.resident.dense().view(-1)[idx], expected)
    untouched = torch.ones_like(base, dtype=torch.bool)
    untouched[idx] = False
    assert torch.equal(weight.resident.dense().view(-1)[untouched], base[untouched].to(weight.resident.dtype))


@pytest.mark.parametrize("exact", [True, False])
def test_reselection_without_index_ops_equals_the_default(quantized, monkeypatch, exact):
    """Score accumulation, reselection (fold, reindex, Adam state surgery) on host copies give the same run."""
    from helpers_engine import batch, make_engine, random_selection, train_step
    from usaf.engine import optim, scores
    from usaf.engine.optim import SparseAdamW
    from usaf.engine.reselect import collect_scores, cumulative_delta, reselect

    runs = []
    for index_ops in (True, False):
        with monkeypatch.context() as m:
            if not index_ops:  # the device lacks index ops: what optimizer and accumulators look up
                caps = dataclass_replace(device_capabilities("cpu"), index_ops=False)
                m.setattr(optim, "device_capabilities", lambda device, caps=caps: caps)
                m.setattr(scores, "device_capabilities", lambda device, caps=caps: caps)
            engine = make_engine(quantized, "qwen3_moe")
            for state in engine.loaded.experts.values():
                state.set_index_ops(index_ops)
            engine.set_deltas(random_selection(engine, frac=0.05))
            optimizer = SparseAdamW(engine.parameter_groups(lr=0.05, router_lr=1e-2, weight_decay=0.0))
            ids, labels = batch(4)
            with collect_scores(engine, exact=exact) as collected:
                for _ in range(3):
                    train_step(engine, optimizer, ids, labels)
                    collected.end_batch()
            report = reselect(engine, optimizer, collected, 0.3)
            for weight in engine.weights.values():  # the frozen record is written into the resident base
                _assert_resident_holds_the_record(weight)
            after = train_step(engine, optimizer, ids, labels)
            state = {
                name: (
                    *cumulative_delta(weight),
                    weight.delta.indices.clone(),
                    weight.resident.dense().clone(),
                    *optimizer.state_for(weight.delta.values).values(),
                )
                for name, weight in engine.weights.items()
            }
            runs.append((report, after, state))
    (report_a, after_a, state_a), (report_b, after_b, state_b) = runs
    assert report_a == report_b and report_a.tensors and sum(r.grown for r in report_a.tensors.values()) > 0
    assert after_b == pytest.approx(after_a, rel=1e-5)
    for name in state_a:
        for a, b in zip(state_a[name], state_b[name]):
            assert a.device == b.device == torch.device("cpu")
            if a.dtype.is_floating_point:
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
            else:
                assert torch.equal(a, b), name
