"""The installed transformers' in-memory module layout, seen through usaf's names.

usaf names every tensor as transformers >= 5 holds it in memory: one fused ``experts.gate_up_proj``
``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]`` per MoE layer, and the family's load-time renames
applied (Mixtral's ``block_sparse_moe`` is ``mlp``). Quantized directories, checkpoints and exports
use these names whatever transformers produced them.

transformers 4.x (which the DirectML configuration needs: torch-directml pins torch 2.4.1, and
transformers >= 5 refuses torch < 2.6) holds most families' experts as an ``nn.ModuleList`` of
per-expert MLPs, under the on-disk names. This module is the one translation between the two:

- :func:`module_layout`: which layout the installed transformers gives a family;
- :func:`usaf_view`: the model's ``state_dict`` names and shapes -> usaf's (per-expert weights
  gathered into the fused names and shapes);
- :class:`FusedView`: read or write a fused tensor (or any usaf-named tensor) of a transformers model,
  whichever layout it has.

Importing this module imports neither torch nor transformers.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from collections.abc import Mapping
from enum import Enum
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from usaf.errors import UsafError
from usaf.families.spec import FamilySpec

if TYPE_CHECKING:
    import torch

#: The oldest transformers 4.x usaf supports (Qwen3-MoE appeared in 4.51).
MIN_LEGACY = "4.51"

#: The fused experts module's bias parameters (gpt-oss), in (gate_up, down) order.
EXPERT_BIAS_PARAMS = ("gate_up_proj_bias", "down_proj_bias")


def expert_biases(experts: Any, expert: int) -> tuple[Any, Any]:
    """``(gate_up_bias (2I,), down_bias (H,))`` of one expert of a fused experts module, or ``(None, None)``
    when the module has no biases (its ``has_bias``; every family but gpt-oss)."""
    if not getattr(experts, "has_bias", False):
        return None, None
    return tuple(getattr(experts, name)[expert] for name in EXPERT_BIAS_PARAMS)


def load_balancing_loss_of(model: Any) -> Any:
    """The family's own Switch-style load-balancing loss, ``fn(gate_logits: tuple, num_experts, top_k,
    attention_mask) -> loss``: the ``load_balancing_loss_func`` of the model's transformers module; None where
    the family defines none (DeepSeek-V3 balances with its routing bias instead)."""
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def has_load_balancing_loss(model_type: str) -> bool:
    """Whether the installed transformers gives the family a ``load_balancing_loss_func`` (what ``--aux-loss-coef``
    trains with; :func:`load_balancing_loss_of`), read from its modeling module without building a model."""
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return False
    return hasattr(module, "load_balancing_loss_func")


class ModuleLayout(str, Enum):
    """How the installed transformers holds one family's MoE experts in memory."""

    FUSED = "fused"  # transformers >= 5: fused 3-D experts, dispatched through the experts registry
    PER_EXPERT_MODULES = "per_expert_modules"  # transformers 4.x: nn.ModuleList of per-expert MLPs
    FUSED_NO_REGISTRY = "fused_no_registry"  # transformers 4.x gpt-oss: fused 3-D experts, its own forward


@lru_cache(maxsize=1)
def installed_transformers() -> str | None:
    """The installed transformers version (from its metadata: no import), or None when absent."""
    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def major_of(version: str | None) -> int:
    match = re.match(r"(\d+)", version or "")
    return int(match[1]) if match else 0


def transformers_major() -> int:
    """The installed transformers' major version (0 when it is not installed)."""
    return major_of(installed_transformers())


def module_layout(spec: FamilySpec, major: int | None = None) -> ModuleLayout:
    """The layout transformers ``major`` (default: the installed one) gives ``spec``'s family.

    Raises:
        UsafError: transformers 4.x with a model type usaf supports on transformers >= 5 only
            (the structural fallback relies on v5's fused experts).
    """
    major = transformers_major() if major is None else major
    if major >= 5:
        return ModuleLayout.FUSED
    if spec.legacy is None:
        raise UsafError(
            f"{spec.model_type}: usaf supports this model type with transformers >= 5 only "
            f"(installed: {installed_transformers() or 'none'})",
            "install transformers >= 5 (not possible with torch-directml, which pins torch 2.4.1)",
        )
    return ModuleLayout.FUSED_NO_REGISTRY if spec.legacy.experts == "fused" else ModuleLayout.PER_EXPERT_MODULES


