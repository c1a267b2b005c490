"""Atomic artifact directories.

A stage writes into a hidden temporary sibling of its output directory. Only when every file is in
place does :meth:`ArtifactWriter.commit` hash the files, write ``manifest.json`` last and rename the
directory into place. An exception or Ctrl-C before that removes the temporary directory, so a
consumer never sees a half-written artifact: a directory either has a manifest that matches its
files, or it does not exist.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import psutil

from usaf._version import __version__
from usaf.artifacts.disk import raise_disk_error, removed_on_failure
from usaf.artifacts.hashing import combine, hashing_phase, sha256_file
from usaf.artifacts.in_place import fill_in_place
from usaf.artifacts.lock import OutputLock
from usaf.artifacts.manifest import MANIFEST_NAME, FileRecord, InputRecord, Manifest, manifest_checksum
from usaf.artifacts.outputs import (
    OLD_TAG,
    PARTIAL_TAG,
    TMP_TAG,
    InputPaths,
    check_not_an_input,
    finished_kind,
    found_at,
    mark_usaf_made,
    refuse_unless_replaceable,
    set_aside,
)
from usaf.errors import UsafError

M = TypeVar("M", bound=Manifest)


def remove_stale_temporaries(target: Path, tags: tuple[str, ...] = (TMP_TAG, OLD_TAG)) -> None:
    """Delete temporaries and replaced outputs of this target left by processes that no longer run (SIGKILL)."""
    parent = target.parent
    if not parent.is_dir():
        return
    for tag in tags:
        for candidate in parent.glob(f".{target.name}{tag}*"):
            if _of_a_dead_process(candidate, tag):
                shutil.rmtree(candidate, ignore_errors=True)


def remove_stale_sibling_temporaries(target: Path) -> None:
    """The temporaries of the other outputs beside ``target`` too, each under its output's lock (free: no process
    writes it, here or on another machine sharing the disk). A default output is named by its start time, so no later
    write has the name of one that was killed: its temporary (GBs of tokens) stayed for good (found in review). Not
    their replaced outputs (``.NAME.usaf-old-*``): killed between the two renames of an --overwrite, that is the
    only copy of the output it was replacing, left for its own rerun to settle."""
    parent = target.parent
    if not parent.is_dir():
        return
    for candidate in parent.glob(f".*{TMP_TAG}*"):
        sibling = parent / candidate.name[1:].rsplit(TMP_TAG, 1)[0]
        if sibling.name == target.name or not _of_a_dead_process(candidate, TMP_TAG):
            continue
        lock = OutputLock(sibling)
        try:
            lock.acquire()
        except UsafError:
            continue  # held: written by a process that is alive somewhere
        try:
            remove_stale_temporaries(sibling, tags=(TMP_TAG,))
        finally:
            lock.release()


def _of_a_dead_process(candidate: Path, tag: str) -> bool:
    pid_text = candidate.name.rsplit(tag, 1)[1].split("-", 1)[0]
    return pid_text.isdigit() and not psutil.pid_exists(int(pid_text)) and not candidate.is_symlink()


# safetensors >= 0.8 writes ``save_file``'s bytes into ``.tmpXXXXXX`` (Rust's tempfile crate, six random
# characters) beside the target and renames it: a kill mid-write leaves that file, which names no process
_LIBRARY_TEMPORARY = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def remove_stale_temporaries_inside(directory: Path) -> None:
    """Inside a resumed partial directory: temporaries (``*.usaf-tmp-PID-*``) of processes that no longer run,
    and the libraries' own temporaries (the caller holds the directory's lock: no writer is alive)."""
    for candidate in directory.rglob(f"*{TMP_TAG}*"):
        pid_text = candidate.name.rsplit(TMP_TAG, 1)[1].split("-", 1)[0]
        if pid_text.isdigit() and not psutil.pid_exists(int(pid_text)):
            if candidate.is_dir():
                shutil.rmtree(candidate, ignore_errors=True)
            else:
                candidate.unlink(missing_ok=True)
    for candidate in directory.rglob(".tmp*"):
        if _LIBRARY_TEMPORARY.fullmatch(candidate.name) and candidate.is_file():
            candidate.unlink(missing_ok=True)
    (directory / (MANIFEST_NAME + ".tmp")).unlink(missing_ok=True)  # write_manifest's, cut short


def discard_partial(target: Path, markers: tuple[str, ...]) -> bool:
    """Delete the work an interrupted resumable run of ``target`` left (``.NAME.usaf-partial``); True if there was
    some. Only a directory holding one of ``markers``, the settings file its stage writes first, is usaf's for sure:
    anything else of that name (a link, a directory without them) is left alone."""
    partial = ArtifactWriter.partial_dir(target)
    if not partial.is_dir() or partial.is_symlink() or not any((partial / m).is_file() for m in markers):
        return False
    shutil.rmtree(partial)
    return True


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step: a kill leaves the old content or the new, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with removed_on_failure(tmp), tmp.open("w", encoding="utf-8") as f:  # a full disk leaves no torn temporary
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _nothing_to_resume(work: Path) -> bool:
    """A resumable writer's work directory that holds no file but usaf's temporaries: stopped before its first file
    was in place (Ctrl-C at once), it was left behind, unlisted by ``usaf inspect``, after "nothing half-written was
    left behind" (found in review)."""
    if not work.is_dir() or work.is_symlink():
        return False
    return all(path.is_dir() and not path.is_symlink() or TMP_TAG in path.name for path in work.rglob("*"))


