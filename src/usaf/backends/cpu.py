"""The CPU backend: always available; fp32 by default (half precision is rarely faster on CPUs)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import psutil
import torch

from usaf.backends._torch_features import has_cxx_compiler, has_grouped_mm_op, torch_at_least
from usaf.backends.base import Backend, DeviceInfo, Note, Probe, host_memory
from usaf.backends.capabilities import Capabilities
from usaf.backends.spec import CPU


def cpu_name() -> str:
    """The processor's marketing name where the OS tells it, else the architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():  # Linux: platform.processor() says only "x86_64" there
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def capabilities() -> Capabilities:
    return Capabilities(
        bf16=True,
        fp16=True,
        autocast=True,
        prefers_half=False,
        pinned_memory=False,  # there is no device to copy to
        memory_stats=False,  # host RAM is reported separately in MemoryStats.host_*
        unified_memory=True,
        float64=True,
        torch_compile=has_cxx_compiler(),
        # torch <= 2.8 has no CPU kernel for grouped matmul (pytorch#172440).
        grouped_mm=has_grouped_mm_op() and torch_at_least("2.9"),
    )


def probe() -> Probe:
    total, available = host_memory()
    info = DeviceInfo(
        device=CPU,
        name=cpu_name(),
        total_memory=total,
        details={
            "logical_cores": os.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
            "torch_threads": torch.get_num_threads(),
            "ram_available": available,
        },
    )
    return Probe(name=CPU, label="CPU", available=True, devices=(info,))


class CpuBackend(Backend):
    """Host CPU: synchronize and empty_cache have nothing to do."""

    def free_memory(self) -> int | None:
        return host_memory()[1]  # tensors live in host RAM: what is available there


def create(index: int | None, *, amp: bool | None, notes: tuple[Note, ...]) -> CpuBackend:
    del index  # the CPU has no index; parse_device_spec rejects "cpu:N"
    return CpuBackend(
        name=CPU,
        label="CPU",
        device=torch.device(CPU),
        device_name=cpu_name(),
        capabilities=capabilities(),
        amp=amp,
        notes=notes,
    )
