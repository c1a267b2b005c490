"""usaf.families: the only place that knows Hugging Face names.

From a model's ``config.json`` alone, :func:`resolve_family` gives a :class:`FamilySpec`: which layers
are MoE and which dense, expert count / top-k / widths, the in-memory fused expert layout of
transformers v5, the router and shared experts, and the family's on-disk naming. :func:`build_mapping`
turns a checkpoint's tensor names into a plan checked in both directions, with per-layer ``fuse`` /
``split`` conversions; :func:`describe_model` summarises a model directory from headers only.

Importing this package does not import torch or transformers; the functions that need them do.
"""

from usaf.families import deepseek_v3, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe  # noqa: F401 - registers
from usaf.families.checkpoint import TensorInfo, load_tensors, quantized_formats, read_checkpoint
from usaf.families.convert import (
    ExpertLayerPlan,
    ExpertOp,
    FusedTensorPlan,
    bias_halves,
    combine_gate_up,
    gate_up_halves,
)
from usaf.families.describe import ROLES, ModelDescription, RoleCount, describe_model, tensor_role
from usaf.families.mapping import (
    MappingPlan,
    build_mapping,
    canonical_disk_names,
    load_expert_layer,
    map_checkpoint,
)
from usaf.families.registry import load_model_config, registered_families, resolve_family
from usaf.families.routing import route
from usaf.families.spec import (
    DiskLayout,
    DiskSpec,
    ExpertsLayout,
    FamilySpec,
    PerExpertNaming,
    RouterKind,
    RouterSpec,
    SharedExpertSpec,
)

# The families with their own file (the structural fallback covers other fused-expert model types).
SUPPORTED_FAMILIES: tuple[str, ...] = registered_families()

__all__ = [
    "ROLES",
    "SUPPORTED_FAMILIES",
    "DiskLayout",
    "DiskSpec",
    "ExpertLayerPlan",
    "ExpertOp",
    "ExpertsLayout",
    "FamilySpec",
    "FusedTensorPlan",
    "MappingPlan",
    "ModelDescription",
    "PerExpertNaming",
    "RoleCount",
    "RouterKind",
    "RouterSpec",
    "SharedExpertSpec",
    "TensorInfo",
    "bias_halves",
    "build_mapping",
    "canonical_disk_names",
    "combine_gate_up",
    "describe_model",
    "gate_up_halves",
    "load_expert_layer",
    "load_model_config",
    "load_tensors",
    "map_checkpoint",
    "quantized_formats",
    "read_checkpoint",
    "registered_families",
    "resolve_family",
    "route",
    "tensor_role",
]
