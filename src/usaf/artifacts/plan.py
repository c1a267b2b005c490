"""The ``plan`` artifact written by ``usaf score``: which expert weights train, and why."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from usaf.artifacts.manifest import Manifest, Record, register

MASKS_FILE = "masks.safetensors"  # tensor name -> sorted int64 flat indices into the stored (E, O, I)
IMPORTANCE_FILE = "importance.safetensors"  # "<name>.indices" / "<name>.scores": ranked candidates
FULL_MAPS_FILE = "importance_full.safetensors"  # tensor name -> dense (E, O, I) statistic (--full-maps)
ROUTING_FILE = "routing.json"


class TensorSelection(Record):
    name: str = Field(description="in-memory name of the fused expert tensor")
    layer: int
    shape: list[int] = Field(description="stored orientation (E, O, I) the indices refer to")
    budget: int
    selected: int
    candidates: int = Field(description="ranked candidates kept in the importance map")
    per_expert: list[int] = Field(description="selected entries per expert")
    certified: bool = Field(description="the selection is provably the true top-k of the streamed statistic")
    stability: float | None = Field(None, description="Jaccard overlap of the masks of the two calibration halves")


class LayerRouting(Record):
    layer: int
    tokens_per_expert: list[int]
    entropy: float
    max_share: float
    dead_experts: int


class PrefixCacheRecord(Record):
    samples: int = Field(description="distinct training sequences whose prefix state is stored")
    tokens: int
    bytes: int
    start: int = Field(description="the first trainable layer: states are the hidden states entering it")
    dtype: str


class PlanSummary(Record):
    model_fingerprint: str
    tokens_fingerprint: str
    trainable_layers: list[int]
    frac: float
    budget: Literal["per-tensor", "per-layer", "global", "per-expert"]
    statistic: Literal["grad", "grad2", "grad_x_weight"]
    router: bool
    calib_samples: int
    calib_tokens: int
    tensors: list[TensorSelection]
    expert_entries: int
    router_params: int
    trainable_params: int = Field(description="expert entries + router parameters")
    stability_mean: float | None
    routing: list[LayerRouting]
    prefix_cache: PrefixCacheRecord | None = Field(None, description="states stored by --cache, for usaf train")
    seconds: float


@register
class PlanManifest(Manifest):
    KIND = "plan"
    SCHEMA_VERSION = 1
    DESCRIPTION = "masks, importance maps and routing statistics from calibration data"

    summary: PlanSummary
