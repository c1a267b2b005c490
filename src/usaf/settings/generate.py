"""Settings of ``usaf generate``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from usaf.config import StageConfig
from usaf.settings import fields as f
from usaf.settings.fields import ComputeDtype, cli

MIN_TEMPERATURE = 0.01


class GenerateConfig(StageConfig):
    """Settings of ``usaf generate``."""

    prompt: str = Field(
        description="The prompt (a user message when the chat template is applied).",
        json_schema_extra=cli(argument=True),
    )
    model: Path | None = f.quantized_model("the one the change was trained on, else newest")
    checkpoint: Path | None = f.checkpoint()
    no_checkpoint: bool = Field(False, description="Use the untrained quantized model (to compare).")
    workspace: Path | None = f.workspace()
    temperature: float = Field(0.7, ge=0, le=100, description="Sampling temperature; 0 = greedy, else >= 0.01.")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(128, ge=1, description="Tokens to generate at most.")
    seed: int = Field(0, ge=0, lt=2**32, description="Sampling seed: the same seed gives the same text.")
    chat: bool = Field(True, description="Apply the tokenizer's chat template if it has one.")
    device: str = f.device()
    dtype: ComputeDtype = Field(
        "auto", description="auto | float32 | bfloat16 | float16: the dtype of the weights kept unquantized and of the "
        "dequantized experts; auto: bf16 where native, else fp16, on a GPU; fp32 on CPU (what eval and train use).",
    )  # fmt: skip
    stream_experts: bool | None = f.stream_experts()

    @model_validator(mode="after")
    def _one_checkpoint_choice(self) -> GenerateConfig:
        if self.no_checkpoint and self.checkpoint is not None:
            raise ValueError("pass either --checkpoint or --no-checkpoint, not both")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / 1e-45 overflow: a traceback in sampling (found in review)
            raise ValueError(f"--temperature {self.temperature:g}: 0 for greedy decoding, else {MIN_TEMPERATURE}+")
        return self
