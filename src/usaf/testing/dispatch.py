"""What a step dispatches: every aten operator, and those that make the host wait for a device.

A GPU step is launched from the host one operator at a time; while the host runs ahead of the device the two
overlap. An operator that waits for the device (a scalar read, an output whose size depends on the data, a
copy between host and device memory, unless non-blocking from or into pinned memory: torch synchronizes the
stream after a blocking one, ``memcpy_and_sync``)
stops that, so the step pays its launch time and its device time one after the other from there. The tests and
``benchmarks/bench_steps_gpu.py`` count both. On a CPU nothing waits (host and device are one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from usaf.backends.transfer import is_host

# Operators whose output's size depends on the values: the host reads them to allocate it.
DATA_SIZED = ("nonzero", "unique", "masked_select", "repeat_interleave", "bincount")


def _on_device(x) -> bool:
    return isinstance(x, torch.Tensor) and not is_host(x.device)


def _blocking_copy(name: str, args: tuple, kwargs: dict, out) -> str | None:
    """``"copy to the device"`` or ``"copy to the host"`` for a copy between host and device memory that waits,
    else None. Only a non-blocking copy whose host side is pinned does not: torch synchronizes the stream after a
    blocking one, and CUDA makes one from or into pageable memory synchronous (``usaf.backends.transfer.upload``
    goes through pinned memory for that)."""
    if name.startswith("_to_copy"):
        src, dst, non_blocking = args[0], out, kwargs.get("non_blocking", False)
    elif name.startswith("copy_"):
        src, dst = args[1], args[0]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    else:
        return None
    if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)) or _on_device(src) == _on_device(dst):
        return None
    host = dst if _on_device(src) else src
    if non_blocking and host.is_pinned():
        return None
    return "copy to the device" if _on_device(dst) else "copy to the host"


def waits_for_device(name: str, args: tuple, kwargs: dict, out) -> str | None:
    """Why this call (operator ``name``) makes the host wait for the device to finish what it queued: ``"copy to
    the device"``, ``"copy to the host"``, ``"scalar read"`` or ``"sized by the data"``; None if it does not."""
    copy = _blocking_copy(name, args, kwargs, out)
    if copy is not None:
        return copy
    if not any(_on_device(a) for a in args):
        return None
    if name.startswith("_local_scalar_dense"):
        return "scalar read"
    return "sized by the data" if name.startswith(DATA_SIZED) else None


class DispatchCount(TorchDispatchMode):
    """Inside ``with DispatchCount() as count:``, ``count.ops`` operators ran (views included) and
    ``count.syncs`` of them waited for the device; ``count.waiting`` counts those by why (:func:`waits_for_device`),
    ``count.names`` every operator by its name (``"index_select.default"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: Counter[str] = Counter()
        self.names: Counter[str] = Counter()

    @property
    def ops(self) -> int:
        return sum(self.names.values())

    @property
    def syncs(self) -> int:
        return sum(self.waiting.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.names[func.__name__] += 1
        why = waits_for_device(func.__name__, args, kwargs, out)
        if why is not None:
            self.waiting[why] += 1
        return out


def count_dispatch(fn: Callable[[], object]) -> DispatchCount:
    """Run ``fn()`` once under a :class:`DispatchCount`; the count."""
    with DispatchCount() as count:
        fn()
    return count
