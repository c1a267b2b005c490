"""Simulated accelerators for tests on machines without them.

Each helper patches torch (or ``sys.modules`` for ``torch_directml``) through a pytest
``MonkeyPatch``, so resolution, capabilities and dtype policy can be tested for every backend on a
CPU-only machine. Only the queries are simulated: tensors cannot be put on a simulated device.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

GIB = 2**30


def hide_accelerators(mp: Any) -> None:
    """Make this machine look CPU-only: a CPU build of torch, no MPS, no torch-directml."""
    mp.setattr(torch.version, "cuda", None)
    mp.setattr(torch.version, "hip", None)
    mp.setattr(torch.cuda, "is_available", lambda: False)
    mp.setattr(torch.cuda, "device_count", lambda: 0)
    mp.setattr(torch.backends.mps, "is_available", lambda: False)
    mp.setitem(sys.modules, "torch_directml", None)  # None in sys.modules makes the import fail


def simulate_cuda(
    mp: Any,
    *,
    capability: tuple[int, int] = (8, 0),
    names: tuple[str, ...] = ("Simulated GPU",),
    total_memory: int = 24 * GIB,
    free_memory: int = 20 * GIB,
    rocm: str | None = None,
    cuda_version: str = "12.4",
) -> None:
    """Pretend ``len(names)`` CUDA devices of one compute capability exist (ROCm when ``rocm`` is set)."""
    mp.setattr(torch.version, "cuda", None if rocm else cuda_version)
    mp.setattr(torch.version, "hip", rocm)
    props = types.SimpleNamespace(
        total_memory=total_memory,
        multi_processor_count=64,
        is_integrated=False,
        gcnArchName="gfx1100" if rocm else None,
    )
    mp.setattr(torch.cuda, "is_available", lambda: True)
    mp.setattr(torch.cuda, "device_count", lambda: len(names))
    mp.setattr(torch.cuda, "get_device_name", lambda i=0: names[_index(i)])
    mp.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)
    mp.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    mp.setattr(torch.cuda, "mem_get_info", lambda i=0: (free_memory, total_memory))
    mp.setattr(torch.cuda, "memory_allocated", lambda i=0: 0)


def _index(device: Any) -> int:
    if isinstance(device, torch.device):
        return device.index or 0
    return int(device)


def simulate_mps(mp: Any, *, bf16: bool = True, recommended_max: int = 16 * GIB) -> None:
    """Pretend this is an Apple-silicon Mac (macOS 14+ when ``bf16``)."""
    mp.setattr(torch.backends.mps, "is_available", lambda: True)
    mp.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: bf16 or (major, minor) < (14, 0))
    # raising=False: torch 2.4 (the DirectML configuration) has no recommended_max_memory
    mp.setattr(torch.mps, "recommended_max_memory", lambda: recommended_max, raising=False)
    mp.setattr(torch.mps, "current_allocated_memory", lambda: 1 * GIB)
    mp.setattr(torch.mps, "driver_allocated_memory", lambda: 2 * GIB)


def simulate_directml(
    mp: Any, *, names: tuple[str, ...] = ("AMD Radeon RX 7900 XTX",), float64: bool = False
) -> types.ModuleType:
    """Install a fake ``torch_directml`` module with ``len(names)`` devices; returns it."""
    module = types.ModuleType("torch_directml")
    module.is_available = lambda: bool(names)
    module.device_count = lambda: len(names)
    module.device_name = lambda i: names[i]
    module.device = lambda i=0: torch.device("privateuseone", i)
    module.has_float64_support = lambda i: float64
    mp.setitem(sys.modules, "torch_directml", module)
    return module
