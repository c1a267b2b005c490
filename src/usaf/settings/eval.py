"""Settings of ``usaf eval`` (each also ``USAF_<NAME>`` and an ``[eval]`` TOML key)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from usaf.config import StageConfig
from usaf.settings import fields as f
from usaf.settings.fields import ComputeDtype, cli


class EvalConfig(StageConfig):
    """Settings of ``usaf eval`` (each also ``USAF_<NAME>`` and an ``[eval]`` TOML key)."""

    model: Path | None = f.quantized_model("the one --checkpoint was trained on, else newest")
    checkpoint: Path | None = Field(
        None,
        description="Run directory, unfinished run, checkpoints/step-N or delta directory to evaluate. Not given: the "
        "base model only; "
        "with neither --model nor --checkpoint, the newest finished run for the workspace's newest model.",
    )
    data: list[Path] = Field(
        default_factory=list,
        description="In-domain sequences: a tokens dir (its train.jsonl), tokens JSONL or text (repeatable).",
    )
    held_out: list[Path] = Field(
        default_factory=list,
        description="Held-out sequences: a tokens dir (its heldout.jsonl), tokens JSONL, JSONL of text, or text "
        "files/directories tokenized with the model's tokenizer (repeatable).",
        json_schema_extra=cli(own_only=True),  # paths here, source globs to tokenize: not from a shared source
    )
    out: Path | None = f.out_dir("eval_report", "Report directory.")
    workspace: Path | None = f.workspace()
    microbatch: int = Field(8, ge=1, description="Sequences per forward.")
    max_sequences: int | None = Field(
        None, ge=1, description="Evaluate a seeded random sample of this many sequences per input.",
        json_schema_extra=cli(default_text="all"),
    )  # fmt: skip
    # Raw-text inputs only (None = not given; refused when every input is already tokenized):
    seq_len: int | None = f.seq_len_field(
        None, "Raw text: tokens per packed sequence.", default_text="512, capped by the model's context"
    )
    source_depth: int | None = Field(
        None, ge=0, description="Raw text directories: path components that name a source.",
        json_schema_extra=cli(default_text="1"),
    )  # fmt: skip
    text_field: str | None = Field(
        None, min_length=1, description="JSONL of text: the text field.", json_schema_extra=cli(default_text="text")
    )
    source_field: str | None = Field(
        None, min_length=1, description="JSONL of text: the field naming the source, else repo.",
        json_schema_extra=cli(default_text="source"),
    )  # fmt: skip
    all_files: bool = Field(
        False,
        description="Raw text directories: also read hidden files and directories, environments and what git ignores "
        "(as usaf tokenize --all-files).",
    )
    bootstrap: int = Field(1000, ge=100, le=1_000_000, description="Bootstrap resamples per interval.")
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of the bootstrap and of --max-sequences.")
    base_cache: bool = Field(
        True, description="Reuse/store the base pass in WORKSPACE/cache, and keep a pass stopped by Ctrl-C there."
    )
    plots: bool | None = Field(
        None, description="PNG plots, needs matplotlib.", json_schema_extra=cli(default_text="when it is installed")
    )
    resident: bool | None = Field(
        None,
        description="Dequantize all experts once (fast; full-size memory) or the routed ones per forward (4-bit "
        "memory).",
        json_schema_extra=cli(flag="--resident/--streaming", default_text="once when they fit in half the free memory"),
    )
    stream_experts: bool | None = f.stream_experts()
    device: str = f.device()
    dtype: ComputeDtype = Field(
        "auto", description="auto | float32 | bfloat16 | float16: the dtype of the weights kept unquantized and of the "
        "dequantized experts, in both passes; auto: bf16 where native, else fp16, on a GPU; fp32 on CPU.",
    )  # fmt: skip

    @model_validator(mode="after")
    def _placement(self) -> EvalConfig:
        if self.resident and self.stream_experts:
            raise ValueError("--resident dequantizes every expert onto the device; --stream-experts keeps them in "
                             "host memory: pass one")  # fmt: skip
        return self

    overwrite: bool = f.overwrite()
