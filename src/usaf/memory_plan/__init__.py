"""usaf.memory_plan: predict each stage's peak memory from ``config.json`` and pick settings that fit.

``usaf plan`` is its command line. Not to be confused with the *plan artifact* that ``usaf score`` writes
(masks of the weights to train): this package plans memory, before anything is downloaded or quantized.

Pieces, one job each: :mod:`~usaf.memory_plan.source` reads ``config.json`` (and a quantized model's
settings), :mod:`~usaf.memory_plan.model` turns it into sizes, :mod:`~usaf.memory_plan.weights` and
:mod:`~usaf.memory_plan.activations` hold the byte formulas, :mod:`~usaf.memory_plan.stages` adds them
up per stage and placement, :mod:`~usaf.memory_plan.choose` picks the settings, and
:mod:`~usaf.memory_plan.target` describes the machine. Only ``model`` and ``weights`` import torch or
transformers (lazily).
"""

from usaf.memory_plan.choose import Plan, Request, plan_memory
from usaf.memory_plan.config import PlanConfig
from usaf.memory_plan.model import ModelFacts, model_facts
from usaf.memory_plan.sizes import parse_size
from usaf.memory_plan.source import ModelSource, QuantSettings, read_model
from usaf.memory_plan.stages import PLACEMENTS, Component, Settings, StagePlan
from usaf.memory_plan.target import Target, make_target

__all__ = [
    "PLACEMENTS",
    "Component",
    "ModelFacts",
    "ModelSource",
    "Plan",
    "PlanConfig",
    "QuantSettings",
    "Request",
    "Settings",
    "StagePlan",
    "Target",
    "make_target",
    "model_facts",
    "parse_size",
    "plan_memory",
    "read_model",
]
