"""The settings of ``usaf train`` (light: pydantic only, no torch), and the original tool's variables."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from usaf.config import StageConfig

# The original tool's environment variables, honoured below --config (README documents them).
LEGACY_ENV = {
    "FRAC": "frac",
    "STEPS": "steps",
    "EPOCHS": "epochs",
    "TRAIN_FROM": "train_from",
    "MICROBATCH": "microbatch",
    "LR_PEAK": "lr",
    "RESELECT_EVERY": "reselect_every",
    "DATASET_PATH": "data",
    "QUANT_PATH": "model",
}


class TrainConfig(StageConfig):
    """Settings of ``usaf train`` (each also ``USAF_<NAME>`` and a ``[train]`` TOML key)."""

    model: Path | None = None
    data: Path | None = None
    plan: Path | None = None
    eval_data: Path | None = None
    out: Path | None = None
    workspace: Path | None = None
    frac: float = Field(0.005, gt=0, lt=1)
    train_from: int | None = Field(None, ge=0)
    layers: list[int] | None = Field(None, description="Explicit trainable MoE layers (scoring on the fly).")
    statistic: Literal["grad", "grad2", "grad_x_weight"] = "grad"
    budget: Literal["per-tensor", "per-layer", "global", "per-expert"] = "per-tensor"
    steps: int | None = Field(None, ge=1)
    epochs: float | None = Field(None, gt=0)
    microbatch: int = Field(2, ge=1)
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(3e-3, gt=0, description="Peak learning rate of the deltas (docs/ARCHITECTURE.md: the evidence).")
    router_lr: float = Field(1e-4, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    clip: float | None = Field(1.0, gt=0)
    warmup: float = Field(0.05, ge=0, lt=1, description="Warmup steps as a fraction of the run.")
    reselect_every: int | None = Field(
        None, ge=0, description="Steps between reselections; 0 = static [default: 50, static for runs of <= 50 steps]."
    )
    seq_len: int | None = Field(None, ge=2, description="Cut longer sequences to this many tokens.")
    reselect_fraction: float = Field(0.2, ge=0, le=1)
    aux_loss_coef: float = Field(0.0, ge=0)
    z_loss_coef: float = Field(0.0, ge=0)
    router: bool = True
    eval_every: int = Field(0, ge=0)
    save_every: int = Field(50, ge=0)
    seed: int = 0
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype [default: bf16 where native, else fp16 + loss scaling; fp32 on CPU]."
    )
    calib_samples: int = Field(64, ge=1)
    prefix_cache_gib: float = Field(2.0, ge=0, description="RAM for cached prefix states before spilling to disk.")
    stream_experts: bool | None = Field(
        None, description="Frozen layers' 4-bit experts in host memory, streamed per layer [default: by size]."
    )
    vram: str | None = Field(None, description="Device memory budget: usaf plan picks the settings not given.")
    ram: str | None = Field(None, description="Host memory budget: usaf plan picks the settings not given.")
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend under torchrun [default: nccl on CUDA, else gloo]."
    )
    resume: bool = False
    overwrite: bool = False

    @model_validator(mode="after")
    def _length(self) -> TrainConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("pass either --steps or --epochs, not both")
        if self.steps is not None and self.reselect_every is not None and self.reselect_every > self.steps:
            raise ValueError(
                f"--reselect-every {self.reselect_every} exceeds --steps {self.steps}; "
                "lower it or pass 0 for a static mask"
            )
        return self
