"""Settings of ``usaf plan`` (flags, ``USAF_*`` variables, the ``[plan]`` table of ``--config``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from usaf.config import StageConfig

# The original tool's variables, honoured below --config, as usaf score and usaf train do.
LEGACY_ENV = {"FRAC": "frac", "TRAIN_FROM": "train_from", "MICROBATCH": "microbatch"}


class PlanConfig(StageConfig):
    """What to plan for. Unset ``microbatch``/``train_from`` are chosen by the planner."""

    model: str = Field(description="Model directory, usaf quantize output, or hub id (only config.json is read).")
    vram: str | None = Field(None, description="Device memory, e.g. 12GiB [default: this machine's GPU].")
    ram: str | None = Field(None, description="Host memory, e.g. 32GiB [default: this machine's RAM].")
    device: str | None = Field(None, description="cpu|cuda|directml [default: cuda with --vram, else cpu].")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seq_len: int = Field(512, ge=2, description="Tokens per sequence.")
    microbatch: int | None = Field(
        None, ge=1, description="Sequences per forward [default: largest of 2, 1 that fits]."
    )
    frac: float = Field(0.005, gt=0, lt=1, description="Fraction of the trainable layers' expert weights.")
    train_from: int | None = Field(
        None, ge=0, description="First trainable layer [default: most that fit, up to the top quarter]."
    )
    samples: int | None = Field(None, ge=1, description="Training sequences (sizes the prefix cache).")
    nbits: Literal[2, 3, 4, 8] | None = Field(None, description="Bits per expert weight [default: 4].")
    group_size: int | None = Field(None, ge=8, le=4096, description="Weights per scale/zero [default: 128].")
