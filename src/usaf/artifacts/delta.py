"""The ``delta`` artifact written by ``usaf export --format delta``: a trained change alone, small and shareable.

It holds exactly what a run changed in its quantized model, nothing of the model itself:
``deltas.safetensors`` with ``<name>.indices`` (sorted unique int64 flat indices into the stored
``(E, O, I)`` expert tensor) and ``<name>.values`` (fp32, the cumulative delta there), and
``routers.safetensors`` with the trained router weights, both keyed by in-memory names. The
manifest records the quantized model's and the original model's fingerprints, so the delta can only
be applied (``usaf export --checkpoint DELTA``, ``usaf generate --checkpoint DELTA``) to the model it
was trained on.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from usaf.artifacts.manifest import Manifest, Record, register
from usaf.artifacts.safety import load_safetensors
from usaf.errors import UsafError

if TYPE_CHECKING:  # torch stays out of the CLI's import time
    from usaf.artifacts.run import TrainedChange

DELTA_FILE = "deltas.safetensors"  # "<name>.indices" (int64) / "<name>.values" (fp32)
ROUTERS_FILE = "routers.safetensors"  # in-memory router name -> trained weight (fp32)


class DeltaTensorRecord(Record):
    name: str = Field(description="in-memory name of the fused expert tensor")
    shape: list[int] = Field(description="stored orientation (E, O, I) the indices refer to")
    entries: int


class DeltaSummary(Record):
    model_fingerprint: str = Field(description="fingerprint of the quantized model the change was trained on")
    source_fingerprint: str = Field(description="fingerprint of the original model that was quantized")
    family: str
    model_type: str
    change_fingerprint: str = Field(description="identity of the change (the run's manifest fingerprint)")
    trainable_layers: list[int]
    tensors: list[DeltaTensorRecord]
    expert_entries: int  # over every target (experts, attention, shared, dense), as the plan's
    router_tensors: int
    router_params: int


@register
class DeltaManifest(Manifest):
    KIND = "delta"
    SCHEMA_VERSION = 1
    DESCRIPTION = "a trained sparse change alone: expert deltas (indices + values) and routers"

    summary: DeltaSummary


def write_delta_files(directory: Path, change: TrainedChange) -> None:
    """Write ``change``'s deltas and routers into ``directory`` (contiguous CPU copies)."""
    # lazy: torch and safetensors stay out of usaf.artifacts' import time (manifests are read without them)
    import torch

    from usaf.artifacts.tensor_file import save_tensors  # lazy: it imports torch and safetensors

    tensors: dict[str, torch.Tensor] = {}
    for name, (indices, values) in sorted(change.deltas.items()):
        tensors[f"{name}.indices"] = indices.to("cpu", torch.int64).contiguous()
        tensors[f"{name}.values"] = values.to("cpu", torch.float32).contiguous()
    save_tensors(tensors, str(directory / DELTA_FILE), metadata={"format": "pt"})
    routers = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in sorted(change.routers.items())}
    save_tensors(routers, str(directory / ROUTERS_FILE), metadata={"format": "pt"})


def read_delta(path: Path, manifest: DeltaManifest, *, flag: str) -> TrainedChange:
    """The change a verified delta directory holds (:func:`usaf.artifacts.run.load_trained_change` calls this)."""
    # lazy: torch and safetensors stay out of usaf.artifacts' import time (manifests are read without them)
    import torch

    # lazy: an import cycle (usaf.artifacts.run imports this module at its top)
    from usaf.artifacts.run import TrainedChange, check_finite

    try:
        tensors = load_safetensors(path / DELTA_FILE)
        routers = load_safetensors(path / ROUTERS_FILE)
    except UsafError as e:
        raise UsafError(f"{flag} {path}: unreadable delta ({e.message})", "export the delta again") from None
    # as a run's checkpoint is: a shared or forged delta's NaN was a sampling traceback, NaN weights or empty text
    check_finite(path / DELTA_FILE, tensors, flag=flag, hint="export the delta again from an intact run")
    check_finite(path / ROUTERS_FILE, routers, flag=flag, hint="export the delta again from an intact run")
    summary = manifest.summary
    deltas = {}
    for record in summary.tensors:
        indices, values = tensors.get(f"{record.name}.indices"), tensors.get(f"{record.name}.values")
        if (
            indices is None
            or values is None
            or indices.dtype != torch.int64
            or values.shape != indices.shape
            or indices.numel() != record.entries
        ):
            raise UsafError(f"{flag} {path}: malformed delta for {record.name}", "export the delta again")
        deltas[record.name] = (indices, values.float())
    return TrainedChange(
        source=path,
        fingerprint=summary.change_fingerprint,
        model_fingerprint=summary.model_fingerprint,
        trainable_layers=list(summary.trainable_layers),
        deltas=deltas,
        routers=dict(routers),
    )
