"""A full, read-only or forbidden disk as one error line naming the path: never a traceback.

Every stage writes through a few places (:class:`~usaf.artifacts.writer.ArtifactWriter`, a train
checkpoint, the prefix and eval caches). They call into this module so that a write the disk refuses
reads the same everywhere:

- :func:`check_free_space` is the preflight a large write makes first, when its size is known or can
  be estimated (a checkpoint's tensors, the quantized experts, an export): it refuses before anything
  is written, naming the bytes needed and free.
- :func:`disk_error` recognises the errors a refused write raises: ``OSError`` with ``ENOSPC``/
  ``EDQUOT`` (no space), ``EROFS`` (read-only), ``EACCES``/``EPERM`` (permission), and the forms the
  libraries raise instead of an ``OSError`` on a full disk (torch.save's ``RuntimeError``:
  ``basic_ios::clear``, ``PytorchStreamWriter failed writing file``, ``file write failed``;
  safetensors' error carrying ``os error 28``). It returns the :class:`UsafError` to raise.
- :func:`guarded_write` wraps one write site: on such an error it removes the partial output first,
  then raises the translated error, so nothing half-written stays behind; :func:`removed_on_failure`
  does the cleanup alone, for a file inside an artifact whose writer translates at its boundary.

A read-only disk says read-only, not "no space": the fix differs (another path, not a cleanup).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from usaf.errors import UsafError
from usaf.units import human_bytes

NO_SPACE = "no space left on the disk"
READ_ONLY = "read-only file system"
NO_PERMISSION = "permission denied"

_ERRNO_CAUSES = {
    errno.ENOSPC: NO_SPACE,
    errno.EDQUOT: NO_SPACE,  # a quota is a full disk for this user
    errno.EROFS: READ_ONLY,
    errno.EACCES: NO_PERMISSION,
    errno.EPERM: NO_PERMISSION,
}
# What torch's C++ writer (torch.save) and safetensors' Rust writer say when the disk fills: they raise
# RuntimeError / SafetensorError, not OSError, and keep only this text of the cause.
_LIBRARY_NO_SPACE = (
    "basic_ios::clear",
    "pytorchstreamwriter failed writing file",
    "file write failed",
    "os error 28",
    "no space left",
    "disk quota exceeded",
    "os error 122",
)
_LIBRARY_READ_ONLY = ("os error 30", "read-only file system")
_WRITING = "usaf_writing"  # set on an exception by removed_on_failure: the file whose write failed
_NEEDED = "usaf_needed"  # ... and the bytes that write needed, when known


def cause_of(exc: BaseException) -> str | None:
    """Why the disk refused the write that raised ``exc`` (one of the constants above), or None."""
    if isinstance(exc, UsafError):
        return None
    if isinstance(exc, OSError) and exc.errno in _ERRNO_CAUSES:
        return _ERRNO_CAUSES[exc.errno]
    if isinstance(exc, OSError) and exc.errno is not None:
        return None  # another OS error (a missing file, ...): not the disk's answer, and not ours to rename
    text = str(exc).lower()
    if any(marker in text for marker in _LIBRARY_READ_ONLY):
        return READ_ONLY
    if any(marker in text for marker in _LIBRARY_NO_SPACE):
        return NO_SPACE
    return None


def _existing(target: Path) -> Path:
    """``target``, or its nearest existing parent: what decides the disk a path that is not there yet is on."""
    probe = Path(target).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def free_bytes(target: Path) -> int:
    """Free space on the disk ``target`` is (or would be) on."""
    return shutil.disk_usage(_existing(target)).free


def on_read_only_mount(target: Path) -> bool:
    """Whether the disk ``target`` is (or would be) on is mounted read-only."""
    probe = _existing(target)
    try:
        return bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        return False


def check_free_space(target: Path, needed: int, *, flag: str | None = "--out", what: str = "the output") -> None:
    """Refuse before writing ``needed`` bytes to ``target`` when its disk has less free space.

    ``target`` may not exist yet: the nearest existing parent decides which disk it is on. ``flag``:
    the flag the path came from (None: the message starts with the path alone).
    """
    free = free_bytes(target)
    if free < needed:
        where = f"{flag} {target}" if flag else str(target)
        if on_read_only_mount(target):  # a read-only image (squashfs, ISO) reports 0 free: say read-only
            raise UsafError(f"{where}: {READ_ONLY}, cannot write there", "pass a path on a writable disk")
        raise UsafError(
            f"{where}: {what} needs {needed:,} bytes (about {needed / 2**30:.2f} GiB) on that disk, "
            f"which has {free:,} bytes ({free / 2**30:.2f} GiB free); {needed - free:,} bytes needed beyond that",
            "free some space, or pass another path on a disk with room",
        )


def disk_error(
    exc: BaseException,
    target: Path,
    *,
    flag: str | None = "--out",
    writing: Path | None = None,
    needed: int | None = None,
    resumable: bool = False,
) -> UsafError | None:
    """The one-line error for a write the disk refused, or None when ``exc`` is something else.

    Args:
        exc: what the write raised.
        target: the output the user named (the path the message starts with).
        flag: the flag ``target`` came from (None: the message starts with the path alone).
        writing: the file being written, when it is not ``target`` itself.
        needed: the bytes the write needs, when known.
        resumable: finished work is kept and a rerun continues from it (said in the hint).
    """
    cause = cause_of(exc)
    if cause is None:
        return None
    if writing is None:  # marked by an inner write site, or named by the OS
        writing = getattr(exc, _WRITING, None) or (Path(str(exc.filename)) if getattr(exc, "filename", None) else None)
    needed = needed if needed is not None else getattr(exc, _NEEDED, None)
    where = f"{flag} {target}" if flag else str(target)
    file = f" (at {_shown(writing, target)})" if writing is not None and Path(writing) != Path(target) else ""
    rerun = "rerun to resume where it stopped" if resumable else "rerun"
    if cause == READ_ONLY:
        return UsafError(f"{where}: {READ_ONLY}{file}, cannot write there", "pass a path on a writable disk")
    if cause == NO_PERMISSION:
        return UsafError(f"{where}: {NO_PERMISSION}{file}", "pass a path you may write to, or fix its permissions")
    return UsafError(
        f"{where}: {NO_SPACE}{file}{_room(target, needed)}",
        f"free some space or pass a path on another disk, then {rerun}; nothing half-written was left",
    )


def _shown(writing: Path, target: Path) -> str:
    """The file being written, relative to the output's parent when it lies there (a temp sibling)."""
    writing, parent = Path(writing).absolute(), Path(target).absolute().parent
    return str(writing.relative_to(parent)) if parent in writing.parents else str(writing)


