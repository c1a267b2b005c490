"""One expert's linear layer over a frozen base weight plus a trainable sparse delta (method.md §3).

``y = x @ (W + D)^T + b`` where ``D[rows, cols] = values`` is never materialised as a dense delta.
Backward returns ``dx = dy @ (W + D)`` and ``dvalues`` as a sampled dense–dense product (SDDMM) over
only the ``n`` delta positions. No dense ``(O, I)`` gradient is formed unless a ``score_sink`` asks
for it (dense-score mode).

Three strategies compute the same thing (see :data:`STRATEGIES`): ``"gather"`` is the literal
arithmetic — dense ``x @ W^T`` plus gather–multiply–scatter terms, in token chunks so temporaries
are ``O(chunk_tokens × n)`` — and works for every dtype and device; ``"merge"`` forms the
trained weight ``W + D`` for this one expert (one ``(O, I)`` temporary, like a dtype cast of ``W``)
and uses one GEMM for ``y`` and one for ``dx``; ``"dense"`` forms ``D`` alone, in at least fp32, as one
``(O, I)`` temporary, and turns every sparse term into a GEMM: ``y = x W^T + x D^T``, ``dx = dy W + dy D``,
``dvalues = (dy^T x)[rows, cols]``. Except under ``"gather"`` and ``"dense"``, ``dvalues`` comes from
``torch.sparse.sampled_addmm`` on CPU fp32/fp64 (its kernel refuses bf16/fp16; elsewhere it is gathered).

``"auto"``: ``"dense"`` where the backend declares ``Capabilities.dense_delta_terms`` (CUDA): there the
gather's scatters are atomics that collide on the few output columns an expert's tokens share, and its gathers
move ``T × n`` elements where a GEMM of the same ``T`` tokens costs little; the profile of a training step at
Qwen3-30B-A3B's width on an H200 spent 82 % of the device's time in the gather path's
``index_add_``/``index_select``/casts (docs/BENCHMARKS.md). Elsewhere it merges in fp32/fp64 when the sparse
terms would cost more than the merge, else gathers; it never merges in bf16/fp16, where rounding ``W + D`` to
the weight's precision would erase deltas smaller than half an ulp of the base weight (``"dense"`` keeps ``D``
apart, so it loses nothing).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import nullcontext

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from usaf.backends.transfer import device_capabilities, sampled_addmm_supported

ScoreSink = Callable[[torch.Tensor, torch.Tensor], None]
"""``sink(grad_w (O, I) fp32, weight (O, I)) -> None``; must reduce ``grad_w`` at once, not keep it."""

STRATEGIES = ("auto", "gather", "merge", "dense")
"""``sparse_delta_linear(strategy=...)`` choices; all give the same result up to rounding."""

# "auto" merges once the sparse terms' T * n elements reach this share of the merge's O * I. Measured
# on 2 CPU cores (O=1536, I=2048, n=0.5 %): forward+backward break even near T * n = O * I / 2.
_MERGE_SHARE = 1 / 2

__all__ = ["STRATEGIES", "ScoreSink", "sparse_delta_linear"]


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32: bf16/fp16 products and sums of many terms lose the small delta contributions."""
    return torch.promote_types(dtype, torch.float32)


def no_autocast(device: torch.device):
    """Autocast off inside the kernel: the contract is "compute in the dtype of x", whatever the caller's context."""
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.autocast(device_type=device.type, enabled=False)
    return nullcontext()


