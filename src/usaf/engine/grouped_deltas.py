"""A trainable layer's experts as grouped GEMMs: the base and the sparse deltas' terms per tensor, not per expert.

The per-expert path (:func:`usaf.engine.experts._sorted_loop` calling ``TrainableTensor.linear``, i.e.
:func:`usaf.engine.sparse_linear.sparse_delta_linear` once per routed expert and tensor) runs about thirty small
ops and two autograd nodes per routed expert. On an H200 at Qwen3-30B-A3B's width a training step made about
7,900 kernel launches and was launch-bound: 0.245 s a step against 54 ms of device time (docs/BENCHMARKS.md, "On a
GPU"). Here each fused tensor of a layer is one autograd node over all its routed experts. Per block (a run of
consecutive experts from a routed one to a routed one, within one resident chunk, its fp32 delta within
:data:`DELTA_BLOCK_BYTES`; see :func:`blocks`) the delta ``D`` is formed dense in fp32 by one scatter, and

    y       = x W^T + x D^T             two grouped GEMMs (the second in fp32)
    dx      = dy W + dy D               two grouped GEMMs
    dvalues = (dy^T x)[entries]         one grouped GEMM to (e, O, I), one gather

which is ``sparse_delta_linear``'s ``"dense"`` strategy, expert for expert, in a fixed number of ops per block.
Chosen where the backend declares ``Capabilities.dense_delta_terms`` (CUDA), the same switch as that strategy:
on the CPU the gathered terms cost about ``frac`` of a GEMM and the per-expert overhead is small, so the loop
stays there.

Score-collecting steps (RigL) and ``usaf score``'s dense scores run here too: the block's ``dy^T x`` is each
routed expert's dense slice gradient, which goes to that expert's sink (``TrainableTensor.score_sink``) in the
order the loop's backward calls them (descending expert), after the delta's gradient has been read from it. An
accumulator's sink takes a whole block at once (``ScoreAccumulator.add_block``): the step's pool work is then a
fixed number of ops per block too, where the loop ran about 23 ops and a host sync per routed expert and tensor.

Not taken (the per-expert loop runs): bases not resident on the compute device (a pinned host base is copied one
expert at a time), devices without index ops (DirectML: the loop's index-free path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from usaf.backends.transfer import upload
from usaf.engine.grouped import group_ends, grouped_linear, grouped_weight_grad, module_biases
from usaf.engine.score_sinks import ScoreSink
from usaf.engine.sparse_linear import accumulate_dtype, dense_delta, no_autocast
from usaf.engine.trainable import EMPTY_VALUES

# The fp32 bytes of one block's dense delta; the backward holds two (D and its gradient). A block of Qwen3-30B-A3B's
# gate_up (1536 x 2048 an expert) is then 20 experts: about 7 blocks a tensor at 128 experts, where the loop
# ran 128 experts one by one, and 0.5 GiB of transients, under a tenth of a 12 GB card.
DELTA_BLOCK_BYTES = 256 * 2**20


def applies(state, hidden_states: torch.Tensor) -> bool:
    """Whether this forward of ``state`` (a ``LayerExperts``) runs grouped over its deltas.

    The device asks for it (``state.grouped_deltas``), has index ops, and both tensors' bases are resident on the
    compute device.
    """
    if not (state.grouped_deltas and state.index_ops):
        return False
    weights = (state.gate_up, state.down)
    return all(w.resident is not None and w.resident.device == hidden_states.device for w in weights)


def run_experts(self: nn.Module, state, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """The routed experts over expert-major rows: ``x (N, H) -> (N, H)``, ``counts (E,)`` rows per expert.

    Args:
        self: the family's fused experts module (its ``_apply_gate``, biases, post-expert norm).
        state: its ``LayerExperts``.
        x: ``(N, H)`` the token copies sorted by expert (each expert's in token order).
        counts: ``(E,)`` rows of each expert, on the host.
    """
    gate_up_bias, down_bias = module_biases(self)  # (E, 2I), (E, H) or None
    h = _linear(state.gate_up, x, counts, gate_up_bias, state.grouped_mm)  # (N, 2I), the family's column order
    h = self._apply_gate(h)  # (N, I)
    y = _linear(state.down, h, counts, down_bias, state.grouped_mm)  # (N, H)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    return y


@dataclass(frozen=True)
class Block:
    """Experts ``[first, stop)`` within one resident chunk, the first and last routed; their rows and delta entries."""

    first: int
    stop: int
    rows: slice  # their expert-major rows
    counts: torch.Tensor  # (e,) int64 on the host, rows per expert (0 for an unrouted one inside the run)
    entries: slice  # their segment of the delta's values (empty without a delta)
    unrouted: torch.Tensor  # (u,) int64 on the host: positions in the block of experts with no rows
    ends: torch.Tensor | None = None  # (e,) int32 on the device: the groups' end rows, for torch's grouped matmul


def blocks(
    weight, counts: Sequence[int], budget: int | None = None, device: torch.device | None = None
) -> list[Block]:
    """Runs of consecutive experts of ``weight`` (an ``ExpertWeight``) from a routed one to a routed one, cut at its
    resident chunks' edges and to at most ``budget`` bytes of fp32 delta each (default :data:`DELTA_BLOCK_BYTES`; at
    least one expert).

    ``device``: where the grouped matmul runs, given when it does: each block's group ends are sent there once (one
    upload a block, where each of its five grouped products made its own).

    Unrouted experts inside a run stay in it as empty groups: cutting there would multiply the blocks where
    routing is uneven (83 of 128 experts routed made 31 runs instead of 1), and a block's ops cost the same for
    any number of experts. Their entries' gradients are set to zero (:attr:`Block.unrouted`).
    """
    _, o, i = weight.shape
    budget = DELTA_BLOCK_BYTES if budget is None else budget  # read when called: tests set the module's
    per_block = max(1, budget // (4 * o * i))
    per_chunk = weight.resident.per_chunk
    bounds = weight.delta._bounds if weight.delta is not None else None
    ends = [0]  # ends[e]: the first expert-major row of expert e
    for n in counts:
        ends.append(ends[-1] + n)
    routed = [e for e, n in enumerate(counts) if n]
    out: list[Block] = []
    j = 0
    while j < len(routed):
        first = routed[j]
        limit = min(first + per_block, (first // per_chunk + 1) * per_chunk)  # the block may not reach this expert
        while j + 1 < len(routed) and routed[j + 1] < limit:
            j += 1
        stop = routed[j] + 1
        span = torch.tensor(counts[first:stop], dtype=torch.int64)  # (e,)
        entries = slice(bounds[first], bounds[stop]) if bounds is not None else slice(0, 0)
        unrouted = torch.nonzero(span == 0)[:, 0]
        group = None if device is None else group_ends(span, device)
        out.append(Block(first, stop, slice(ends[first], ends[stop]), span, entries, unrouted, group))
        j += 1
    return out


def _linear(
    weight, x: torch.Tensor, counts: Sequence[int], bias: torch.Tensor | None, use_grouped_mm: bool
) -> torch.Tensor:
    """``x (N, I) -> (N, O)`` through every routed expert's base + delta of ``weight``."""
    delta = weight.delta
    if delta is not None:
        values = delta.values
    elif weight.score_sink is not None:  # scoring with no delta: a stand-in that requires grad, so backward runs
        values = EMPTY_VALUES.get(x.device)
    else:  # no delta (an attention-only target, a frozen layer under a graph): its gradient is never formed
        values = x.new_zeros(0, dtype=torch.float32)
    plan = blocks(weight, counts, device=x.device if use_grouped_mm else None)
    return _GroupedDeltaLinear.apply(x, values, weight, plan, bias, use_grouped_mm)


