"""The :class:`Backend` every stage is handed, and the records it reports.

A backend is passed in explicitly (never a global). Subclasses per device type override only what
differs: how device memory is read, how to wait for queued work, how to release cached blocks.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import psutil
import torch

from usaf.backends.capabilities import Capabilities, DTypePolicy, dtype_policy


@dataclass(frozen=True)
class Note:
    """A remark for the caller to show the user (``warning``: something asked for is not done)."""

    level: Literal["info", "warning"]
    message: str


@dataclass(frozen=True)
class MemoryStats:
    """Memory in bytes. Device fields are ``None`` where the backend cannot report them.

    On CPU there is no separate device: host RAM is where tensors live, so use ``host_*``.
    """

    host_total: int
    host_available: int
    device_total: int | None = None
    device_free: int | None = None
    device_allocated: int | None = None

    def as_dict(self) -> dict[str, int | None]:
        return asdict(self)


@dataclass(frozen=True)
class DeviceInfo:
    """One device a probe found."""

    device: str
    name: str
    total_memory: int | None = None
    compute_capability: tuple[int, int] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if self.compute_capability is not None:
            data["compute_capability"] = ".".join(map(str, self.compute_capability))
        return data


@dataclass(frozen=True)
class Probe:
    """Whether one backend is usable here, and if not, why not and how to fix it.

    Attributes:
        name: the backend (``cpu``, ``cuda``, ``mps``, ``directml``).
        label: what users call it here (``"ROCm 6.2"`` for a ROCm build of torch, ``"CUDA 12.8"``).
        available: at least one device is usable.
        devices: the usable devices (empty when unavailable).
        reason: why it is unavailable, else ``None``.
        fix: what the user can do about it, else ``None``.
    """

    name: str
    label: str
    available: bool
    devices: tuple[DeviceInfo, ...] = ()
    reason: str | None = None
    fix: str | None = None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["devices"] = [d.as_dict() for d in self.devices]
        return data


def host_memory() -> tuple[int, int]:
    """Host RAM (total, available) in bytes; "available" counts reclaimable page cache as free."""
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


class Backend:
    """One device and what it can do. Construct through :func:`usaf.backends.resolve_backend`.

    Attributes:
        name: the backend kind (``cpu``, ``cuda``, ``mps``, ``directml``); for display and
            manifests only, code branches on :attr:`capabilities`.
        label: what users call it (``"ROCm 6.2"``, ``"CUDA 12.8"``, ``"DirectML"``, ``"CPU"``).
        device: the torch device tensors go to.
        device_name: the hardware's name (``"NVIDIA GeForce RTX 4090"``).
        capabilities: what the backend can do.
        policy: the dtypes a run uses here.
        notes: remarks from resolution (ignored legacy variables, unsupported requests).
    """

    def __init__(
        self,
        *,
        name: str,
        label: str,
        device: torch.device,
        device_name: str,
        capabilities: Capabilities,
        amp: bool | None = None,
        notes: tuple[Note, ...] = (),
    ) -> None:
        self.name = name
        self.label = label
        self.device = device
        self.device_name = device_name
        self.capabilities = capabilities
        self.policy: DTypePolicy = dtype_policy(capabilities, amp)
        self.notes = notes

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={str(self.device)!r}, name={self.device_name!r})"

    def device_memory(self) -> tuple[int | None, int | None, int | None]:
        """Device (total, free, allocated) bytes; ``None`` for what the backend cannot report."""
        return None, None, None

    def memory(self) -> MemoryStats:
        """Host RAM and, where the backend reports it, device memory."""
        host_total, host_available = host_memory()
        total, free, allocated = self.device_memory()
        return MemoryStats(host_total, host_available, total, free, allocated)

    def free_memory(self) -> int | None:
        """Free bytes where this backend's tensors live (the device's; ``None`` where it cannot say)."""
        return self.memory().device_free

    def peak_allocated(self) -> int | None:
        """The most device memory tensors have held so far (bytes); ``None`` where the backend cannot tell."""
        return None

    def synchronize(self) -> None:
        """Wait until all queued work on the device is done (for timing and before reading memory)."""

    def empty_cache(self) -> None:
        """Return cached, unused device blocks to the driver (after freeing a large working set)."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` for the policy's autocast dtype, or a no-op context without one."""
        if self.policy.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.policy.autocast)

    def compute_threads(self) -> int | None:
        """torch's intra-op threads where this backend computes on the host CPU, whose sums' bits depend on them
        (a resume runs at its run's count again: :meth:`same_threads_as`); None where the device computes."""
        return None

    def same_threads_as(self, recorded: int | None, what: str) -> str | None:
        """Resuming work ``what`` did at ``recorded`` :meth:`compute_threads`: compute at that count again; the note
        to show, if any. Nothing to do where the device computes."""
        return None

    def compute_dtype(self, setting: str = "auto") -> torch.dtype:
        """What a ``--dtype`` setting computes in here: the policy's compute dtype for ``auto``."""
        return self.policy.compute if setting == "auto" else getattr(torch, setting)

    def recorded(self, dtype: torch.dtype | None = None) -> dict[str, str]:
        """What an artifact's environment and a resume's identity record of this device: ``backend``, ``device``
        and ``dtype`` (the policy's compute dtype unless ``dtype``: what the stage computed in)."""
        dtype = self.policy.compute if dtype is None else dtype
        return {"backend": self.name, "device": str(self.device), "dtype": str(dtype).removeprefix("torch.")}

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary for manifests: backend, device, hardware, capabilities, dtypes."""
        return {
            "backend": self.name,
            "label": self.label,
            "device": str(self.device),
            "device_name": self.device_name,
            "torch": torch.__version__,
            "capabilities": self.capabilities.as_dict(),
            "dtype_policy": self.policy.as_dict(),
        }
