"""Loading a quantized model for an engine, with the experts placed as ``--stream-experts`` decides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from usaf.artifacts.quantized import open_quantized
from usaf.engine.loading import load_quantized_model
from usaf.engine.streaming import choose_streaming
from usaf.stages.progress import Progress


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
    loaded = load_quantized_model(
        files, device=backend.device, compute_dtype=compute, experts_device="cpu" if stream else None
    )
    pin = stream and backend.capabilities.pinned_memory
    return loaded, {"stream_experts": stream, "pin_experts": pin}
