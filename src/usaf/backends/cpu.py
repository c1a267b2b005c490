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
        reproducible=True,  # tests/test_determinism.py: byte-identical runs across processes
        unpack_via_int16=True,  # docs/BENCHMARKS.md, "The 4-bit codes unpacked through an int16 scratch"
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


# Sampled once per process before choosing the thread count: long enough to see other processes' load,
# short next to any stage's start-up.
LOAD_SAMPLE_SECONDS = 0.2
_threads_note: Note | None | bool = False  # False: not chosen yet in this process


def threads_for_load(default: int, cores: int, busy_percent: float) -> int:
    """Intra-op threads: torch's ``default`` less the cores other processes keep busy (``busy_percent`` of all
    ``cores``, as psutil reports them), at least 1.

    A thread team larger than the idle cores waits at every parallel region for its descheduled members: with one
    busy process on a 2-core machine ``usaf demo --quick`` took 3.6x its idle time at 2 threads and 1.35x at 1
    (docs/BENCHMARKS.md, "Threads under load").
    """
    busy = round(busy_percent / 100 * cores)
    return max(1, min(default, cores - busy))


def choose_threads(env: dict | None = None) -> Note | None:
    """Once per process: lower torch's intra-op threads to the cores other processes leave idle.

    Left alone where ``OMP_NUM_THREADS`` is set (the user's or torchrun's choice, and the test suite's, which
    needs one count for exact comparisons across processes). Returns a note when it lowered the count.
    """
    global _threads_note
    if _threads_note is not False:
        return _threads_note  # type: ignore[return-value]
    env = os.environ if env is None else env
    _threads_note = None
    if env.get("OMP_NUM_THREADS"):
        return None
    default, cores = torch.get_num_threads(), os.cpu_count() or 1
    chosen = threads_for_load(default, cores, psutil.cpu_percent(interval=LOAD_SAMPLE_SECONDS))
    if chosen < default:
        torch.set_num_threads(chosen)
        _threads_note = Note(
            "info",
            f"{cores - chosen} of {cores} cores busy with other processes: {chosen} torch thread(s) instead of "
            f"{default} (set OMP_NUM_THREADS to choose)",
        )
    return _threads_note


def thread_count(value: object) -> int | None:
    """``value`` when it is a thread count as usaf records one (a whole number from 1), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def same_threads_as(recorded: int | None, what: str, env: dict | None = None) -> str | None:
    """On resuming CPU work that ran at ``recorded`` intra-op threads: run at that count again, and say so.

    The CPU's sums are bit-identical only at one thread count (a matrix product or a reduction splits its work by
    the threads), and :func:`choose_threads` picks the count by the machine's load, so a resume on a busier or an
    idler machine would otherwise continue with other last bits than the run it continues. Where the user set
    ``OMP_NUM_THREADS`` their count stays, and the note says what that costs. ``recorded`` None (work saved by an
    older usaf): nothing to match. Returns the note to show, if any.
    """
    env = os.environ if env is None else env
    now = torch.get_num_threads()
    if recorded is None or recorded == now:
        return None
    if env.get("OMP_NUM_THREADS"):
        return (f"{what} ran at {recorded} torch threads, this process runs at {now} (OMP_NUM_THREADS): the result "
                f"equals an uninterrupted run's only within float rounding; OMP_NUM_THREADS={recorded} gives its "
                "bits")  # fmt: skip
    torch.set_num_threads(recorded)
    return (f"resuming at the {recorded} torch threads {what} ran at, not the {now} this machine's load chose: the "
            "same count gives the same bits (set OMP_NUM_THREADS to choose)")  # fmt: skip


class CpuBackend(Backend):
    """Host CPU: synchronize and empty_cache have nothing to do."""

    def free_memory(self) -> int | None:
        return host_memory()[1]  # tensors live in host RAM: what is available there

    def compute_threads(self) -> int | None:
        return torch.get_num_threads()

    def same_threads_as(self, recorded: int | None, what: str) -> str | None:
        return same_threads_as(recorded, what)


def create(index: int | None, *, amp: bool | None, notes: tuple[Note, ...]) -> CpuBackend:
    del index  # the CPU has no index; parse_device_spec rejects "cpu:N"
    threads = choose_threads()
    return CpuBackend(
        name=CPU,
        label="CPU",
        device=torch.device(CPU),
        device_name=cpu_name(),
        capabilities=capabilities(),
        amp=amp,
        notes=(*notes, *([threads] if threads is not None else [])),
    )
