"""The ``plan`` artifact written by ``usaf score``: which expert weights train, and why.

Its files are written by :func:`write_plan_files` and read by :func:`read_masks` / :func:`read_importance`
(through :mod:`usaf.artifacts.safety`); the prefix store a plan may hold is :mod:`usaf.artifacts.prefix_store`'s.

A plan is trusted by nothing but its own consistency: the summary's counts must add up (checked when the manifest
is read, :class:`PlanSummary`), the masks must be what the summary says, tensor by tensor (:func:`read_masks`),
and both must fit the model being trained (:func:`check_plan_layers`, :func:`check_masks_fit`). A masks file
edited and re-signed would otherwise train other weights, or fewer, than the plan claims.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NoReturn

from pydantic import Field, model_validator

from usaf.artifacts.hashing import sha256_file
from usaf.artifacts.manifest import Manifest, Record, register
from usaf.artifacts.safety import load_safetensors
from usaf.errors import UsafError

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
    stability: float | None = Field(
        None,
        description="Jaccard overlap of the masks of the two calibration halves (None: not measured, or nothing "
        "selected in the plan or either half)",
    )


class LayerRouting(Record):
    layer: int
    tokens_per_expert: list[int]
    entropy: float
    max_share: float
    dead_experts: int


class PrefixCacheRecord(Record):
    scope: Literal["calibration", "data"] = Field(
        "data",
        description="which sequences: the calibration sample's (usaf score's default: its scoring pass computed "
        "them) or every training sequence (--cache)",
    )
    samples: int = Field(description="distinct training sequences whose prefix state is stored")
    tokens: int
    bytes: int
    start: int = Field(description="the first trainable layer: states are the hidden states entering it")
    dtype: str


class LrTestRecord(Record):
    """usaf score's learning-rate test (:mod:`usaf.stages.lr_test`): what it measured and the lr it chose."""

    lr: float = Field(gt=0, allow_inf_nan=False, description="the chosen lr of the deltas: usaf train's unless --lr")
    candidates: list[float] = Field(description="the probes' lrs, ascending")
    heldout_losses: list[float | None] = Field(
        description="held-back loss after each probe (None: it diverged, or was not run: see probes_run)"
    )
    heldout_gap_se: list[float | None] | None = Field(
        None,
        description="standard error of each probe's held-back loss minus the lowest one's, over the held-back "
        "sequences (None in the list: not eligible; None: a plan from before the one-standard-error rule)",
    )
    base_loss: float = Field(allow_inf_nan=False, description="held-back loss of the untrained model")
    rule: str = Field(description="how the lr was chosen from the losses")
    steps: int = Field(ge=0, description="optimizer steps over the probes that ran")
    seconds: float = Field(ge=0, allow_inf_nan=False)
    probes_run: int | None = Field(
        None,
        ge=1,
        description="probes run, by ascending lr: the test stops at the first that diverges, as no larger lr is "
        "eligible (None: a plan from before, where every probe ran)",
    )


class PlanSummary(Record):
    model_fingerprint: str
    tokens_fingerprint: str
    trainable_layers: list[int] = Field(description="the layers that train: MoE, and dense with --targets dense")
    frac: float = Field(description="the share selected: --frac, or the default for the layers' size")
    frac_given: bool | None = Field(None, description="--frac was given (None: a plan from before the default rule)")
    budget: Literal["per-tensor", "per-layer", "global", "per-expert"]
    statistic: Literal["grad", "grad2", "grad_x_weight"]
    router: bool
    targets: list[Literal["experts", "attention", "shared", "dense"]] | None = Field(
        None, description="the weights that carry deltas (--targets; None: a plan from before targets, experts)"
    )
    calib_samples: int
    calib_tokens: int
    tensors: list[TensorSelection]
    expert_entries: int = Field(description="delta entries over every target (the experts' and any other)")
    router_params: int
    trainable_params: int = Field(description="delta entries + router parameters")
    stability_mean: float | None = Field(description="the mean of the tensors' stability, over those that have one")
    routing: list[LayerRouting]
    prefix_cache: PrefixCacheRecord | None = Field(
        None, description="frozen-prefix states stored for usaf train (the calibration sample's, or --cache: all)"
    )
    lr_test: LrTestRecord | None = Field(None, description="the lr test (None: --no-lr-test, or an older plan)")
    seconds: float

    @model_validator(mode="after")
    def _consistent(self) -> PlanSummary:
        problem = _summary_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self


