"""The ``run`` artifact written by ``usaf train``: checkpoints, metrics and the final sparse delta.

Unlike the other artifacts, a run directory exists while training (its checkpoints must survive a
crash): ``checkpoints/step-NNNNNNN/`` are each written atomically, ``metrics.jsonl`` grows line by
line, and ``manifest.json`` is written last, when the run completes. A directory without a manifest
is an interrupted run, which ``usaf train`` resumes.
"""

from __future__ import annotations

from pydantic import Field

from usaf.artifacts.manifest import Manifest, Record, register

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
    seconds: float


@register
class RunManifest(Manifest):
    KIND = "run"
    SCHEMA_VERSION = 1
    DESCRIPTION = "a finished training run: final sparse delta + routers, checkpoints, metrics"

    summary: RunSummary
