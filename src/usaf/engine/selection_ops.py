"""Three selection primitives of the score pools, with a host-memory path through numpy.

On one CPU thread torch's comparison, ``nonzero`` and ``kthvalue`` are several times slower than numpy's at the
sizes a score pool works on (one expert slice: ~200 k values; a pool: ~750 k). Measured with torch 2.13 (one
thread): ``x > t`` then ``nonzero`` on 196,608 floats, 430 µs against numpy's 90 µs; the 252,000-th smallest of
755,000 floats, ``kthvalue`` 12.6 ms against ``np.partition`` 1.1 ms. Every collecting training step runs the
first on every routed expert slice, so on CPU these go through numpy (zero-copy views of the same memory);
on other devices they are torch's own ops. Both paths give identical results.

The k-th smallest of a large fp32 array on the host is a radix select: non-negative floats order as their bit
patterns, so one histogram of the top 16 bits (sign, exponent, 7 mantissa bits) finds the bin that holds it, and
only that bin is partitioned. At a 128-expert ``gate_up`` pool's cut (the 251,756-th of 755,072 scores spread
over the experts' segments) that took 1.7-1.8 ms against ``np.partition``'s 4.8-5.2 ms (uniform, heavy-tailed and
tied scores; the 1.1 ms above was another array), and the first collecting step of a RigL window at 128 experts
cuts its pools 16-26 times (docs/BENCHMARKS.md, "Cutting the pool"). Arrays holding a negative value or -0.0
(whose patterns do not order) go to ``np.partition``; the value is the same.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from usaf.backends.transfer import is_host

__all__ = ["kth_smallest", "positions", "positions_above"]


def positions_above(values: Tensor, threshold: Tensor) -> Tensor:
    """``(m,)`` int64 positions of ``values (n,)`` (fp32) strictly above ``threshold`` (a 0-d fp32), ascending."""
    if is_host(values.device):
        # np.float32: the comparison stays in fp32 on every numpy version, exactly as torch's.
        return torch.from_numpy(np.flatnonzero(values.numpy() > np.float32(threshold.item())))
    return (values > threshold).nonzero().squeeze(1)


def positions(mask: Tensor) -> Tensor:
    """``(m,)`` int64 positions where the bool ``mask (n,)`` is true, ascending."""
    if is_host(mask.device):
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().squeeze(1)


def kth_smallest(values: Tensor, k: int) -> Tensor:
    """The ``k``-th smallest of ``values (n,)`` (1-based, ``1 <= k <= n``) as a 0-d tensor on their device."""
    if is_host(values.device):
        return torch.tensor(_kth_smallest_host(values.numpy(), k))
    return values.kthvalue(k).values


_RADIX_MIN = 2**16  # below this many values a partition of the whole array costs about as much as the histogram


def _kth_smallest_host(x: np.ndarray, k: int) -> np.generic:
    """``np.partition(x, k - 1)[k - 1]``, by a radix select on fp32 (see the module docstring)."""
    if x.dtype != np.float32 or x.size < _RADIX_MIN:
        return np.partition(x, k - 1)[k - 1]
    bits = x.view(np.uint32)  # (n,)
    high = bits >> 16  # (n,) each value's bin: sign, exponent and the top 7 mantissa bits
    counts = np.bincount(high, minlength=1 << 16)  # (65536,)
    if counts[1 << 15 :].any():  # a sign bit is set (a negative value or -0.0): bit order is not value order
        return np.partition(x, k - 1)[k - 1]
    at_or_below = np.cumsum(counts)  # (65536,) values in each bin and every bin below it
    b = int(np.searchsorted(at_or_below, k))  # the first bin that reaches the k-th value (NaN's bins sort last)
    rank = k - (int(at_or_below[b - 1]) if b else 0)  # its rank within that bin
    return np.partition(bits[high == b], rank - 1)[rank - 1].view(np.float32)
