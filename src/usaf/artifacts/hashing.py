"""Content fingerprints: sha256 of files and of whole artifacts."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def combine(parts: Iterable[tuple[str, str]]) -> str:
    """One fingerprint for named parts (name, sha256), independent of their order."""
    digest = hashlib.sha256()
    for name, sha in sorted(parts):
        digest.update(f"{name}\0{sha}\n".encode())
    return digest.hexdigest()


def sha256_tensors(tensors: Mapping[str, torch.Tensor]) -> str:
    """One sha256 of named tensors' names, dtypes, shapes and bytes, in name order (a checkpoint's values, not how
    its files are laid out: the same tensors read from another file layout hash the same)."""
    import torch  # lazy: usaf.artifacts reads manifests without torch (the hashing of files needs none)

    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        digest.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\n".encode())
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # (nbytes,) uint8
    return digest.hexdigest()
