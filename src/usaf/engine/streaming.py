"""Frozen layers' 4-bit experts streamed from host memory to the device, one layer ahead of the forward.

This is ``usaf plan``'s ``stream`` placement. Every MoE layer's 4-bit experts stay in host memory (pinned
where the backend allows); when a forward reaches a *frozen* MoE layer, that layer's codes must be on the
device. The streamer keeps at most two layers' copies there — the one in use and the next one, whose copy
started (on a side copy stream, CUDA/ROCm) when the previous layer began, so the transfer overlaps that layer's compute
— and drops a layer's copy when its forward ends (autograd never keeps the codes: a frozen expert's backward
needs only the dequantized slice it saved).

Trainable layers are not streamed: they compute from their resident dequantized base, which lives on the
device, and read their codes only when a reselection folds dropped deltas, one expert at a time (which
``dequantize`` moves itself).

A training step whose prefix comes from the cache never runs the frozen layers below the first trainable
one: :meth:`ExpertStreamer.skipping` (entered by ``SparseEngine.loss`` while it injects the cached state)
makes their hooks copy nothing — the layer modules are still called, only their ``forward`` passes the
state through — so streaming costs nothing there; it serves prefix capture, ``usaf score`` and
``usaf eval``'s forwards.

A forward of few tokens (decoding: ``usaf generate``'s one new token a step) routes to a few experts of each
layer: copying the whole layer would move all of them for those few (at Qwen3-30B-A3B's size about 15 GB a token,
top-8 of 128 reads 6 % of that). Where the tokens times the top-k are at most ``ROUTED_ONLY_SHARE`` of the experts,
the layer is not copied: its codes stay in host memory, and the frozen forward's dequantization selects the routed
experts there and moves only those (:func:`usaf.quant.dequantize`, as a trainable layer's fold does), synchronously,
so nothing is prefetched for such a forward. The same numbers either way (the same dequantization of the same codes).

Without a separate device (CPU) there is nothing to stream and the stages do not install it; ``copy=True``
with a CPU device runs the same mechanism with copies in host memory — how the tests check it without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from usaf.backends.transfer import CopyStream, has_copy_stream
from usaf.engine.experts import LayerExperts
from usaf.quant import QuantizedTensor
from usaf.units import human_bytes

BUFFER_LAYERS = 2  # one layer in use, one in flight (the planner's "4-bit streaming buffer")
# A forward that can route to at most this share of a layer's experts reads them from host memory instead of copying
# the layer. Chosen by arithmetic, not yet measured on a GPU: a quarter of the bytes or less, moved synchronously from
# pageable memory (roughly half the speed of a pinned asynchronous copy), should still take half the time or less.
ROUTED_ONLY_SHARE = 0.25


@dataclass
class StreamStats:
    """What the streamer did: layer copies started, how many were ready (prefetched) when needed."""

    copies: int = 0
    prefetched: int = 0  # forwards that found their layer already copied (or in flight)
    waited: int = 0  # forwards that had to start their own copy first
    bytes: int = 0  # host -> device bytes moved
    max_alive: int = 0  # most layer copies on the device at once (at most BUFFER_LAYERS)
    routed_only: int = 0  # forwards of few tokens that read their routed experts from host memory (no layer copy)
    order: list[int] = field(default_factory=list)  # layers in the order their forwards began

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "order"}


@dataclass
class _Copy:
    gate_up: QuantizedTensor
    down: QuantizedTensor
    ready: Any  # the copy stream's event (CopyStream.ready); None for synchronous copies

    def tensors(self) -> list[torch.Tensor]:
        return [*self.gate_up.tensors(), *self.down.tensors()]


class ExpertStreamer:
    """Streams the 4-bit experts of ``layers`` (frozen MoE layers) through forward hooks on their decoder layers.

    Args:
        decoder_layers: the model's decoder layers (``model.model.layers``), hooked by index.
        experts: usaf's per-layer expert state (``LoadedModel.experts``).
        layers: the frozen MoE layers to stream.
        device: where forwards compute.
        pin: keep the host copies in page-locked memory (needed for asynchronous copies).
        overlap: copy on a side stream (default: where the device has one, :func:`has_copy_stream`).
        copy: force real copies even when ``device`` is host memory (tests).
        top_k: experts routed per token; with it, a forward of few tokens reads only its routed experts from host
            memory (``ROUTED_ONLY_SHARE``); None: every forward copies its layer.
    """

    def __init__(
        self,
        decoder_layers: nn.ModuleList,
        experts: Mapping[int, LayerExperts],
        layers: Sequence[int],
        device: torch.device,
        *,
        pin: bool = False,
        overlap: bool | None = None,
        copy: bool = False,
        top_k: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.top_k = top_k
        self.layers = tuple(sorted(layers))
        self._states = {layer: experts[layer] for layer in self.layers}
        self._copy_always = copy
        self._host: dict[int, tuple[QuantizedTensor, QuantizedTensor]] = {}
        for layer, state in self._states.items():
            host = tuple(_to_host(w.q, pin) for w in (state.gate_up, state.down))
            state.gate_up.q, state.down.q = host
            self._host[layer] = host
        self._overlap = has_copy_stream(self.device) if overlap is None else overlap
        self._stream = CopyStream(self.device) if self._overlap else None
        self._copies: dict[int, _Copy] = {}  # started, not yet in use
        self._in_use: int | None = None
        self._skip_below = 0  # layers below this one are skipped by the forward (a cached prefix): no copies
        self.stats = StreamStats()
        self._handles = []
        for layer in self.layers:
            module = decoder_layers[layer]
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(layer), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(layer)))

    @property
    def host_bytes(self) -> int:
        return sum(q.nbytes for pair in self._host.values() for q in pair)

    @property
    def alive(self) -> int:
        """Layer copies on the device now (in flight or in use)."""
        return len(self._copies) + (self._in_use is not None)

    def close(self) -> None:
        """Remove the hooks and drop the device copies; the experts stay in host memory."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._copies.clear()
        for layer, state in self._states.items():
            state.gate_up.q, state.down.q = self._host[layer]

    @contextlib.contextmanager
    def skipping(self, below: int) -> Iterator[None]:
        """Within the block, forwards skip the decoder layers below ``below`` (a cached prefix state is injected
        there): their hooks copy nothing, and prefetching looks only at the layers that run."""
        self._skip_below = below
        try:
            yield
        finally:
            self._skip_below = 0

    # -- hooks ----------------------------------------------------------------------------------------

    def _pre_hook(self, layer: int):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs.get("hidden_states")  # (B, T, H)
            self._enter(layer, hidden.numel() // hidden.shape[-1] if isinstance(hidden, torch.Tensor) else None)

        return hook

    def _post_hook(self, layer: int):
        def hook(module, args, output):
            self._leave(layer)

        return hook

    def _enter(self, layer: int, tokens: int | None = None) -> None:
        if layer < self._skip_below:
            return  # this layer's forward passes the injected state through: its experts are not needed
        copy = self._copies.pop(layer, None)
        few = self._routed_only(layer, tokens)
        if copy is None and few:  # the codes stay in host memory: the forward's dequantization moves the routed
            self.stats.routed_only += 1  # experts alone
            self.stats.order.append(layer)
            return
        if copy is None:
            copy = self._start(layer)
            self.stats.waited += 1
        else:
            self.stats.prefetched += 1
        if copy.ready is not None:
            self._stream.wait(copy.ready, copy.tensors())
        state = self._states[layer]
        state.gate_up.q, state.down.q = copy.gate_up, copy.down
        self._in_use = layer
        self.stats.order.append(layer)
        following = self._following(layer)  # a forward of few tokens (one whose copy was prefetched) starts none:
        if following is not None and following not in self._copies and not few:  # the next reads routed experts
            self._copies[following] = self._start(following)
        self.stats.max_alive = max(self.stats.max_alive, self.alive)

    def _leave(self, layer: int) -> None:
        if layer < self._skip_below:
            return
        state = self._states[layer]
        state.gate_up.q, state.down.q = self._host[layer]  # the device copy is freed with its last reference
        self._in_use = None

    def _routed_only(self, layer: int, tokens: int | None) -> bool:
        """Whether a forward of ``tokens`` tokens routes to at most ``ROUTED_ONLY_SHARE`` of the layer's experts."""
        if self.top_k is None or tokens is None:
            return False
        return tokens * self.top_k <= ROUTED_ONLY_SHARE * self._host[layer][0].shape[0]

    def _following(self, layer: int) -> int | None:
        """The next streamed layer a forward will reach (the first again after the last: the next forward)."""
        running = [other for other in self.layers if other >= self._skip_below]
        if len(running) < 2:
            return None
        position = running.index(layer)
        return running[(position + 1) % len(running)]

    def _start(self, layer: int) -> _Copy:
        gate_up, down = self._host[layer]
        self.stats.copies += 1
        self.stats.bytes += gate_up.nbytes + down.nbytes
        if self._stream is None:
            return _Copy(*(q.to(self.device, copy=self._copy_always) for q in (gate_up, down)), None)
        with self._stream.copying():
            moved = [q.to(self.device, non_blocking=True) for q in (gate_up, down)]
            ready = self._stream.ready()
        return _Copy(*moved, ready)


def _to_host(q: QuantizedTensor, pin: bool) -> QuantizedTensor:
    host = q.to("cpu")
    return host.pin_memory() if pin else host


STREAM_SHARE = 0.5  # by default, stream when the 4-bit experts would take more than this share of free device memory


def choose_streaming(requested: bool | None, backend, experts_bytes: int) -> tuple[bool, str | None]:
    """Whether to stream (``--stream-experts`` as given, else by size), and a note for the user.

    By default: on when every layer's 4-bit experts would take more than half the device's free memory, on
    a backend with a separate device that reports its memory; off otherwise. Where host and device memory
    are one (CPU, Apple silicon) streaming moves nothing: asked for, it runs (the hooks swap references), keeps the
    frozen experts 4-bit (no dequantization once), and says so.
    """
    unified = backend.capabilities.unified_memory
    if requested is not None:
        # what it still does here: a 288 MiB smaller, 3.7× slower run was said to change nothing (found in review)
        note = ("host and device memory are one here: streaming moves nothing, but the frozen layers' experts stay "
                "4-bit, dequantized at each forward instead of once (less memory, slower)") if requested and unified \
            else None  # fmt: skip
        return requested, note
    free = None if unified else backend.memory().device_free
    if free is None or experts_bytes <= STREAM_SHARE * free:
        return False, None
    return True, (
        f"streaming the frozen layers' 4-bit experts from host memory ({human_bytes(experts_bytes)} would take over "
        f"half of the device's {human_bytes(free)} free); --no-stream-experts keeps them on the device"
    )
