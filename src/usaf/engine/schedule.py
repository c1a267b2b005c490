"""Learning-rate schedule shared by the delta and router groups: linear warmup, then cosine decay."""

from __future__ import annotations

import math
from typing import Any


class WarmupCosine:
    """Linear warmup from 0 to the peak over ``warmup_steps``, then cosine to ``min_lr_ratio`` × peak.

    ``factor(step)`` is 0 at step 0, 1 at ``warmup_steps`` and ``min_lr_ratio`` from ``total_steps``
    on. Call :meth:`apply` with the 0-based index of the update about to be made, before ``step()``.

    Args:
        warmup_steps: length of the linear warmup (0 starts at the peak).
        total_steps: the step at which the cosine reaches its floor.
        min_lr_ratio: the floor as a fraction of each group's peak.
        peak_lr: what :meth:`lr_at` scales; :meth:`apply` uses each group's own ``initial_lr``.
    """

    def __init__(self, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1, peak_lr: float = 1.0) -> None:
        if total_steps <= 0 or not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"need 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps}), total > 0")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.min_lr_ratio = float(min_lr_ratio)
        self.peak_lr = float(peak_lr)
        self.last_step: int | None = None

    def factor(self, step: int) -> float:
        """Multiplier of the peak lr at ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return step / self.warmup_steps
        span = self.total_steps - self.warmup_steps
        progress = 1.0 if span == 0 else min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def lr_at(self, step: int) -> float:
        """``peak_lr × factor(step)``."""
        return self.peak_lr * self.factor(step)

    def apply(self, optimizer: Any, step: int) -> float:
        """Set each group's ``lr`` to its own peak (``initial_lr``) × ``factor(step)``; return the factor.

        Works for any optimizer with ``param_groups``; a group without ``initial_lr`` records its
        current ``lr`` as its peak on first use (torch's scheduler convention).
        """
        f = self.factor(step)
        for group in optimizer.param_groups:
            group["lr"] = group.setdefault("initial_lr", group["lr"]) * f
        self.last_step = step
        return f

    def state_dict(self) -> dict[str, Any]:
        return {
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "min_lr_ratio": self.min_lr_ratio,
            "peak_lr": self.peak_lr,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__init__(  # re-validate
            state_dict["warmup_steps"], state_dict["total_steps"], state_dict["min_lr_ratio"], state_dict["peak_lr"]
        )
        self.last_step = state_dict["last_step"]
