"""A disk that refuses the Nth write: ENOSPC, EROFS, EACCES, or the libraries' own forms of a full disk.

:func:`failing_write` patches, for the time of a ``with`` block in this process, every write-side
call usaf's stages make (``safetensors.torch.save_file``, ``torch.save``, ``Path.write_text``, a file
opened for writing, the streaming ``experts_q4.pt`` writer's ``add``, ``mkdir``) and makes the
``at``-th of them fail as a full or read-only disk would:

- a file write leaves a torn prefix (half the bytes), then raises; an ``open`` for writing raises at once;
- ``mkdir`` raises before creating anything (a read-only disk refuses the first directory);
- ``form`` picks the error: ``OSError`` with ``ENOSPC``/``EDQUOT``/``EROFS``/``EACCES`` (any write), or
  what the libraries raise instead on a full disk: torch.save's ``RuntimeError`` (``torch``) and
  safetensors' ``SafetensorError`` carrying ``os error 28`` (``safetensors``), each only at its own writes.

In-process only (tests, the hostile-input catalogue); ``usaf.testing.crash_child`` does the same in a
child process. No real disk is filled: we run as root, where permissions cannot make a path read-only.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError

from usaf.quant import ptfile

TORCH_NO_SPACE = (
    "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0: file write failed"
)
SAFETENSORS_NO_SPACE = "Error while serializing: I/O error: No space left on device (os error 28)"
_ERRNOS = {"enospc": errno.ENOSPC, "edquot": errno.EDQUOT, "erofs": errno.EROFS, "eacces": errno.EACCES}
FORMS = (*_ERRNOS, "torch", "safetensors")
_KINDS_OF_FORM = {"torch": ("torch.save",), "safetensors": ("save_file",)}
_WRITE_MODES = ("w", "a", "x", "+")


@dataclass
class FaultLog:
    """What the injector saw: every write event (kind, path) in order, and the one it failed."""

    events: list[tuple[str, str]] = field(default_factory=list)
    failed: tuple[str, str] | None = None


def make_error(form: str, path: object) -> Exception:
    """The exception a refused write of ``path`` raises, in ``form``."""
    if form == "torch":
        return RuntimeError(TORCH_NO_SPACE)
    if form == "safetensors":
        return SafetensorError(SAFETENSORS_NO_SPACE)
    number = _ERRNOS[form]
    return OSError(number, os.strerror(number), str(path))


def _torn(path: object) -> None:
    """Leave half the file a full disk stopped writing (the libraries write in place, not to a temp)."""
    path = Path(str(path))
    if path.is_file():
        os.truncate(path, path.stat().st_size // 2)


@contextlib.contextmanager
def failing_write(
    at: int, form: str = "enospc", *, kinds: tuple[str, ...] | None = None, only: Callable[[str], bool] | None = None
) -> Iterator[FaultLog]:
    """Within the block, the ``at``-th write event (1-based) of ``kinds`` whose path satisfies ``only`` fails.

    ``kinds`` defaults to those ``form`` can come from (all, for an ``OSError`` form); ``at=0`` fails
    nothing (the events are only logged: a reference run to count them).
    """
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r}, expected one of {FORMS}")
    kinds = kinds or _KINDS_OF_FORM.get(form)
    log = FaultLog()
    count = 0

    depth = 0  # > 0 inside a patched call: its own inner calls (write_text opens the file) are not events

    @contextlib.contextmanager
    def inside() -> Iterator[None]:
        nonlocal depth
        depth += 1
        try:
            yield
        finally:
            depth -= 1

    def due(kind: str, path: object) -> bool:
        nonlocal count
        if depth > 1:
            return False
        log.events.append((kind, str(path)))
        if (kinds is not None and kind not in kinds) or (only is not None and not only(str(path))):
            return False
        count += 1
        if count == at:
            log.failed = (kind, str(path))
            return True
        return False

    real_save_file, real_torch_save = safetensors.torch.save_file, torch.save
    real_write_text, real_path_open, real_open = Path.write_text, Path.open, builtins.open
    real_mkdir, real_os_mkdir = Path.mkdir, os.mkdir
    real_add = ptfile.StreamingTorchSave.add

    def save_file(tensors, filename, metadata=None):
        with inside():
            real_save_file(tensors, filename, metadata=metadata)
            if due("save_file", filename):
                _torn(filename)
                raise make_error(form, filename)

    def torch_save(obj, f, *args, **kwargs):
        with inside():
            real_torch_save(obj, f, *args, **kwargs)
            if isinstance(f, (str, os.PathLike)) and due("torch.save", f):
                _torn(f)
                raise make_error(form, f)

    def write_text(self, data, *args, **kwargs):
        with inside():
            if due("write_text", self):
                real_write_text(self, data[: len(data) // 2], *args, **kwargs)
                raise make_error(form, self)
            return real_write_text(self, data, *args, **kwargs)

    def opened(real: Callable, file, mode="r", *args, **kwargs):
        with inside():
            if isinstance(file, (str, os.PathLike)) and any(m in mode for m in _WRITE_MODES) and due("open", file):
                raise make_error(form, file)  # refused at the open: nothing created
            return real(file, mode, *args, **kwargs)

    def path_open(self, mode="r", *args, **kwargs):
        return opened(lambda f, m, *a, **k: real_path_open(Path(f), m, *a, **k), self, mode, *args, **kwargs)

    def builtin_open(file, mode="r", *args, **kwargs):
        return opened(real_open, file, mode, *args, **kwargs)

    def mkdir(self, *args, **kwargs):
        with inside():
            if due("mkdir", self):
                raise make_error(form, self)
            return real_mkdir(self, *args, **kwargs)

    def os_mkdir(path, *args, **kwargs):
        with inside():
            if due("mkdir", path):
                raise make_error(form, path)
            return real_os_mkdir(path, *args, **kwargs)

    def add(self, name, entry):
        with inside():
            real_add(self, name, entry)
            if due("ptfile.add", self.path):
                raise make_error(form, self.path)

    save_file._usaf_fault = True  # type: ignore[attr-defined]  # a module imported in the block binds it
    bound = _binding_save_file(real_save_file)  # modules that bound save_file at import: rebound here
    patches = [
        (safetensors.torch, "save_file", save_file), (torch, "save", torch_save), (Path, "write_text", write_text),
        (Path, "open", path_open), (builtins, "open", builtin_open), (Path, "mkdir", mkdir), (os, "mkdir", os_mkdir),
        (ptfile.StreamingTorchSave, "add", add), *((m, "save_file", save_file) for m in bound),
    ]  # fmt: skip
    originals = [(target, name, getattr(target, name)) for target, name, _ in patches]
    for target, name, value in patches:
        setattr(target, name, value)
    try:
        yield log
    finally:
        for target, name, value in reversed(originals):
            setattr(target, name, value)
        for module in _binding_save_file(real_save_file):  # imported inside the block: bound the wrapper
            module.save_file = real_save_file


def _binding_save_file(real: Callable) -> list:
    """usaf's modules whose ``save_file`` is safetensors' (bound at import), or a wrapper of a block."""
    found = []
    for name, module in list(sys.modules.items()):
        bound = getattr(module, "save_file", None) if name.startswith("usaf.") else None
        if bound is not None and (bound is real or getattr(bound, "_usaf_fault", False)):
            found.append(module)
    return found