def legacy_config_fields(spec: FamilySpec, config: Mapping[str, Any], major: int | None = None) -> dict[str, Any]:
    """Config fields to set under their transformers 4.x names: ``{4.x name: value}`` (empty on v5).

    Only fields the ``config.json`` holds under the transformers-5 name and not under the 4.x one.
    """
    if module_layout(spec, major) is ModuleLayout.FUSED or spec.legacy is None:
        return {}
    text = config.get(spec.nested_in, config) if spec.nested_in else config
    return {old: text[new] for new, old in spec.legacy.config_renames if new in text and old not in text}


def transformers_config(path: Any, spec: FamilySpec) -> Any:
    """``AutoConfig.from_pretrained(path)`` with :func:`legacy_config_fields` applied (transformers 4.x)."""
    # lazy: importing usaf.families stays free of transformers
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    for name, value in legacy_config_fields(spec, raw).items():
        setattr(config.get_text_config() if spec.nested_in else config, name, value)
    return config


def decoder_returns_tuple(spec: FamilySpec, major: int | None = None) -> bool:
    """Whether the installed transformers' decoder layers return a tuple whose ``[0]`` is the hidden state."""
    legacy = module_layout(spec, major) is not ModuleLayout.FUSED
    return legacy and bool(spec.legacy and spec.legacy.layer_returns_tuple)


def per_expert_module_names(spec: FamilySpec, layer: int) -> dict[str, list[str]]:
    """transformers 4.x names of one MoE layer's per-expert weights: role -> [name of expert 0, 1, ...].

    Roles: ``gate`` ``[I, H]``, ``up`` ``[I, H]``, ``down`` ``[H, I]`` (``nn.Linear`` weights, out x in).
    """
    naming = spec.disk.per_expert
    if naming is None:
        raise ValueError(f"{spec.model_type} has no per-expert naming")
    prefix = spec.moe_prefix(layer)
    return {
        role: [spec.disk.to_disk(f"{prefix}.{template.format(e=e)}") for e in range(spec.num_experts)]
        for role, template in (("gate", naming.gate), ("up", naming.up), ("down", naming.down))
    }


def model_name(spec: FamilySpec, name: str, major: int | None = None) -> str:
    """The installed transformers' in-memory name of a usaf-named non-expert tensor."""
    return name if module_layout(spec, major) is ModuleLayout.FUSED else spec.disk.to_disk(name)


def usaf_view(spec: FamilySpec, tensors: Mapping[str, Any], major: int | None = None) -> dict[str, Any]:
    """The model's ``state_dict`` ``name -> shape`` (as the installed transformers names it) in usaf's names.

    On transformers >= 5 this is the identity. On 4.x the family's renames are applied and each MoE
    layer's per-expert weights are replaced by the fused ``gate_up_proj``/``down_proj`` with the fused
    shapes; a layer whose per-expert weights are not all there, or have other shapes, is an error (the
    spec and the model disagree).
    """
    layout = module_layout(spec, major)
    if layout is ModuleLayout.FUSED:
        return dict(tensors)
    out: dict[str, Any] = {}
    claimed: set[str] = set()
    if layout is ModuleLayout.PER_EXPERT_MODULES:
        i, h = spec.expert_width, spec.hidden_size
        want = {"gate": (i, h), "up": (i, h), "down": (h, i)}
        for layer in spec.moe_layers:
            names = per_expert_module_names(spec, layer)
            for role, per_expert in names.items():
                wrong = [n for n in per_expert if n not in tensors or tuple(tensors[n]) != want[role]]
                if wrong:
                    raise UsafError(
                        f"{spec.model_type} layer {layer}: transformers' model has no {role} weight {want[role]} "
                        f"at {wrong[0]} (spec and model disagree)",
                        "report this model and transformers version",
                    )
                claimed.update(per_expert)
            shapes = spec.expert_shapes()
            out[spec.gate_up_name(layer)] = shapes["gate_up"]
            out[spec.down_name(layer)] = shapes["down"]
    for name, shape in tensors.items():
        if name not in claimed:
            out[spec.disk.to_memory(name)] = shape
    return out


