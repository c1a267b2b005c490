"""Dynamic loss scaling for fp16 compute: small gradients survive fp16's narrow range.

The loss is multiplied by ``scale`` before backward, so every gradient computed in fp16 is ``scale``
times larger (above fp16's underflow); before the optimizer step the fp32 gradients of every trainable
(sparse delta values and routers, in one place) are divided back. An overflow (a non-finite gradient)
skips the step and halves the scale; ``growth_interval`` clean steps in a row double it. The same
policy as ``torch.amp.GradScaler``, kept here because the engine's parameters are its own.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class DynamicLossScaler:
    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 200,
        min_scale: float = 1.0,
    ) -> None:
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_steps = 0
        self.overflows = 0

    def unscale_(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide every gradient by the scale in place; returns whether all of them are finite."""
        finite = True
        inverse = 1.0 / self.scale
        for p in params:
            if p.grad is None:
                continue
            p.grad.mul_(inverse)
            finite = finite and bool(torch.isfinite(p.grad).all())
        return finite

    def update(self, finite: bool) -> None:
        """After a step: back off on overflow, grow after ``growth_interval`` clean steps."""
        if not finite:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.clean_steps = 0
            self.overflows += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.overflows = int(state["overflows"])
