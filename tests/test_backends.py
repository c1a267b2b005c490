"""usaf.backends: spec parsing, resolution, capabilities, dtype policy, legacy variables, memory.

Accelerators are simulated with monkeypatching (usaf.backends.testing); every test except the
``cuda``-marked one first hides any real accelerator, so results do not depend on the machine.
"""

from __future__ import annotations

import pytest
import torch

from usaf.backends import (
    AUTO_ORDER,
    Backend,
    Capabilities,
    DeviceSpec,
    dtype_policy,
    explain_env,
    parse_device_spec,
    probe_backends,
    resolve_backend,
)
from usaf.backends import directml as directml_module
from usaf.backends.testing import hide_accelerators, simulate_cuda, simulate_directml, simulate_mps
from usaf.errors import UsafError


@pytest.fixture(autouse=True)
def _cpu_only(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("cuda") is None:
        hide_accelerators(monkeypatch)


# --- parsing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("auto", DeviceSpec("auto")),
        ("cpu", DeviceSpec("cpu")),
        ("cuda", DeviceSpec("cuda")),
        ("cuda:0", DeviceSpec("cuda", 0)),
        ("cuda:3", DeviceSpec("cuda", 3)),
        ("mps", DeviceSpec("mps")),
        ("directml", DeviceSpec("directml")),
        ("directml:1", DeviceSpec("directml", 1)),
        ("  CUDA:1 ", DeviceSpec("cuda", 1)),
    ],
)
def test_parse_every_spec_form(text: str, expected: DeviceSpec) -> None:
    assert parse_device_spec(text) == expected
    assert str(parse_device_spec(text)) == str(expected)


@pytest.mark.parametrize(
    ("text", "why", "hint"),
    [
        ("gpu", "unknown device 'gpu'", "--device cuda"),
        ("rocm", "unknown device 'rocm'", "--device cuda"),
        ("dml", "unknown device 'dml'", "--device directml"),
        ("tpu", "unknown device 'tpu'", "cuda:N"),
        ("cpu:0", "'cpu' takes no index", "--device cpu"),
        ("mps:1", "'mps' takes no index", "--device mps"),
        ("auto:0", "'auto' takes no index", "--device auto"),
        ("cuda:", "not a non-negative integer", "cuda:N"),
        ("cuda:-1", "not a non-negative integer", "cuda:N"),
        ("cuda:x", "not a non-negative integer", "cuda:N"),
        ("directml:1.5", "not a non-negative integer", "directml:N"),
        ("cuda:²", "not a non-negative integer", "cuda:N"),
        ("   ", "empty device", "cuda:N"),
    ],
)
def test_parse_errors_name_the_flag_and_fix(text: str, why: str, hint: str) -> None:
    with pytest.raises(UsafError) as info:
        parse_device_spec(text)
    assert info.value.message.startswith("--device ")
    assert why in info.value.message
    assert hint in (info.value.hint or "")


# --- the real CPU path ---------------------------------------------------------------------------


def test_cpu_backend_is_real_and_fp32_by_default() -> None:
    backend = resolve_backend("cpu", env={})
    assert backend.name == "cpu" and backend.device == torch.device("cpu")
    assert backend.policy.compute == torch.float32 and backend.policy.master == torch.float32
    assert backend.policy.autocast is None and not backend.policy.loss_scaling
    assert not backend.capabilities.pinned_memory and backend.capabilities.unified_memory
    assert backend.notes == ()
    x = torch.ones(4, 4, device=backend.device, dtype=backend.policy.compute)
    with backend.autocast():
        assert (x @ x).dtype == torch.float32
    backend.synchronize()
    backend.empty_cache()


def test_cpu_with_amp_uses_bf16_autocast() -> None:
    backend = resolve_backend("cpu", env={}, amp=True)
    assert backend.policy.compute == torch.bfloat16 and backend.policy.autocast == torch.bfloat16
    assert not backend.policy.loss_scaling
    x = torch.ones(4, 4)
    with backend.autocast():
        assert (x @ x).dtype == torch.bfloat16


