"""The base pass's results, cached in the workspace so evaluating another checkpoint skips it.

The base model's results depend only on the quantized model, the evaluated sequences and how they are
run, never on the checkpoint, so the key is the sha256 of: the quantized model's fingerprint, the
sequences' fingerprint (set, source, ids, labels), the microbatch (padding), device type and compute
dtype, and the usaf/torch/transformers versions (a forward may change with any of them). An entry is
``<workspace>/cache/eval-base/<key>/`` holding ``base.safetensors`` (per-sequence NLL and tokens, per-layer
top-k sets) and ``base.json`` (the key's parts, timing); it is written to a temporary directory and
renamed, so a reader never sees half of one. An entry whose contents do not match its key is ignored
and replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file

from usaf.artifacts.hashing import sha256_text
from usaf.artifacts.tensor_file import save_tensors
from usaf.stages.eval.passes import PassResult

CACHE_SUBDIR = Path("cache") / "eval-base"
CACHE_FORMAT = 1
TENSORS_FILE = "base.safetensors"
META_FILE = "base.json"


def cache_key(parts: dict[str, Any]) -> str:
    return sha256_text(json.dumps({"format": CACHE_FORMAT, **parts}, sort_keys=True))


def entry_dir(workspace: Path, key: str) -> Path:
    return workspace / CACHE_SUBDIR / key[:32]


def load(directory: Path, key: str, *, sequences: int, input_tokens: int) -> PassResult | None:
    """The cached base pass, or ``None`` when absent or not matching (then the caller recomputes)."""
    try:
        meta = json.loads((directory / META_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(directory / TENSORS_FILE))
    except (OSError, ValueError, SafetensorError):
        return None
    if meta.get("key") != key or meta.get("input_tokens") != input_tokens:
        return None
    nll, tokens = tensors.get("nll"), tensors.get("tokens")
    if nll is None or tokens is None or nll.shape != (sequences,) or tokens.shape != (sequences,):
        return None
    routing = {int(name.split(".", 1)[1]): t for name, t in tensors.items() if name.startswith("topk.")}
    if any(t.shape[0] != input_tokens for t in routing.values()):
        return None
    return PassResult(nll, tokens, routing, input_tokens, float(meta.get("seconds", 0.0)), cached=True)


def save(directory: Path, key: str, parts: dict[str, Any], result: PassResult) -> None:
    """Write an entry atomically (temp dir + rename); an existing entry of the same key is replaced."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        tensors = {"nll": result.nll.contiguous(), "tokens": result.tokens.contiguous()}
        tensors |= {f"topk.{layer}": sets.contiguous() for layer, sets in result.routing.items()}
        save_tensors(tensors, str(tmp / TENSORS_FILE))
        meta = {"key": key, "parts": parts, "input_tokens": result.input_tokens, "seconds": result.seconds}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
