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
from torch import nn


class SavedTensorMeter:
    """Peak bytes of distinct storages saved for backward during one measured forward.

    Args:
        weight_storages: returns the data pointers of storages that are weights (parameters, buffers,
            resident bases), excluded because the accounting counts them as weights.
        start_at: count only from this module's first call on (the first decoder layer). What a model
            does before it — build attention masks, look up embeddings — saves nothing of note for
            backward (the token ids), and transformers 4.x on torch < 2.6 builds sliding-window masks
            (gpt-oss) with ``torch.func.vmap``, which refuses to run while saved-tensor hooks are set.
            None: count from the start of :meth:`measure`.
    """

    def __init__(self, weight_storages: Callable[[], set[int]], *, start_at: nn.Module | None = None) -> None:
        self._weight_storages = weight_storages
        self._start_at = start_at
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

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        entered = False

        def enter(*_: object) -> None:
            nonlocal entered
            if not entered:  # hooks stack: entered once, left below after everything the forward pushed
                hooks.__enter__()
                entered = True

        handle = self._start_at.register_forward_pre_hook(enter) if self._start_at is not None else None
        if handle is None:
            enter()
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()
            if entered:
                hooks.__exit__(None, None, None)
        self.last = sum(seen.values())
        self.peak = max(self.peak, self.last)
