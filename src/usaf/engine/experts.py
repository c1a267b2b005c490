"""The MoE experts computation usaf plugs into transformers: 4-bit bases, resident bases, sparse deltas.

transformers v5 dispatches every MoE layer's experts forward through its experts-implementation
registry (``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS``, chosen by
``config._experts_implementation``). usaf registers one more implementation, ``"usaf"``, and attaches
its per-layer state to each experts module instance (``module.usaf_experts``). Everything else — the
attention, the router, the family's gating (``module._apply_gate``: SwiGLU, gpt-oss's clamped
variant), biases, shared experts — stays transformers' own code. Nothing global is patched: the
registry is transformers' extension point, and a model not built by usaf never selects ``"usaf"``.

Weights are held in the quantized tensor's stored orientation ``(E, O, I)`` (out-major) and applied as
``x @ W_e^T``; for gpt-oss, whose in-memory weights are input-major, that is the same product.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from usaf.engine import grouped, grouped_deltas
from usaf.engine.resident import ResidentBase
from usaf.engine.trainable import TrainableTensor
from usaf.families.modules import expert_biases
from usaf.families.routing import dense_weights
from usaf.families.spec import RouterSpec
from usaf.quant import QuantizedTensor, dequantize, dequantize_entries

IMPLEMENTATION = "usaf"


class ExpertWeight(TrainableTensor):
    """One fused expert tensor of one layer: a 4-bit base, optionally resident, optionally a sparse delta.

    Frozen layers dequantize only the experts a batch routes to, on every forward. Trainable layers
    keep a resident dequantized base ``(E, O, I)`` in the compute dtype (made once, in expert chunks
    under the device's per-allocation limit), and may carry a :class:`SparseDelta` whose values train.
    Folded entries (the frozen record) are written into ``resident``, so the forward pays nothing.
    """

    def __init__(self, q: QuantizedTensor, *, compute_dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(q.shape, compute_dtype)  # (E, O, I)
        self.q = q.to(device)
        self.resident: ResidentBase | None = None

    @property
    def home(self) -> torch.device | None:
        return self.resident.device if self.resident is not None else None

    def make_resident(self, device: torch.device | None = None, *, pin: bool = False) -> None:
        """Dequantize every expert once; kept on ``device`` (or pinned host memory) for the run.

        Stored in expert chunks under the device's per-allocation limit (:class:`ResidentBase`).
        """
        self.resident = ResidentBase.dequantized(self.q, dtype=self.compute_dtype, device=device, pin=pin)
        self._write_frozen(self.frozen_indices)  # a record restored before the base became resident

    def _check_foldable(self) -> None:
        if self.resident is None:
            raise ValueError("fold needs a resident base (make_resident first)")

    @torch.no_grad()
    def _write_frozen(self, indices: torch.Tensor) -> None:
        """``resident[i] = round(dequantize(q)[i] + frozen[i])`` for the given (unique) flat indices."""
        if self.resident is None or not indices.numel():
            return
        # With index ops, the touched entries are read where the codes are; without them, on the host.
        device = self.q.codes.device if self.index_ops else torch.device("cpu")
        indices = indices.to(device)
        at = torch.searchsorted(self.frozen_indices.to(device), indices)  # positions in the record
        frozen = self.frozen_values.to(device)[at]  # (k,)
        if self.index_ops:
            # Only the touched entries are dequantized: O(k), not O(O·I) per touched expert.
            total = dequantize_entries(self.q, indices) + frozen  # fp32, one rounding to the compute dtype
            self.resident.write(indices.to(self.resident.device), total.to(self.resident.device))
            return
        # Without index ops on the device, each touched expert's (O, I) slice is edited on the host and
        # copied back whole (a contiguous copy, no index_put_ on the device).
        per_expert = self.shape[1] * self.shape[2]
        experts = indices // per_expert
        for expert in torch.unique(experts).tolist():
            # One expert at a time: a transient (O, I) fp32, never a second copy of the whole tensor.
            mine = experts == expert
            local = indices[mine] - expert * per_expert
            base = dequantize(self.q, experts=[expert], dtype=torch.float32, device=device, memory_layout=False)
            total = base.view(-1)[local] + frozen[mine]  # fp32, one rounding to the compute dtype below
            block = self.resident.expert(expert)  # (O, I), a view of the stored base
            edited = block.to(device, copy=True)  # (O, I) host copy, never a view
            edited.view(-1)[local] = total.to(edited.dtype)
            block.copy_(edited)

    def base(self, expert: int, device: torch.device) -> torch.Tensor:
        """The frozen base of one expert, ``(O, I)``, in the compute dtype on ``device``."""
        if self.resident is not None:
            return self.resident.expert(expert).to(device, non_blocking=True)
        return dequantize(self.q, experts=[expert], dtype=self.compute_dtype, device=device, memory_layout=False)[0]

    def block(self, experts: slice | torch.Tensor, device: torch.device) -> torch.Tensor:
        """Several experts' frozen bases, ``(e, O, I)`` in the compute dtype on ``device``.

        A view of the resident base where it lives on ``device`` and ``experts`` is a run of consecutive
        experts within one stored chunk (as :mod:`usaf.engine.grouped` asks); else dequantized in one call.

        Args:
            experts: a run of consecutive experts as a slice (dequantized from views of the codes: no gather of codes,
                scales and zeros, and on a device no upload of the selection), or ``(e,)`` int64 ascending on the host.
            device: where the result lives.
        """
        if self.resident is not None and self.resident.device == device:
            if not isinstance(experts, slice):
                raise ValueError("a resident base is read by runs of consecutive experts (a slice)")
            return self.resident.run(experts.start, experts.stop)
        return dequantize(self.q, experts=experts, dtype=self.compute_dtype, device=device, memory_layout=False)

    def nbytes(self) -> dict[str, int]:
        resident = self.resident.nbytes if self.resident is not None else 0
        return {"quantized": self.q.nbytes, "resident": resident, **self.delta_nbytes()}


class LayerExperts(nn.Module):
    """usaf's state for one MoE layer's experts module: gate_up and down weights, and load statistics."""

    def __init__(self, layer: int, gate_up: ExpertWeight, down: ExpertWeight) -> None:
        super().__init__()
        self.layer = layer
        self.gate_up = gate_up
        self.down = down
        self.num_experts = gate_up.shape[0]
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.int64)  # since last reset
        # (T,) bool, True on the forward's real tokens, where it has padding (set around each forward by
        # :func:`count_real_tokens`); None: every token is real. Padding is routed and computed like any token, but
        # counted in the load statistics it skewed score's routing.json by --microbatch (found in review).
        self.real_tokens: torch.Tensor | None = None
        # False where the device lacks nonzero/index_add_/scatter (Capabilities.index_ops, DirectML):
        # the forward then routes on the host and combines by permutation gathers (:func:`_index_free_forward`).
        self.index_ops = True
        # Capabilities.grouped_mm of the device: a grouped forward's GEMMs go through torch's grouped matmul.
        self.grouped_mm = False
        # Capabilities.dense_delta_terms of the device: a forward under a graph or with deltas runs each tensor over
        # all its routed experts at once (usaf.engine.grouped_deltas), not expert by expert.
        self.grouped_deltas = False
        # Optional observer of every forward's routing decisions (``usaf.engine.routing.RoutingCapture``):
        # ``sink(layer, top_k_index (T, k))``. None costs nothing.
        self.routing_sink: Callable[[int, torch.Tensor], None] | None = None
        # DenseMixer's router gradient (SparseEngine(dense_router_grad=True), trainable layers only): the
        # family's router spec, and the router logits (T, E) its forward hook left for this layer's forward.
        self.dense_router: RouterSpec | None = None
        self.router_logits: torch.Tensor | None = None

    def set_capabilities(self, caps) -> None:
        """What the device runs (``usaf.backends.Capabilities``): index ops, torch's grouped matmul, grouped deltas."""
        self.set_index_ops(caps.index_ops)
        self.grouped_mm = caps.grouped_mm
        self.grouped_deltas = caps.dense_delta_terms

    def set_index_ops(self, available: bool) -> None:
        """Whether the device runs nonzero/index_add_/scatter (``Capabilities.index_ops``); False: avoid them."""
        self.index_ops = available
        self.gate_up.index_ops = self.down.index_ops = available

    def record_load(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """``(E,)`` tokens per expert of this forward, in host memory (one copy back from a device: every caller
        reads them there), added to the load statistics."""
        counts = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts)[: self.num_experts].cpu()
        real = self.real_tokens
        if real is None or real.numel() != top_k_index.shape[0]:  # no padding (or a forward of other tokens)
            self.tokens_per_expert += counts
        else:  # the real tokens' choices only; a boolean mask is a nonzero, which DirectML lacks: there on the host
            index = top_k_index if self.index_ops else top_k_index.cpu()
            chosen = index[real.to(index.device)].reshape(-1)
            self.tokens_per_expert += torch.bincount(chosen, minlength=self.num_experts)[: self.num_experts].cpu()
        if self.routing_sink is not None:
            self.routing_sink(self.layer, top_k_index)
        return counts

    def take_router_logits(self, tokens: int) -> torch.Tensor | None:
        """The router logits ``(T, E)`` of this forward when the dense router gradient applies, else None.

        It applies while training: the logits reach the router's (trainable) weights. Taken once, so no
        graph outlives the forward that made it.
        """
        logits, self.router_logits = self.router_logits, None
        if self.dense_router is None or logits is None or not (torch.is_grad_enabled() and logits.requires_grad):
            return None
        logits = logits.reshape(-1, logits.shape[-1])  # (T, E)
        if logits.shape[0] != tokens:
            raise RuntimeError(f"router logits for {logits.shape[0]} tokens, the experts got {tokens}")
        return logits


def _expert_output(self: nn.Module, state: LayerExperts, x: torch.Tensor, expert: int, *, score: bool = True):
    """One expert's MLP, ``x (t, H) -> (t, H)``: gate_up, the family's gate, down (+ biases, post-norm)."""
    gate_up_bias, down_bias = expert_biases(self, expert)  # (2I,), (H,) or None
    h = state.gate_up.linear(x, expert, gate_up_bias, score=score)  # (t, 2I), the family's own column order
    h = self._apply_gate(h)  # (t, I)
    y = state.down.linear(h, expert, down_bias, score=score)  # (t, H)
    if getattr(self, "has_post_expert_norm", False):
        y = self.post_expert_norm(y)
    return y


class _DenseRouterGrad(torch.autograd.Function):
    """DenseMixer's straight-through router gradient: the output is the top-k mixture, unchanged; the
    gradient of the routing weights is the dense mixture's, over every expert.

    The top-k mixture already gives each kept expert's weight ``dL/dw[t, e] = g_t . f_e(x_t)``. This adds
    the same term for every expert a token was *not* routed to, ``f_e(x_t)`` computed in the backward
    under no_grad (one extra pass over all experts, no activations kept): the gradient of
    ``sum_e w[t, e] f_e(x_t)`` with the experts' outputs held constant. Experts' weights get nothing more.
    """

    @staticmethod
    def forward(ctx, out, weights, hidden, others, expert_output):
        # out (T, H) the top-k mixture; weights (T, E) every expert's weight (grad to the router);
        # hidden (T, H) the experts' input, detached; others (T, E) bool: the experts a token was not routed to
        ctx.save_for_backward(hidden, others)
        ctx.expert_output = expert_output  # (x (T, H), expert) -> (T, H), no grad
        return out.view_as(out)  # the forward is the top-k output, bit for bit

    @staticmethod
    def backward(ctx, grad):
        hidden, others = ctx.saved_tensors
        with torch.no_grad():
            columns = []
            for expert in range(others.shape[1]):  # one (T, H) output at a time
                y = ctx.expert_output(hidden, expert)  # (T, H)
                columns.append((grad.float() * y.float()).sum(dim=-1))  # (T,) g_t . f_e(x_t)
            grad_weights = torch.stack(columns, dim=1) * others  # (T, E), kept experts' terms are the sparse path's
        return grad, grad_weights, None, None, None


def _dense_router_grad(
    self: nn.Module, state: LayerExperts, out: torch.Tensor, hidden_states: torch.Tensor, top_k_index: torch.Tensor
) -> torch.Tensor:
    """``out`` unchanged, with DenseMixer's router gradient attached when it applies (training a trainable layer)."""
    logits = state.take_router_logits(hidden_states.shape[0])
    if logits is None:
        return out
    weights = dense_weights(state.dense_router, logits, top_k_index)  # (T, E) fp32
    experts = torch.arange(weights.shape[1], device=weights.device)
    others = (top_k_index.unsqueeze(-1) != experts).all(dim=1)  # (T, E) bool, by comparison (no one_hot)

    def expert_output(x: torch.Tensor, expert: int) -> torch.Tensor:
        return _expert_output(self, state, x, expert, score=False)

    return _DenseRouterGrad.apply(out, weights, hidden_states.detach(), others, expert_output)


def usaf_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ``"usaf"`` experts implementation: ``(T, H) -> (T, H)``, only experts that got tokens do work."""
    state: LayerExperts | None = getattr(self, "usaf_experts", None)
    if state is None:
        raise RuntimeError("experts_implementation='usaf' on a module usaf did not prepare; build it with usaf.engine")
    if not state.index_ops:
        return _index_free_forward(self, state, hidden_states, top_k_index, top_k_weights)
    if grouped.applies(state, hidden_states):  # no graph, no delta: one pass per layer (usaf.engine.grouped)
        return grouped.grouped_forward(self, state, hidden_states, top_k_index, top_k_weights).to(hidden_states.dtype)
    out = _sorted_loop(self, state, hidden_states, top_k_index, top_k_weights)  # (T, H) fp32
    return _dense_router_grad(self, state, out.to(hidden_states.dtype), hidden_states, top_k_index)


def _sorted_loop(
    self: nn.Module, state: LayerExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights
) -> torch.Tensor:
    """The routed experts over tokens sorted by expert once: ``(T, H) -> (T, H)`` fp32.

    One gather, one weighting and one ``index_add_`` per layer, not per expert (each expert used to search its
    tokens, gather them, weight and add them back: at 128 experts the backward alone then built 128 ``(T, H)``
    gradients of the gathers). In between, the experts run grouped where the device asks for it
    (:mod:`usaf.engine.grouped_deltas`: equal to the loop within rounding), else one at a time, where the products
    and each token's order of addition (ascending expert) are the per-expert loop's: the same output, bit for bit.
    """
    k = top_k_index.shape[1]
    counts = state.record_load(top_k_index).tolist()  # (E,) tokens per expert
    order = torch.argsort(top_k_index.reshape(-1), stable=True)  # (T*k,) expert-major, each expert's in token order
    rows_token = order // k  # (T*k,) the token of each row
    # index_select, not x[index]: its backward is an index_add_, where advanced indexing's is a slower index_put_
    x = hidden_states.index_select(0, rows_token)  # (T*k, H)
    out = torch.zeros_like(hidden_states, dtype=torch.float32)  # (T, H), fp32 accumulation
    if not x.shape[0]:
        return out
    if grouped_deltas.applies(state, hidden_states):
        y = grouped_deltas.run_experts(self, state, x, counts)  # (T*k, H)
    else:
        routed = [expert for expert, n in enumerate(counts) if n]
        # One split, not a slice per expert: a slice's backward writes its gradient into a zero (T*k, H) of its
        # own, a split's concatenates them all once.
        chunks = x.split([counts[expert] for expert in routed])  # (n_e, H) each
        y = torch.cat([_expert_output(self, state, chunk, expert) for expert, chunk in zip(routed, chunks)])
    y = y * top_k_weights.reshape(-1).index_select(0, order)[:, None]  # (T*k, H)
    # In place: the out-of-place index_add copies (T, H) and measured 100x slower on CPU (torch 2.13);
    # autograd is unaffected (index_add's backward saves only the index).
    out.index_add_(0, rows_token, y.float())
    return out


class _PermuteRows(torch.autograd.Function):
    """``x[perm]`` for a permutation ``perm`` of the rows; the backward is the gather by its inverse.

    Autograd's own backward of ``index_select`` is an ``index_add_`` (a scatter), which DirectML rejects;
    for a permutation the transpose is the inverse permutation, so a second gather is exact.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)  # (N, H)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _index_free_forward(
    self: nn.Module,
    state: LayerExperts,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts forward without ``nonzero``/``index_add_``/``one_hot``/scatter on the device.

    The routing (``T * k`` small integers) is sorted on the host with numpy; the ``(T * k, H)`` token
    copies are permuted on the device into expert order by a gather, each expert computes on its
    contiguous slice, and the outputs are gathered back to ``(T, k, H)`` and summed over ``k``.
    """
    t, k = top_k_index.shape
    hidden = hidden_states.shape[-1]
    host_index = top_k_index.detach().cpu()  # (T, k)
    state.record_load(host_index)
    flat = host_index.reshape(-1).numpy()  # (T*k,)
    order = np.argsort(flat, kind="stable")  # positions grouped by expert
    inverse = np.argsort(order, kind="stable")
    counts = np.bincount(flat, minlength=state.num_experts)  # (E,)
    device = hidden_states.device
    perm = torch.from_numpy(order).to(device)
    inv = torch.from_numpy(inverse).to(device)
    copies = hidden_states.unsqueeze(1).expand(t, k, hidden).reshape(t * k, hidden)  # (T*k, H), token-major
    rows = _PermuteRows.apply(copies, perm, inv)  # (T*k, H), expert-major
    outputs, start = [], 0
    for expert in range(state.num_experts):
        n = int(counts[expert])
        if n == 0:
            continue
        x = rows[start : start + n]  # (n, H)
        start += n
        outputs.append(_expert_output(self, state, x, expert).float())  # (n, H)
    expert_major = torch.cat(outputs)  # (T*k, H)
    token_major = _PermuteRows.apply(expert_major, inv, perm).view(t, k, hidden)  # (T, k, H)
    out = (token_major * top_k_weights.float().unsqueeze(-1)).sum(dim=1)  # (T, H)
    return _dense_router_grad(self, state, out.to(hidden_states.dtype), hidden_states, top_k_index)


def register() -> None:
    """Make ``experts_implementation="usaf"`` known to transformers (idempotent)."""
    # lazy: transformers >= 5 only: 4.x has no experts registry (engine/legacy.py adapts it)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, usaf_experts_forward)


def count_real_tokens(model: nn.Module, experts: dict[int, LayerExperts]) -> None:
    """Around each forward of ``model``, tell its MoE layers which tokens are real (``attention_mask``), so their
    load statistics leave padding out; the forward itself still routes and computes every token."""

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)  # (B, S), 1 on real tokens
        real = None if mask is None or bool(mask.all()) else mask.reshape(-1).bool()  # (B*S,), row-major as routed
        for state in experts.values():
            state.real_tokens = real

    def after(module: nn.Module, args: tuple, output: object) -> None:
        for state in experts.values():
            state.real_tokens = None

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, always_call=True)  # a forward that raised leaves no stale mask either