def _add_gathered_product(
    out: torch.Tensor,
    src: torch.Tensor,
    gather: torch.Tensor,
    scatter: torch.Tensor,
    values: torch.Tensor,
    chunk_tokens: int,
) -> None:
    """In place: ``out[:, scatter[j]] += src[:, gather[j]] * values[j]`` for every entry ``j``.

    Forward uses it as ``y += x D^T`` (gather cols, scatter rows), backward as ``dx += dy D``
    (gather rows, scatter cols). Token chunks bound the ``(chunk, n)`` temporaries; every token row
    is independent, so the result does not depend on ``chunk_tokens``.

    Args:
        out: ``(T, A)`` tensor updated in place.
        src: ``(T, B)`` tensor read.
        gather: ``(n,)`` int64 column indices into ``src``.
        scatter: ``(n,)`` int64 column indices into ``out``.
        values: ``(n,)`` delta values.
        chunk_tokens: tokens per chunk.
    """
    acc_dtype = accumulate_dtype(out.dtype)
    vals = values.to(acc_dtype)  # (n,)
    for start in range(0, src.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, src.shape[0])
        contrib = src[start:end].index_select(1, gather).to(acc_dtype) * vals  # (t, n)
        if out.dtype == acc_dtype:
            out[start:end].index_add_(1, scatter, contrib)
        else:
            # Sum the duplicate-row contributions in fp32 and round once, not once per entry.
            block = out[start:end].to(acc_dtype)  # (t, A)
            block.index_add_(1, scatter, contrib)
            out[start:end] = block.to(out.dtype)


# Elements of the (chunk, width, L) temporary of the scatter-free sum (64 MiB in fp32).
_SEGMENT_BUDGET = 2**24


def _segment_table(scatter: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    """For each output column, the entries that land in it, padded: ``(width * L,)`` indices and ``L``.

    Built on the host (numpy): row ``c`` of the ``(width, L)`` table lists the entries ``j`` with
    ``scatter[j] == c``, padded with ``n`` (which points at an all-zero column appended to the
    contributions). ``L`` is the most entries any column receives.
    """
    s = scatter.detach().cpu().numpy()
    n = s.size
    counts = np.bincount(s, minlength=width)  # (width,)
    longest = int(counts.max()) if n else 0
    order = np.argsort(s, kind="stable")  # entries grouped by column
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])  # (width,)
    slot = np.arange(n) - starts[s[order]]  # each entry's place within its column's group
    table = np.full((width, longest), n, dtype=np.int64)
    table[s[order], slot] = order
    return torch.from_numpy(table.reshape(-1)), longest


