"""Capabilities by torch device, and moving tensors within them.

Code that is handed a tensor's device rather than a :class:`~usaf.backends.Backend` (the experts forward,
the loader, dequantization) looks the device's capabilities up here, so every backend limit is still
decided by a flag, and ``torch_directml`` is only consulted when a tensor already lives on it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from functools import lru_cache

import torch

from usaf.backends import cpu, cuda, directml, mps
from usaf.backends.capabilities import Capabilities
from usaf.errors import UsafError

# torch names DirectML devices "privateuseone" (torch's slot for out-of-tree backends)
PRIVATEUSE = "privateuseone"


@lru_cache(maxsize=32)
def _capabilities(kind: str, index: int) -> Capabilities:
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


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor (indices, group offsets, a scalar) on ``device``, without making the host wait for it.

    On CUDA a copy from pageable host memory waits for every kernel queued before it (``memcpy_and_sync``): a step
    that uploads a few indices per block would stop launching ahead of the device at each. Where the device has
    pinned memory the tensor goes through a pinned buffer instead, asynchronously (torch's host allocator keeps the
    buffer until the copy is done, so ``host`` may change or go at once). Elsewhere a plain ``.to(device)``.
    """
    device = torch.device(device)
    if host.device.type != "cpu" or device.type in ("cpu", "meta") or not device_capabilities(device).pinned_memory:
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def check_allocation(nbytes: int, device: torch.device | str, what: str) -> None:
    """Raise when one tensor of ``nbytes`` exceeds the device's per-allocation limit."""
    limit = device_capabilities(device).max_allocation_bytes
    if limit is not None and nbytes > limit:
        raise UsafError(
            f"{what}: one tensor of {nbytes / 2**20:.0f} MiB exceeds {device}'s per-allocation limit "
            f"({limit / 2**20:.0f} MiB)",
            "use a smaller model, or --device cpu",
        )


def is_host(device: torch.device | str) -> bool:
    """Whether ``device`` is the host CPU itself (no separate device memory, nothing to transfer)."""
    return torch.device(device).type == "cpu"


def sampled_addmm_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``torch.sparse.sampled_addmm`` runs here: CPU fp32/fp64 only (bf16/fp16 are refused by the
    kernel, and other backends are untested)."""
    return is_host(device) and dtype in (torch.float32, torch.float64)


def has_copy_stream(device: torch.device | str) -> bool:
    """Whether host -> device copies can run on a side stream while the device computes (CUDA and ROCm)."""
    return torch.device(device).type == "cuda"


class CopyStream:
    """A side stream for host -> device copies that overlap compute (where :func:`has_copy_stream`).

    Copies issued inside :meth:`copying` run on the side stream; :meth:`ready` records an event there, and
    :meth:`wait` makes the compute stream wait for it before the copied tensors are used.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device)

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        with torch.cuda.stream(self._stream):
            yield

    def ready(self) -> torch.cuda.Event:
        """An event recorded on the side stream after the copies issued so far."""
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def wait(self, event: torch.cuda.Event, tensors: Iterable[torch.Tensor]) -> None:
        """Make the compute stream wait for ``event``; ``tensors`` (allocated on the side stream, used on the
        compute one) are freed only after the compute stream's work on them."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in tensors:
            t.record_stream(current)
