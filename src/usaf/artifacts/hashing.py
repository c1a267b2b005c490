"""Content fingerprints: sha256 of files and of whole artifacts."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

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
