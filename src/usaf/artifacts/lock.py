"""One writer per output: an OS advisory lock on a hidden sibling of the directory a command writes.

``usaf train``, ``quantize`` and every other writer hold ``.NAME.usaf-lock`` beside their ``--out`` for as
long as they write it. A second command on the same output refuses at once, naming the holder's PID,
instead of interleaving its metrics with the first's or deleting its partial files. The lock is the
operating system's (``flock``; ``msvcrt.locking`` on Windows): it is released on any exit, a SIGKILL
included, so a lock file left behind by a killed run is stale by construction and simply taken over.
Where the file system has no advisory locks (some network mounts), the PID written in the file decides:
a running process holds it, a dead one's is stale.

The sibling rather than a file inside the directory: the directory may not exist yet (the lock is taken
before it is made), a run directory's listing stays the run's own, and every writer of the same name, a
temporary or a partial one, meets the same lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

import psutil

from usaf.artifacts.disk import raise_disk_error
from usaf.errors import UsafError, not_a

LOCK_TAG = ".usaf-lock"
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}  # the file system has none

if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
    import msvcrt

    def _try_lock(fd: int) -> bool:
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EDEADLK):
                return False
            raise
        return True

    def _unlock(fd: int) -> None:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)

else:
    import fcntl

    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)


# A link put where the lock file goes is never followed (a link made after the check above fails to open)
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)


def lock_path(target: Path) -> Path:
    target = Path(target).absolute()
    return target.parent / f".{target.name}{LOCK_TAG}"


class OutputLock:
    """The lock on one output path, held from :meth:`acquire` to :meth:`release` (a context manager too).

    ``flag`` names the option the path came from in the refusal: ``--out DIR: another usaf process is
    writing it (PID 123: usaf train ...)``.
    """

    def __init__(self, target: Path, *, flag: str = "--out") -> None:
        self.target = Path(target).absolute()
        self.path = lock_path(self.target)
        self.flag = flag
        self._fd: int | None = None
        self._pid_file = False  # the fallback without OS locks: our PID in the file is the lock
        self._made: list[Path] = []  # directories acquire created for the lock file, deepest first

    @property
    def held(self) -> bool:
        return self._fd is not None or self._pid_file

    def acquire(self) -> OutputLock:
        """Take the lock (a no-op when this object holds it already); refuse when another process holds it."""
        if self.held:
            return self
        if self.path.is_symlink():  # opened, it would be truncated and written through: a file usaf did not make
            raise UsafError(
                f"{self.flag} {self.target}: its lock file {self.path.name} is a symbolic link; usaf writes only "
                "files of its own",
                f"remove the link, or pass another {self.flag}",
            )
        made = _missing(self.path.parent)
        above = (made[-1] if made else self.path).parent  # the deepest part of the path that exists
        if not above.is_dir():  # "cannot create its lock file: File exists" named neither the file nor the fix (review)
            broken = above.is_symlink() and not above.exists()
            what = "a symbolic link to nothing" if broken else not_a(above, "directory")
            raise UsafError(f"{self.flag} {self.target}: {above}: {what}",
                            f"pass another {self.flag}, in a directory")  # fmt: skip
        try:
            self._made = made
            self.path.parent.mkdir(parents=True, exist_ok=True)
            while not self._acquire_once():
                pass
        except OSError as e:
            raise_disk_error(e, self.target, flag=self.flag)  # read-only, full, forbidden: the usual one line
            raise UsafError(
                f"{self.flag} {self.target}: cannot create its lock file {self.path.name}: {e.strerror}",
                "pick a writable path",
            ) from None
        return self

    def _acquire_once(self) -> bool:
        """True when locked; False when the file was replaced under us (then try again); refuses when held."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NO_FOLLOW, 0o644)
        try:
            locked = _try_lock(fd)
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKS:
                raise
            self._acquire_by_pid()
            return True
        if not locked:
            holder = _describe(_read_holder(fd))
            os.close(fd)
            raise self._held_by(holder)
        if not _same_file(fd, self.path):  # released and unlinked by its holder between our open and our lock
            os.close(fd)
            return False
        _write_holder(fd)
        self._fd = fd
        return True

    def _acquire_by_pid(self) -> None:
        holder = _read_holder_at(self.path)
        pid = holder.get("pid")
        if isinstance(pid, int) and pid != os.getpid() and psutil.pid_exists(pid):
            raise self._held_by(_describe(holder))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _NO_FOLLOW, 0o644)  # absent or stale: ours now
        try:
            _write_holder(fd)
        finally:
            os.close(fd)
        self._pid_file = True

    def _held_by(self, holder: str) -> UsafError:
        return UsafError(
            f"{self.flag} {self.target}: another usaf process is writing it ({holder})",
            f"wait for it to finish or stop it, or pass another {self.flag}",
        )

    def release(self) -> None:
        if not self.held:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()  # while still holding it: a newcomer that opened the old file sees it replaced
        if self._fd is not None:
            with contextlib.suppress(OSError):
                _unlock(self._fd)
            os.close(self._fd)
        self._fd, self._pid_file = None, False
        # The directories made for the lock go with it where nothing else came to be in them: a command refused or
        # stopped before its output left `--out deep/er/out`'s parents, or an empty workspace folder (found in
        # review). One that holds the output, or anything else, stays.
        for directory in self._made:
            try:
                directory.rmdir()
            except OSError:
                break
        self._made = []

    def check_free(self) -> None:
        """Refuse now, before any work, if another process holds the lock (taking and dropping it)."""
        if not self.held:
            self.acquire().release()

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _missing(directory: Path) -> list[Path]:
    """``directory`` and those of its parents that do not exist, deepest first."""
    missing = []
    while not os.path.lexists(directory) and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    return missing


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except OSError:
        return False


def _write_holder(fd: int) -> None:
    record = {"pid": os.getpid(), "command": " ".join(["usaf", *sys.argv[1:]])[:300]}
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(record).encode())


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096)
        data = json.loads(raw.decode("utf-8")) if raw else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def holder_of(target: Path) -> str | None:
    """The live process writing ``target`` (``PID 123: usaf train ...``), read from its lock file without taking
    the lock, or None. Where a process's PID was not yet written or it has died, None: a kill leaves its lock file
    behind, and the next writer takes it over."""
    holder = _read_holder_at(lock_path(target))
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid == os.getpid() or not psutil.pid_exists(pid):
        return None
    return _describe(holder)


def _read_holder_at(path: Path) -> dict:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return {}
    try:
        return _read_holder(fd)
    finally:
        os.close(fd)


def _describe(holder: dict) -> str:
    pid, command = holder.get("pid"), holder.get("command")
    if not isinstance(pid, int):
        return "PID not yet recorded"  # it has just taken the lock and not written its PID yet
    return f"PID {pid}: {command}" if isinstance(command, str) and command else f"PID {pid}"
