"""Reading files that may be hostile: paths that stay inside their artifact, loads that run no code.

Every file usaf reads from an artifact or a model directory may be truncated, edited or crafted.
The readers here turn each way such a file can be wrong into one :class:`~usaf.errors.UsafError`
naming the file and the problem, never a traceback, and never run code from it:

- :func:`contained` resolves a path *listed in a manifest or index* against its directory and
  refuses one that leaves it (``../x``, ``/etc/passwd``, ``C:\\x``, a symlink pointing out).
- :func:`load_torch` is ``torch.load(weights_only=True)``: a pickle that would import or call
  anything but tensors and plain containers is refused with a message that says so.
- :func:`load_safetensors` / :func:`open_safetensors` turn safetensors' header errors (a header that
  lies about offsets, a truncated file) into the same one-line error.
- ``check_free_space`` (re-exported from :mod:`usaf.artifacts.disk`, where a refused write is translated)
  is the check large writes make first, naming the bytes needed.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from usaf.artifacts.disk import check_free_space
from usaf.errors import UsafError

__all__ = [
    "check_free_space",
    "contained",
    "load_safetensors",
    "load_torch",
    "open_safetensors",
    "unsafe_relative_path",
]

_DRIVE = re.compile(r"^[A-Za-z]:")


def unsafe_relative_path(rel: str) -> str | None:
    """Why ``rel`` cannot name a file inside a directory, or None if it can.

    A listed path must be relative, '/'-separated, free of ``..``, NUL and backslashes: anything
    else could name a file outside the artifact on some platform.
    """
    if not isinstance(rel, str) or not rel:
        return "empty path"
    if "\0" in rel:
        return "NUL byte in the path"
    if "\\" in rel:
        return "backslash in the path (paths are '/'-separated)"
    if rel.startswith("/") or _DRIVE.match(rel):
        return "absolute path"
    parts = PurePosixPath(rel).parts
    if any(part == ".." for part in parts):
        return "'..' in the path"
    if rel.startswith("~"):
        return "home-relative path"
    return None


def contained(root: Path, rel: str, *, where: str, links: bool = True) -> Path:
    """``root / rel``, refusing a path that escapes ``root`` (textually, or through a symlink where ``links``).

    Args:
        root: the artifact or model directory.
        rel: a path read from a manifest or an index file.
        where: what listed it, for the message (``"DIR/manifest.json"``).
        links: refuse a link out of ``root`` too. False for a model directory, which is the user's: the Hugging
            Face cache's snapshot files are links into its ``blobs/``, and a folder of links to shards is a way to
            lay a model out (every sharded model in the cache was refused until 2026-12-06; found in review).
    """
    problem = unsafe_relative_path(rel)
    if problem is None and links:
        base = Path(root).resolve()
        target = (base / rel).resolve()
        if target != base and base not in target.parents:
            problem = f"resolves to {target}, outside {base} (a symlink?)"
    if problem is not None:
        raise UsafError(
            f"{where}: lists the path {rel!r}, which escapes its directory ({problem})",
            "refused: a manifest or index may only name files inside its own directory; re-create the artifact",
        )
    return Path(root) / rel


def load_torch(path: Path, *, mmap: bool = False, what: str = "file") -> Any:
    """``torch.load(path, weights_only=True)`` with every failure as one clear error.

    ``weights_only=True`` is what keeps a crafted pickle from running code; the error says so when
    the file holds anything else than tensors and plain values.
    """
    # lazy: torch and safetensors stay out of usaf.artifacts' import time (manifests are read without them)
    import torch

    path = Path(path)
    try:
        try:
            return torch.load(path, weights_only=True, mmap=mmap)
        except RuntimeError as e:
            if not (mmap and "mmap can only be used" in str(e)):
                raise
            # a legacy (non-zip) pickle: read it once more without mmap, so that what it holds is named
            return torch.load(path, weights_only=True, mmap=False)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        if not any("global" in line.lower() for line in lines):  # no object refused: bytes that are no pickle
            message = next((line for line in lines if line.startswith("Unsupported")), lines[0] if lines else "")
            raise UsafError(
                f"{path}: unreadable {what} (not a torch file: {message})", "re-run the stage that made it"
            ) from None
        detail = next((line for line in lines if "global" in line.lower() and "Unsupported" in line), "")
        raise UsafError(
            f"{path}: refused to load this {what}: it holds pickled objects other than tensors "
            f"(code could run){': ' + detail if detail else ''}",
            "usaf loads .pt files with weights_only=True only; re-create the file with usaf",
        ) from None
    except FileNotFoundError:
        raise UsafError(f"{path}: missing", "re-run the stage that made it") from None
    # random bytes read as a legacy pickle fail anywhere in the unpickler: each of these is the file's fault
    except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile, OSError, KeyError, AttributeError, IndexError,
            TypeError, OverflowError, struct.error) as e:  # fmt: skip
        message = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UsafError(
            f"{path}: unreadable {what} (truncated or not a torch file: {message})", "re-run the stage that made it"
        ) from None


def _safetensors_error(path: Path, e: BaseException) -> UsafError:
    message = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return UsafError(
        f"{path}: unreadable safetensors file ({message})", "the file is truncated or damaged; re-create it"
    )


def load_safetensors(path: Path, *, device: str = "cpu") -> dict[str, Any]:
    """``safetensors.torch.load_file`` with a header that lies, or a truncated file, as one clear error."""
    # lazy: torch and safetensors stay out of usaf.artifacts' import time (manifests are read without them)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise UsafError(f"{path}: missing", "re-run the stage that made it")
    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as e:
        raise _safetensors_error(path, e) from None


@contextlib.contextmanager
def open_safetensors(path: Path, *, device: str = "cpu") -> Iterator[Any]:
    """``safetensors.safe_open`` (lazy), with header errors on opening or reading as one clear error."""
    # lazy: torch and safetensors stay out of usaf.artifacts' import time (manifests are read without them)
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise UsafError(f"{path}: missing", "re-run the stage that made it")
    try:
        handle = safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as e:
        raise _safetensors_error(path, e) from None
    with handle as f:
        try:
            yield f
        except SafetensorError as e:  # a tensor whose offsets the header lies about (callers' bugs pass through)
            raise _safetensors_error(path, e) from None
