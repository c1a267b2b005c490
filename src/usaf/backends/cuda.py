"""NVIDIA CUDA and AMD ROCm (a ROCm build of torch sets ``torch.version.hip`` and reuses the CUDA API)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from usaf.backends._torch_features import has_grouped_mm_op, has_triton, torch_at_least
from usaf.backends.base import Backend, DeviceInfo, Note, Probe
from usaf.backends.capabilities import Capabilities
from usaf.backends.spec import CUDA

_VISIBILITY_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def is_rocm() -> bool:
    return bool(torch.version.hip)


def label() -> str:
    """``"ROCm 6.2"`` on ROCm builds, ``"CUDA 12.8"`` on CUDA builds, ``"CUDA"`` on CPU-only builds."""
    if is_rocm():
        return f"ROCm {torch.version.hip}"
    return f"CUDA {torch.version.cuda}" if torch.version.cuda else "CUDA"


def _why_unavailable(env: Mapping[str, str]) -> tuple[str, str]:
    if not torch.version.cuda and not is_rocm():
        return (
            f"this torch build is CPU-only (torch {torch.__version__})",
            "install a CUDA build of torch (NVIDIA) or a ROCm build (AMD on Linux): "
            "https://pytorch.org/get-started/locally/",
        )
    for name in _VISIBILITY_VARS:
        value = env.get(name)
        if value is not None and value.strip() in ("", "-1"):
            return f"{name}={value!r} hides every GPU", f"unset {name} or list the GPUs to use"
    if is_rocm():
        return (
            f"torch is built for {label()} but found no usable AMD GPU",
            "check that `rocm-smi` lists the GPU and your user is in the 'render' and 'video' groups; "
            "consumer cards ROCm does not list may need HSA_OVERRIDE_GFX_VERSION",
        )
    return (
        f"torch is built for {label()} but found no usable NVIDIA GPU or driver",
        f"check that `nvidia-smi` lists the GPU and that its driver supports {label()}",
    )


def _device_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    details = {"multiprocessors": getattr(props, "multi_processor_count", None)}
    if is_rocm():
        details["gcn_arch"] = getattr(props, "gcnArchName", None)
    return DeviceInfo(
        device=f"{CUDA}:{index}",
        name=torch.cuda.get_device_name(index),
        total_memory=int(props.total_memory),
        compute_capability=tuple(torch.cuda.get_device_capability(index)),
        details=details,
    )


def probe(env: Mapping[str, str]) -> Probe:
    lab = label()
    if not torch.cuda.is_available():
        reason, fix = _why_unavailable(env)
        return Probe(name=CUDA, label=lab, available=False, reason=reason, fix=fix)
    try:
        devices = tuple(_device_info(i) for i in range(torch.cuda.device_count()))
    except RuntimeError as e:  # the driver answers is_available() but fails on first real use
        return Probe(
            name=CUDA,
            label=lab,
            available=False,
            reason=f"{lab} failed to initialise: {e}",
            fix="check the GPU driver and that no other process holds the GPU in exclusive mode",
        )
    if not devices:
        return Probe(name=CUDA, label=lab, available=False, reason="no device found", fix=None)
    return Probe(name=CUDA, label=lab, available=True, devices=devices)


def capabilities(index: int) -> Capabilities:
    cc = tuple(torch.cuda.get_device_capability(index))
    rocm = is_rocm()
    props = torch.cuda.get_device_properties(index)
    return Capabilities(
        # Ampere (8.0) brought bf16 tensor cores; torch treats every ROCm GPU as bf16-capable.
        bf16=rocm or cc >= (8, 0),
        fp16=True,
        autocast=True,
        # Pascal consumer cards (6.x) run fp16 math at a fraction of fp32 speed; tensor cores start at 7.0.
        prefers_half=rocm or cc >= (7, 0),
        pinned_memory=True,
        memory_stats=True,
        # Jetson-style integrated GPUs share host RAM.
        unified_memory=bool(getattr(props, "is_integrated", False)),
        float64=True,
        torch_compile=has_triton() and (rocm or cc >= (7, 0)),  # Triton needs compute capability >= 7.0
        # Same rule transformers applies: SM80+ with torch >= 2.9, Hopper only before.
        grouped_mm=has_grouped_mm_op() and (cc >= (8, 0) if torch_at_least("2.9") else cc[0] == 9),
        dense_delta_terms=True,  # measured on an H200 (docs/BENCHMARKS.md, "On a GPU")
    )


class CudaBackend(Backend):
    """One CUDA or ROCm device."""

    def device_memory(self) -> tuple[int | None, int | None, int | None]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total), int(free), int(torch.cuda.memory_allocated(self.device))

    def peak_allocated(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device)) if torch.cuda.is_initialized() else None

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


def create(index: int | None, *, amp: bool | None, notes: tuple[Note, ...]) -> CudaBackend:
    # Plain "cuda" is the first visible device; CUDA_VISIBLE_DEVICES chooses which one that is.
    index = 0 if index is None else index
    return CudaBackend(
        name=CUDA,
        label=label(),
        device=torch.device(CUDA, index),
        device_name=torch.cuda.get_device_name(index),
        capabilities=capabilities(index),
        amp=amp,
        notes=notes,
    )
