"""The parts of ``usaf quantize`` besides the experts: source fingerprint, non-expert shards, model files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from usaf.artifacts.disk import removed_on_failure
from usaf.artifacts.hashing import combine, sha256_file
from usaf.artifacts.quantized import BASE_INDEX_FILE, ShardRecord, SourceModelRecord
from usaf.artifacts.tensor_file import save_tensors
from usaf.families import TensorInfo, load_tensors
from usaf.stages.progress import Progress

PARTIAL_SETTINGS = "partial-settings.json"
SHARD_BYTES = 512 * 2**20  # non-expert weights per output shard: bounds memory while copying them

# Files carried over verbatim (config.json is never re-serialised: transformers 5 rewrites some
# families' field names, e.g. Qwen3-MoE's num_experts, which other tools then misread).
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
MODEL_FILE_GLOBS = ("*.tiktoken",)  # tiktoken vocabularies (named as the model names them); found missing in review


def _header_sha256(path: Path) -> str:
    """sha256 of a safetensors header: names, dtypes, shapes and offsets, without reading the weights."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return hashlib.sha256(f.read(length)).hexdigest()


def source_record(model: str, model_dir: Path, spec: Any, infos: dict[str, TensorInfo]) -> SourceModelRecord:
    files = sorted({info.file for info in infos.values()})
    stats = {f: (model_dir / f).stat() for f in files}
    shards = [
        ShardRecord(name=f, bytes=stats[f].st_size, header_sha256=_header_sha256(model_dir / f),
                    modified_ns=stats[f].st_mtime_ns)  # fmt: skip
        for f in files
    ]
    config_sha = sha256_file(model_dir / "config.json")
    return SourceModelRecord(
        model=model,
        path=str(model_dir.resolve()),
        family=spec.family,
        model_type=spec.model_type,
        config_sha256=config_sha,
        shards=shards,
        fingerprint=combine([("config.json", config_sha), *((s.name, f"{s.bytes}:{s.header_sha256}") for s in shards)]),
    )


@dataclass(frozen=True)
class BaseShard:
    file: str
    names: tuple[tuple[str, str], ...]  # (on-disk name, in-memory name it is stored under)

    @property
    def disk_names(self) -> tuple[str, ...]:
        return tuple(disk for disk, _ in self.names)


def base_shard_plan(plan: Any, infos: dict[str, TensorInfo]) -> list[BaseShard]:
    """Non-expert tensors grouped into shards of about SHARD_BYTES, in a deterministic order."""
    pairs = dict(plan.renamed)  # on-disk -> in-memory, every non-expert tensor
    # Expert biases (gpt-oss) stay unquantized: small, and added after the matmul.
    for layer in plan.experts:
        for t in layer.tensors:
            if t.role.endswith("_bias"):
                (source,) = t.source_names  # stored fused on disk (the only layout with expert biases)
                pairs[source] = t.target
    groups: list[list[tuple[str, str]]] = [[]]
    size = 0
    for name in sorted(pairs):
        if groups[-1] and size + infos[name].nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, pairs[name]))
        size += infos[name].nbytes
    count = len(groups)
    return [BaseShard(f"base-{i + 1:05d}-of-{count:05d}.safetensors", tuple(g)) for i, g in enumerate(groups) if g]


def write_base_shards(
    shards: list[BaseShard], model_dir: Path, infos: dict[str, TensorInfo], work: Path, progress: Progress
) -> None:
    """Copy the non-expert tensors, renamed to their in-memory names, one shard at a time (resumable)."""
    total = sum(infos[n].nbytes for s in shards for n in s.disk_names)
    progress.start("copying non-expert weights", total, "bytes")
    weight_map: dict[str, str] = {}
    for shard in shards:
        path = work / shard.file
        renamed = dict(shard.names)
        weight_map.update({memory: shard.file for memory in renamed.values()})
        if not path.is_file():
            tensors = load_tensors(model_dir, shard.disk_names, infos)
            tmp = path.with_suffix(".tmp")
            with removed_on_failure(tmp):  # no torn shard left on a full disk
                save_tensors(
                    {renamed[n]: t.contiguous() for n, t in tensors.items()}, str(tmp), metadata={"format": "pt"}
                )
            os.replace(tmp, path)
            del tensors
        progress.advance(sum(infos[n].nbytes for n in shard.disk_names))
    with removed_on_failure(work / BASE_INDEX_FILE):  # rewritten by every run: a torn one is only removed
        (work / BASE_INDEX_FILE).write_text(json.dumps({"weight_map": dict(sorted(weight_map.items()))}, indent=1))
    progress.finish()


def copy_model_files(model_dir: Path, work: Path) -> list[str]:
    """Config, generation config and tokenizer files, byte for byte."""
    copied = []
    globbed = sorted({path.name for pattern in MODEL_FILE_GLOBS for path in model_dir.glob(pattern)})
    for name in (*MODEL_FILES, *globbed):
        source = model_dir / name
        if source.is_file():
            shutil.copyfile(source, work / name)
            copied.append(name)
    return copied
