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
    """How the reloaded export was checked (every distance is a max |logit difference| on the probe sequences)."""

    sequences: int
    tokens_per_sequence: int
    reference: Literal["dequantized+change", "original+change", "engine"] = Field(
        description="the weights the export must hold, built in memory: the quantized model's dequantized base "
        "with the change, or --base's original (as transformers loads it) with the change, each tensor rounded "
        "to its written dtype ('engine': earlier exports, compared with the engine directly)"
    )
    max_abs_diff: float = Field(description="the reloaded export vs the reference: must be fp32 noise")
    tolerance: float
    engine_max_abs_diff: float | None = Field(
        None,
        description="the reloaded export vs the engine with the change (information: the export dtype's rounding; "
        "with --base also the 4-bit base's own error)",
    )
    change_max_abs_effect: float = Field(
        description="the reference with vs without the change: how much the exported change moves logits"
    )
    change_rms: float | None = Field(
        None, description="RMS over the probe logits of the engine with vs without the change: the trained effect"
    )
    rounding_rms: float | None = Field(
        None,
        description="dequantized-base exports: RMS of the engine's base vs the same base rounded as exported "
        "(what the export dtype alone does to this model)",
    )
    change_effect_diff_rms: float | None = Field(
        None,
        description="RMS of (export - exported base) - (engine with the change - engine base): the change's "
        "effect as exported vs as trained",
    )
    change_effect_tolerance: float | None = Field(
        None,
        description="the bound on change_effect_diff_rms (half of change_rms, or twice rounding_rms when larger, "
        "plus fp32 noise); None: not checked (--base: the engine's base is the 4-bit one)",
    )


class HfExportSummary(Record):
    base: Literal["original", "dequantized"] = Field(
        description="original: --base's full-precision weights; dequantized: the quantized model's 4-bit experts"
    )
    base_path: str | None = None
    base_fingerprint: str | None = None
    model_fingerprint: str = Field(description="the quantized model's fingerprint")
    change_fingerprint: str | None = Field(description="None: the quantized base alone (--no-checkpoint)")
    change_source: str | None
    family: str
    model_type: str
    dtype: str = Field(description="'original' (each tensor keeps its dtype) or the --dtype it was cast to")
    shards: list[ExportShardRecord]
    tensors: int
    bytes: int
    expert_tensors_changed: int = Field(
        description="tensors that received a delta: fused experts, and attention/shared/dense weights where trained "
        "(named from when only experts trained)"
    )
    expert_entries: int = Field(description="delta entries applied")
    expert_entries_rounded_away: int | None = Field(
        None,
        description="delta entries whose written weight equals the written base: the output dtype rounded the change "
        "away (None: an export from before it was counted)",
    )
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
