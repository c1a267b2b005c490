"""The ``hf_export`` artifact written by ``usaf export``: a plain Hugging Face model directory plus a manifest.

The directory is what ``AutoModelForCausalLM.from_pretrained`` reads (``model-NNNNN-of-NNNNN.safetensors``
shards, ``model.safetensors.index.json``, ``config.json``, tokenizer files); ``manifest.json`` beside
them records where the weights came from, what was applied, and how the result was verified.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from usaf.artifacts.manifest import Manifest, Record, register

INDEX_FILE = "model.safetensors.index.json"


class ExportShardRecord(Record):
    name: str
    bytes: int
    tensors: int


class VerifyRecord(Record):
    sequences: int
    tokens_per_sequence: int
    reference: Literal["engine", "original+change"] = Field(
        description="what the reloaded export was compared with: the usaf engine with the change applied "
        "(dequantized-base export), or the original model loaded by transformers with the change added"
    )
    max_abs_diff: float = Field(description="max |logit difference| between the reloaded export and the reference")
    tolerance: float
    engine_max_abs_diff: float | None = Field(
        None, description="--base exports: max |logit difference| to the engine (the 4-bit base's own error)"
    )
    change_max_abs_effect: float = Field(
        description="max |logit difference| between the reference with and without the change (what was exported)"
    )


class HfExportSummary(Record):
    base: Literal["original", "dequantized"] = Field(
        description="original: --base's full-precision weights; dequantized: the quantized model's 4-bit experts"
    )
    base_path: str | None = None
    base_fingerprint: str | None = None
    model_fingerprint: str = Field(description="the quantized model's fingerprint")
    change_fingerprint: str
    change_source: str
    family: str
    model_type: str
    dtype: str = Field(description="'original' (each tensor keeps its dtype) or the --dtype it was cast to")
    shards: list[ExportShardRecord]
    tensors: int
    bytes: int
    expert_tensors_changed: int = Field(description="fused in-memory expert tensors that received a delta")
    expert_entries: int = Field(description="delta entries applied")
    router_tensors: int = Field(description="router tensors replaced by their trained values")
    tensors_copied: int = Field(description="tensors written as they were (byte-identical to their source)")
    notes: list[str] = Field(default_factory=list)
    verify: VerifyRecord | None = Field(None, description="None when exported with --no-verify")
    seconds: float


@register
class HfExportManifest(Manifest):
    KIND = "hf_export"
    SCHEMA_VERSION = 1
    DESCRIPTION = "a Hugging Face model directory: base weights with a trained change merged in"

    summary: HfExportSummary
