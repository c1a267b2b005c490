"""The ``run`` artifact written by ``usaf train``: checkpoints, metrics and the final sparse delta.

Unlike the other artifacts, a run directory exists while training (its checkpoints must survive a
crash): ``checkpoints/step-NNNNNNN/`` are each written atomically, ``metrics.jsonl`` grows line by
line, and ``manifest.json`` is written last, when the run completes. A directory without a manifest
is an interrupted run, which ``usaf train`` resumes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from usaf.artifacts.manifest import Manifest, Record, register
from usaf.errors import UsafError

if TYPE_CHECKING:  # torch stays out of the CLI's import time
    import torch

CHECKPOINTS_DIR = "checkpoints"
FINAL_DIR = "final"
METRICS_FILE = "metrics.jsonl"
SETTINGS_FILE = "run-settings.json"
DELTAS_FILE = "deltas.safetensors"  # "<name>.indices"/".values" (active), ".frozen_indices"/".frozen_values"
ROUTERS_FILE = "routers.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.json"


class ReselectionRecord(Record):
    step: int
    fraction: float
    kept: int
    dropped: int
    grown: int
    turnover: float


class RunSummary(Record):
    model_fingerprint: str
    plan_fingerprint: str
    data_fingerprint: str
    trainable_layers: list[int]
    steps: int
    tokens: int
    skipped_steps: int = Field(description="steps skipped for a non-finite loss or gradient")
    first_loss: float
    final_loss: float
    eval_losses: list[list[float]] = Field(description="[step, held-out loss] pairs")
    expert_entries: int
    router_params: int
    frozen_entries: int = Field(description="dropped-by-reselection entries kept in the cumulative delta")
    reselections: list[ReselectionRecord]
    routing_warnings: list[str] = Field(default_factory=list, description="trainable layers whose routing collapsed")
    prefix_cache_hits: int | None = Field(None, description="sequences whose frozen-prefix state was cached")
    prefix_cache_misses: int | None = Field(None, description="sequences whose prefix state had to be computed")
    world_size: int = Field(1, ge=1, description="data-parallel processes (torchrun) of the run's last start")
    seconds: float


@register
class RunManifest(Manifest):
    KIND = "run"
    SCHEMA_VERSION = 1
    DESCRIPTION = "a finished training run: final sparse delta + routers, checkpoints, metrics"

    summary: RunSummary


# -- reading what a run trained ------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainedChange:
    """Everything a run changed in its quantized model, ready to apply (``SparseEngine.apply_change``).

    ``deltas[name] = (indices (m,) int64, values (m,) fp32)``: sorted flat indices into the stored
    ``(E, O, I)`` expert tensor and the cumulative delta there (frozen-by-reselection ∪ active), so the
    trained weight is ``dequantize(q) + delta``. ``routers[name]``: the trained router weights (fp32).
    """

    source: Path
    fingerprint: str  # identifies the change (the run manifest's fingerprint, or the checkpoint's step)
    model_fingerprint: str
    trainable_layers: list[int]
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor]]
    routers: dict[str, torch.Tensor]

    @property
    def expert_entries(self) -> int:
        return sum(int(i.numel()) for i, _ in self.deltas.values())


def load_trained_change(path: Path, *, flag: str = "--checkpoint") -> TrainedChange:
    """Read a finished run (its ``final/``), an unfinished run (its newest checkpoint), one checkpoint,
    or a delta exported by ``usaf export --format delta``.

    Raises UsafError naming ``flag`` when the directory is none of these or its files are damaged.
    """
    from usaf.artifacts.loader import load_verified, read_manifest_json

    path = Path(path)
    if not path.is_dir():
        raise UsafError(f"{flag} {path}: no such directory", "pass a run directory written by usaf train")
    if (path / "manifest.json").is_file():
        from usaf.artifacts.delta import DeltaManifest, read_delta

        if read_manifest_json(path, flag=flag)["kind"] == DeltaManifest.KIND:
            return read_delta(path, load_verified(path, DeltaManifest, flag=flag), flag=flag)
        manifest = load_verified(path, RunManifest, flag=flag)
        return _read_checkpoint(
            path / FINAL_DIR,
            flag=flag,
            source=path,
            fingerprint=manifest.fingerprint,
            model_fingerprint=manifest.summary.model_fingerprint,
            layers=manifest.summary.trainable_layers,
        )
    checkpoint, run_dir = path, path.parent.parent
    if not (path / STATE_FILE).is_file():  # an unfinished run directory: its newest complete checkpoint
        run_dir = path
        done = sorted(p for p in (path / CHECKPOINTS_DIR).glob("step-*") if (p / STATE_FILE).is_file())
        if not done:
            raise UsafError(
                f"{flag} {path}: not a usaf run (no manifest.json, no checkpoint)",
                "pass the --out directory of usaf train, or one of its checkpoints/step-N",
            )
        checkpoint = done[-1]
    settings = run_dir / SETTINGS_FILE
    try:
        record = json.loads(settings.read_text(encoding="utf-8"))
        model_fingerprint = record["model_fingerprint"]
    except (OSError, ValueError, KeyError):
        raise UsafError(
            f"{flag} {checkpoint}: its run's {SETTINGS_FILE} is missing or unreadable",
            "pass the run directory written by usaf train",
        ) from None
    return _read_checkpoint(
        checkpoint,
        flag=flag,
        source=checkpoint,
        fingerprint=f"{model_fingerprint[:16]}:{checkpoint.name}",
        model_fingerprint=model_fingerprint,
        layers=None,
    )


def _read_checkpoint(
    directory: Path, *, flag: str, source: Path, fingerprint: str, model_fingerprint: str, layers: list[int] | None
) -> TrainedChange:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(directory / DELTAS_FILE))
        routers = load_file(str(directory / ROUTERS_FILE))
    except (OSError, SafetensorError) as e:
        raise UsafError(
            f"{flag} {directory}: unreadable checkpoint ({e})", "pass an intact run or checkpoint"
        ) from None
    suffix = ".cumulative_indices"
    deltas = {}
    for key in tensors:
        if key.endswith(suffix):
            name = key[: -len(suffix)]
            indices, values = tensors[key], tensors.get(f"{name}.cumulative_values")
            if values is None or values.shape != indices.shape or indices.dtype != torch.int64:
                raise UsafError(f"{flag} {directory}: malformed delta for {name}", "pass an intact run or checkpoint")
            deltas[name] = (indices, values.float())
    if not deltas:
        raise UsafError(f"{flag} {directory}: the checkpoint holds no deltas", "pass an intact run or checkpoint")
    routers.pop("_none", None)
    if layers is None:
        layers = sorted({int(m.group(1)) for n in deltas if (m := re.search(r"layers\.(\d+)\.", n))})
    return TrainedChange(source, fingerprint, model_fingerprint, list(layers), deltas, dict(routers))


def trim_metrics(run_dir: Path, step: int) -> int:
    """Drop ``metrics.jsonl`` records of steps after ``step`` (a resumed run logs them again); returns how many.

    A run killed after its last checkpoint logged steps the resumed run repeats from that checkpoint;
    kept, they would appear twice in the loss curve of ``usaf eval``.
    """
    from usaf.artifacts.writer import write_text_atomic

    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        if not line.endswith("\n"):  # the last line, cut short by the kill
            dropped += 1
            continue
        try:
            record = json.loads(line)
            at = record["step"] if "step" in record else record["reselection"]["step"]
        except (ValueError, KeyError, TypeError):
            at = None  # not a step record: kept
        if at is not None and at > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        write_text_atomic(path, "".join(kept))
    return dropped