def test_cpu_memory_stats_are_sane() -> None:
    memory = resolve_backend("cpu", env={}).memory()
    assert 0 < memory.host_available <= memory.host_total
    assert memory.device_total is None and memory.device_free is None and memory.device_allocated is None


def test_describe_is_json_ready() -> None:
    import json

    described = resolve_backend("cpu", env={}).describe()
    assert json.loads(json.dumps(described)) == described
    assert described["backend"] == "cpu" and described["device"] == "cpu"
    assert described["dtype_policy"] == {
        "compute": "float32",
        "master": "float32",
        "autocast": None,
        "loss_scaling": False,
    }
    assert set(described["capabilities"]) >= {"bf16", "fp16", "autocast", "pinned_memory", "memory_stats"}
    assert described["device_name"]


def test_auto_on_a_cpu_only_machine_is_cpu() -> None:
    assert resolve_backend(None, env={}).name == "cpu"
    assert resolve_backend("auto", env={}).name == "cpu"
    assert resolve_backend("", env={}).name == "cpu"


# --- simulated accelerators ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("present", "expected"),
    [
        ({"cuda", "directml", "mps"}, "cuda"),
        ({"directml", "mps"}, "directml"),
        ({"mps"}, "mps"),
        (set(), "cpu"),
    ],
)
def test_auto_order(monkeypatch: pytest.MonkeyPatch, present: set[str], expected: str) -> None:
    if "cuda" in present:
        simulate_cuda(monkeypatch)
    if "directml" in present:
        simulate_directml(monkeypatch)
    if "mps" in present:
        simulate_mps(monkeypatch)
    assert AUTO_ORDER == ("cuda", "directml", "mps", "cpu")
    assert resolve_backend("auto", env={}).name == expected


def test_cuda_compute_capability_7_5_gets_fp16_with_loss_scaling(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, capability=(7, 5), names=("NVIDIA GeForce RTX 2080",))
    backend = resolve_backend("cuda", env={})
    assert backend.device == torch.device("cuda", 0) and backend.label == "CUDA 12.4"
    assert backend.device_name == "NVIDIA GeForce RTX 2080"
    assert not backend.capabilities.bf16 and backend.capabilities.pinned_memory
    assert backend.policy.compute == torch.float16 and backend.policy.autocast == torch.float16
    assert backend.policy.master == torch.float32 and backend.policy.loss_scaling


def test_cuda_compute_capability_8_0_gets_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, capability=(8, 0), total_memory=40 * 2**30, free_memory=30 * 2**30)
    backend = resolve_backend("cuda", env={})
    assert backend.capabilities.bf16 and backend.capabilities.memory_stats
    assert backend.capabilities.dense_delta_terms  # the sparse terms as GEMMs (measured on an H200)
    assert not resolve_backend("cpu", env={}).capabilities.dense_delta_terms  # the CPU's gathers are cheaper
    assert resolve_backend("cpu", env={}).capabilities.unpack_via_int16  # measured on the CPU alone
    assert not backend.capabilities.unpack_via_int16  # a device keeps the nibble form (fewer operators)
    assert backend.policy.compute == torch.bfloat16 and backend.policy.autocast == torch.bfloat16
    assert not backend.policy.loss_scaling
    memory = backend.memory()
    assert (memory.device_total, memory.device_free, memory.device_allocated) == (40 * 2**30, 30 * 2**30, 0)


def test_pascal_cuda_defaults_to_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    # fp16 math on compute capability 6.1 runs at a fraction of fp32 speed.
    simulate_cuda(monkeypatch, capability=(6, 1))
    backend = resolve_backend("cuda", env={})
    assert not backend.capabilities.prefers_half and backend.policy.compute == torch.float32
    assert resolve_backend("cuda", env={"USE_AMP": "1"}).policy.compute == torch.float16


