"""Settings of ``usaf tiny-model`` (command line only: no ``--config`` table)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from usaf.config import StageConfig
from usaf.settings import fields as f
from usaf.settings.fields import cli


class TinyModelConfig(StageConfig):
    """Settings of ``usaf tiny-model``."""

    out: Path = Field(
        description="Directory to write the Hugging Face model directory to.", json_schema_extra=cli(argument=True)
    )
    family: str = Field("qwen3_moe", description="Model family (config.json model_type).")
    layers: int = Field(2, ge=1, le=64, description="Decoder layers.", json_schema_extra=cli(min=1, max=64))
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of the random weights.")
    overwrite: bool = f.overwrite()
