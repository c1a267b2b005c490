"""AMD (and other DirectX 12) GPUs on Windows/WSL2 through ``torch-directml``.

``torch_directml`` is imported only here, and only when DirectML is asked for or probed: it pins
torch 2.4.1 and is absent on most machines. It has no bf16, no autocast and no memory statistics,
so the dtype policy there is fp16 with explicit casts and dynamic loss scaling.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

from usaf.backends.base import Backend, DeviceInfo, Note, Probe
from usaf.backends.capabilities import Capabilities
from usaf.backends.spec import DIRECTML

LABEL = "DirectML"


def load() -> tuple[ModuleType | None, str | None]:
    """Import torch_directml: ``(module, None)``, or ``(None, why it could not be imported)``."""
    try:
        # lazy: optional dependency, imported only when DirectML is asked for or probed
        import torch_directml
    except ImportError:
        return None, "torch-directml is not installed"
    except Exception as e:  # a broken DLL or torch mismatch raises OSError/RuntimeError
        return None, f"torch-directml failed to import: {type(e).__name__}: {e}"
    return torch_directml, None


def _install_fix() -> str:
    if sys.platform == "win32":
        return "pip install 'usaf[directml]' (it pins torch 2.4.1; see README, AMD on Windows)"
    return "on WSL2 pip install torch-directml; on native Linux use a ROCm build of torch (--device cuda)"


def _has_float64(module: ModuleType, index: int) -> bool:
    check = getattr(module, "has_float64_support", None)
    return bool(check(index)) if check is not None else False


def probe() -> Probe:
    module, why = load()
    if module is None:
        return Probe(name=DIRECTML, label=LABEL, available=False, reason=why, fix=_install_fix())
    count = int(module.device_count())
    if count == 0:
        return Probe(
            name=DIRECTML,
            label=LABEL,
            available=False,
            reason="torch-directml found no DirectX 12 GPU",
            fix="update the GPU driver",
        )
    devices = tuple(
        DeviceInfo(
            device=f"{DIRECTML}:{i}",
            name=str(module.device_name(i)),
            details={"float64": _has_float64(module, i)},
        )
        for i in range(count)
    )
    return Probe(name=DIRECTML, label=LABEL, available=True, devices=devices)


#: torch-directml fails allocations above roughly this size (the original tool's measurement on RX 6000/7000).
MAX_ALLOCATION_BYTES = 800 * 2**20


def capabilities(module: ModuleType, index: int) -> Capabilities:
    """What a DirectML device can do; each known torch-directml limit is one flag here.

    No bf16 and no autocast, so the dtype policy is fp16 compute with explicit casts, fp32 masters and
    dynamic loss scaling; ``one_hot``/``index_add_``/``nonzero``/scatter fail; single allocations fail
    above ~800 MB; ``.to(device, dtype)`` ignores the dtype; safetensors cannot load onto the device.
    (fp16 Adam falls back to the CPU with NaN there: usaf's optimizer takes fp32 masters only.)
    """
    return Capabilities(
        bf16=False,
        fp16=True,
        autocast=False,
        prefers_half=True,
        pinned_memory=False,
        memory_stats=False,
        unified_memory=False,
        float64=_has_float64(module, index),
        torch_compile=False,
        grouped_mm=False,
        index_ops=False,
        max_allocation_bytes=MAX_ALLOCATION_BYTES,
        to_device_and_dtype=False,
        direct_load=False,
    )


class DirectMLBackend(Backend):
    """One DirectML device (``privateuseone:N`` to torch)."""

    def synchronize(self) -> None:
        # torch-directml has no synchronize(); its queue runs in order, so reading one value back
        # waits for everything queued before it.
        torch.zeros((), device=self.device).item()

    # empty_cache: torch-directml exposes no allocator control, so the base no-op stands.


def create(index: int | None, *, amp: bool | None, notes: tuple[Note, ...]) -> DirectMLBackend:
    module, why = load()
    if module is None:  # resolve_backend probes first; this guards direct callers
        raise RuntimeError(why)
    index = 0 if index is None else index
    return DirectMLBackend(
        name=DIRECTML,
        label=LABEL,
        device=torch.device(module.device(index)),
        device_name=str(module.device_name(index)),
        capabilities=capabilities(module, index),
        amp=amp,
        notes=notes,
    )
