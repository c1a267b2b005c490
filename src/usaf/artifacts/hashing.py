"""Content fingerprints: sha256 of files and of whole artifacts."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    import torch

_CHUNK = 1 << 20


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """``on_bytes``: called with each block's size as it is hashed (a progress bar's bytes)."""
    with path.open("rb") as f:
        return sha256_rest(f, on_bytes).hexdigest()


def sha256_rest(f: BinaryIO, on_bytes: Callable[[int], None] | None = None) -> Any:
    """A sha256 object fed the bytes of ``f`` from where it stands to its end (to be fed more by the caller)."""
    digest = hashlib.sha256()
    while block := f.read(_CHUNK):
        digest.update(block)
        if on_bytes is not None:
            on_bytes(len(block))
    return digest


@contextlib.contextmanager
def hashing_phase(progress: Any, what: str, files: list[Path]) -> Iterator[Callable[[int], None] | None]:
    """A progress phase over ``files``' bytes (none where ``progress`` is None), yielding its advance for
    :func:`sha256_file`: GBs at a real model's size were hashed in silence, a minute or more (found in review)."""
    if progress is None:
        yield None
        return
    progress.start(what, sum(f.stat().st_size for f in files), "bytes")
    try:
        yield progress.advance
    finally:
        progress.finish()


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