def _add_gathered_product_index_free(
    out: torch.Tensor,
    src: torch.Tensor,
    gather: torch.Tensor,
    scatter: torch.Tensor,
    values: torch.Tensor,
    chunk_tokens: int,
) -> None:
    """:func:`_add_gathered_product` without ``index_add_`` (for devices that reject scatter: DirectML).

    The entries of each output column are summed through a padded gather table (:func:`_segment_table`),
    so the device sees only ``index_select``, a reshape, a sum and a dense add. Temporaries are
    ``(chunk, A, L)`` with ``L`` the most entries one column receives; chunks shrink to keep them
    within ``_SEGMENT_BUDGET`` elements.
    """
    acc_dtype = accumulate_dtype(out.dtype)
    width = out.shape[1]
    table, longest = _segment_table(scatter, width)
    if longest == 0:
        return
    table = table.to(out.device)  # (A * L,)
    vals = values.to(acc_dtype)  # (n,)
    step = max(1, min(chunk_tokens, _SEGMENT_BUDGET // (width * longest)))
    for start in range(0, src.shape[0], step):
        end = min(start + step, src.shape[0])
        contrib = src[start:end].index_select(1, gather).to(acc_dtype) * vals  # (t, n)
        padded = torch.cat([contrib, contrib.new_zeros(end - start, 1)], dim=1)  # (t, n + 1)
        summed = padded.index_select(1, table).view(end - start, width, longest).sum(-1)  # (t, A)
        out[start:end] = (out[start:end].to(acc_dtype) + summed).to(out.dtype)


def _sampled_product(
    dy: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """SDDMM: ``out[j] = sum_t dy[t, rows[j]] * x[t, cols[j]]``, accumulated in at least fp32.

    Args:
        dy: ``(T, O)`` output gradient.
        x: ``(T, I)`` activations.
        rows: ``(n,)`` int64.
        cols: ``(n,)`` int64.
        chunk_tokens: tokens per chunk; temporaries are ``(chunk, n)``.

    Returns:
        ``(n,)`` tensor in ``accumulate_dtype(x.dtype)``.
    """
    acc_dtype = accumulate_dtype(x.dtype)
    out = torch.zeros(rows.shape[0], dtype=acc_dtype, device=x.device)  # (n,)
    for start in range(0, x.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, x.shape[0])
        g = dy[start:end].index_select(1, rows).to(acc_dtype)  # (t, n)
        a = x[start:end].index_select(1, cols).to(acc_dtype)  # (t, n)
        g.mul_(a)  # in place: one (t, n) temporary fewer
        out += g.sum(0)
    return out


def _merged_weight(weight: torch.Tensor, rows, cols, values, dtype: torch.dtype) -> torch.Tensor:
    """``W + D`` for one expert in ``dtype``: a fresh ``(O, I)`` tensor, never a view of ``weight``."""
    merged = weight.to(dtype, copy=True)  # (O, I)
    # accumulate=True: the same arithmetic as the sparse terms even if a caller passes duplicates.
    return merged.index_put_((rows, cols), values.to(dtype), accumulate=True)


def _sampled_addmm_supported(x: torch.Tensor) -> bool:
    """CPU fp32/fp64 only: bf16/fp16 are refused by the kernel, and other backends are untested here."""
    return sampled_addmm_supported(x.device, x.dtype)


def _sampled_product_csr(dy: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Same result as :func:`_sampled_product` via ``torch.sparse.sampled_addmm`` (no ``(T, n)`` temporaries).

    Args:
        dy: ``(T, O)`` fp32/fp64, on CPU.
        x: ``(T, I)`` same dtype.
        rows: ``(n,)`` int64.
        cols: ``(n,)`` int64.

    Returns:
        ``(n,)`` tensor in ``x.dtype``, in the order of ``rows``/``cols``.
    """
    out_features, in_features = dy.shape[1], x.shape[1]
    order = None
    if rows.numel() > 1 and bool((rows[1:] < rows[:-1]).any()):
        order = torch.argsort(rows, stable=True)  # CSR needs row-major order; SparseDelta slices already are
        rows, cols = rows[order], cols[order]
    crow = torch.zeros(out_features + 1, dtype=torch.int64, device=rows.device)  # (O + 1,)
    torch.cumsum(torch.bincount(rows, minlength=out_features), 0, out=crow[1:])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
        pattern = torch.sparse_csr_tensor(
            crow,
            cols,
            torch.zeros(rows.shape[0], dtype=x.dtype, device=x.device),
            (out_features, in_features),
            check_invariants=False,
        )
    sampled = torch.sparse.sampled_addmm(pattern, dy.t(), x, beta=0.0).values()  # (n,)
    if order is None:
        return sampled
    return torch.empty_like(sampled).index_copy_(0, order, sampled)


def _resolve(strategy: str, x: torch.Tensor, weight: torch.Tensor, n: int, index_ops: bool) -> str:
    """The strategy that runs: ``"gather"``, ``"merge"`` or ``"dense"`` (see the module docstring)."""
    if not index_ops:
        return "gather"  # merge and dense write D with index_put_ (a scatter); the gather is index-free there
    if strategy != "auto":
        return strategy
    if device_capabilities(x.device).dense_delta_terms:
        return "dense"
    if x.dtype not in (torch.float32, torch.float64):
        return "gather"  # see the module docstring: merging in low precision loses small deltas
    return "merge" if x.shape[0] * n >= _MERGE_SHARE * weight.shape[0] * weight.shape[1] else "gather"


def _flat_positions(rows: torch.Tensor, cols: torch.Tensor, in_features: int) -> torch.Tensor:
    """``(n,)`` positions of the entries in a flattened ``(O, I)``: 1-D indexing is one kernel each way, where
    2-D advanced indexing adds bounds checks, wrap-arounds and (accumulating) a sort, launched per expert."""
    return rows * in_features + cols


def dense_delta(shape: torch.Size, flat: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``D`` as a fresh dense ``(O, I)`` tensor in ``dtype`` (at least fp32: the delta is never rounded to bf16)."""
    d = torch.zeros(shape[0] * shape[1], dtype=dtype, device=values.device)  # (O * I,)
    return d.index_add_(0, flat, values.detach().to(dtype)).view(shape)  # duplicates add, as in the other strategies


class _SparseDeltaLinear(torch.autograd.Function):
    """Autograd function behind :func:`sparse_delta_linear`; gradients for ``x`` and ``values`` only."""

    @staticmethod
    def forward(ctx, x, weight, rows, cols, values, bias, score_sink, chunk_tokens, strategy, index_ops):
        active = bool(rows.numel() and x.shape[0])  # False: the delta contributes nothing
        resolved = _resolve(strategy, x, weight, rows.numel(), index_ops) if active else "gather"
        merge = resolved == "merge"
        with no_autocast(x.device):
            w = _merged_weight(weight, rows, cols, values, x.dtype) if merge else weight.to(x.dtype)  # (O, I)
            y = torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))  # (T, O)
            del w
            flat = None
            if resolved == "dense":
                flat = _flat_positions(rows, cols, weight.shape[1])  # (n,)
                acc = accumulate_dtype(x.dtype)
                d = dense_delta(weight.shape, flat, values, acc)  # (O, I)
                y = torch.addmm(y.to(acc), x.to(acc), d.t()).to(x.dtype)  # (T, O), one rounding, as the gather's
                del d
            elif active and not merge:
                add = _add_gathered_product if index_ops else _add_gathered_product_index_free
                add(y, x, cols, rows, values, chunk_tokens)
        # The original weight, not its cast: saving a cast copy would hold an extra (O, I) per expert
        # until backward, defeating "one dense expert slice at a time".
        ctx.save_for_backward(x, weight, rows, cols, values)
        ctx.score_sink = score_sink
        ctx.chunk_tokens = chunk_tokens
        ctx.resolved = resolved
        ctx.flat = flat  # int64 positions, not part of the graph: kept for backward's D and dvalues
        ctx.strategy = strategy
        ctx.index_ops = index_ops
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, rows, cols, values = ctx.saved_tensors
        chunk_tokens, resolved = ctx.chunk_tokens, ctx.resolved
        active = bool(rows.numel() and x.shape[0])
        need_dx, need_dvalues = ctx.needs_input_grad[0], ctx.needs_input_grad[4]
        dx = dvalues = None
        acc = accumulate_dtype(x.dtype)
        with no_autocast(x.device):
            dy = dy.to(x.dtype)  # (T, O)
            # "dense" reads dy in the accumulation dtype twice (dx's sparse term, dvalues): cast once
            dy_acc = dy.to(acc) if resolved == "dense" else None  # (T, O)
            if need_dx:
                # Merged again rather than saved from forward: holding W + D until backward would keep
                # one extra (O, I) per expert alive across the whole layer. So is D for "dense".
                merge = resolved == "merge"
                w = _merged_weight(weight, rows, cols, values, x.dtype) if merge else weight.to(x.dtype)  # (O, I)
                dx = dy @ w  # (T, I)
                del w
                if resolved == "dense":
                    d = dense_delta(weight.shape, ctx.flat, values, acc)  # (O, I)
                    dx = torch.addmm(dx.to(acc), dy_acc, d).to(x.dtype)  # (T, I)
                    del d
                elif active and not merge:
                    add = _add_gathered_product if ctx.index_ops else _add_gathered_product_index_free
                    add(dx, dy, rows, cols, values, chunk_tokens)
            # The dense weight gradient dy^T x (O, I) for the score sink, in fp32: scores are summed over many
            # batches and compared across experts. With no tokens it is identically zero: no call.
            grad_w = None
            if ctx.score_sink is not None and x.shape[0]:
                grad_w = dy.to(torch.float32).t() @ x.to(torch.float32)  # (O, I)
            if need_dvalues:
                if not active:
                    dvalues = torch.zeros_like(values)
                elif resolved == "dense":  # the entries of dy^T x (O, I), the sink's where that is precise enough
                    dense_grad = grad_w if grad_w is not None and acc == torch.float32 else dy_acc.t() @ x.to(acc)
                    # (n,), read before the sink overwrites grad_w
                    dvalues = dense_grad.view(-1).index_select(0, ctx.flat).to(values.dtype)
                    del dense_grad
                elif ctx.strategy != "gather" and ctx.index_ops and _sampled_addmm_supported(x):
                    dvalues = _sampled_product_csr(dy, x, rows, cols).to(values.dtype)  # (n,)
                else:
                    dvalues = _sampled_product(dy, x, rows, cols, chunk_tokens).to(values.dtype)  # (n,)
            if grad_w is not None:
                ctx.score_sink(grad_w, weight)
                del grad_w
        return dx, None, None, None, dvalues, None, None, None, None, None


def sparse_delta_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    score_sink: ScoreSink | None = None,
    chunk_tokens: int = 1024,
    strategy: str = "auto",
    index_ops: bool = True,
) -> torch.Tensor:
    """``y = x @ (weight + D)^T + bias`` with ``D[rows, cols] = values``, without forming ``D``.

    Computes in ``x.dtype`` (``weight`` and ``bias`` are cast, autocast is switched off inside);
    the sparse terms and ``dvalues`` are accumulated in at least fp32. ``weight`` and ``bias`` never
    receive a gradient. Backward runs only if ``x`` or ``values`` requires grad — a ``SparseDelta``
    slice always does, even when empty, so dense-score mode works on experts with no entries.

    Args:
        x: ``(T, I)`` activations of the tokens routed to one expert; ``T`` may be 0.
        weight: ``(O, I)`` frozen base slice of that expert, any float dtype. It is saved for
            backward as given (no copy).
        rows: ``(n,)`` int64 output indices of the delta entries; ``n`` may be 0.
        cols: ``(n,)`` int64 input indices. ``(rows, cols)`` pairs are assumed unique (as in
            ``SparseDelta``); duplicates would simply add.
        values: ``(n,)`` delta values (fp32 in training; fp64 works for gradcheck). May be a slice
            of a larger parameter: its gradient accumulates into the parameter.
        bias: optional ``(O,)`` frozen bias.
        score_sink: optional ``sink(grad_w, weight)``. If given, backward also forms this expert's
            dense weight gradient ``grad_w = dy^T @ x`` as ``(O, I)`` fp32, passes it with the
            original ``weight`` to the sink, and drops it. Not called when ``T == 0`` (``grad_w``
            would be all zeros).
        chunk_tokens: tokens per chunk of the gathered sparse terms; bounds their temporaries to
            ``chunk_tokens × n`` elements.
        strategy: ``"gather"`` (sparse terms by gather/scatter), ``"merge"`` (GEMMs with ``W + D``
            formed for this expert, one ``(O, I)`` temporary at a time), ``"dense"`` (GEMMs with ``D``
            formed apart in at least fp32, one ``(O, I)`` temporary at a time) or ``"auto"`` (dense where
            ``Capabilities.dense_delta_terms``, CUDA; elsewhere merge only in fp32/fp64 and when
            ``T * n >= O * I / 2``). An explicit
            ``"merge"`` in bf16/fp16 rounds ``W + D`` to that precision. Under ``"merge"`` and ``"auto"``,
            ``dvalues`` comes from ``torch.sparse.sampled_addmm`` on CPU fp32/fp64 (gathered in chunks
            elsewhere). See the module docstring.
        index_ops: the device runs ``index_add_``/``index_put_`` (``Capabilities.index_ops``). False
            (DirectML): the sparse terms are summed through a padded gather table instead, and
            ``"merge"`` and ``"dense"`` are not used.

    Returns:
        ``(T, O)`` tensor in ``x.dtype``.

    Raises:
        ValueError: on inconsistent shapes, a non-positive ``chunk_tokens`` or an unknown ``strategy``.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must be (T, I) and (O, I)")
    if not (rows.shape == cols.shape == values.shape and values.dim() == 1):
        raise ValueError(
            f"rows {tuple(rows.shape)}, cols {tuple(cols.shape)}, values {tuple(values.shape)} must be equal (n,)"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be ({weight.shape[0]},)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    # detach(): "never gets a gradient" holds even if a caller's weight or bias requires grad.
    return _SparseDeltaLinear.apply(
        x,
        weight.detach(),
        rows,
        cols,
        values,
        None if bias is None else bias.detach(),
        score_sink,
        int(chunk_tokens),
        strategy,
        bool(index_ops),
    )
