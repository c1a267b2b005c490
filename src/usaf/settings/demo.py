"""Settings of ``usaf demo``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from usaf.config import StageConfig
from usaf.settings import fields as f
from usaf.settings.fields import cli


class DemoConfig(StageConfig):
    """Settings of ``usaf demo``."""

    workspace: Path = Field(Path("usaf-demo"), description="Where the demo's artifacts go.")
    steps: int = Field(150, ge=1, description="Training steps.")
    frac: float | None = f.frac()
    seq_len: int = Field(256, ge=16, description="Tokens per sequence.", json_schema_extra=cli(hidden=True))
    lr: float | None = Field(
        None, gt=0, description="Peak learning rate of the deltas.",
        json_schema_extra=cli(hidden=True, default_text="the plan's (usaf score's lr test)"),
    )  # fmt: skip
    eval_sequences: int = Field(32, ge=1, description="Sequences per evaluated input (a seeded sample).")
    export: bool = Field(
        False, description="Also export a HF model.", json_schema_extra=cli(flag="--export/--no-export")
    )
    quick: bool = Field(
        False, description="A one-minute smoke run on three sources (20 steps, 16 held-out sequences, unless given)."
    )
    device: str = f.device()
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of the calibration sample and data order.")
    overwrite: bool = f.overwrite("Start over instead of reusing finished stages.")
