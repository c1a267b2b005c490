"""The ``plan`` artifact written by ``usaf score``: which expert weights train, and why.

Its files are written by :func:`write_plan_files` and read by :func:`read_masks` / :func:`read_importance`
(through :mod:`usaf.artifacts.safety`); the prefix store a plan may hold is :mod:`usaf.artifacts.prefix_store`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from usaf.artifacts.manifest import Manifest, Record, register
from usaf.artifacts.safety import load_safetensors

if TYPE_CHECKING:  # torch stays out of the CLI's import time
    import torch

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


# -- the plan's files: written by usaf score, read by usaf train ---------------------------------------------


def write_plan_files(
    directory: Path,
    masks: dict[str, torch.Tensor],
    importance: dict[str, tuple[torch.Tensor, torch.Tensor]],
    routing: dict[int, dict],
    *,
    full_maps: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write the masks, the ranked candidates (``importance[name] = (indices, scores)``), the routing statistics
    (``routing[layer]``: a LayerLoad's fields) and, with ``full_maps``, the dense statistic per tensor."""
    # lazy: torch and safetensors stay out of usaf.artifacts' import time (manifests are read without them)
    from safetensors.torch import save_file

    save_file({name: idx.contiguous() for name, idx in masks.items()}, str(directory / MASKS_FILE))
    ranked = {}
    for name, (indices, scores) in importance.items():
        ranked[f"{name}.indices"] = indices.contiguous()
        ranked[f"{name}.scores"] = scores.contiguous()
    save_file(ranked, str(directory / IMPORTANCE_FILE))
    if full_maps is not None:
        save_file({name: m.contiguous() for name, m in full_maps.items()}, str(directory / FULL_MAPS_FILE))
    (directory / ROUTING_FILE).write_text(json.dumps({str(layer): load for layer, load in routing.items()}, indent=1))


def read_masks(directory: Path) -> dict[str, torch.Tensor]:
    """The plan's masks: tensor name -> sorted int64 flat indices into the stored (E, O, I)."""
    return load_safetensors(directory / MASKS_FILE)


def read_importance(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The plan's ranked candidates: tensor name -> (flat indices, scores), best first."""
    tensors = load_safetensors(directory / IMPORTANCE_FILE)
    suffix = ".indices"
    return {k[: -len(suffix)]: (v, tensors[k[: -len(suffix)] + ".scores"]) for k, v in tensors.items()
            if k.endswith(suffix) and k[: -len(suffix)] + ".scores" in tensors}  # fmt: skip
