"""Apple silicon GPUs through Metal Performance Shaders (one device, memory shared with the host)."""

from __future__ import annotations

import platform
import subprocess
import sys

import torch

from usaf.backends.base import Backend, DeviceInfo, Note, Probe
from usaf.backends.capabilities import Capabilities
from usaf.backends.spec import MPS


def chip_name() -> str:
    """``"Apple M2 Pro"`` on macOS (platform.processor() says only "arm" there)."""
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            )
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return "Apple GPU"


def _recommended_max_memory() -> int | None:
    fn = getattr(torch.mps, "recommended_max_memory", None)  # torch >= 2.5
    return int(fn()) if fn is not None else None


def has_bf16() -> bool:
    """MPS has bfloat16 from macOS 14 on."""
    check = getattr(torch.backends.mps, "is_macos_or_newer", None)
    try:
        return bool(check(14, 0)) if check is not None else False
    except RuntimeError:  # raised when the MPS backend is not usable at all
        return False


def probe() -> Probe:
    if torch.backends.mps.is_available():
        info = DeviceInfo(device=MPS, name=chip_name(), total_memory=_recommended_max_memory())
        return Probe(name=MPS, label="MPS", available=True, devices=(info,))
    if sys.platform != "darwin":
        reason = f"MPS is Apple's Metal backend, only on macOS (this is {platform.system() or sys.platform})"
        return Probe(name=MPS, label="MPS", available=False, reason=reason, fix=None)
    if not torch.backends.mps.is_built():
        return Probe(
            name=MPS,
            label="MPS",
            available=False,
            reason="this torch build has no MPS support",
            fix="install the macOS arm64 build of torch",
        )
    return Probe(
        name=MPS,
        label="MPS",
        available=False,
        reason="MPS needs macOS 12.3+ on Apple silicon",
        fix="update macOS and use a native arm64 Python (not one running under Rosetta)",
    )


def capabilities() -> Capabilities:
    return Capabilities(
        bf16=has_bf16(),
        fp16=True,
        autocast=torch.amp.is_autocast_available(MPS),
        prefers_half=True,
        pinned_memory=False,  # unified memory: there is no slow host -> device copy to speed up
        memory_stats=_recommended_max_memory() is not None,
        unified_memory=True,
        float64=False,  # MPS has no float64 kernels at all
        torch_compile=False,  # inductor's MPS backend is still experimental
        grouped_mm=False,  # no MPS kernel; transformers falls back to its own loop
    )


class MpsBackend(Backend):
    """The Apple GPU."""

    def device_memory(self) -> tuple[int | None, int | None, int | None]:
        total = _recommended_max_memory()
        allocated = int(torch.mps.current_allocated_memory())
        # "Free" is an estimate: Metal's recommended working set less what the driver holds for us.
        free = None if total is None else max(0, total - int(torch.mps.driver_allocated_memory()))
        return total, free, allocated

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def empty_cache(self) -> None:
        torch.mps.empty_cache()


def create(index: int | None, *, amp: bool | None, notes: tuple[Note, ...]) -> MpsBackend:
    del index  # one device; parse_device_spec rejects "mps:N"
    return MpsBackend(
        name=MPS,
        label="MPS",
        device=torch.device(MPS),
        device_name=chip_name(),
        capabilities=capabilities(),
        amp=amp,
        notes=notes,
    )
