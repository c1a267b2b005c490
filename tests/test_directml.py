"""The DirectML backend's capability logic, with a stand-in torch_directml (no DirectML device exists here).

What is checked: the flags and dtype policy a DirectML device gets, that code paths follow the flags
(index-free experts forward, host-side resident bases over the allocation limit, two-call ``.to``), and
that the index-free forward really avoids the ops DirectML rejects (they are made to raise) while
computing the same thing as the default forward. Running on a DirectML GPU is not tested anywhere.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from conftest import TRANSFORMERS_V5
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


def test_resident_bases_over_the_allocation_limit_stay_on_the_host():
    from usaf.engine.engine import resident_placement

    caps = dataclass_replace(device_capabilities("cpu"), max_allocation_bytes=800 * 2**20, pinned_memory=False)
    memory = types.SimpleNamespace(device_free=64 * 2**30)
    backend = types.SimpleNamespace(device=torch.device("cuda"), capabilities=caps, memory=lambda: memory)
    assert resident_placement(backend, 700 * 2**20) == (torch.device("cuda"), False)
    assert resident_placement(backend, 900 * 2**20) == (torch.device("cpu"), False)  # one base > limit
    assert resident_placement(backend, 900 * 2**20, largest=400 * 2**20) == (torch.device("cuda"), False)
    no_limit = dataclass_replace(caps, max_allocation_bytes=None)
    unlimited = types.SimpleNamespace(device=backend.device, capabilities=no_limit, memory=backend.memory)
    assert resident_placement(unlimited, 900 * 2**20) == (torch.device("cuda"), False)


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


def _forbid_index_ops(monkeypatch):
    """Make every op DirectML rejects raise, as torch-directml does ("partially modified dimensions")."""

    def boom(*args, **kwargs):
        raise _Forbidden("op DirectML rejects")

    for name in ("index_add_", "index_add", "scatter_", "scatter", "scatter_add_", "scatter_add", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    for name in ("nonzero", "index_add", "scatter", "scatter_add"):
        monkeypatch.setattr(torch, name, boom)
    monkeypatch.setattr(torch.nn.functional, "one_hot", boom)
    real_where = torch.where
    monkeypatch.setattr(torch, "where", lambda *a, **k: boom() if len(a) == 1 else real_where(*a, **k))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_index_free_forward_equals_the_default_and_avoids_rejected_ops(family, quantized, monkeypatch):
    if family == "gpt_oss" and not TRANSFORMERS_V5:
        pytest.skip("transformers 4.x's gpt-oss router itself uses scatter_: gpt-oss is not supported on DirectML")
    from usaf.engine.loading import load_quantized_model

    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    loaded = load_quantized_model(quantized(family))
    with torch.no_grad():
        reference = loaded.model(input_ids=ids).logits
    for state in loaded.experts.values():
        state.index_ops = False
    # negative control: with the flag on, the default forward hits a forbidden op
    loaded.experts[loaded.spec.moe_layers[0]].index_ops = True
    with monkeypatch.context() as m:
        _forbid_index_ops(m)
        with pytest.raises(_Forbidden), torch.no_grad():
            loaded.model(input_ids=ids)
    loaded.experts[loaded.spec.moe_layers[0]].index_ops = False
    with monkeypatch.context() as m:
        _forbid_index_ops(m)
        with torch.no_grad():
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
            state.index_ops = index_ops
        router.weight.grad = None
        loaded.model(input_ids=ids).logits.square().mean().backward()
        grads.append(router.weight.grad.clone())
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-7)


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
    assert any("index_add_" in line for line in conf["cannot"])
    assert any("single tensor above 800 MiB" in line for line in conf["cannot"])
    cpu = configuration_report(resolve_backend("cpu").capabilities)  # negative control: no DirectML limits
    assert not any("index_add_" in line or "single tensor" in line for line in cpu["cannot"])
