"""The base pass's results, cached in the workspace so evaluating another checkpoint skips it.

The base model's results depend only on the quantized model, the evaluated sequences and how they are run, never on
the checkpoint, so the key is the sha256 of: the quantized model's fingerprint and its files' sizes and modification
times (:func:`files_as_they_stand`), the sequences' fingerprint (set, source, ids, labels), the microbatch
(padding), device type, the card's (or CPU's) name and compute dtype, and the usaf/torch/transformers versions (a
forward may change with any of them). An entry is ``<workspace>/cache/eval-base/<key>/`` holding
``base.safetensors`` (per-sequence NLL and tokens, per-layer top-k sets) and ``base.json`` (the key's parts, timing,
and the sha256 of ``base.safetensors``: a byte changed there that still read as numbers was reported as the base
model's loss, found in review); it is written to a temporary directory and renamed, so a reader never sees half of
one. An entry whose contents do not match its key or its sha256 is ignored and replaced.

A pass stopped by Ctrl-C (SIGTERM, SIGHUP) keeps what it did in the same format, with the microbatches done
(``batches`` in ``base.json``): the base pass in its own entry (replaced by the whole pass when it ends), the
fine-tuned pass in ``<workspace>/cache/eval-tuned/<key>/``, keyed by the base key's parts and the checkpoint's
fingerprint (deleted once the report is written). The same eval then continues from there
(:func:`load_partial`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from usaf.artifacts.hashing import sha256_file, sha256_text
from usaf.artifacts.outputs import TMP_TAG, mark_usaf_made
from usaf.artifacts.tensor_file import save_tensors
from usaf.artifacts.writer import remove_stale_temporaries
from usaf.data.batches import Batch
from usaf.stages.eval.passes import PartialPass, PassResult

CACHE_SUBDIR = Path("cache") / "eval-base"
TUNED_SUBDIR = Path("cache") / "eval-tuned"  # fine-tuned passes stopped part-way, until their eval ends
CACHE_FORMAT = 2  # 2: base.json records base.safetensors' sha256
TENSORS_FILE = "base.safetensors"
META_FILE = "base.json"


def files_as_they_stand(directory: Path, names: list[str]) -> dict[str, list[int]]:
    """Each file's size and modification time (ns), for the key: a model file replaced by one of the same size (another
    quantization's ``experts_q4.pt``) kept its manifest's fingerprint, and the cached base pass of the first model
    was reported beside the fine-tuned pass of the second (found in review). Loads check sizes, not hashes (hashing
    a 30B model at every eval costs a minute); a stat costs nothing, and a copied or replaced file misses."""
    stood = {}
    for name in names:
        try:
            info = (Path(directory) / name).stat()
        except OSError:
            continue  # the load names a missing file
        stood[name] = [info.st_size, info.st_mtime_ns]
    return stood


def cache_key(parts: dict[str, Any]) -> str:
    return sha256_text(json.dumps({"format": CACHE_FORMAT, **parts}, sort_keys=True))


def entry_dir(workspace: Path, key: str) -> Path:
    return workspace / CACHE_SUBDIR / key[:32]


def tuned_dir(workspace: Path, key: str) -> Path:
    """Where a stopped fine-tuned pass of ``key`` (:func:`tuned_key`) keeps its work."""
    return workspace / TUNED_SUBDIR / key[:32]


def tuned_key(base_parts: dict[str, Any], checkpoint_fingerprint: str) -> str:
    return cache_key({**base_parts, "checkpoint": checkpoint_fingerprint, "pass": "fine-tuned"})


def load(directory: Path, key: str, *, sequences: int, input_tokens: int) -> PassResult | None:
    """The cached base pass, or ``None`` when absent, part of a pass or not matching (then the caller
    recomputes)."""
    found = _read(directory, key)
    if found is None or found[0].get("batches") is not None:
        return None
    result = _result(found, sequences=sequences, input_tokens=input_tokens)
    if result is not None:
        result.cached = True
    return result


def load_partial(directory: Path, key: str, batches: list[Batch]) -> PartialPass | None:
    """The first microbatches of ``batches`` a stopped pass of ``key`` did, or None (none, or not matching)."""
    found = _read(directory, key)
    done = found[0].get("batches") if found is not None else None
    if not isinstance(done, int) or not 0 < done < len(batches):
        return None
    first = batches[:done]
    result = _result(found, sequences=sum(len(b.input_ids) for b in first), input_tokens=sum(b.tokens for b in first))
    threads = found[0].get("threads")
    threads = threads if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0 else None
    return PartialPass(done, result, threads) if result is not None else None


def drop_kept(directory: Path, key: str) -> None:
    """Delete the part of a pass a stop request kept in ``directory`` for ``key`` (once its eval is written): only
    such an entry, never a directory that does not hold one."""
    found = _read(directory, key)
    if found is not None and isinstance(found[0].get("batches"), int):
        shutil.rmtree(directory, ignore_errors=True)


def _read(directory: Path, key: str) -> tuple[dict, dict] | None:
    try:
        meta = json.loads((directory / META_FILE).read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or meta.get("key") != key:
            return None
        if meta.get("sha256") != sha256_file(directory / TENSORS_FILE):
            return None
        return meta, load_file(str(directory / TENSORS_FILE))
    except (OSError, ValueError, SafetensorError):
        return None


def _result(found: tuple[dict, dict], *, sequences: int, input_tokens: int) -> PassResult | None:
    """The pass in an entry's files when its shapes are those of ``sequences`` and ``input_tokens``, else None."""
    meta, tensors = found
    if meta.get("input_tokens") != input_tokens:
        return None
    nll, tokens = tensors.get("nll"), tensors.get("tokens")
    if nll is None or tokens is None or nll.shape != (sequences,) or tokens.shape != (sequences,):
        return None
    routing = {int(name.split(".", 1)[1]): t for name, t in tensors.items() if name.startswith("topk.")}
    if any(t.shape[0] != input_tokens for t in routing.values()):
        return None
    return PassResult(nll, tokens, routing, input_tokens, float(meta.get("seconds", 0.0)))


def save(directory: Path, key: str, parts: dict[str, Any], result: PassResult, *, batches: int | None = None) -> None:
    """Write an entry atomically (temp dir + rename); an existing entry of the same key is replaced. ``batches``:
    the microbatches done, where ``result`` is part of a pass (a stopped one)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(directory)  # a killed save's (hundreds of MB at a real model's size; found in review)
    tmp = directory.with_name(f".{directory.name}{TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        tensors = {"nll": result.nll.contiguous(), "tokens": result.tokens.contiguous()}
        tensors |= {f"topk.{layer}": sets.contiguous() for layer, sets in result.routing.items()}
        save_tensors(tensors, str(tmp / TENSORS_FILE))
        # threads: the CPU's sums are bit-identical at one count only, so a resumed pass computes at this one
        meta = {"key": key, "parts": parts, "input_tokens": result.input_tokens, "seconds": result.seconds,
                "batches": batches, "threads": torch.get_num_threads(),
                "sha256": sha256_file(tmp / TENSORS_FILE)}  # fmt: skip
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        mark_usaf_made(tmp, "eval cache entry")  # so a walk of the workspace never reads base.json as text
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
