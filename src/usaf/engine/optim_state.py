"""The state :class:`usaf.engine.optim.SparseAdamW` keeps per element, and its state dict.

One :class:`ParamState` per managed parameter: fp32 moments and an int32 step count per element (12 bytes
per element). The state dict holds tensors and plain values only, so ``torch.load(weights_only=True)``
reads it back; :func:`check_state_dict` checks everything before :func:`restore_state` changes anything,
so a rejected state dict leaves the optimizer as it was.
"""

from __future__ import annotations

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


def check_state_dict(state_dict: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
    """Raise unless ``state_dict`` fits ``param_groups``: same format, group names, parameter counts and sizes."""
    if state_dict.get("format") != FORMAT:
        raise ValueError(f"not a SparseAdamW state dict (format {state_dict.get('format')!r})")
    groups = state_dict["groups"]
    if [g["name"] for g in groups] != [g["name"] for g in param_groups]:
        raise ValueError(
            f"state dict groups {[g['name'] for g in groups]} do not match {[g['name'] for g in param_groups]}"
        )
    for saved, group in zip(groups, param_groups):
        if len(saved["state"]) != len(group["params"]):
            raise ValueError(f"group {group['name']!r}: {len(saved['state'])} saved params, {len(group['params'])} now")
        for j, (s, p) in enumerate(zip(saved["state"], group["params"])):
            if any(s[k].numel() != p.numel() for k in ("exp_avg", "exp_avg_sq", "step")):
                raise ValueError(
                    f"group {group['name']!r} param {j}: saved state has {s['step'].numel()} entries, "
                    f"the parameter {p.numel()}"
                )
            if s["step"].numel() and int(s["step"].min()) < 0:
                raise ValueError(f"group {group['name']!r} param {j}: negative step counts")


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