class _GroupedDeltaLinear(torch.autograd.Function):
    """``y = x (W + D)^T + b`` over every routed expert of one fused tensor; gradients for ``x`` and the values."""

    @staticmethod
    def forward(ctx, x, values, weight, plan, bias, use_grouped_mm):
        # x (N, I) compute dtype; values (n,) fp32, the whole delta; weight the ExpertWeight; plan [Block]
        acc = accumulate_dtype(x.dtype)
        out = x.new_empty(x.shape[0], weight.shape[1])  # (N, O); every row is some block's
        with no_autocast(x.device):
            for block in plan:
                base = weight.resident.run(block.first, block.stop)  # (e, O, I), a view
                xb = x[block.rows]  # (n, I)
                y = _through(block, xb, base, bias, use_grouped_mm)  # (n, O)
                d = _block_delta(weight, block, values, acc)
                if d is not None:  # one rounding to the compute dtype, as sparse_delta_linear's "dense"
                    y = y.to(acc) + _through(block, xb.to(acc), d, None, use_grouped_mm)
                out[block.rows] = y.to(x.dtype)
        ctx.save_for_backward(x, values)
        ctx.weight, ctx.plan, ctx.use_grouped_mm = weight, plan, use_grouped_mm
        ctx.score_sink = weight.score_sink  # as set for this forward (a collecting step's), expert -> sink
        return out

    @staticmethod
    def backward(ctx, dy):
        x, values = ctx.saved_tensors
        weight, plan, use_grouped_mm, score_sink = ctx.weight, ctx.plan, ctx.use_grouped_mm, ctx.score_sink
        need_dx, need_dvalues = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = accumulate_dtype(x.dtype)
        dx = torch.empty_like(x) if need_dx else None  # (N, I)
        dvalues = torch.zeros_like(values) if need_dvalues else None  # (n,); unrouted experts' entries stay 0
        dy = dy.to(x.dtype).contiguous()  # (N, O)
        with no_autocast(x.device):
            # Descending, as the loop's backward reaches its experts: a pooled accumulator's floor sees the same order.
            for block in reversed(plan):
                dyb = dy[block.rows]  # (n, O)
                d = _block_delta(weight, block, values, acc)  # (e, O, I) or None: formed again, not kept
                if need_dx:
                    base = weight.resident.run(block.first, block.stop)  # (e, O, I)
                    dxb = _through(block, dyb, base.transpose(1, 2), None, use_grouped_mm)  # (n, I)
                    if d is not None:  # dy W + dy D, one rounding
                        dxb = dxb.to(acc) + _through(block, dyb.to(acc), d.transpose(1, 2), None, use_grouped_mm)
                    dx[block.rows] = dxb.to(x.dtype)
                del d
                want_values = need_dvalues and block.entries.stop > block.entries.start
                if not (want_values or score_sink is not None):
                    continue
                grad = grouped_weight_grad(dyb.to(acc), x[block.rows].to(acc), block.counts, use_grouped_mm, block.ends)
                if block.unrouted.numel():  # an empty group's output is not promised to be written
                    grad.index_fill_(0, upload(block.unrouted, grad.device), 0.0)
                if want_values:  # read before the sinks, which overwrite their slices
                    local = _local_positions(weight, block)  # (m,)
                    dvalues[block.entries] = grad.view(-1).index_select(0, local).to(values.dtype)
                if score_sink is not None:
                    _feed_sinks(score_sink, weight, block, grad)
        return dx, dvalues, None, None, None, None


