"""Settings of ``usaf quantize``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from usaf.config import StageConfig
from usaf.settings import fields as f
from usaf.settings.fields import cli


class QuantizeConfig(StageConfig):
    """Settings of ``usaf quantize``."""

    model: str | None = Field(
        None,
        description="Hugging Face model directory or hub id (e.g. Qwen/Qwen3-30B-A3B).",
        json_schema_extra=cli(argument=True, names_a_path=True),
    )
    out: Path | None = f.out_dir("quantized_model")
    workspace: Path | None = f.workspace()
    method: Literal["hqq", "rtn"] = Field(
        "hqq", description="hqq (half-quadratic) or rtn (min-max round-to-nearest, fast)."
    )
    nbits: Literal[2, 3, 4, 8] = Field(4, description="Bits per expert weight: 2, 3, 4 or 8.")
    group_size: int = Field(
        128, ge=8, le=4096, description="Weights per scale/zero along the input axis.",
        json_schema_extra=cli(default_text="128; the largest divisor if not"),
    )  # fmt: skip
    device: str = f.device()
    resume: bool = Field(False, description="Accept an existing complete --out made with these settings.")
    force: bool = Field(False, description="Replace an existing --out; discard an interrupted run's work.",
                        json_schema_extra=cli(alias="--overwrite", own_only=True))  # fmt: skip  # as overwrite

    @model_validator(mode="after")
    def _resume_or_force(self) -> QuantizeConfig:
        if self.resume and self.force:  # --force replaced what --resume asked to accept, in silence (found in review)
            raise ValueError("pass either --resume (accept the complete --out) or --force (replace it), not both")
        return self
