"""One pass per MoE layer for experts with no trainable delta: frozen layers and inference (issue 21, item 1).

The per-expert loop (:func:`usaf.engine.experts.usaf_experts_forward`) issues for every routed expert a token
search, a gather, a dequantization, two GEMMs, the gate and an ``index_add_``. On a GPU at 128 experts that is
hundreds of small kernels per layer and the forward is launch-bound. Here the tokens are sorted by expert
once, the routed experts are dequantized in a few vectorized calls (blocks of experts whose fp32 transient
stays under a byte budget), each block's two GEMMs go through torch's grouped matmul (where the device and
dtype have it; else one ``F.linear`` per expert of the block), and one ``index_add_`` per block combines.

It runs where no autograd graph is recorded (prefix capture, score's and eval's frozen layers, generate):
under a graph, or with sparse deltas, a layer's experts run through :mod:`usaf.engine.grouped_deltas` (its own
autograd function per tensor; torch 2.13's CPU grouped matmul backward refuses an expanded gradient) where the
device asks for it, else the per-expert loop. On CPU in fp32 the output is
bit-identical to the loop's: the same per-expert products, added into each token in the same (ascending
expert) order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from usaf.backends.transfer import is_host, upload
from usaf.families.modules import EXPERT_BIAS_PARAMS

# The fp32 bytes of one block's experts (both tensors; each tensor is dequantized just before its GEMM, so one
# tensor's transient is held at a time). On the host a block should stay in the cache (one call over all 128
# experts was slower than one call per expert there), yet hold a few experts: of 2 to 32 MiB, 8 MiB ran the whole
# forward fastest or within 2 % of it (docs/BENCHMARKS.md, "The frozen-layer forward"). On a device, fewer and
# larger calls are the point, bounded so the transient stays a small share of a 12 GB card (3 experts of
# Qwen3-30B-A3B's width).
HOST_BLOCK_BYTES = 8 * 2**20
DEVICE_BLOCK_BYTES = 64 * 2**20

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch's grouped matmul accepts


def applies(state, hidden_states: torch.Tensor) -> bool:
    """Whether this forward of ``state`` (a ``LayerExperts``) can run grouped: no graph, no delta, no sink."""
    if not state.index_ops or (torch.is_grad_enabled() and hidden_states.requires_grad):
        return False
    return all(w.delta is None and w.score_sink is None for w in (state.gate_up, state.down))


def block_bytes(device: torch.device) -> int:
    return HOST_BLOCK_BYTES if is_host(device) else DEVICE_BLOCK_BYTES


def grouped_forward(
    self: nn.Module, state, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """``(T, H) -> (T, H)`` fp32 accumulation of the routed experts' outputs, weighted (before the final cast).

    Args:
        self: the family's fused experts module (its ``_apply_gate``, biases, post-expert norm).
        state: its ``LayerExperts``.
        hidden_states: ``(T, H)``.
        top_k_index: ``(T, k)`` routed experts per token.
        top_k_weights: ``(T, k)`` their routing weights.
    """
    k = top_k_index.shape[1]
    counts = state.record_load(top_k_index)  # (E,) tokens per expert, on the host; one sync, as the loop's nonzero
    flat = top_k_index.reshape(-1)  # (T*k,) token-major
    order = torch.argsort(flat, stable=True)  # (T*k,) expert-major, each expert's rows in token order
    rows_token = order // k  # (T*k,) the token of each expert-major row
    x = hidden_states[rows_token]  # (T*k, H)
    weights = top_k_weights.reshape(-1)[order, None]  # (T*k, 1)
    out = torch.zeros_like(hidden_states, dtype=torch.float32)  # (T, H)
    biases = module_biases(self)
    for block in _blocks(state, counts, hidden_states.device):
        rows = block.rows
        ends = group_ends(block.counts, x.device) if state.grouped_mm else None  # both tensors' groups
        # Each tensor dequantized right before its GEMM (and dropped after): its fresh values are still in the
        # cache when they are read, and only one tensor's transient is held at a time.
        gate_up = state.gate_up.block(block.experts, x.device)  # (e, 2I, H)
        h = grouped_linear(x[rows], gate_up, block.counts, biases[0], block.ids, state.grouped_mm, ends)  # (n, 2I)
        del gate_up
        h = self._apply_gate(h)  # (n, I)
        down = state.down.block(block.experts, x.device)  # (e, H, I)
        y = grouped_linear(h, down, block.counts, biases[1], block.ids, state.grouped_mm, ends)  # (n, H)
        del down
        if getattr(self, "has_post_expert_norm", False):
            y = self.post_expert_norm(y)
        out.index_add_(0, rows_token[rows], (y * weights[rows]).float())
    return out


class FrozenBlock(NamedTuple):
    """Experts of one frozen layer run together, and what the forward needs of them, all known on the host."""

    experts: slice | torch.Tensor  # what to read: a run of consecutive experts, else (e,) int64 ascending
    ids: torch.Tensor  # (e,) int64: the experts (for their biases)
    counts: torch.Tensor  # (e,) int64: rows per expert
    rows: slice  # their expert-major rows


def _blocks(state, counts: torch.Tensor, device: torch.device) -> Iterator[FrozenBlock]:
    """Runs of routed experts, in ascending order, over consecutive expert-major rows.

    Resident bases (on ``device``) are read as views: a block is a run of consecutive experts within one
    stored chunk of each tensor (their chunks differ in size), unrouted ones included (their groups are
    empty). Otherwise a block is a run of routed experts whose fp32 dequantization transient (both
    tensors) fits :func:`block_bytes`; where they are consecutive (every block when all experts are routed) they
    are read as a slice, from views of the codes.
    """
    sizes = counts.tolist()  # (E,) on the host: python ints, so no block reads a tensor element back
    ends = list(itertools.accumulate(sizes))  # expert-major row where each expert's rows end
    routed = [e for e, n in enumerate(sizes) if n]  # ascending

    def make(chosen: list[int]) -> FrozenBlock:  # routed experts, ascending
        first, last = chosen[0], chosen[-1]
        run = last - first + 1 == len(chosen)
        experts = slice(first, last + 1) if run else torch.tensor(chosen)
        ids = torch.arange(first, last + 1) if run else experts
        return FrozenBlock(experts, ids, counts[experts], slice(ends[first] - sizes[first], ends[last]))

    if _resident_on(state, device):
        per_chunk = [w.resident.per_chunk for w in (state.gate_up, state.down)]
        chunk = [tuple(e // size for size in per_chunk) for e in routed]  # the chunk of each tensor it lies in
        first = 0
        for j in range(1, len(routed) + 1):
            if j == len(routed) or chunk[j] != chunk[first]:
                yield make(list(range(routed[first], routed[j - 1] + 1)))
                first = j
        return
    per_expert = 4 * sum(w.shape[1] * w.shape[2] for w in (state.gate_up, state.down))  # fp32 bytes
    budget = max(1, block_bytes(device) // per_expert)
    for first in range(0, len(routed), budget):
        yield make(routed[first : first + budget])


def _resident_on(state, device: torch.device) -> bool:
    return all(w.resident is not None and w.resident.device == device for w in (state.gate_up, state.down))


def module_biases(self: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(gate_up_bias (E, 2I), down_bias (E, H))`` of a fused experts module, or ``(None, None)``."""
    if not getattr(self, "has_bias", False):
        return None, None
    return tuple(getattr(self, name) for name in EXPERT_BIAS_PARAMS)


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: torch.Tensor,
    bias: torch.Tensor | None,
    experts: torch.Tensor,
    grouped_mm: bool,
    ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x (n, I)`` expert-major rows through ``weight (e, O, I)``, ``counts (e,)`` rows each -> ``(n, O)``.

    ``grouped_mm``: the device has torch's grouped matmul (``Capabilities.grouped_mm``). ``ends``: the groups' end
    rows on the device (:func:`group_ends`), where a caller passes the same groups more than once.
    """
    w = weight.to(x.dtype)
    if grouped_mm and _grouped_mm_fits(x, w):
        y = _grouped_mm(x, w.transpose(1, 2), group_ends(counts, x.device) if ends is None else ends)  # (n, O)
        if bias is not None:
            row_experts = upload(torch.repeat_interleave(experts.cpu(), counts.cpu()), bias.device)  # (n,)
            y = y + bias.to(x.dtype).index_select(0, row_experts)
        return y
    parts, start = [], 0
    for j, n in enumerate(counts.tolist()):  # the device or dtype has no grouped matmul: one GEMM per expert
        b = None if bias is None else bias[int(experts[j])].to(x.dtype)
        parts.append(F.linear(x[start : start + n], w[j], b))
        start += n
    return torch.cat(parts)


def group_ends(counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``(e,)`` int32 on ``device``: the end row of each group, from its row ``counts (e,)`` (on the host)."""
    return upload(torch.cumsum(counts, 0).to(torch.int32), device)


