"""sha256 records of the files a stage keeps to be read back before its manifest exists.

A finished artifact lists each file's sha256 in its manifest. What a stage keeps while it runs is read back by a
later command with no manifest to check it against: a run's ``checkpoints/step-N/`` (by resume, eval and export),
quantize's finished ``layers/layer-N.pt`` (merged into the output it resumes to), score's saved calibration pass and
lr-test probes, eval's kept passes. Each reader refused what does not parse, NaN and Inf, and wrong shapes, but a
byte changed on disk that still read as finite numbers was taken, and a resumed quantize sealed it into a manifest
with fresh hashes (found in review, 2026-12-07). So each such file's sha256 is recorded when it is written (a JSON
object, file name -> sha256, in a record file beside it) and compared when it is read back.

A record names the files by name, not path: a directory moved or renamed whole (a run's checkpoint, a partial
output) keeps its record valid.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from usaf.artifacts.hashing import sha256_file
from usaf.artifacts.writer import write_text_atomic

SIDECAR_SUFFIX = ".sha256"  # one kept file's record: NAME.sha256 beside NAME


def sidecar(path: Path) -> Path:
    """Where the record of one kept file lies (written by :func:`seal`)."""
    return path.with_name(path.name + SIDECAR_SUFFIX)


def write_record(record: Path, files: Mapping[str, Path]) -> None:
    """Record the sha256 of ``files`` (the name each is read back under -> where its bytes are now: a temporary
    not yet renamed into place is recorded under its final name) in ``record``, atomically."""
    sums = {name: sha256_file(path) for name, path in files.items()}
    write_text_atomic(record, json.dumps(sums, indent=1, sort_keys=True))


def seal(path: Path, *, written_at: Path | None = None) -> None:
    """Record one kept file's sha256 in its sidecar. ``written_at``: a temporary holding its bytes, renamed to
    ``path`` after this (so no moment has the file in place without its record)."""
    write_record(sidecar(path), {path.name: written_at or path})


def unmatched(directory: Path, names: Iterable[str], record: Path) -> list[str] | None:
    """The files of ``names`` in ``directory`` whose bytes are not those ``record`` holds (an unrecorded name and an
    unreadable file included; a record that does not read as one: all of them), or None where there is no record
    (kept by a usaf from before records)."""
    names = list(names)
    try:
        text = record.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError:
        return names
    try:
        sums = json.loads(text)
    except ValueError:
        return names
    if not isinstance(sums, dict):
        return names
    return [name for name in names if name not in sums or sums[name] != _sha256_or_none(directory / name)]


def doubt(path: Path) -> str | None:
    """Why ``path`` cannot be taken for the bytes usaf wrote there (no sidecar, or other bytes), or None: intact."""
    found = unmatched(path.parent, [path.name], sidecar(path))
    if found is None:
        return "no checksum"
    return "its sha256 is not the one recorded" if found else None


def _sha256_or_none(path: Path) -> str | None:
    try:
        return sha256_file(path)
    except OSError:
        return None
