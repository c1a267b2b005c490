"""Settings of ``usaf score``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, PrivateAttr, model_validator

from usaf.config import StageConfig
from usaf.settings import fields as f
from usaf.settings.fields import Budget, ComputeDtype, DistBackend, Statistic, Targets, cli

LR_TEST_STEPS = 16  # per probe: 4 probes x 16 steps at the default microbatch 4 (docs/ARCHITECTURE.md, usaf score)


class ScoreConfig(StageConfig):
    """Settings of ``usaf score``."""

    # usaf train scoring the plan it was given none of into RUN/plan (``out``): the one writer an unfinished run's
    # plan directory is open to. A user's score or export there was later deleted with the run by train --overwrite.
    _into_run: bool = PrivateAttr(False)

    model: Path | None = f.quantized_model()
    data: Path | None = Field(
        None, description="Tokens directory (usaf tokenize) or tokens JSONL.",
        json_schema_extra=cli(default_text="newest matching"),
    )  # fmt: skip
    out: Path | None = f.out_dir("plan")
    workspace: Path | None = f.workspace()
    frac: float | None = f.frac()
    train_from: int | None = f.train_from()
    layers: list[int] | None = f.layers()
    calib_samples: int = f.calib_samples()
    statistic: Statistic = f.statistic()
    budget: Budget = f.budget()
    targets: Targets | None = f.targets()
    router: bool = Field(True, description="Train the routers too (counted in the plan).")
    device: str = f.device()
    dtype: ComputeDtype = Field(
        "auto", description="auto | float32 | bfloat16 | float16: what the calibration pass and the lr test compute in "
        "(train's --dtype); auto: bf16 where native, else fp16, on a GPU; fp32 on CPU.",
    )  # fmt: skip
    microbatch: int = Field(4, ge=1, description="Sequences per backward.")
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of the calibration sample.")
    candidates_factor: int = Field(
        4, ge=1, le=1024,
        description="Candidates kept per tensor as a multiple of its budget (12 bytes each); larger is closer "
        "to exact.",
    )  # fmt: skip
    full_maps: bool = Field(False, description="Exact, full-size importance maps (memory: 4 bytes per weight).")
    stability: bool = Field(True, description="Measure mask overlap of two data halves.")
    cache: bool | None = Field(
        None,
        description="Frozen-prefix states stored in the plan, which usaf train then reads instead of running the "
        "frozen layers: every training sequence's (--cache), none (--no-cache).",
        json_schema_extra=cli(flag="--cache/--no-cache", default_text="the calibration sample's, computed anyway"),
    )
    lr_test: bool = Field(
        True,
        description="Pick usaf train's lr by short probe runs at a few lrs, scored on a held-back part of the "
        "calibration sample; recorded in the plan.",
        json_schema_extra=cli(flag="--lr-test/--no-lr-test"),
    )
    lr_test_steps: int | None = Field(
        None, ge=1, le=10_000, description="Optimizer steps of each of the lr test's probe runs.",
        json_schema_extra=cli(default_text=str(LR_TEST_STEPS)),
    )  # fmt: skip
    stream_experts: bool | None = f.stream_experts()
    dist_backend: DistBackend = f.dist_backend()
    overwrite: bool = f.overwrite()

    @model_validator(mode="after")
    def _one_layer_choice(self) -> ScoreConfig:
        if self.train_from is not None and self.layers is not None:
            raise ValueError("pass either --train-from or --layers, not both")
        if not self.lr_test and self.lr_test_steps is not None:
            raise ValueError("--lr-test-steps sizes the lr test, which --no-lr-test turns off; drop one")
        return self
