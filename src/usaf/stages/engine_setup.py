"""Loading a quantized model for an engine, with the experts placed as ``--stream-experts`` decides, and
dequantized once where memory allows."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from usaf.artifacts.quantized import QuantizedFiles, open_quantized
from usaf.engine.loading import LoadedModel, load_quantized_model, tensor_count
from usaf.engine.streaming import ExpertStreamer, choose_streaming
from usaf.memory_plan.weights import RESIDENT_SHARE  # of free memory dequantized experts may take (usaf plan's too)
from usaf.stages.progress import Progress
from usaf.units import human_bytes


def load_model(files: QuantizedFiles, progress: Progress, **placement: Any) -> LoadedModel:
    """:func:`~usaf.engine.loading.load_quantized_model` as a progress phase, a tick per tensor (at Qwen3-30B-A3B's
    size ~17 GB of experts onto a GPU: a minute or more); ``placement``: its device and dtype arguments."""
    progress.start("loading the model", tensor_count(files), "tensors")
    try:
        return load_quantized_model(files, on_tensor=lambda: progress.advance(1), **placement)
    finally:
        progress.finish()


def load_for_engine(
    model_dir: Path, backend: Any, compute: Any, stream: bool | None, progress: Progress
) -> tuple[Any, dict[str, Any]]:
    """The loaded model and the :class:`~usaf.engine.engine.SparseEngine` keyword arguments for its experts.

    Streamed: every 4-bit expert is loaded into host memory (never all onto the device first), pinned
    where the backend can, and the engine streams the frozen layers' (:mod:`usaf.engine.streaming`).
    """
    files = open_quantized(model_dir)
    stream, note = choose_streaming(stream, backend, files.experts_bytes)
    if note:
        progress.note(note)
    loaded = load_model(
        files, progress, device=backend.device, compute_dtype=compute, experts_device="cpu" if stream else None
    )
    pin = stream and backend.capabilities.pinned_memory
    return loaded, {"stream_experts": stream, "pin_experts": pin}


def stream_every_layer(loaded: LoadedModel, backend: Any, placement: dict[str, Any]) -> ExpertStreamer | None:
    """Stream every MoE layer's experts (a pass where none trains), as :func:`load_for_engine` placed them; None when
    they are not streamed. Close it to end the streaming."""
    if not placement["stream_experts"]:
        return None
    return ExpertStreamer(loaded.model.model.layers, loaded.experts, list(loaded.experts), backend.device,
                          pin=placement["pin_experts"], copy=placement["stream_experts"] == "copy",
                          top_k=loaded.spec.top_k)  # fmt: skip


def make_resident(
    loaded: Any,
    backend: Any,
    wanted: bool | None,
    layers: Iterable[int] | None = None,
    progress: Progress | None = None,
) -> tuple[bool, int]:
    """Dequantize the experts of ``layers`` (default: every MoE layer) once, or keep dequantizing the routed ones
    in every forward.

    ``wanted``: ``True``/``False`` forces the choice; ``None`` dequantizes once when the full-size experts fit
    in ``RESIDENT_SHARE`` of the device's free memory (host RAM on CPU). Both give the same numbers: the same
    dequantization, once or in every forward (``tests/test_grouped.py``). ``progress``: the dequantization as a
    phase of bytes (at Qwen3-30B-A3B's size tens of GB, a minute or more on a CPU).

    Returns:
        ``(resident, bytes)``: the choice and the bytes the dequantized experts take (or would take).
    """
    layers = list(loaded.experts) if layers is None else list(layers)
    weights = [w for layer in layers for w in (loaded.experts[layer].gate_up, loaded.experts[layer].down)]
    weights = [w for w in weights if w.resident is None]  # a trainable layer's base already is
    size = torch.empty(0, dtype=weights[0].compute_dtype).element_size() if weights else 0
    nbytes = [w.shape[0] * w.shape[1] * w.shape[2] * size for w in weights]
    needed = sum(nbytes)
    if wanted is None:
        free = backend.free_memory()
        wanted = free is not None and needed <= RESIDENT_SHARE * free
    if wanted and weights:
        if progress is not None:
            progress.start("dequantizing experts once", needed, "bytes")
        try:
            for weight, n in zip(weights, nbytes):
                weight.make_resident(backend.device)
                if progress is not None:
                    progress.advance(n)
        finally:
            if progress is not None:
                progress.finish()
    return wanted, needed


def frozen_layers_resident(engine: Any, backend: Any, progress: Progress, *, planned: bool | None = None) -> bool:
    """``usaf score`` and ``usaf train``: the frozen MoE layers' experts dequantized once when they fit.

    A frozen layer otherwise dequantizes every routed expert in every forward it runs (a first visit's prefix
    capture, score's calibration, the held-out loss): most of that forward's time on CPU (docs/BENCHMARKS.md,
    "The frozen-layer forward"). Callers ask only when frozen layers will run. The rule is ``usaf eval``'s
    default (``RESIDENT_SHARE`` of the free memory, read after the engine is built), and never with
    ``--stream-experts``, whose point is keeping them 4-bit. ``planned``: the memory planner's choice under a
    ``--vram``/``--ram`` budget, which the predicted peak assumed; None decides from the free memory.

    Returns:
        Whether they were made resident.
    """
    frozen = [layer for layer in engine.loaded.experts if layer not in engine.trainable_layers]
    if not frozen or engine.streamer is not None:
        return False
    resident, nbytes = make_resident(engine.loaded, backend, planned, frozen, progress)
    where = f"{len(frozen)} frozen MoE layers' experts"
    why = "the --vram/--ram budget's plan" if planned is not None else "once would exceed half the free memory"
    progress.note(
        f"{where} dequantized once ({human_bytes(nbytes)})"
        if resident
        else f"{where} dequantized per forward ({human_bytes(nbytes)} dequantized once: {why})"
    )
    return resident
