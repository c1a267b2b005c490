"""Settings of ``usaf tiny-model`` (command line only: no ``--config`` table)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from usaf.config import StageConfig
from usaf.settings import fields as f
from usaf.settings.fields import cli

# usaf.families.SUPPORTED_FAMILIES, which settings sit below (tests/test_cli.py checks they agree)
FAMILIES = ("deepseek_v3", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")


class TinyModelConfig(StageConfig):
    """Settings of ``usaf tiny-model``."""

    out: Path = Field(
        description="Directory to write the Hugging Face model directory to.", json_schema_extra=cli(argument=True)
    )
    family: str = Field("qwen3_moe", description=f"Model family (config.json model_type): {', '.join(FAMILIES)}.")
    layers: int = Field(2, ge=1, le=64, description="Decoder layers.")
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of the random weights.")
    overwrite: bool = f.overwrite()
