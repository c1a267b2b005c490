"""Reading a checkpoint's tensor names, shapes and dtypes from safetensors headers (no weights loaded).

A safetensors file starts with an 8-byte little-endian header length and a JSON header mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``; sharded checkpoints add
``model.safetensors.index.json`` (``weight_map``: name -> file). Reading only the headers makes
describing a 60 GB model instant.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from usaf.artifacts.safety import contained, open_safetensors
from usaf.errors import UsafError

INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit; a bigger "length" means a corrupt file


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, from its file's header."""

    name: str
    file: str  # file name relative to the model directory
    dtype: str  # safetensors dtype code: "F32", "BF16", "F8_E4M3", "U8", ...
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# safetensors' dtypes -> bytes per element (None: sub-byte, packed; not checked against the offsets)
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8, "F64": 8, "I64": 8, "U64": 8,
    "F4": None, "F6_E2M3": None, "F6_E3M2": None,
}  # fmt: skip


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> info for one ``.safetensors`` file, from its header only."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than 8 bytes")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER:
                raise ValueError(f"header length {length} is implausible")
            header = json.loads(f.read(length).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UsafError(f"{path}: not a readable safetensors file ({e})", "re-download or re-save the model") from None
    out = {}
    data_end = 0
    try:  # a header that is JSON but not a safetensors header (a crafted or damaged file)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            shape = tuple(entry["shape"])
            if not all(type(v) is int and v >= 0 for v in (begin, end, *shape)) or end < begin:
                raise ValueError(f"tensor {name}: offsets {entry['data_offsets']} or shape {entry['shape']} invalid")
            size = _DTYPE_BYTES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
            if entry["dtype"] not in _DTYPE_BYTES:
                raise ValueError(f"tensor {name}: unknown dtype {entry['dtype']!r}")
            if size is not None and math.prod(shape) * size != end - begin:
                raise ValueError(f"tensor {name}: shape {list(shape)} of {entry['dtype']} disagrees with its offsets")
            data_end = max(data_end, end)
            out[name] = TensorInfo(name, path.name, entry["dtype"], shape, end - begin)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        detail = e if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise UsafError(
            f"{path}: malformed safetensors header ({detail})", "re-download or re-save the model"
        ) from None
    expected_size = 8 + length + data_end
    if (size := path.stat().st_size) < expected_size:
        raise UsafError(
            f"{path}: truncated ({size:,} bytes, its header describes {expected_size:,})",
            "the download is incomplete; re-download this shard",
        )
    return out


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory: those of the index if there is one, else all."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise UsafError(f"{index}: unreadable index ({e})", "re-download the model") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UsafError(f"{index}: 'weight_map' must map tensor names to file names", "re-download the model")
        files = sorted(set(weight_map.values()))
        for f in files:  # an index naming ../../x would make usaf read files outside the model (its links are
            contained(model_dir, f, where=str(index), links=False)  # the user's: the hub cache's point into blobs/)
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise UsafError(
                f"{model_dir}: {len(missing)} shard(s) named in {INDEX_NAME} are missing: {', '.join(missing[:5])}",
                "the download is incomplete; fetch the missing shards",
            )
        return [model_dir / f for f in files]
    return sorted(model_dir.glob("*.safetensors"))


def read_checkpoint(model_dir: Path, *, required: bool = True) -> dict[str, TensorInfo]:
    """Tensor name -> info over every shard of a model directory, from headers only.

    Args:
        model_dir: a Hugging Face model directory.
        required: raise if the directory has no safetensors files (else return an empty dict).
    """
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    if not files:
        if not required:
            return {}
        others = sorted(p.name for p in model_dir.glob("*.bin"))[:3]
        raise UsafError(
            f"{model_dir}: no *.safetensors files" + (f" (found {', '.join(others)})" if others else ""),
            "usaf reads safetensors checkpoints; re-save the model with save_pretrained(safe_serialization=True)",
        )
    out: dict[str, TensorInfo] = {}
    for path in files:
        for name, info in read_header(path).items():
            if name in out:
                raise UsafError(
                    f"{model_dir}: tensor {name} is in both {out[name].file} and {info.file}",
                    "the checkpoint is inconsistent; re-download it",
                )
            out[name] = info
    index = model_dir / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        absent = sorted(set(weight_map) - set(out))
        if absent:
            raise UsafError(
                f"{index}: {len(absent)} tensor(s) in the index are in no shard (e.g. {absent[0]})",
                "the checkpoint is inconsistent; re-download it",
            )
    return out


def load_tensors(model_dir: Path, names: Iterable[str], infos: Mapping[str, TensorInfo] | None = None):
    """Load the named tensors (and only those) from a model directory; returns name -> torch.Tensor."""
    infos = infos if infos is not None else read_checkpoint(model_dir)
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name not in infos:
            raise KeyError(name)
        by_file.setdefault(infos[name].file, []).append(name)
    out = {}
    for file, file_names in by_file.items():
        with open_safetensors(Path(model_dir) / file) as f:  # a header safetensors rejects: one clear error
            for name in file_names:
                out[name] = f.get_tensor(name)
    return out


# -- quantized checkpoints, recognised by name ----------------------------------------------------------

# suffix -> format; checked on every key, first match wins
_QUANT_SUFFIXES = (
    ("weight_scale_inv", "DeepSeek-style block FP8 (weight_scale_inv)"),
    (".qweight", "GPTQ/AWQ (qweight/qzeros)"),
    (".qzeros", "GPTQ/AWQ (qweight/qzeros)"),
    (".absmax", "bitsandbytes (absmax/quant_map)"),
    (".quant_map", "bitsandbytes (absmax/quant_map)"),
    ("_blocks", "MXFP4 (*_blocks/*_scales)"),
)

MXFP4 = "MXFP4 (*_blocks/*_scales)"


def quantized_formats(names: Iterable[str]) -> dict[str, list[str]]:
    """Format -> example tensor names, for every quantized-checkpoint format recognised by name."""
    found: dict[str, list[str]] = {}
    for name in names:
        for suffix, fmt in _QUANT_SUFFIXES:
            if name.endswith(suffix):
                found.setdefault(fmt, []).append(name)
                break
    return found
