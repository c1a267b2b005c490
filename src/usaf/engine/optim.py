"""Adam(W) for compact sparse-delta values and dense router weights (schedule: usaf.engine.schedule).

Why not ``torch.optim.AdamW`` (method §2, §5, §6):

* Every element has its own step count (``int32``, the parameter's shape), so entries that join the
  active set at a reselection get fresh moments *and their own bias correction* while kept entries
  continue. torch keeps one step count per tensor.
* Decoupled weight decay pulls toward an anchor: zero for delta values (the delta *is* the distance
  from the pretrained weight, so decay pulls toward the base), a frozen pretrained copy for routers.
* A step is all or nothing: one non-finite gradient anywhere skips it with parameters and state left
  bit-identical; the gradient norm and clipping span every group at once.
* A delta's value vector changes size at reselection; :meth:`SparseAdamW.remap_state` moves the kept
  entries' state to their new positions.

The arithmetic follows ``torch.optim.AdamW``'s single-tensor path operation for operation (bias
corrections in float64 on the host, rounded once to fp32), so on CPU with uniform step counts the
result equals torch's bit for bit. Each operation runs over all of a group's parameters at once
(``torch._foreach_*``: on a GPU a few kernel launches whatever the number of parameters, where one
update per parameter launched about eleven each; on the CPU the same single-tensor operation per
parameter).

Swapping a parameter for one of another size (what the reselection code does), either:

1. in place, keeping the ``nn.Parameter`` object: ``delta.values.data = new_values`` then
   ``opt.remap_state(delta.values, keep_src, keep_dst, new_values.numel())``; or
2. with a new ``nn.Parameter``: ``opt.remap_state(old, keep_src, keep_dst, new.numel())`` then
   ``opt.replace_param(old, new)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from usaf.backends.transfer import device_capabilities, upload
from usaf.engine.optim_state import (
    ParamState,
    check_anchor,
    check_state_dict,
    optimizer_state_dict,
    restore_state,
)

try:
    from torch.nn.utils import get_total_norm  # torch >= 2.6
except ImportError:  # torch 2.4 (the DirectML configuration): clip_grad_norm_'s own reduction, restated

    def get_total_norm(tensors, norm_type: float = 2.0):
        norms = [torch.linalg.vector_norm(t, norm_type) for t in tensors]
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)


@dataclass(frozen=True)
class StepReport:
    """What :meth:`SparseAdamW.step` did.

    Attributes:
        applied: the parameters were updated (False when skipped or when no parameter had a gradient).
        grad_norm: global L2 norm of all gradients before clipping (``inf``/``nan`` when non-finite).
        clipped: the gradients were scaled down to ``max_grad_norm``.
        skipped_nonfinite: a gradient (or the norm) was non-finite, so nothing changed.
    """

    applied: bool
    grad_norm: float
    clipped: bool
    skipped_nonfinite: bool


class SparseAdamW:
    """AdamW with per-element step counts, anchored decoupled weight decay and all-or-nothing steps.

    Args:
        param_groups: dicts with ``params`` (list of fp32 tensors), ``lr``, optional ``weight_decay``
            (default 0), ``anchor`` (list aligned with ``params`` of frozen tensors or ``None`` = zero;
            ``None`` for all zero) and ``name`` (default ``group<i>``). Each group also gets
            ``initial_lr`` (its peak lr, used by :class:`usaf.engine.schedule.WarmupCosine`).
        betas: Adam's moment decay rates.
        eps: added to the denominator, as in torch.
        max_grad_norm: clip the global gradient L2 norm to this; ``None`` disables clipping.

    State (fp32 moments + int32 steps, 12 bytes per element) is allocated eagerly on each parameter's
    device, so :meth:`state_bytes` is exact before the first step.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        max_grad_norm: float | None = None,
    ) -> None:
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.applied_steps = 0
        self.skipped_steps = 0
        self.param_groups: list[dict[str, Any]] = []
        self._state: list[list[ParamState]] = []
        # Upper bound on any element's step count: the length the bias-correction tables must cover.
        self._max_step = 0
        self._bc1 = torch.ones(1, dtype=torch.float64)  # 1 - beta1**s, float64, index s
        self._bc2_sqrt = torch.ones(1, dtype=torch.float64)  # sqrt(1 - beta2**s)
        seen: set[int] = set()
        for i, group in enumerate(param_groups):
            self.param_groups.append(self._check_group(i, group, seen))
            self._state.append([ParamState.fresh(p.shape, p.device) for p in self.param_groups[-1]["params"]])

    @staticmethod
    def _check_group(i: int, group: dict[str, Any], seen: set[int]) -> dict[str, Any]:
        unknown = set(group) - {"params", "lr", "weight_decay", "anchor", "name", "initial_lr"}
        if unknown:
            raise ValueError(f"param group {i}: unknown keys {sorted(unknown)}")
        params = list(group["params"])
        anchors = group.get("anchor")
        anchors = [None] * len(params) if anchors is None else list(anchors)
        if len(anchors) != len(params):
            raise ValueError(f"param group {i}: {len(anchors)} anchors for {len(params)} params")
        for p, a in zip(params, anchors):
            if p.dtype != torch.float32:
                raise TypeError(f"param group {i}: params must be fp32 master weights, got {p.dtype}")
            if id(p) in seen:
                raise ValueError(f"param group {i}: a parameter appears twice")
            seen.add(id(p))
            check_anchor(p, a)
        lr = float(group["lr"])
        return {
            "params": params,
            "lr": lr,
            "initial_lr": float(group.get("initial_lr", lr)),
            "weight_decay": float(group.get("weight_decay", 0.0)),
            "anchor": [None if a is None else a.detach() for a in anchors],
            "name": str(group.get("name", f"group{i}")),
        }

    # ----------------------------------------------------------------------------------- stepping

    def zero_grad(self) -> None:
        """Set every parameter's ``grad`` to ``None``."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self) -> StepReport:
        """One all-or-nothing AdamW update over every group; see :class:`StepReport`."""
        live = [
            (i, j) for i, g in enumerate(self.param_groups) for j, p in enumerate(g["params"]) if p.grad is not None
        ]
        if not live:
            return StepReport(applied=False, grad_norm=0.0, clipped=False, skipped_nonfinite=False)
        grads = [self.param_groups[i]["params"][j].grad for i, j in live]
        if any(g.is_sparse for g in grads):
            raise TypeError("SparseAdamW expects dense gradients of the compact value vectors")
        # Same reduction as torch.nn.utils.clip_grad_norm_, so the reported norm matches it exactly.
        total = get_total_norm(grads, 2.0)
        norm = float(total)  # the one host sync per step
        if not math.isfinite(norm):
            self.skipped_steps += 1
            return StepReport(applied=False, grad_norm=norm, clipped=False, skipped_nonfinite=True)
        coef = None
        if self.max_grad_norm is not None:
            # clip_grad_norm_'s formula and fp32 arithmetic, on the host copy of the norm.
            coef = torch.clamp(self.max_grad_norm / (total.cpu() + 1e-6), max=1.0)
            if float(coef) >= 1.0:
                coef = None  # torch would multiply by exactly 1.0: skip the copy
        self._max_step += 1
        self._grow_tables(self._max_step)
        for i, group in enumerate(self.param_groups):
            by_device: dict[torch.device, list[int]] = {}
            for j, p in enumerate(group["params"]):
                if p.grad is not None:
                    by_device.setdefault(p.device, []).append(j)
            for device, js in by_device.items():
                params = [group["params"][j] for j in js]
                grads = [p.grad for p in params]
                if coef is not None:
                    grads = torch._foreach_mul(grads, upload(coef, device))  # new tensors: p.grad stays as given
                states = [self._checked_state(i, j) for j in js]
                anchors = [group["anchor"][j] for j in js]
                tables = self._step_tables(group["lr"], device)
                self._update(params, grads, anchors, group["lr"], group["weight_decay"], states, tables)
        self.applied_steps += 1
        return StepReport(applied=True, grad_norm=norm, clipped=coef is not None, skipped_nonfinite=False)

    def _update(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        anchors: list[torch.Tensor | None],
        lr: float,
        weight_decay: float,
        states: list[ParamState],
        tables: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """One update of ``params`` (one group, one device), as multi-tensor ops: a fixed number of them for any
        number of parameters, where a GPU step would otherwise launch about eleven kernels per parameter. Each
        ``_foreach_*`` op computes, tensor for tensor, what its single-tensor op does (on the CPU it is that op)."""
        beta1, beta2 = self.betas
        steps = [state.step for state in states]
        exp_avgs = [state.exp_avg for state in states]
        exp_avg_sqs = [state.exp_avg_sq for state in states]
        torch._foreach_add_(steps, 1)  # every element with a gradient row counts this update, zero or not
        if weight_decay != 0:
            toward_zero = [p for p, a in zip(params, anchors) if a is None]
            anchored = [(p, a) for p, a in zip(params, anchors) if a is not None]
            if toward_zero:  # torch's form: toward zero, i.e. toward the base for a delta
                torch._foreach_mul_(toward_zero, 1 - lr * weight_decay)
            if anchored:  # p + c * (anchor - p): an entry sitting at its anchor stays bit-identical
                torch._foreach_lerp_([p for p, _ in anchored], [a for _, a in anchored], lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        neg_step_size, bc2_sqrt = self._per_element(tables, steps)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bc2_sqrt)
        del bc2_sqrt
        torch._foreach_add_(denom, self.eps)
        # addcdiv_ computes (value * t1) / t2; a per-element value goes into t1 with the same rounding. The product
        # is formed in the factors' buffers (a * b == b * a, bit for bit): fewer buffers alive at once.
        numerators = neg_step_size
        torch._foreach_mul_(numerators, exp_avgs)
        torch._foreach_addcdiv_(params, numerators, denom)

    @staticmethod
    def _per_element(
        tables: tuple[torch.Tensor, torch.Tensor], steps: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each table's fp32 factor at every element's step count, one tensor per parameter (its shape): read for
        all parameters at once (index_select is ~10x faster than advanced indexing on CPU)."""
        flat = torch.cat([s.reshape(-1) for s in steps])  # (total,) int32
        sizes = [s.numel() for s in steps]
        return tuple(
            [part.view(s.shape) for part, s in zip(torch.index_select(t, 0, flat).split(sizes), steps)] for t in tables
        )

    def _grow_tables(self, max_step: int) -> None:
        """Extend the float64 bias-correction tables to cover steps ``0..max_step``."""
        have = self._bc1.numel()
        if have > max_step:
            return
        new = max(max_step + 1, 2 * have)
        beta1, beta2 = self.betas
        # Python floats, exactly as torch computes them from its scalar step count.
        bc1 = [1 - beta1 ** float(s) for s in range(have, new)]
        bc2_sqrt = [(1 - beta2 ** float(s)) ** 0.5 for s in range(have, new)]
        self._bc1 = torch.cat([self._bc1, torch.tensor(bc1, dtype=torch.float64)])
        self._bc2_sqrt = torch.cat([self._bc2_sqrt, torch.tensor(bc2_sqrt, dtype=torch.float64)])

    def _step_tables(self, lr: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(-lr / bc1, sqrt(bc2))`` indexed by step, computed in float64 then rounded once to fp32."""
        n = self._max_step + 1
        bc1 = self._bc1[:n].clone()
        bc1[0] = 1.0  # step 0 never reaches an update (steps are incremented first); avoid 1/0
        bc2_sqrt = self._bc2_sqrt[:n].clone()
        bc2_sqrt[0] = 1.0
        return upload((-(lr / bc1)).to(torch.float32), device), upload(bc2_sqrt.to(torch.float32), device)

    # ------------------------------------------------------------------------------ state surgery

    def _locate(self, param: torch.Tensor) -> tuple[int, int]:
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if p is param:
                    return i, j
        raise KeyError("parameter is not managed by this optimizer")

    def _checked_state(self, i: int, j: int) -> ParamState:
        """The state of param ``(i, j)``, moved to its device; errors if its size no longer matches."""
        p, state = self.param_groups[i]["params"][j], self._state[i][j]
        if state.step.numel() != p.numel():
            raise RuntimeError(
                f"group {self.param_groups[i]['name']!r} param {j}: state has {state.step.numel()} entries, "
                f"the parameter {p.numel()}; call remap_state after resizing a parameter"
            )
        if state.step.shape != p.shape or state.step.device != p.device:
            # A model moved with .to() keeps its Parameter objects; follow them.
            state = ParamState(*(t.reshape(p.shape).to(p.device) for t in state.tensors().values()))
            self._state[i][j] = state
        anchors = self.param_groups[i]["anchor"]
        if anchors[j] is not None and anchors[j].device != p.device:
            anchors[j] = anchors[j].to(p.device)
        return state

    def state_for(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"exp_avg", "exp_avg_sq", "step"}`` of ``param``: live tensors, to read, not to modify.

        Change state only through :meth:`reset_state`, :meth:`remap_state` and :meth:`load_state_dict`:
        the bias-correction tables assume no step count exceeds the number of applied steps.
        """
        i, j = self._locate(param)
        return self._state[i][j].tensors()

    def reset_state(self, param: torch.Tensor, mask_or_index: torch.Tensor) -> None:
        """Give chosen entries of ``param`` fresh state: zero moments and step 0.

        Args:
            param: a managed parameter.
            mask_or_index: a bool mask (the parameter's shape or flat) or int64 flat indices.
        """
        i, j = self._locate(param)
        state = self._checked_state(i, j)
        sel = mask_or_index.to(state.step.device)
        if sel.dtype == torch.bool:
            sel = sel.reshape(-1)
            if sel.numel() != param.numel():
                raise ValueError(f"mask has {sel.numel()} entries, the parameter {param.numel()}")
        for t in state.tensors().values():
            t.view(-1)[sel] = 0

    def remap_state(self, param: torch.Tensor, keep_src: torch.Tensor, keep_dst: torch.Tensor, new_numel: int) -> None:
        """Rebuild ``param``'s state for a new index set of ``new_numel`` entries.

        Kept entries carry moments and step counts from flat position ``keep_src[k]`` of the old state
        to ``keep_dst[k]`` of the new one; every other new entry starts fresh. Call it with the old
        parameter (before :meth:`replace_param`) or after resizing the same parameter in place.

        Args:
            param: a managed parameter.
            keep_src: ``(k,)`` int64 positions in the old state.
            keep_dst: ``(k,)`` int64 positions in the new state, unique.
            new_numel: size of the new value vector.
        """
        i, j = self._locate(param)
        old = self._state[i][j]
        keep_src = keep_src.reshape(-1).to(old.step.device, torch.int64)
        keep_dst = keep_dst.reshape(-1).to(old.step.device, torch.int64)
        if keep_src.numel() != keep_dst.numel():
            raise ValueError(f"keep_src has {keep_src.numel()} entries, keep_dst {keep_dst.numel()}")
        if keep_src.numel():
            old_n = old.step.numel()
            if int(keep_src.min()) < 0 or int(keep_src.max()) >= old_n:
                raise ValueError(f"keep_src out of range for the old state of {old_n} entries")
            if int(keep_dst.min()) < 0 or int(keep_dst.max()) >= new_numel:
                raise ValueError(f"keep_dst out of range for {new_numel} entries")
            if keep_dst.unique().numel() != keep_dst.numel():
                raise ValueError("keep_dst has repeated positions")
        shape = param.shape if param.numel() == new_numel else (new_numel,)
        device = old.step.device
        # Without index ops on the device (DirectML) the new state is assembled on the host, then moved.
        where = device if device_capabilities(device).index_ops else torch.device("cpu")
        keep_src, keep_dst = keep_src.to(where), keep_dst.to(where)
        new = ParamState.fresh((new_numel,), where)
        for src, dst in zip(old.tensors().values(), new.tensors().values()):
            dst[keep_dst] = src.reshape(-1).to(where)[keep_src]
        self._state[i][j] = ParamState(*(t.reshape(shape).to(device) for t in new.tensors().values()))

    def replace_param(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Manage ``new`` in ``old``'s place (same group, position, anchor and state).

        The state must already have ``new``'s size (see :meth:`remap_state`); an anchored parameter
        cannot change shape.
        """
        if new.dtype != torch.float32:
            raise TypeError(f"params must be fp32 master weights, got {new.dtype}")
        i, j = self._locate(old)
        if new is not old and any(new is p for g in self.param_groups for p in g["params"]):
            raise ValueError("the new parameter is already managed by this optimizer")
        if self._state[i][j].step.numel() != new.numel():
            raise ValueError(
                f"state has {self._state[i][j].step.numel()} entries, the new parameter {new.numel()}; "
                "call remap_state(old, keep_src, keep_dst, new.numel()) first"
            )
        check_anchor(new, self.param_groups[i]["anchor"][j])
        self.param_groups[i]["params"][j] = new
        self._checked_state(i, j)

    def state_bytes(self, include_anchors: bool = False) -> int:
        """Bytes held as optimizer state (moments and step counts; anchors, owned by the caller, on request)."""
        total = sum(t.nbytes for row in self._state for s in row for t in s.tensors().values())
        if include_anchors:
            total += sum(a.nbytes for g in self.param_groups for a in g["anchor"] if a is not None)
        return total

    # ------------------------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only (``torch.load(weights_only=True)`` reads it back).

        The tensors are the live state, not copies: save or clone before stepping again. Anchors are
        not included: they are the frozen pretrained weights, rebuilt from the model on resume.
        """
        return optimizer_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output onto parameters of the same groups, order and sizes.

        Everything is checked before anything changes, so a rejected state dict leaves this optimizer
        as it was. Hyperparameters (betas, eps, clipping, lrs, decay) are restored too, as in torch.
        """
        check_state_dict(state_dict, self.param_groups)
        self.betas = tuple(float(b) for b in state_dict["betas"])
        self.eps = float(state_dict["eps"])
        self.max_grad_norm = state_dict["max_grad_norm"]
        self.applied_steps = int(state_dict["applied_steps"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        # Tables are rebuilt lazily from betas; drop any built for other betas.
        self._bc1 = torch.ones(1, dtype=torch.float64)
        self._bc2_sqrt = torch.ones(1, dtype=torch.float64)
        self._max_step = restore_state(state_dict, self.param_groups, self._state)
        self._grow_tables(self._max_step)