class ArtifactWriter:
    """Context manager that builds an artifact in a temporary directory and commits it atomically.

    Example::

        with ArtifactWriter(out, kinds=("tokens",), flag="--out", overwrite=False) as art:
            (art.dir / "train.jsonl").write_text(...)
            manifest = art.commit(TokensManifest, inputs=[...], config={...},
                                  environment=current_environment(), summary=summary)
    """

    def __init__(
        self,
        target: Path,
        *,
        kinds: tuple[str, ...],
        flag: str = "--out",
        overwrite: bool = False,
        overwrite_flag: str = "--overwrite",
        inputs: InputPaths | None = None,
        resumable: bool = False,
        markers: tuple[str, ...] = (),
        defaulted: bool = False,
        runs_own_plan: bool = False,
    ) -> None:
        """Args:
        target: the artifact directory to create.
        kinds: what the command writes there (manifest kinds, or a :meth:`commit_foreign` marker's): ``overwrite``
            replaces a usaf artifact of these kinds only, never another command's output.
        flag: the flag the path came from, for messages.
        overwrite: replace an existing ``target`` (atomically, at commit), if usaf made it.
        overwrite_flag: the flag that sets ``overwrite``, for messages (``--force`` for quantize).
        inputs: the command's inputs (flag -> path or paths): ``target`` may not be, contain or lie in one.
        resumable: build in a fixed ``.NAME.usaf-partial`` directory that survives a failure or
            Ctrl-C, so a rerun continues from what it holds (``resumed`` says whether it existed).
        markers: with ``resumable``, the file the stage writes first in that directory: one there (or a manifest,
            written after the bookkeeping is gone) makes it usaf's; anything else of that name is refused.
        defaulted: ``target`` is the workspace's default output, not a ``flag`` given (said so where refused).
        runs_own_plan: ``target`` is the plan an unfinished run scores for itself (``RUN/plan``), the one place
            inside an unfinished run a writer may be; any other writer there is refused.
        """
        self.target = Path(target).absolute()
        self.flag = flag
        self.overwrite = overwrite
        self.overwrite_flag = overwrite_flag
        self.kinds = kinds
        self.inputs = inputs or {}
        self.defaulted = defaulted
        self.runs_own_plan = runs_own_plan
        self.lock = OutputLock(self.target, flag=flag)
        self.resumable = resumable
        self.markers = markers
        if resumable:
            self.dir = self.partial_dir(self.target)
        else:
            self.dir = self.target.parent / f".{self.target.name}{TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.resumed = False
        self.committed = False
        self.needed: int | None = None  # bytes the artifact needs, if a preflight knew (a full disk's message)

    @staticmethod
    def partial_dir(target: Path) -> Path:
        """Where a resumable writer of ``target`` keeps its work between runs."""
        target = Path(target).absolute()
        return target.parent / f".{target.name}{PARTIAL_TAG}"

    def check_target(self) -> None:
        """Refuse early (before any work): an output that is or holds an input, that exists and may not be
        replaced, or that another process is writing."""
        check_not_an_input(self.target, self.flag, self.inputs, defaulted=self.defaulted,
                           runs_own_plan=self.runs_own_plan)  # fmt: skip
        self._check_replaceable()
        self._check_partial()
        self.lock.check_free()

    def _check_partial(self) -> None:
        """A resumable writer's ``.NAME.usaf-partial`` is taken over (written into, its entries cleared or deleted) only
        where an interrupted usaf run left it: not a link, and holding one of ``markers`` or a manifest, or nothing
        but usaf's temporaries (killed while writing its first file)."""
        if not self.resumable:
            return
        partial = self.dir
        if partial.is_symlink():
            raise UsafError(
                f"{self.flag} {self.target}: {partial.name} beside it is a symbolic link, where usaf keeps the work "
                "of an unfinished run: usaf never writes through it",
                f"remove the link, or pass another {self.flag}",
            )
        if not partial.is_dir() or any((partial / name).is_file() for name in (*self.markers, MANIFEST_NAME)):
            return
        foreign = sorted(entry.name for entry in partial.iterdir() if TMP_TAG not in entry.name)
        if foreign:
            raise UsafError(
                f"{self.flag} {self.target}: {partial.name} beside it holds {', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''} and none of what an interrupted usaf run leaves there: usaf "
                "never writes into or deletes it",
                f"move it away, or pass another {self.flag}",
            )

    def _check_replaceable(self) -> None:
        refuse_unless_replaceable(self.target, found_at(self.target), self.flag, overwrite=self.overwrite,
                                  overwrite_flag=self.overwrite_flag, kinds=self.kinds)  # fmt: skip

    def __enter__(self) -> ArtifactWriter:
        check_not_an_input(self.target, self.flag, self.inputs, defaulted=self.defaulted,
                           runs_own_plan=self.runs_own_plan)  # fmt: skip
        self._check_replaceable()
        self.lock.acquire()  # held until __exit__: one writer per output
        try:
            self._check_partial()  # again under the lock: what is there now is what will be taken
            self._enter()
        except BaseException:
            self.lock.release()
            raise
        return self

    def _enter(self) -> None:
        try:
            self.target.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temporaries(self.target)
            remove_stale_sibling_temporaries(self.target)
            self.resumed = self.resumable and self.dir.is_dir()
            self.dir.mkdir(exist_ok=self.resumable)
            if self.resumed:  # files a killed run was still writing: never part of the artifact
                remove_stale_temporaries_inside(self.dir)
        except OSError as e:
            raise_disk_error(e, self.target, flag=self.flag)  # full, read-only, forbidden: says which
            raise UsafError(
                f"{self.flag} {self.target}: cannot create it: {e.strerror}", "pick a writable path"
            ) from None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if not self.committed and (not self.resumable or _nothing_to_resume(self.dir)):
                shutil.rmtree(self.dir, ignore_errors=True)
            if exc is not None:  # a full or read-only disk while writing or committing: one line naming the output
                raise_disk_error(exc, self.target, flag=self.flag, needed=self.needed, resumable=self.resumable)
        finally:
            self.lock.release()

    def file_records(self, exclude: tuple[str, ...] = (), progress: Any = None) -> list[FileRecord]:
        """Every file but those under the top-level names ``exclude`` (hashed on ``progress``, if given)."""
        files = (p for p in self.dir.rglob("*") if p.is_file() and p.relative_to(self.dir).parts[0] not in exclude)
        return record_files(self.dir, files, progress)

    def commit(
        self, manifest_cls: type[M], *, exclude: tuple[str, ...] = (), progress: Any = None, **fields: Any
    ) -> M:
        """Hash the files (a phase of ``progress``, if given), write the manifest last, and move the directory into
        place.

        ``exclude``: bookkeeping files or directories of a resumable writer (top level), kept until the manifest is
        written, so a kill while hashing still finds them, then deleted before the rename.
        """
        manifest = write_manifest(self.dir, manifest_cls, self.file_records(exclude, progress), **fields)
        self.drop(exclude)
        self._move_into_place()
        self.committed = True
        return manifest

    def drop(self, names: tuple[str, ...]) -> None:
        """Delete the top-level files or directories ``names`` of the work directory (bookkeeping)."""
        for name in names:
            path = self.dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    def commit_foreign(self, kind: str | None = None) -> Path:
        """Move the directory into place as it is: one in another tool's format (a Hugging Face model), marked
        as usaf's by a ``kind`` marker file, or one whose manifest is already written (``kind`` None)."""
        if kind is not None:
            mark_usaf_made(self.dir, kind)
        self._move_into_place()
        self.committed = True
        return self.target

    def _move_into_place(self) -> None:
        # looked at again: it may have appeared or changed while we worked
        old = set_aside(self.target, self.flag, overwrite=self.overwrite, overwrite_flag=self.overwrite_flag,
                        kinds=self.kinds)  # fmt: skip
        if self.target.is_dir():  # an empty directory, or a mount point emptied: kept, its entries moved in
            fill_in_place(self.dir, self.target, finished_kind(self.dir) or self.kinds[0], self.flag)
        else:
            os.replace(self.dir, self.target)
        if old is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(old)