def grouped_weight_grad(
    dy: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, grouped_mm: bool, ends: torch.Tensor | None = None
) -> torch.Tensor:
    """Each expert's weight gradient ``dy_e^T x_e``: ``dy (n, O)``, ``x (n, I)`` expert-major rows -> ``(e, O, I)``.

    ``counts (e,)`` rows each, on the host; an expert with no rows gets zeros. ``ends`` as in :func:`grouped_linear`.
    """
    if grouped_mm and _grouped_mm_fits(dy.t(), x):  # both operands 2-D: the rows are the groups
        return _grouped_mm(dy.t(), x, group_ends(counts, x.device) if ends is None else ends)
    out = x.new_empty(len(counts), dy.shape[1], x.shape[1])  # (e, O, I)
    start = 0
    for j, n in enumerate(counts.tolist()):  # no grouped matmul for this device or dtype: one GEMM per expert
        torch.mm(dy[start : start + n].t(), x[start : start + n], out=out[j])
        start += n
    return out


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    op = getattr(torch.nn.functional, "grouped_mm", None)  # public since torch 2.10
    return op(x, w, offs=offsets) if op is not None else torch._grouped_mm(x, w, offs=offsets)


def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch's grouped matmul takes ``x (n, I)`` with ``w (e, O, I)`` (or, both 2-D, ``(O, n)`` with ``(I, n)``,
    for a weight gradient): a supported dtype, and 16-byte aligned leading strides and pointers, either operand
    row- or column-major in its last two dimensions."""
    if x.dtype not in _GROUPED_DTYPES or w.dtype != x.dtype:
        return False
    size = x.element_size()
    leads = [_leading_stride(x), _leading_stride(w)]
    if None in leads:
        return False
    strides = [lead * size for lead in leads] + ([w.stride(0) * size] if w.dim() == 3 else [])
    return all(s % 16 == 0 for s in strides) and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0


def _leading_stride(t: torch.Tensor) -> int | None:
    """The stride between rows (row-major) or columns (column-major) of ``t``'s last two dimensions, else None."""
    rows, cols = t.stride(-2), t.stride(-1)
    if cols == 1 and rows >= max(1, t.shape[-1]):
        return rows
    if rows == 1 and cols >= max(1, t.shape[-2]):
        return cols
    return None
