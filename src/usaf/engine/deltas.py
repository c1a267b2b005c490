"""Sparse trainable deltas over one fused expert tensor.

A delta lives in the *stored* orientation of the quantized tensor, ``(E, O, I)`` out-major (see
``usaf.quant.QuantizedTensor.shape``), whatever the family's in-memory orientation: entry ``j`` changes
weight ``[expert[j], row[j], col[j]]`` by ``values[j]``, so the trained weight is ``base + delta``.
Indices are flat (``e * O * I + r * I + c``), unique and sorted, so each expert's entries are one
contiguous segment ``values[offsets[e]:offsets[e + 1]]`` — the engine hands exactly that slice to the
expert's matmul, and autograd accumulates the slices' gradients into ``values.grad``.
"""

from __future__ import annotations

import torch
from torch import nn


class SparseDelta(nn.Module):
    """Sorted flat indices into ``(E, O, I)`` plus fp32 values (a trainable ``nn.Parameter``).

    Buffers (moved with the module): ``indices (n,)``, ``experts (n,)``, ``rows (n,)``, ``cols (n,)``
    (all int64) and ``offsets (E + 1,)``.
    """

    def __init__(self, shape: tuple[int, int, int], indices: torch.Tensor, values: torch.Tensor | None = None) -> None:
        super().__init__()
        num_experts, out_features, in_features = (int(d) for d in shape)
        self.shape = (num_experts, out_features, in_features)
        indices = torch.as_tensor(indices, dtype=torch.int64).flatten().cpu()
        if indices.numel() and (indices[1:] <= indices[:-1]).any():
            raise ValueError("delta indices must be unique and sorted ascending")
        if indices.numel() and not (
            int(indices[0]) >= 0 and int(indices[-1]) < num_experts * out_features * in_features
        ):
            raise ValueError(f"delta indices out of range for shape {self.shape}")
        if values is None:
            values = torch.zeros(indices.numel(), dtype=torch.float32)
        elif values.shape != indices.shape:
            raise ValueError(f"values {tuple(values.shape)} do not match indices {tuple(indices.shape)}")
        per_expert = out_features * in_features
        self.register_buffer("indices", indices)
        self.register_buffer("experts", indices // per_expert)
        self.register_buffer("rows", (indices % per_expert) // in_features)
        self.register_buffer("cols", indices % in_features)
        boundaries = torch.arange(num_experts + 1, dtype=torch.int64) * per_expert
        self.register_buffer("offsets", torch.searchsorted(indices, boundaries))
        # The same offsets on the host: segment() runs per expert per pass, and reading a GPU buffer costs a sync
        # each time (two per expert: 850 a training step at 128 experts, stalling the launch queue).
        self._bounds: list[int] = self.offsets.tolist()
        self.values = nn.Parameter(values.detach().to(torch.float32).clone())

    @property
    def nnz(self) -> int:
        return self.indices.numel()

    def segment(self, expert: int) -> tuple[int, int]:
        """``(start, end)`` of ``expert``'s entries in ``values``/``rows``/``cols``."""
        return self._bounds[expert], self._bounds[expert + 1]

    def expert_entries(self, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(rows, cols, values)`` of one expert; ``values`` is a slice of the parameter (grads flow)."""
        start, end = self.segment(expert)
        return self.rows[start:end], self.cols[start:end], self.values[start:end]

    @torch.no_grad()
    def reindex(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Swap in a new index set and its values, keeping the ``values`` Parameter object.

        Optimizers and parameter groups hold that object, so it stays; its gradient belonged to the
        old positions and is dropped. The caller moves optimizer state (``SparseAdamW.remap_state``).

        Args:
            indices: ``(n',)`` flat indices, unique and sorted ascending (checked).
            values: ``(n',)`` new values (cast to fp32).
        """
        fresh = SparseDelta(self.shape, indices, values)  # validates and derives the buffers
        device = self.values.device
        for name, buffer in fresh.named_buffers():
            setattr(self, name, buffer.to(device))
        self._bounds = fresh._bounds
        self.values.data = fresh.values.data.to(device)
        self.values.grad = None

    def dense(self, expert: int | None = None) -> torch.Tensor:
        """The delta as a dense tensor: ``(O, I)`` for one expert, else ``(E, O, I)``. For tests and export."""
        if expert is not None:
            rows, cols, values = self.expert_entries(expert)
            out = torch.zeros(self.shape[1:], dtype=values.dtype, device=values.device)
            out[rows, cols] = values.detach()
            return out
        out = torch.zeros(self.shape, dtype=self.values.dtype, device=self.values.device)
        out.view(-1)[self.indices] = self.values.detach()
        return out

    def extra_repr(self) -> str:
        return f"shape={self.shape}, nnz={self.nnz}"
