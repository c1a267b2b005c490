"""A sparse delta on a plain ``nn.Linear`` of a trainable layer: attention projections, shared experts.

The module's own weight ``(O, I)`` is the frozen base (as the quantized directory stores it, unquantized),
seen as one expert ``(1, O, I)`` so masks, scores and reselection address it like an expert tensor. Its
forward is replaced, on this module instance only, by ``x @ (W + D)^T + b`` through
:func:`usaf.engine.sparse_linear.sparse_delta_linear`: the same SDDMM gradient, no dense weight gradient.

Folds (reselection's dropped entries) are written into the module's weight, like an expert tensor's resident
base; the original values of folded entries are kept (``(m,)``, a few KB), so a fold is always
``original + frozen`` rounded once and a resumed run rebuilds the same weight.
"""

from __future__ import annotations

import torch
from torch import nn

from usaf.engine.trainable import TrainableTensor

ATTRIBUTE = "usaf_target"  # where the target is attached on its nn.Linear (a submodule: its delta moves with it)


class LinearTarget(TrainableTensor):
    """The trainable state of one ``nn.Linear``; attach with :func:`attach`."""

    def __init__(self, module: nn.Linear) -> None:
        weight = module.weight
        super().__init__((1, weight.shape[0], weight.shape[1]), weight.dtype)
        # Not a submodule: the Linear owns this target (``module.usaf_target``), not the other way round.
        object.__setattr__(self, "_module", module)
        self.originals = torch.zeros(0, dtype=torch.float32)  # (m,) the weight before folds, at frozen_indices

    @property
    def module(self) -> nn.Linear:
        return self._module

    @property
    def home(self) -> torch.device:
        return self.module.weight.device

    def base(self, expert: int, device: torch.device) -> torch.Tensor:
        """The module's weight ``(O, I)`` (folds included), on ``device``."""
        if expert != 0:
            raise IndexError(f"a linear target has one expert (0), not {expert}")
        return self.module.weight.to(device, non_blocking=True)

    @torch.no_grad()
    def _before_fold(self, indices: torch.Tensor) -> None:
        """Keep the original value of every entry folded for the first time (the record is about to grow)."""
        device = self.frozen_indices.device
        indices = torch.unique(indices.to(device))
        new = indices[~torch.isin(indices, self.frozen_indices)]
        if not new.numel():
            return
        weight = self.module.weight.detach().reshape(-1)
        merged = torch.cat([self.frozen_indices, new])
        order = torch.argsort(merged)  # the record's order after the fold: sorted ascending
        originals = torch.cat([self.originals.to(device), weight[new.to(weight.device)].float().to(device)])
        self.originals = originals[order]

    @torch.no_grad()
    def _write_frozen(self, indices: torch.Tensor) -> None:
        """``weight[i] = round(original[i] + frozen[i])`` for the given (unique) flat indices."""
        if not indices.numel():
            return
        record = self.frozen_indices.to(indices.device)
        at = torch.searchsorted(record, indices)  # positions in the record
        total = self.originals.to(indices.device)[at] + self.frozen_values.to(indices.device)[at]  # fp32
        weight = self.module.weight
        flat = weight.detach().reshape(-1)
        if self.index_ops:
            flat[indices.to(weight.device)] = total.to(weight.device, weight.dtype)
        else:  # no index_put_ on the device: edit a host copy, copy it back whole
            edited = flat.to("cpu", copy=True)
            edited[indices.cpu()] = total.cpu().to(edited.dtype)
            weight.detach().copy_(edited.view_as(weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The module's forward: ``x (..., I) -> (..., O)`` through base + delta (+ bias)."""
        flat = x.reshape(-1, x.shape[-1])  # (N, I)
        y = self.linear(flat, 0, self.module.bias)  # (N, O)
        return y.view(*x.shape[:-1], y.shape[-1])

    def nbytes(self) -> dict[str, int]:
        return {**self.delta_nbytes(), "originals": self.originals.nbytes}


def attach(module: nn.Linear, *, index_ops: bool = True) -> LinearTarget:
    """Make ``module`` a sparse-delta target: its forward goes through the target from now on (idempotent).

    Nothing global is patched: the instance's ``forward`` attribute shadows the class's for this module only.
    """
    existing = getattr(module, ATTRIBUTE, None)
    if existing is not None:
        return existing
    if not isinstance(module, nn.Linear):
        raise TypeError(f"a linear target must be an nn.Linear, not {type(module).__name__}")
    target = LinearTarget(module)
    target.index_ops = index_ops
    setattr(module, ATTRIBUTE, target)  # registered: its delta's values and buffers move with the model
    module.forward = target.forward
    return target
