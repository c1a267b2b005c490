"""What the engine counts: expert loads per MoE layer, memory by component, and the sizes it plans with."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from usaf.backends.transfer import is_host


@dataclass(frozen=True)
class LayerLoad:
    tokens_per_expert: list[int]
    entropy: float  # of the expert-load distribution, in nats (max: log E)
    max_share: float
    dead_experts: int


def layer_loads(experts: dict, *, reset: bool = True) -> dict[int, LayerLoad]:
    """Per MoE layer: tokens per expert since the last reset, load entropy, max share, dead experts."""
    stats = {}
    for layer, state in experts.items():
        counts = state.tokens_per_expert.clone()
        total = int(counts.sum())
        shares = counts.double() / max(total, 1)
        nonzero = shares[shares > 0]
        entropy = float(-(nonzero * nonzero.log()).sum()) if total else 0.0
        stats[layer] = LayerLoad(
            counts.tolist(), entropy, float(shares.max()) if total else 0.0, int((counts == 0).sum())
        )
        if reset:
            state.tokens_per_expert.zero_()
    return stats


def memory_by_component(engine: Any, *, optimizer: object | None = None, cache: Any = None) -> dict[str, int]:
    """Bytes by component: 4-bit experts, resident bases, deltas, routers (fp32 masters), other
    weights, activations (measured: the largest training forward's saved tensors so far), and (when
    given) the optimizer's state and the prefix cache (RAM and disk)."""
    quantized = resident = 0
    for state in engine.loaded.experts.values():
        for weight in (state.gate_up, state.down):
            sizes = weight.nbytes()
            quantized += sizes["quantized"]
            resident += sizes["resident"]
    delta = 0  # every target's delta and frozen record (a linear target's kept originals too)
    for weight in engine.weights.values():
        sizes = weight.nbytes()
        delta += sizes["delta"] + sizes["frozen"] + sizes.get("originals", 0)
    routers = sum(p.numel() * 4 for p in engine.routers.values())
    counted = {id(p) for p in engine.routers.values()} | {id(d.values) for d in engine.deltas().values()}
    counted |= {id(b) for d in engine.deltas().values() for b in d.buffers()}
    other = sum(
        t.numel() * t.element_size()
        for t in [*engine.model.parameters(), *engine.model.buffers()]
        if id(t) not in counted
    )
    out = {
        "experts_4bit": quantized,
        "resident_bases": resident,
        "deltas": delta,
        "routers": routers,
        "other_weights": other,
    }
    if engine.activations.peak:
        out["activations"] = engine.activations.peak  # measured: the largest training forward's saved tensors
    if optimizer is not None:
        out["optimizer_state"] = optimizer.state_bytes()
    if cache is not None:
        out["prefix_cache_ram"] = cache.nbytes["ram"]
        out["prefix_cache_disk"] = cache.nbytes["disk"]
    return out


def weight_storages(engine: Any) -> set[int]:
    """Data pointers of every weight storage: parameters, buffers, resident bases, 4-bit experts."""
    tensors = [*engine.model.parameters(), *engine.model.buffers()]
    for state in engine.loaded.experts.values():
        for weight in (state.gate_up, state.down):
            q = weight.q
            tensors.extend((q.codes, q.scale, q.zero))
            if weight.resident is not None:
                tensors.extend(weight.resident.chunks)
    return {t.untyped_storage().data_ptr() for t in tensors if t.device.type != "meta"}


def resident_placement(backend: object, nbytes: int, *, headroom: float = 0.8) -> tuple[torch.device, bool]:
    """Where trainable layers' resident bases go: ``(device, pin)``.

    On the accelerator when ``nbytes`` fits in ``headroom`` of its free memory; otherwise in host memory,
    pinned where the backend supports it (then each expert slice is copied to the device when used). A
    per-allocation limit does not matter here: bases are stored in expert chunks under it
    (:class:`usaf.engine.resident.ResidentBase`).
    """
    device = backend.device
    if is_host(device):
        return device, False
    free = backend.memory().device_free
    if free is not None and nbytes <= headroom * free:
        return device, False
    return torch.device("cpu"), bool(backend.capabilities.pinned_memory)


def budget(shape: tuple[int, int, int], frac: float) -> int:
    """Entries a per-tensor budget of ``frac`` gives a tensor of ``shape`` (at least 1)."""
    return max(1, math.floor(frac * shape[0] * shape[1] * shape[2]))