def _through(block: Block, x: torch.Tensor, weight: torch.Tensor, bias, use_grouped_mm: bool) -> torch.Tensor:
    """The block's rows ``x (n, I)`` through ``weight (e, O, I)`` (its base or delta, or a transpose) -> ``(n, O)``."""
    experts = torch.arange(block.first, block.stop)  # (e,) for the biases
    return grouped_linear(x, weight, block.counts, bias, experts, use_grouped_mm, block.ends)


def _feed_sinks(score_sink, weight, block: Block, grad: torch.Tensor) -> None:
    """The block's dense slice gradients ``grad (e, O, I)`` (a scratch) to the sink, as fp32, with their base slices.

    A :class:`~usaf.engine.score_sinks.ScoreSink` takes the whole block at once (a fixed number of ops); any other
    ``expert -> sink`` factory gets each routed expert's slice, descending, as the loop's backward calls it.
    """
    grad = grad.to(torch.float32)  # the loop's sinks get fp32 (a copy only for fp64 compute)
    base = weight.resident.run(block.first, block.stop)  # (e, O, I)
    if isinstance(score_sink, ScoreSink):
        score_sink.add_block(block.first, grad, base, block.counts > 0)
        return
    for j in reversed(range(block.stop - block.first)):
        if block.counts[j]:  # the loop calls no sink for an expert without tokens
            score_sink(block.first + j)(grad[j], base[j])


def _local_positions(weight, block: Block) -> torch.Tensor:
    """The block's delta entries as flat positions into its ``(e, O, I)``."""
    _, o, i = weight.shape
    return weight.delta.indices[block.entries] - block.first * o * i  # (m,)


def _block_delta(weight, block: Block, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The block's delta as a dense ``(e, O, I)`` in ``dtype`` (at least fp32), or None if it has no entries."""
    if weight.delta is None or block.entries.stop == block.entries.start:
        return None
    _, o, i = weight.shape
    e = block.stop - block.first
    flat = dense_delta(torch.Size((e * o, i)), _local_positions(weight, block), values[block.entries], dtype)
    return flat.view(e, o, i)
