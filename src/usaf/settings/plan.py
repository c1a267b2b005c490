"""Settings of ``usaf plan`` (flags, ``USAF_*`` variables, the ``[plan]`` table of ``--config``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from usaf.config import StageConfig
from usaf.settings import fields as f
from usaf.settings.fields import ComputeDtype, Targets, cli


class PlanConfig(StageConfig):
    """What to plan for. Unset ``microbatch``/``train_from`` are chosen by the planner."""

    model: str = Field(
        description="Model directory, usaf quantize output, or hub id (config.json only).",
        json_schema_extra=cli(argument=True, names_a_path=True),
    )
    vram: str | None = Field(None, description="Device memory: 12GiB, 16GB, ...",
                             json_schema_extra=cli(default_text="this machine's GPU"))  # fmt: skip
    ram: str | None = Field(None, description="Host memory: 32GiB, ...",
                            json_schema_extra=cli(default_text="this machine's RAM"))  # fmt: skip
    device: str | None = Field(
        None, description="cpu|cuda|directml: the kind of device to plan for.",
        json_schema_extra=cli(default_text="cuda with --vram, else cpu"),
    )  # fmt: skip
    dtype: ComputeDtype = Field(
        "auto", description="auto|float32|bfloat16|float16; auto: bf16 on cuda, fp16 on directml, fp32 cpu."
    )
    seq_len: int = f.seq_len_field(512)
    microbatch: int | None = Field(
        None, ge=1, description="Sequences per forward.",
        json_schema_extra=cli(default_text="the largest of 2, 1 that fits"),
    )  # fmt: skip
    frac: float | None = f.frac()
    targets: Targets | None = f.targets()
    train_from: int | None = Field(
        None, ge=0, description="First trainable layer.",
        json_schema_extra=cli(default_text="the most layers that fit, up to the top quarter"),
    )  # fmt: skip
    samples: int | None = Field(None, ge=1, description="Training sequences, to size the prefix cache.")
    nbits: Literal[2, 3, 4, 8] | None = Field(
        None, description="Bits per expert weight.", json_schema_extra=cli(default_text="4, or the quantized model's")
    )
    group_size: int | None = Field(
        None, ge=8, le=4096, description="Weights per scale/zero.",
        json_schema_extra=cli(default_text="128, or the quantized model's"),
    )  # fmt: skip