def test_rocm_is_cuda_said_as_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, capability=(11, 0), rocm="6.2", names=("AMD Radeon RX 7900 XTX",))
    backend = resolve_backend("auto", env={})
    assert backend.name == "cuda" and backend.label == "ROCm 6.2"
    assert backend.policy.compute == torch.bfloat16
    (cuda_probe,) = [p for p in probe_backends({}) if p.name == "cuda"]
    assert cuda_probe.label == "ROCm 6.2" and cuda_probe.devices[0].details["gcn_arch"] == "gfx1100"


def test_cuda_index_selects_and_bad_index_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, names=("first GPU", "second GPU"))
    backend = resolve_backend("cuda:1", env={})
    assert backend.device == torch.device("cuda", 1) and backend.device_name == "second GPU"
    with pytest.raises(UsafError) as info:
        resolve_backend("cuda:2", env={})
    assert "--device cuda:2" in info.value.message and "there is no device cuda:2" in info.value.message
    assert "cuda:1 second GPU" in info.value.message
    assert "from 0 to 1" in (info.value.hint or "")


@pytest.mark.parametrize(("bf16", "compute", "scaling"), [(True, torch.bfloat16, False), (False, torch.float16, True)])
def test_mps_policy_follows_bf16(
    monkeypatch: pytest.MonkeyPatch, bf16: bool, compute: torch.dtype, scaling: bool
) -> None:
    simulate_mps(monkeypatch, bf16=bf16, recommended_max=16 * 2**30)
    backend = resolve_backend("mps", env={})
    assert backend.device == torch.device("mps")
    assert backend.policy.compute == compute and backend.policy.loss_scaling is scaling
    assert not backend.capabilities.float64 and backend.capabilities.unified_memory
    memory = backend.memory()
    assert memory.device_total == 16 * 2**30 and memory.device_allocated == 2**30
    assert memory.device_free == 14 * 2**30  # recommended maximum less what the driver holds


def test_directml_gets_fp16_casts_and_loss_scaling(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_directml(monkeypatch, names=("GPU A", "GPU B"))
    backend = resolve_backend("directml:1", env={})
    assert backend.device == torch.device("privateuseone", 1) and backend.device_name == "GPU B"
    caps = backend.capabilities
    assert not caps.bf16 and caps.fp16 and not caps.autocast and not caps.memory_stats
    assert backend.policy.compute == torch.float16 and backend.policy.autocast is None
    assert backend.policy.loss_scaling
    assert backend.memory().device_total is None
    with pytest.raises(UsafError, match="there is no device directml:2"):
        resolve_backend("directml:2", env={})


def test_torch_directml_is_imported_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real_load = directml_module.load
    monkeypatch.setattr(directml_module, "load", lambda: calls.append(1) or real_load())
    resolve_backend("cpu", env={})
    assert calls == []
    probe_backends({})
    assert calls == [1]


@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "mps", "directml"])
def test_unavailable_backend_names_flag_and_what_was_found(spec: str) -> None:
    with pytest.raises(UsafError) as info:
        resolve_backend(spec, env={})
    message, hint = info.value.message, info.value.hint or ""
    assert message.startswith(f"--device {spec}: ") and "is not available here" in message
    assert "found instead: cpu" in message
    assert "--device auto (here: cpu)" in hint


def test_probe_reports_every_backend_with_reasons() -> None:
    probes = probe_backends({})
    assert [p.name for p in probes] == list(AUTO_ORDER)
    assert [p.name for p in probes if p.available] == ["cpu"]
    for p in probes:
        assert (p.reason is None) == p.available
    (cuda_probe,) = [p for p in probes if p.name == "cuda"]
    assert "CPU-only" in (cuda_probe.reason or "")
    cpu_info = probes[-1].devices[0]
    assert cpu_info.details["logical_cores"] >= 1 and cpu_info.total_memory > 0


def test_cuda_probe_blames_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a CUDA build that sees no GPU
    (cuda_probe,) = [p for p in probe_backends({"CUDA_VISIBLE_DEVICES": ""}) if p.name == "cuda"]
    assert "CUDA_VISIBLE_DEVICES" in (cuda_probe.reason or "")
    (cuda_probe,) = [p for p in probe_backends({}) if p.name == "cuda"]
    assert "nvidia-smi" in (cuda_probe.fix or "")


