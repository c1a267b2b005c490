"""Settings of ``usaf export``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from usaf.config import StageConfig
from usaf.settings import fields as f
from usaf.settings.fields import cli

DEFAULT_SHARD_GIB = 2.0


class ExportConfig(StageConfig):
    """Settings of ``usaf export``."""

    model: Path | None = f.quantized_model("the one the change was trained on")
    checkpoint: Path | None = f.checkpoint()
    no_checkpoint: bool = Field(
        False, description="Export the quantized model's dequantized base alone, without a change (to compare)."
    )
    out: Path | None = f.out_dir("hf_export|delta")
    workspace: Path | None = f.workspace()
    base: str | None = Field(
        None,
        description="Original model (directory or hub id, offline cache) to merge into.",
        json_schema_extra=cli(default_text="the quantized model's experts, dequantized", names_a_path=True),
    )
    format: Literal["hf", "delta"] = Field("hf", description="hf (merged model directory) | delta (change alone).")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="float32 | bfloat16 | float16 for floating tensors.",
        json_schema_extra=cli(default_text="each keeps the original's", own_only=True),
    )  # fmt: skip
    max_shard_gib: float | None = Field(
        None, gt=0, le=1024,
        description="Largest safetensors shard, in GiB; one layer's experts, or one tensor, go whole into one shard "
        "(said where that is larger).",
        json_schema_extra=cli(default_text=f"{DEFAULT_SHARD_GIB:g}"),
    )  # fmt: skip
    verify: bool = Field(True, description="Reload with transformers and compare logits before committing.")
    device: str | None = f.device(None, default_text="cpu")
    overwrite: bool = f.overwrite()

    @model_validator(mode="after")
    def _no_checkpoint_alone(self) -> ExportConfig:
        if not self.no_checkpoint:
            return self
        if self.checkpoint is not None:
            raise ValueError("pass either --checkpoint or --no-checkpoint, not both")
        if self.format == "delta":
            raise ValueError("--no-checkpoint with --format delta would write an empty change; pass --format hf")
        if self.base is not None:
            raise ValueError(
                "--no-checkpoint with --base would copy the original unchanged; drop --base to export the "
                "dequantized base"
            )
        return self

    @model_validator(mode="after")
    def _hf_only(self) -> ExportConfig:
        if self.format == "delta":
            # (--device is not among them: USAF_DEVICE and [defaults] set it for every command)
            hf_only = {"--base": self.base, "--dtype": self.dtype, "--max-shard-gib": self.max_shard_gib}
            given = [flag for flag, value in hf_only.items() if value is not None]
            if given:
                verb, them = ("applies", "it") if len(given) == 1 else ("apply", "them")  # "--dtype apply" (review)
                raise ValueError(f"{', '.join(given)} {verb} to --format hf only; drop {them} or pass --format hf")
        return self
