"""Capabilities by torch device, and moving tensors within them.

Code that is handed a tensor's device rather than a :class:`~usaf.backends.Backend` (the experts forward,
the loader, dequantization) looks the device's capabilities up here, so every backend limit is still
decided by a flag, and ``torch_directml`` is only consulted when a tensor already lives on it.
"""

from __future__ import annotations

import sys
from functools import lru_cache

import torch

from usaf.backends.capabilities import Capabilities

# torch names DirectML devices "privateuseone" (torch's slot for out-of-tree backends)
PRIVATEUSE = "privateuseone"


@lru_cache(maxsize=32)
def _capabilities(kind: str, index: int) -> Capabilities:
    from usaf.backends import cpu, cuda, directml, mps

    if kind == "cpu":
        return cpu.capabilities()
    if kind == "cuda":
        return cuda.capabilities(index)
    if kind == "mps":
        return mps.capabilities()
    if kind == PRIVATEUSE:
        module = sys.modules.get("torch_directml")
        if module is None:  # a tensor is on the device, so the backend was selected and imported
            module, why = directml.load()
            if module is None:
                raise RuntimeError(f"a tensor is on {kind}:{index}, but {why}")
        return directml.capabilities(module, index)
    raise ValueError(f"usaf has no backend for device type {kind!r}")


def device_capabilities(device: torch.device | str) -> Capabilities:
    """The capabilities of the backend ``device`` belongs to (cached per device)."""
    device = torch.device(device)
    return _capabilities(device.type, device.index or 0)


def clear_cache() -> None:
    """Forget cached capabilities (tests that simulate devices)."""
    _capabilities.cache_clear()


def move(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor.to(device, dtype)``, as two calls where the device ignores the dtype in a joint one."""
    device = torch.device(device)
    if dtype is None or device_capabilities(device).to_device_and_dtype:
        return tensor.to(device, dtype)
    return tensor.to(dtype=dtype).to(device)  # cast where the tensor is, then transfer


def check_allocation(nbytes: int, device: torch.device | str, what: str) -> None:
    """Raise when one tensor of ``nbytes`` exceeds the device's per-allocation limit."""
    limit = device_capabilities(device).max_allocation_bytes
    if limit is not None and nbytes > limit:
        from usaf.errors import UsafError

        raise UsafError(
            f"{what}: one tensor of {nbytes / 2**20:.0f} MiB exceeds {device}'s per-allocation limit "
            f"({limit / 2**20:.0f} MiB)",
            "use a smaller model, or --device cpu",
        )