def _summary_problem(s: PlanSummary) -> str | None:
    """The first way the summary disagrees with itself (an edited manifest), or None."""
    if not 0 < s.frac < 1:
        return f"frac must be between 0 and 1, got {s.frac}"
    layers = s.trainable_layers
    if not layers or layers != sorted(set(layers)) or layers[0] < 0:
        return f"trainable_layers must be distinct layer numbers in ascending order, got {layers}"
    names = [t.name for t in s.tensors]
    if not names or len(set(names)) != len(names):
        return "tensors must list each trainable tensor once"
    for t in s.tensors:
        if problem := _tensor_problem(t, layers, shared_ranking=s.budget in ("per-layer", "global")):
            return f"tensor {t.name}: {problem}"
    entries = sum(t.selected for t in s.tensors)
    if s.expert_entries != entries:
        return f"expert_entries is {s.expert_entries}, the tensors select {entries}"
    if s.trainable_params != s.expert_entries + s.router_params:
        expected = s.expert_entries + s.router_params
        return f"trainable_params is {s.trainable_params}, not expert_entries + router_params ({expected})"
    if s.lr_test is not None:
        return _lr_test_problem(s.lr_test)
    return None


def _lr_test_problem(t: LrTestRecord) -> str | None:
    if not t.candidates or any(not math.isfinite(c) or c <= 0 for c in t.candidates):
        return f"lr_test.candidates must be finite learning rates > 0, got {t.candidates}"
    if len(t.heldout_losses) != len(t.candidates):
        return f"lr_test has {len(t.heldout_losses)} heldout_losses for {len(t.candidates)} candidates"
    if t.heldout_gap_se is not None and len(t.heldout_gap_se) != len(t.candidates):
        return f"lr_test has {len(t.heldout_gap_se)} heldout_gap_se for {len(t.candidates)} candidates"
    if t.heldout_gap_se is not None and not all(v is None or (math.isfinite(v) and v >= 0) for v in t.heldout_gap_se):
        return f"lr_test.heldout_gap_se must be finite and >= 0 or null, got {t.heldout_gap_se}"
    if any(loss is not None and not math.isfinite(loss) for loss in t.heldout_losses):
        return f"lr_test.heldout_losses must be finite or null, got {t.heldout_losses}"
    if t.lr not in t.candidates:
        return f"lr_test.lr {t.lr} is none of its candidates {t.candidates}"
    if t.probes_run is not None and t.probes_run > len(t.candidates):
        return f"lr_test.probes_run {t.probes_run} is more than its {len(t.candidates)} candidates"
    return None


def _tensor_problem(t: TensorSelection, layers: list[int], *, shared_ranking: bool) -> str | None:
    if t.layer not in layers:
        return f"layer {t.layer} is not one of trainable_layers {layers}"
    if len(t.shape) != 3 or any(d < 1 for d in t.shape):
        return f"shape must be 3 positive sizes (E, O, I), got {t.shape}"
    experts, rows, cols = t.shape
    # 0 only where a shared ranking (--budget per-layer/global) gave this tensor nothing; per-tensor/per-expert
    # budgets give every tensor at least one entry
    least = 0 if shared_ranking else 1
    if not least <= t.selected <= experts * rows * cols:
        return f"selected {t.selected} is not between {least} and the tensor's {experts * rows * cols} weights"
    if len(t.per_expert) != experts or min(t.per_expert) < 0 or sum(t.per_expert) != t.selected:
        return f"per_expert must be {experts} counts adding up to selected ({t.selected})"
    return None


