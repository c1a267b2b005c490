"""A trainable layer's dequantized experts, stored in expert chunks that respect a per-allocation limit.

Trainable layers keep their frozen base ``(E, O, I)`` dequantized once, in the compute dtype. On most
devices that is one tensor. DirectML fails single allocations above about 800 MB, and Qwen3-30B-A3B's
fp16 ``gate_up_proj`` base is 805 MB, so there the base is held as several tensors, each a run of whole
experts (the forward reads one expert ``(O, I)`` at a time, and a whole expert is always one
contiguous slice of one chunk). Dequantization also runs in expert batches whose fp32 transient
stays under the limit.
"""

from __future__ import annotations

import torch

from usaf.backends.transfer import device_capabilities
from usaf.quant import QuantizedTensor, dequantize


class ResidentBase:
    """``(E, O, I)`` as expert-contiguous chunks: chunk ``c`` holds experts ``[c * per_chunk, (c + 1) * per_chunk)``.

    Args:
        chunks: ``(e_c, O, I)`` tensors of one dtype on one device; all but the last have ``per_chunk`` experts.
    """

    def __init__(self, chunks: list[torch.Tensor]) -> None:
        if not chunks:
            raise ValueError("a resident base needs at least one chunk")
        self.chunks = chunks
        self.per_chunk = chunks[0].shape[0]
        self.shape = (sum(c.shape[0] for c in chunks), *chunks[0].shape[1:])  # (E, O, I)

    @classmethod
    def dequantized(
        cls,
        q: QuantizedTensor,
        *,
        dtype: torch.dtype,
        device: torch.device | None,
        pin: bool = False,
        max_bytes: int | None = None,
    ) -> ResidentBase:
        """Dequantize every expert of ``q`` into chunks of at most ``max_bytes`` each.

        Args:
            q: the 4-bit tensor, stored ``(E, O, I)``.
            dtype: the compute dtype of the base.
            device: where the base lives (None: where ``q``'s codes are).
            pin: page-locked host memory instead (copied to the device one expert at a time when used).
            max_bytes: the largest single tensor allowed where the base lives; None looks up that
                device's ``Capabilities.max_allocation_bytes`` (None there: no limit, one chunk).
        """
        e, o, i = q.shape
        where = torch.device("cpu") if pin else torch.device(device) if device is not None else q.codes.device
        if max_bytes is None:
            max_bytes = device_capabilities(where).max_allocation_bytes
        expert_bytes = o * i * torch.empty(0, dtype=dtype).element_size()
        per_chunk = e if max_bytes is None else _fitting(max_bytes, expert_bytes, e)
        # dequantize computes in fp32: its transients are 4 bytes an element, whatever ``dtype`` is
        per_batch = e if max_bytes is None else _fitting(max_bytes, o * i * 4, e)
        chunks = []
        for start in range(0, e, per_chunk):
            stop = min(start + per_chunk, e)
            if per_batch >= stop - start:  # one call: the result is the chunk, no second copy
                chunk = dequantize(q, experts=slice(start, stop), dtype=dtype, device=where, memory_layout=False)
            else:
                chunk = torch.empty((stop - start, o, i), dtype=dtype, device=where)  # (e_c, O, I)
                for first in range(start, stop, per_batch):
                    last = min(first + per_batch, stop)
                    part = dequantize(q, experts=slice(first, last), dtype=dtype, device=where, memory_layout=False)
                    chunk[first - start : last - start].copy_(part)
            chunks.append(chunk.pin_memory() if pin else chunk)
        return cls(chunks)

    def expert(self, index: int) -> torch.Tensor:
        """Expert ``index``'s ``(O, I)`` base: a view, so writes reach the stored base."""
        return self.chunks[index // self.per_chunk][index % self.per_chunk]

    def run(self, first: int, stop: int) -> torch.Tensor:
        """Experts ``[first, stop)`` as one ``(e, O, I)`` view; they must lie in one chunk."""
        chunk = first // self.per_chunk
        if (stop - 1) // self.per_chunk != chunk:
            raise ValueError(f"experts {first}..{stop - 1} span two chunks of {self.per_chunk}")
        offset = chunk * self.per_chunk
        return self.chunks[chunk][first - offset : stop - offset]

    def write(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """``base.view(-1)[indices] = values``: ``(n,)`` flat indices into ``(E, O, I)``, on the base's device.

        One ``index_put_`` per chunk touched (needs index ops on the device).
        """
        per_chunk = self.per_chunk * self.shape[1] * self.shape[2]  # elements in a full chunk
        chunk_of = indices // per_chunk
        for c in torch.unique(chunk_of).tolist():
            mine = chunk_of == c
            self.chunks[c].view(-1)[indices[mine] - c * per_chunk] = values[mine].to(self.dtype)

    @property
    def device(self) -> torch.device:
        return self.chunks[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.chunks[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.chunks)

    def dense(self) -> torch.Tensor:
        """The whole ``(E, O, I)`` base as one tensor (a copy when chunked): for checks and tests."""
        return self.chunks[0] if len(self.chunks) == 1 else torch.cat(self.chunks)


def _fitting(max_bytes: int, unit_bytes: int, count: int) -> int:
    """How many ``unit_bytes`` units fit in one ``max_bytes`` tensor (1 to ``count``); at least 1."""
    return max(1, min(count, max_bytes // unit_bytes))