def _absolute(record: InputRecord) -> InputRecord:
    """An input on this machine recorded by its absolute path: relative ones ("toks", "q") named nothing once read
    from another directory, and eval looked for a run's training data relative to its own (found in review). A hub
    id, which is no path here, is kept as it is."""
    if os.path.isabs(record.path) or not os.path.exists(record.path):
        return record
    return record.model_copy(update={"path": os.path.abspath(record.path)})


def record_files(root: Path, paths: Any, progress: Any = None) -> list[FileRecord]:
    """Size and sha256 of each file (paths under ``root``), sorted, the manifest itself excluded; hashed as a phase
    of ``progress`` when given."""
    files = [path for path in sorted(paths) if path.relative_to(root).as_posix() != MANIFEST_NAME]
    with hashing_phase(progress, "hashing the output", files) as on_bytes:
        return [FileRecord(path=path.relative_to(root).as_posix(), bytes=path.stat().st_size,
                           sha256=sha256_file(path, on_bytes)) for path in files]  # fmt: skip


def write_manifest(directory: Path, manifest_cls: type[M], files: list[FileRecord], **fields: Any) -> M:
    """Build the manifest of ``files`` and write it into ``directory`` (temp file, fsync, rename)."""
    if "inputs" in fields:
        fields["inputs"] = [_absolute(record) for record in fields["inputs"]]
    manifest = manifest_cls(
        kind=manifest_cls.KIND,
        schema_version=manifest_cls.SCHEMA_VERSION,
        usaf_version=__version__,
        created_at=datetime.now(timezone.utc),
        fingerprint=combine((f.path, f.sha256) for f in files),
        files=files,
        **fields,
    )
    manifest = manifest.model_copy(update={"manifest_sha256": manifest_checksum(manifest)})
    tmp = directory / (MANIFEST_NAME + ".tmp")
    with removed_on_failure(tmp), tmp.open("w", encoding="utf-8") as f:  # a full disk leaves no torn temporary
        f.write(manifest.model_dump_json(indent=2))
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_NAME)
    return manifest
