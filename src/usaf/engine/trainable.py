"""What every sparse-delta target shares: a frozen base, a trainable :class:`SparseDelta`, the frozen record.

A target is a tensor of shape ``(E, O, I)`` in the stored (out-major) orientation: a fused expert tensor
(:class:`usaf.engine.experts.ExpertWeight`, E experts over a 4-bit base) or a plain ``nn.Linear`` weight seen
as one expert, ``(1, O, I)`` (:class:`usaf.engine.linear_target.LinearTarget`: attention, shared experts).
Scores, masks, reselection, checkpoints and exports address both through this interface alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from usaf.backends.transfer import move
from usaf.engine.deltas import SparseDelta
from usaf.engine.sparse_linear import sparse_delta_linear

ScoreSinkFactory = Callable[[int], Callable[[torch.Tensor, torch.Tensor], None]]


class TrainableTensor(nn.Module, ABC):
    """A frozen base ``(E, O, I)`` that may carry a sparse delta; subclasses say where the base lives.

    Subclasses implement :meth:`base` (one expert's ``(O, I)`` in the compute dtype), :attr:`home` (the device
    of the base, where the delta lives; None until known) and :meth:`_write_frozen` (rewrite folded entries
    of the base as ``original + frozen``, rounded once).
    """

    def __init__(self, shape: tuple[int, int, int], compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = tuple(int(d) for d in shape)  # (E, O, I)
        self.compute_dtype = compute_dtype
        self.delta: SparseDelta | None = None
        self.score_sink: ScoreSinkFactory | None = None  # dense-score mode: expert -> sink
        self.index_ops = True  # Capabilities.index_ops of the device; False: no index_add_/index_put_ there
        # The frozen record (usaf.engine.reselect): trained values of entries dropped at reselections,
        # sorted unique flat indices into (E, O, I) + fp32 cumulative values. They are also written
        # into the base, so the forward pays nothing; the record lets checkpoints and export
        # reproduce base + frozen + active exactly.
        self.frozen_indices = torch.zeros(0, dtype=torch.int64)  # (m,)
        self.frozen_values = torch.zeros(0, dtype=torch.float32)  # (m,)

    @property
    @abstractmethod
    def home(self) -> torch.device | None:
        """The device of the base, where the delta lives; None until known."""

    @abstractmethod
    def base(self, expert: int, device: torch.device) -> torch.Tensor:
        """One expert's frozen base ``(O, I)`` in the compute dtype, on ``device``."""

    @abstractmethod
    def _write_frozen(self, indices: torch.Tensor) -> None:
        """Rewrite the base at flat ``indices`` as ``original + frozen``, rounded once."""

    def _check_foldable(self) -> None:
        """Raise ValueError when the base cannot take folds yet."""

    @torch.no_grad()
    def fold(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``values`` at flat ``indices`` to the frozen record and to the base.

        Duplicates (within ``indices`` or with the record) sum. Each touched element of the base is
        rewritten as ``original + frozen`` in fp32, rounded once to its dtype, so repeated folds do not
        accumulate rounding and a rebuilt base (resume) is identical.

        Args:
            indices: ``(k,)`` int64 flat indices into ``(E, O, I)``.
            values: ``(k,)`` values to add (cast to fp32).
        """
        self._check_foldable()
        # the record's arithmetic (unique, index_add_) runs on the host where the device lacks index ops
        device = self.home if self.index_ops and self.home is not None else torch.device("cpu")
        indices = torch.as_tensor(indices, dtype=torch.int64).reshape(-1).to(device)
        values = move(torch.as_tensor(values).reshape(-1), device, torch.float32)
        if indices.shape != values.shape:
            raise ValueError(f"indices {tuple(indices.shape)} do not match values {tuple(values.shape)}")
        numel = self.shape[0] * self.shape[1] * self.shape[2]
        if indices.numel() and not (int(indices.min()) >= 0 and int(indices.max()) < numel):
            raise ValueError(f"fold indices out of range for shape {tuple(self.shape)}")
        self._before_fold(indices)
        merged = torch.cat([self.frozen_indices.to(device), indices])
        unique, inverse = torch.unique(merged, return_inverse=True)  # sorted ascending
        summed = torch.zeros(unique.numel(), dtype=torch.float32, device=device)
        summed.index_add_(0, inverse, torch.cat([self.frozen_values.to(device), values]))
        self.frozen_indices, self.frozen_values = unique, summed
        self._write_frozen(torch.unique(indices))

    def _before_fold(self, indices: torch.Tensor) -> None:
        """Hook: called with a fold's indices before the record changes (a base that keeps originals)."""

    def linear(
        self, x: torch.Tensor, expert: int, bias: torch.Tensor | None = None, *, score: bool = True
    ) -> torch.Tensor:
        """``x (T, I) -> (T, O)`` through expert ``expert``'s base + delta.

        ``score=False``: no dense-score sink even in score mode (the dense router pass, which has no backward).
        """
        weight = self.base(expert, x.device)
        sink = self.score_sink(expert) if self.score_sink is not None and score else None
        if self.delta is None and sink is None:
            return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        if self.delta is not None:
            rows, cols, values = self.delta.expert_entries(expert)
        else:  # score mode without a delta: an empty trainable set still routes the backward here
            rows = cols = torch.zeros(0, dtype=torch.int64, device=x.device)
            values = EMPTY_VALUES.get(x.device)
        return sparse_delta_linear(x, weight, rows, cols, values, bias, score_sink=sink, index_ops=self.index_ops)

    def delta_nbytes(self) -> dict[str, int]:
        """Bytes of the delta (fp32 values + its int64 index buffers) and of the frozen record."""
        delta = 0
        if self.delta is not None:  # fp32 values + the int64 index buffers (flat, expert, row, col, offsets)
            delta = sum(t.numel() * t.element_size() for t in [*self.delta.parameters(), *self.delta.buffers()])
        return {"delta": delta, "frozen": self.frozen_indices.nbytes + self.frozen_values.nbytes}


class _EmptyValues:
    """One zero-size tensor that requires grad per device, so score mode reaches the custom backward."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        if device not in self._by_device:
            self._by_device[device] = torch.zeros(0, dtype=torch.float32, device=device, requires_grad=True)
        return self._by_device[device]


EMPTY_VALUES = _EmptyValues()