# --- dtype policy ----------------------------------------------------------------------------------


def _caps(**overrides: bool) -> Capabilities:
    flags = dict(
        bf16=False,
        fp16=False,
        autocast=False,
        prefers_half=True,
        pinned_memory=False,
        memory_stats=False,
        unified_memory=False,
        float64=True,
        torch_compile=False,
        grouped_mm=False,
    )
    return Capabilities(**{**flags, **overrides})


def test_dtype_policy_table() -> None:
    bf16 = dtype_policy(_caps(bf16=True, fp16=True, autocast=True))
    assert (bf16.compute, bf16.autocast, bf16.loss_scaling) == (torch.bfloat16, torch.bfloat16, False)
    fp16 = dtype_policy(_caps(fp16=True))
    assert (fp16.compute, fp16.autocast, fp16.loss_scaling) == (torch.float16, None, True)
    none = dtype_policy(_caps())
    assert (none.compute, none.autocast, none.loss_scaling, none.mixed) == (torch.float32, None, False, False)
    off = dtype_policy(_caps(bf16=True, autocast=True), amp=False)
    assert off.compute == torch.float32 and not off.mixed
    cpu_like = dtype_policy(_caps(bf16=True, autocast=True, prefers_half=False))
    assert cpu_like.compute == torch.float32
    for policy in (bf16, fp16, none, off, cpu_like):
        assert policy.master == torch.float32


def test_a_hand_built_backend_serves_as_a_test_double() -> None:
    backend = Backend(
        name="cpu",
        label="fp16 double",
        device=torch.device("cpu"),
        device_name="test",
        capabilities=_caps(fp16=True),
    )
    assert backend.policy.compute == torch.float16 and backend.policy.loss_scaling
    assert backend.memory().host_total > 0


# --- legacy environment variables ------------------------------------------------------------------


def test_use_cuda_1_means_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_mps(monkeypatch)  # auto would pick mps; USE_CUDA=1 must not
    simulate_cuda(monkeypatch)
    simulate_directml(monkeypatch)
    assert resolve_backend(None, env={"USE_CUDA": "1"}).name == "cuda"


def test_use_cuda_1_without_cuda_names_the_variable_and_flag() -> None:
    with pytest.raises(UsafError) as info:
        resolve_backend(None, env={"USE_CUDA": "1"})
    assert "USE_CUDA='1'" in info.value.message and "--device cuda" in info.value.message
    assert "unset USE_CUDA" in (info.value.hint or "")


def test_use_cuda_0_means_auto_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch)
    assert resolve_backend(None, env={}).name == "cuda"  # control: auto alone picks cuda
    assert resolve_backend(None, env={"USE_CUDA": "0"}).name == "cpu"
    simulate_mps(monkeypatch)
    assert resolve_backend(None, env={"USE_CUDA": "0"}).name == "mps"


def test_explicit_spec_wins_over_use_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch)
    backend = resolve_backend("cpu", env={"USE_CUDA": "1"})
    assert backend.name == "cpu"
    assert [n.level for n in backend.notes] == ["info"] and "USE_CUDA='1' ignored" in backend.notes[0].message
    assert resolve_backend("cuda", env={"USE_CUDA": "0"}).name == "cuda"
    assert resolve_backend("auto", env={"USE_CUDA": "0"}).name == "cuda"


def test_a_commands_own_default_device_gives_way_to_use_cuda_1_and_is_not_called_explicit(monkeypatch) -> None:
    """usaf export verifies on the CPU by default, passed as the spec: ``USE_CUDA=1`` was then "ignored: the device
    is set explicitly (cpu)" though nothing was set (found in review). As ``default``: USE_CUDA=1 means cuda, as
    export's help says; USE_CUDA=0 or none leaves the default, with no note. The control is the test above."""
    simulate_cuda(monkeypatch)
    assert resolve_backend(None, env={"USE_CUDA": "1"}, default="cpu").name == "cuda"
    for env in ({"USE_CUDA": "0"}, {}):
        backend = resolve_backend(None, env=env, default="cpu")
        assert backend.name == "cpu" and not [n for n in backend.notes if "ignored" in n.message], backend.notes