def _room(target: Path, needed: int | None) -> str:
    """``: needs 1.2 GiB, 300.0 MiB free on that disk`` (what is known of it), measured after the cleanup."""
    try:
        free: int | None = free_bytes(target)
    except OSError:
        free = None
    parts = ([f"needs {human_bytes(needed)}"] if needed is not None else []) + (
        [f"{human_bytes(free)} free on that disk"] if free is not None else []
    )
    return f": {', '.join(parts)}" if parts else ""


def raise_disk_error(exc: BaseException, target: Path, **kwargs: object) -> None:
    """Raise :func:`disk_error`'s answer for ``exc`` if the disk refused the write; else return."""
    translated = disk_error(exc, target, **kwargs)  # type: ignore[arg-type]
    if translated is not None:
        raise translated from None


def remove_partial(path: Path) -> None:
    """Delete a half-written file or directory (a full disk leaves a prefix of it)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def removed_on_failure(partial: Path, *, needed: int | None = None) -> Iterator[None]:
    """Around one write inside an artifact being built: a refused write deletes the torn ``partial`` (a
    file or a temp dir) and passes on, marked with the file and ``needed``, to the boundary that names
    the output (:func:`guarded_write`, :class:`~usaf.artifacts.writer.ArtifactWriter`)."""
    try:
        yield
    except Exception as e:
        if cause_of(e) is not None:
            remove_partial(partial)
            _mark(e, _WRITING, Path(partial))
            _mark(e, _NEEDED, needed)
        raise


def _mark(exc: BaseException, name: str, value: object) -> None:
    """Record ``value`` on ``exc`` for the message, unless an inner write site already did."""
    if value is not None and getattr(exc, name, None) is None:
        with contextlib.suppress(AttributeError):  # an exception type without a __dict__: left unnamed
            setattr(exc, name, value)


@contextlib.contextmanager
def guarded_write(
    target: Path,
    *,
    flag: str | None = "--out",
    partial: Path | None = None,
    needed: int | None = None,
    resumable: bool = False,
) -> Iterator[None]:
    """Around a write: a refused write removes ``partial`` (the file or temp dir being written), then
    raises one :class:`UsafError` naming ``target``; any other exception passes through unchanged."""
    try:
        yield
    except Exception as e:
        if cause_of(e) is None:
            raise
        if partial is not None:
            remove_partial(partial)
        raise_disk_error(e, target, flag=flag, writing=partial, needed=needed, resumable=resumable)
        raise