@register
class PlanManifest(Manifest):
    KIND = "plan"
    SCHEMA_VERSION = 1
    DESCRIPTION = "masks, importance maps and routing statistics from calibration data"

    summary: PlanSummary

    def required_files(self) -> tuple[str, ...]:
        # lazy: the store's module imports torch and numpy at its top; manifests are read without them
        from usaf.artifacts.prefix_store import INDEX_FILE, STATES_FILE

        store = (STATES_FILE, INDEX_FILE) if self.summary.prefix_cache is not None else ()
        return (MASKS_FILE, IMPORTANCE_FILE, ROUTING_FILE, *store)


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
    from usaf.artifacts.tensor_file import save_tensors

    save_tensors({name: idx.contiguous() for name, idx in masks.items()}, str(directory / MASKS_FILE))
    ranked = {}
    for name, (indices, scores) in importance.items():
        ranked[f"{name}.indices"] = indices.contiguous()
        ranked[f"{name}.scores"] = scores.contiguous()
    save_tensors(ranked, str(directory / IMPORTANCE_FILE))
    if full_maps is not None:
        save_tensors({name: m.contiguous() for name, m in full_maps.items()}, str(directory / FULL_MAPS_FILE))
    (directory / ROUTING_FILE).write_text(json.dumps({str(layer): load for layer, load in routing.items()}, indent=1))


def read_masks(directory: Path, plan: PlanManifest, *, flag: str = "--plan") -> dict[str, torch.Tensor]:
    """The plan's masks: tensor name -> sorted int64 flat indices into the stored (E, O, I).

    Each mask is checked against the plan's own manifest (``plan``, already read): one per listed tensor, of
    exactly its ``selected`` count and ``per_expert`` split, unique, ascending and inside its shape.
    """
    path = Path(directory) / MASKS_FILE
    masks = load_safetensors(path)
    listed = {t.name: t for t in plan.summary.tensors}
    if extra := sorted(set(masks) - set(listed)):
        _refuse(flag, path, f"a mask for {extra[0]}, which the plan's manifest does not list")
    if missing := sorted(set(listed) - set(masks)):
        _refuse(flag, path, f"no mask for {missing[0]}, which the plan's manifest lists")
    for name, selection in listed.items():
        if problem := _indices_problem(masks[name], selection.shape, selection.selected):
            _refuse(flag, path, f"the mask of {name} {problem}")
        if _per_expert(masks[name], selection.shape) != selection.per_expert:
            _refuse(flag, path, f"the mask of {name} splits over the experts unlike the manifest's per_expert")
    # Read when the model has loaded, minutes after the manifest at 30B: another plan's masks of the same counts put
    # there meanwhile (usaf score --overwrite) trained under this plan's record (found in review).
    recorded = next((f.sha256 for f in plan.files if f.path == MASKS_FILE), None)
    if recorded is not None and sha256_file(path) != recorded:
        _refuse(flag, path, "changed since the plan's manifest was read (replaced by another usaf score?)")
    return masks