def test_use_amp(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, capability=(8, 9))
    off = resolve_backend("cuda", env={"USE_AMP": "0"})
    assert off.policy.compute == torch.float32 and off.policy.autocast is None
    assert any("USE_AMP='0'" in n.message for n in off.notes)
    on_cpu = resolve_backend("cpu", env={"USE_AMP": "1"})
    assert on_cpu.policy.compute == torch.bfloat16
    # said: a CPU run in bf16 from a USE_AMP=1 left set was silent (found verifying USE_AMP on the CPU)
    assert [n.message for n in on_cpu.notes if "USE_AMP" in n.message] == [
        "USE_AMP='1': mixed precision on, so --dtype auto computes in bfloat16 on CPU (fp32 without it)"]
    default = resolve_backend("cpu", env={})  # the control: fp32, nothing said about precision
    assert default.policy.compute == torch.float32 and not [n for n in default.notes if "precision" in n.message]
    assert resolve_backend("cpu", env={"USE_AMP": "1"}, amp=False).policy.compute == torch.float32


@pytest.mark.parametrize(("value", "warned"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_use_multi_gpu_is_a_warning(value: str, warned: bool) -> None:
    backend = resolve_backend("cpu", env={"USE_MULTI_GPU": value})
    warnings = [n for n in backend.notes if n.level == "warning"]
    assert bool(warnings) is warned
    if warned:
        # it said data parallel was a later feature, which usaf train --nproc is (found in review)
        assert "is not read" in warnings[0].message and "usaf train --nproc N" in warnings[0].message
        assert "later" not in warnings[0].message
    assert backend.name == "cpu"


@pytest.mark.parametrize("name", ["USE_CUDA", "USE_AMP"])
def test_malformed_legacy_value_is_an_error(name: str) -> None:
    with pytest.raises(UsafError) as info:
        resolve_backend(None, env={name: "maybe"})
    assert f"{name}='maybe' is not 0 or 1" in info.value.message


def test_explain_env() -> None:
    rows = {
        name: meaning
        for name, _, meaning in explain_env(
            {
                "USE_CUDA": "1",
                "USE_AMP": "off",
                "USE_MULTI_GPU": "1",
                "CUDA_VISIBLE_DEVICES": "1",
                "HOME": "/x",
            }
        )
    }
    assert set(rows) == {"USE_CUDA", "USE_AMP", "USE_MULTI_GPU", "CUDA_VISIBLE_DEVICES"}
    assert "device cuda" in rows["USE_CUDA"] and "fp32" in rows["USE_AMP"]
    assert "not read" in rows["USE_MULTI_GPU"] and "--nproc" in rows["USE_MULTI_GPU"]
    assert "later" not in rows["USE_MULTI_GPU"]


# --- a real GPU ------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
def test_real_cuda_device() -> None:
    backend = resolve_backend("cuda", env={})
    assert backend.device.type == "cuda" and backend.device_name == torch.cuda.get_device_name(0)
    before = backend.memory()
    assert before.device_total is not None and before.device_free is not None
    assert 0 < before.device_free <= before.device_total
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=backend.device)  # 64 MiB
    backend.synchronize()
    after = backend.memory()
    assert after.device_allocated is not None and before.device_allocated is not None
    assert after.device_allocated >= before.device_allocated + x.numel()
    caps = backend.capabilities
    expected = torch.float32 if not caps.prefers_half else torch.bfloat16 if caps.bf16 else torch.float16
    assert backend.policy.compute == expected
    y = torch.ones(8, 8, device=backend.device)
    with backend.autocast():
        assert (y @ y).dtype == expected
    del x
    backend.empty_cache()
