"""Measuring the activation memory of a training forward: the bytes autograd keeps for backward.

Every tensor autograd saves passes through ``torch.autograd.graph.saved_tensors_hooks``; counting each
underlying storage once, minus the storages of weights (counted elsewhere in the engine's accounting),
gives what one forward's graph holds until its backward frees it. This is a measurement of the step
actually run, not a formula, so it covers whatever the family's attention, routing and loss save.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


class SavedTensorMeter:
    """Peak bytes of distinct storages saved for backward during one measured forward.

    Args:
        weight_storages: returns the data pointers of storages that are weights (parameters, buffers,
            resident bases), excluded because the accounting counts them as weights.
    """

    def __init__(self, weight_storages: Callable[[], set[int]]) -> None:
        self._weight_storages = weight_storages
        self.last = 0  # bytes saved by the most recent measured forward
        self.peak = 0  # the largest of those since construction or reset()

    def reset(self) -> None:
        self.last = self.peak = 0

    @contextmanager
    def measure(self) -> Iterator[None]:
        if not torch.is_grad_enabled():
            yield  # no graph is built: nothing is held for a backward
            return
        excluded = self._weight_storages()
        seen: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
                return tensor
            pointer = storage.data_ptr()
            if pointer not in excluded:
                seen[pointer] = max(seen.get(pointer, 0), storage.nbytes())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self.last = sum(seen.values())
        self.peak = max(self.peak, self.last)
