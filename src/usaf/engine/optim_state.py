"""The state :class:`usaf.engine.optim.SparseAdamW` keeps per element, and its state dict.

One :class:`ParamState` per managed parameter: fp32 moments and an int32 step count per element (12 bytes
per element). The state dict holds tensors and plain values only, so ``torch.load(weights_only=True)``
reads it back; :func:`check_state_dict` checks everything before :func:`restore_state` changes anything,
so a rejected state dict leaves the optimizer as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from usaf.engine.optim import SparseAdamW

FORMAT = "usaf.sparse_adamw/1"


@dataclass
class ParamState:
    exp_avg: torch.Tensor  # fp32, the parameter's shape
    exp_avg_sq: torch.Tensor  # fp32, the parameter's shape
    step: torch.Tensor  # int32, the parameter's shape: updates this element has received

    @classmethod
    def fresh(cls, shape: torch.Size | tuple[int, ...], device: torch.device) -> ParamState:
        return cls(
            torch.zeros(shape, dtype=torch.float32, device=device),
            torch.zeros(shape, dtype=torch.float32, device=device),
            torch.zeros(shape, dtype=torch.int32, device=device),
        )

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "step": self.step}


def check_anchor(p: torch.Tensor, anchor: torch.Tensor | None) -> None:
    if anchor is None:
        return
    if anchor.shape != p.shape or anchor.device != p.device:
        raise ValueError(
            f"anchor {tuple(anchor.shape)} on {anchor.device} must match its parameter {tuple(p.shape)} on {p.device}"
        )
    if anchor.data_ptr() == p.data_ptr():
        # Decay toward itself would be a silent no-op; the anchor must be a frozen copy.
        raise ValueError("an anchor must be a frozen copy, not the parameter itself")


def optimizer_state_dict(opt: SparseAdamW) -> dict[str, Any]:
    """The live state of ``opt`` (not copies) and its hyperparameters; anchors are not included."""
    return {
        "format": FORMAT,
        "betas": list(opt.betas),
        "eps": opt.eps,
        "max_grad_norm": opt.max_grad_norm,
        "applied_steps": opt.applied_steps,
        "skipped_steps": opt.skipped_steps,
        "groups": [
            {
                "name": g["name"],
                "lr": g["lr"],
                "initial_lr": g["initial_lr"],
                "weight_decay": g["weight_decay"],
                "state": [s.tensors() for s in row],
            }
            for g, row in zip(opt.param_groups, opt._state)
        ],
    }


def check_state_dict(state_dict: Any, param_groups: list[dict[str, Any]]) -> None:
    """Raise ValueError unless ``state_dict`` fits ``param_groups``: same format, group names, parameter counts
    and sizes, fp32 moments that are finite, integer step counts from 0.

    It may come from a file (a resumed checkpoint's ``optimizer.pt``): every way it can be wrong is a
    ValueError saying what, never a KeyError or TypeError from deep inside :func:`restore_state`.
    """
    if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
        given = state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"not a SparseAdamW state dict (format {given!r})")
    _check_hyperparameters(state_dict)
    groups = state_dict.get("groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError("its groups are not a list of groups")
    names = [g.get("name") for g in groups]
    if names != [g["name"] for g in param_groups]:
        raise ValueError(f"state dict groups {names} do not match {[g['name'] for g in param_groups]}")
    for saved, group in zip(groups, param_groups):
        _check_group(saved, group)


def _check_hyperparameters(state_dict: dict[str, Any]) -> None:
    betas = state_dict.get("betas")
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_is_number(b) for b in betas)):
        raise ValueError(f"betas {betas!r} are not two numbers")
    if not _is_number(state_dict.get("eps")):
        raise ValueError(f"eps {state_dict.get('eps')!r} is not a number")
    clip = state_dict.get("max_grad_norm")
    if clip is not None and not _is_number(clip):
        raise ValueError(f"max_grad_norm {clip!r} is not a number")
    for key in ("applied_steps", "skipped_steps"):
        value = state_dict.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{key} {value!r} is not a count")


def _check_group(saved: dict[str, Any], group: dict[str, Any]) -> None:
    name = group["name"]
    for key in ("lr", "initial_lr", "weight_decay"):
        if not _is_number(saved.get(key)):
            raise ValueError(f"group {name!r}: {key} {saved.get(key)!r} is not a number")
    rows = saved.get("state")
    if not isinstance(rows, list) or len(rows) != len(group["params"]):
        count = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise ValueError(f"group {name!r}: {count} saved params, {len(group['params'])} now")
    for j, (s, p) in enumerate(zip(rows, group["params"])):
        tensors = [s.get(k) for k in ("exp_avg", "exp_avg_sq", "step")] if isinstance(s, dict) else []
        if len(tensors) != 3 or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError(f"group {name!r} param {j}: not exp_avg, exp_avg_sq and step tensors")
        exp_avg, exp_avg_sq, step = tensors
        if any(t.numel() != p.numel() for t in tensors):
            shapes = [tuple(t.shape) for t in tensors]
            raise ValueError(
                f"group {name!r} param {j}: saved state of shapes {shapes}, the parameter {tuple(p.shape)}"
            )
        if not (exp_avg.is_floating_point() and exp_avg_sq.is_floating_point()) or step.is_floating_point():
            raise ValueError(f"group {name!r} param {j}: moments must be floating point and step counts integers")
        if not bool(exp_avg.isfinite().all() and exp_avg_sq.isfinite().all()):
            raise ValueError(f"group {name!r} param {j}: NaN or Inf in the moments")
        if step.numel() and int(step.min()) < 0:
            raise ValueError(f"group {name!r} param {j}: negative step counts")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def restore_state(
    state_dict: dict[str, Any], param_groups: list[dict[str, Any]], states: list[list[ParamState]]
) -> int:
    """Copy a checked state dict's group settings into ``param_groups`` and its state into ``states`` (onto
    each parameter's device and shape); returns the largest step count restored."""
    max_step = 0
    for saved, group, row in zip(state_dict["groups"], param_groups, states):
        for key in ("lr", "initial_lr", "weight_decay"):
            group[key] = float(saved[key])
        for j, (s, p) in enumerate(zip(saved["state"], group["params"])):
            row[j] = ParamState(
                s["exp_avg"].to(p.device, torch.float32).reshape(p.shape).clone(),
                s["exp_avg_sq"].to(p.device, torch.float32).reshape(p.shape).clone(),
                s["step"].to(p.device, torch.int32).reshape(p.shape).clone(),
            )
            if p.numel():
                max_step = max(max_step, int(row[j].step.max()))
    return max_step
