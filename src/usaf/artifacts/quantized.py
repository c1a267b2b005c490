"""The ``quantized_model`` artifact written by ``usaf quantize``: 4-bit experts plus the rest as-is."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from usaf.artifacts.loader import load_verified
from usaf.artifacts.manifest import Manifest, Record, register
from usaf.artifacts.safety import contained, load_torch, open_safetensors
from usaf.errors import UsafError

EXPERTS_FILE = "experts_q4.pt"
BASE_INDEX_FILE = "base.safetensors.index.json"
CONFIG_FILE = "config.json"  # the model's own, read by usaf.families; checked against the summary when loaded


class ShardRecord(Record):
    name: str
    bytes: int
    header_sha256: str = Field(description="sha256 of the safetensors header (names, dtypes, shapes, offsets)")
    modified_ns: int | None = Field(
        None, description="the file's modification time when quantized, in ns (None: quantized before 2026-12-06)"
    )


class SourceModelRecord(Record):
    model: str = Field(description="what the user passed: a directory or a hub id")
    path: str = Field(description="the resolved local directory")
    family: str
    model_type: str
    config_sha256: str
    shards: list[ShardRecord]
    fingerprint: str = Field(description="config hash + every shard's name, size and header hash")

    @property
    def origin(self) -> str:
        """What tells two source models apart where the workspace's newest quantized model is taken: the fingerprint
        reads the files' headers, not the weights, so two fine-tunes of one architecture share it; their directories
        differ. (A model re-saved in place is one origin: its newest quantization holds what the directory holds.)"""
        return f"{self.fingerprint}@{self.path}"


class QuantSettingsRecord(Record):
    method: Literal["hqq", "rtn"]
    nbits: int
    group_size_requested: int
    packing: str
    device: str


class TensorQuantRecord(Record):
    name: str = Field(description="in-memory name, e.g. model.layers.3.mlp.experts.gate_up_proj")
    layer: int
    shape: list[int] = Field(description="in-memory shape")
    group_size: int = Field(description="effective group size along the input axis")
    params: int
    source_bytes: int
    quantized_bytes: int
    rel_error: float = Field(description="||W - dequant(Q)||_F / ||W||_F")


class QuantizedModelSummary(Record):
    source: SourceModelRecord
    quant: QuantSettingsRecord
    moe_layers: list[int]
    tensors: list[TensorQuantRecord]
    tensors_quantized: int
    params_quantized: int
    tensors_kept: int = Field(description="non-expert tensors stored as they were (attention, norms, routers, ...)")
    params_kept: int
    tensors_ignored: list[str] = Field(description="checkpoint tensors not part of the model (e.g. MTP layers)")
    experts_source_bytes: int
    experts_quantized_bytes: int
    base_bytes: int
    compression_ratio: float = Field(description="experts' source bytes / quantized bytes")
    mean_rel_error: float
    max_rel_error: float
    group_sizes_adjusted: list[str] = Field(description="tensors whose group size differs from the requested one")
    expert_digests: dict[int, str] = Field(
        default_factory=dict,
        description="MoE layer -> sha256 of its on-disk expert tensors as read (export --base compares the original's; "
        "absent in models quantized before it was recorded, or for layers quantized by one)",
    )


@register
class QuantizedModelManifest(Manifest):
    KIND = "quantized_model"
    SCHEMA_VERSION = 1
    DESCRIPTION = "quantized experts (experts_q4.pt), non-expert weights, config and tokenizer"

    summary: QuantizedModelSummary

    def required_files(self) -> tuple[str, ...]:
        return (EXPERTS_FILE, BASE_INDEX_FILE, CONFIG_FILE)


def read_base_index(model_dir: Path, *, flag: str = "--model") -> dict[str, str]:
    """``base.safetensors.index.json``'s weight map (tensor -> shard file), each file checked to stay inside."""
    path = Path(model_dir) / BASE_INDEX_FILE
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise UsafError(f"{flag} {path}: unreadable index ({type(e).__name__}: {e})", "re-run usaf quantize") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UsafError(f"{flag} {path}: 'weight_map' must map tensor names to file names", "re-run usaf quantize")
    for file in set(weight_map.values()):
        contained(Path(model_dir), file, where=str(path))
    return weight_map


# -- reading a quantized model's files, for the engine ----------------------------------------------------


@dataclass(frozen=True)
class QuantizedFiles:
    """A ``usaf quantize`` output opened for the engine: its verified manifest and checked shard map.

    The engine builds the model from what this hands it (:meth:`shards`, :meth:`experts`) and never opens
    a file itself. ``path`` stays for the model's own ``config.json`` (read by :mod:`usaf.families`).
    """

    path: Path
    manifest: QuantizedModelManifest
    weight_map: dict[str, str]  # tensor -> shard file, every file checked to stay inside ``path``
    flag: str = "--model"

    @property
    def experts_bytes(self) -> int:
        """Bytes of every layer's 4-bit experts (the size of ``experts_q4.pt``)."""
        return (self.path / EXPERTS_FILE).stat().st_size

    def shards(self, device: str) -> Iterator[tuple[str, Any]]:
        """``(where, handle)`` per base shard, opened with :func:`~usaf.artifacts.safety.open_safetensors`."""
        for file in sorted(set(self.weight_map.values())):
            with open_safetensors(self.path / file, device=device) as f:
                yield str(self.path / file), f

    def experts(self) -> dict:
        """``experts_q4.pt``: expert tensor name -> its quantized dict (memory-mapped, weights only)."""
        path = self.path / EXPERTS_FILE
        raw = load_torch(path, mmap=True, what="experts file")  # weights_only: no code runs
        if not isinstance(raw, dict):
            raise UsafError(f"{path}: holds a {type(raw).__name__}, not a dict of layers", "re-run usaf quantize")
        return raw


def open_quantized(path: Path, *, flag: str = "--model") -> QuantizedFiles:
    """Open a quantized-model directory: manifest verified (without rehashing the weights), shard map checked."""
    path = Path(path)
    manifest = load_verified(path, QuantizedModelManifest, flag=flag, hashes=False)
    weight_map = read_base_index(path, flag=flag)
    listed = {record.path for record in manifest.files}
    unlisted = sorted(set(weight_map.values()) - listed)
    if unlisted:  # its size and hash are nobody's: a swapped shard would load unnoticed
        raise UsafError(
            f"{flag} {path / 'manifest.json'}: does not list {unlisted[0]}, a shard {BASE_INDEX_FILE} names",
            "re-run usaf quantize",
        )
    return QuantizedFiles(path, manifest, weight_map, flag)