def read_importance(
    directory: Path, plan: PlanManifest, *, flag: str = "--plan"
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The plan's ranked candidates: tensor name -> (flat indices, scores), best first.

    One pair per tensor of the plan's manifest, of its ``candidates`` count: int64 indices, unique and inside the
    tensor's shape (in rank order, not sorted), and as many finite floating-point scores.
    """
    # lazy: torch stays out of usaf.artifacts' import time (manifests are read without it)
    import torch

    path = Path(directory) / IMPORTANCE_FILE
    tensors = load_safetensors(path)
    ranked = {}
    for t in plan.summary.tensors:
        indices, scores = tensors.get(f"{t.name}.indices"), tensors.get(f"{t.name}.scores")
        if indices is None or scores is None:
            _refuse(flag, path, f"no {t.name}.indices and .scores, a tensor the plan's manifest lists")
        if problem := _indices_problem(indices.sort().values, t.shape, t.candidates):
            _refuse(flag, path, f"{t.name}.indices {problem}")
        if not scores.is_floating_point() or scores.shape != indices.shape or not bool(torch.isfinite(scores).all()):
            _refuse(flag, path, f"{t.name}.scores must be {t.candidates} finite floating-point values")
        ranked[t.name] = (indices, scores)
    if extra := sorted(set(tensors) - {f"{n}.{k}" for n in ranked for k in ("indices", "scores")}):
        _refuse(flag, path, f"holds {extra[0]}, which the plan's manifest does not list")
    return ranked


def check_plan_layers(
    directory: Path, plan: PlanManifest, moe_layers: list[int], dense_layers: list[int] = (), *, flag: str = "--plan"
) -> None:
    """Refuse a plan that trains a layer the model lacks (``moe_layers``, ``dense_layers``: the model's): a layer
    the model has no experts in, unless it is a dense layer and the plan has the dense target."""
    dense = "dense" in (plan.summary.targets or ())
    allowed = set(moe_layers) | (set(dense_layers) if dense else set())
    foreign = sorted(set(plan.summary.trainable_layers) - allowed)
    if foreign:
        what = "MoE or dense" if dense else "MoE"
        raise UsafError(
            f"{flag} {Path(directory) / 'manifest.json'}: trains layer {foreign[0]}, which is no {what} layer of "
            f"the model (its MoE layers: {list(moe_layers)})",
            "re-run usaf score for this model",
        )
    if not set(plan.summary.trainable_layers) & set(moe_layers):
        raise UsafError(
            f"{flag} {Path(directory) / 'manifest.json'}: trains no MoE layer of the model ({list(moe_layers)})",
            "re-run usaf score for this model",
        )


def check_masks_fit(
    directory: Path,
    plan: PlanManifest,
    masks: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    *,
    flag: str = "--plan",
) -> None:
    """Refuse masks (read by :func:`read_masks`, so agreeing with ``plan``) that do not cover exactly the model's
    trainable tensors (``shapes``: name -> stored (E, O, I)), or a plan made for other shapes: a missing mask would
    train fewer weights than planned, a foreign shape other weights."""
    path = Path(directory) / MASKS_FILE
    if extra := sorted(set(masks) - set(shapes)):
        _refuse(flag, path, f"a mask for {extra[0]}, which is no trainable tensor of the plan's layers in this model")
    if missing := sorted(set(shapes) - set(masks)):
        _refuse(flag, path, f"no mask for {missing[0]}, a tensor of the layers the plan trains")
    for selection in plan.summary.tensors:
        if list(selection.shape) != list(shapes[selection.name]):
            _refuse(flag, Path(directory) / "manifest.json", f"{selection.name} has shape {selection.shape}, "
                    f"the model's is {list(shapes[selection.name])} (a plan for another model)")  # fmt: skip


def _indices_problem(indices: torch.Tensor, shape: list[int], count: int) -> str | None:
    """Why ``indices`` are not ``count`` unique ascending int64 flat indices into ``shape``, or None."""
    # lazy: torch stays out of usaf.artifacts' import time (manifests are read without it)
    import torch

    if indices.dtype != torch.int64 or indices.dim() != 1:
        return f"must be a 1-D int64 tensor, got {indices.dim()}-D {str(indices.dtype).removeprefix('torch.')}"
    if indices.numel() != count:
        return f"holds {indices.numel()} indices, the plan's manifest says {count}"
    if indices.numel() == 0:
        return None  # as many as the manifest says: a shared ranking gave this tensor nothing
    if bool((indices[1:] == indices[:-1]).any()):
        return "repeats an index"
    if bool((indices[1:] < indices[:-1]).any()):
        return "is not in ascending order"
    size = shape[0] * shape[1] * shape[2]
    if int(indices[0]) < 0 or int(indices[-1]) >= size:
        bad = int(indices[0]) if int(indices[0]) < 0 else int(indices[-1])
        return f"holds the index {bad}, outside the {size} weights of shape {list(shape)}"
    return None


def _per_expert(indices: torch.Tensor, shape: list[int]) -> list[int]:
    # lazy: torch stays out of usaf.artifacts' import time (manifests are read without it)
    import torch

    experts, rows, cols = shape
    return torch.bincount(indices // (rows * cols), minlength=experts).tolist()


def _refuse(flag: str, path: Path, problem: str) -> NoReturn:
    raise UsafError(f"{flag} {path}: {problem}", "the plan was edited or is damaged; re-run usaf score")