class FusedView:
    """Read and write a transformers model's tensors by usaf name, whatever layout the model has.

    Expert tensors are the fused ``(E, 2I, H)``/``(E, H, I)`` (or gpt-oss's transposed) tensors; on a
    per-expert (transformers 4.x) model, :meth:`get` stacks the per-expert ``nn.Linear`` weights into a
    new tensor and :meth:`set` splits a fused value back into them.
    """

    def __init__(self, model: torch.nn.Module, spec: FamilySpec, major: int | None = None) -> None:
        self.model, self.spec = model, spec
        self.layout = module_layout(spec, major)
        self._experts: dict[str, tuple[int, str]] = {}  # usaf expert name -> (layer, role)
        if self.layout is ModuleLayout.PER_EXPERT_MODULES:
            for layer in spec.moe_layers:
                self._experts[spec.gate_up_name(layer)] = (layer, "gate_up")
                self._experts[spec.down_name(layer)] = (layer, "down")

    def _param(self, name: str) -> torch.Tensor:
        try:
            return self.model.get_parameter(name)
        except AttributeError:  # a persistent buffer (DeepSeek's e_score_correction_bias)
            return self.model.get_buffer(name)

    def get(self, name: str, *, grad: bool = False) -> torch.Tensor:
        """The tensor ``name`` (usaf's name): the parameter itself, or a fused copy of per-expert weights.

        ``grad``: the parameter's ``.grad`` instead (fused the same way).
        """
        # lazy: this module imports neither torch nor transformers (see its docstring)
        import torch

        def part(n: str) -> torch.Tensor:
            p = self._param(n)
            if not grad:
                return p.detach()
            # an expert no token reached has no .grad in 4.x; in the fused tensor its rows are zeros
            return p.grad if p.grad is not None else torch.zeros_like(p)

        if name not in self._experts:
            param = self._param(name if self.layout is ModuleLayout.FUSED else self.spec.disk.to_disk(name))
            return param.grad if grad else param
        layer, role = self._experts[name]
        names = per_expert_module_names(self.spec, layer)
        if role == "down":
            return torch.stack([part(n) for n in names["down"]])  # (E, H, I)
        gate = torch.stack([part(n) for n in names["gate"]])  # (E, I, H)
        up = torch.stack([part(n) for n in names["up"]])  # (E, I, H)
        return torch.cat([gate, up], dim=1)  # (E, 2I, H): gate rows first, as v5's concatenated layout

    def requires_grad_(self, name: str) -> None:
        """Make the parameter(s) behind ``name`` require gradients."""
        if name not in self._experts:
            self.get(name).requires_grad_(True)
            return
        layer, _ = self._experts[name]
        names = per_expert_module_names(self.spec, layer)
        roles = ("down",) if name == self.spec.down_name(layer) else ("gate", "up")
        for role in roles:
            for n in names[role]:
                self._param(n).requires_grad_(True)

    def set(self, name: str, value: torch.Tensor) -> None:
        """Copy ``value`` (usaf's layout for ``name``) into the model, casting to the model's dtype."""
        # lazy: this module imports neither torch nor transformers (see its docstring)
        import torch

        with torch.no_grad():
            if name not in self._experts:
                param = self.get(name)
                param.copy_(value.to(param.dtype))
                return
            layer, role = self._experts[name]
            names = per_expert_module_names(self.spec, layer)
            i = self.spec.expert_width
            for e in range(self.spec.num_experts):
                if role == "down":
                    self._copy(names["down"][e], value[e])  # (H, I)
                else:
                    self._copy(names["gate"][e], value[e, :i])  # (I, H)
                    self._copy(names["up"][e], value[e, i:])  # (I, H)

    def _copy(self, name: str, value: torch.Tensor) -> None:
        param = self._param(name)
        param.copy_(value.to(param.device, param.dtype))


def usaf_state_dict(model: torch.nn.Module, spec: FamilySpec, major: int | None = None) -> dict[str, torch.Tensor]:
    """A transformers model's ``state_dict`` under usaf's names (on 4.x: fused copies of per-expert weights)."""
    state = model.state_dict()
    layout = module_layout(spec, major)
    if layout is ModuleLayout.FUSED:
        return state
    view = FusedView(model, spec, major)
    names = usaf_view(spec, {n: tuple(t.shape) for n, t in state.items()}, major)
    return {name: view.get(name) if name in view._experts else state[spec.disk.to_disk(name)] for name in names}
