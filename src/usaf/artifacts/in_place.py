"""An output directory that exists is filled (or emptied) where it is, never swapped for another.

A writer builds its artifact in a hidden sibling and renames it over the output. Where the output is an existing
empty directory that rename replaced the user's directory with a new one: its mode, group and setgid bit lost (a
``chmod 2770`` shared directory came back ``drwxr-xr-x``), and where it is a mount point (``docker run -v
$PWD/out:/out ... --out /out``) the rename fails with EBUSY after all the work, on every rerun (found in review).
So such a directory keeps its inode: the work's entries are moved into it, the manifest last, and a usaf artifact at
a mount point is emptied in place for ``--overwrite``.

Crash safety: :data:`FILLING_MARKER` is written into the directory first and removed last, so a kill midway leaves
a directory that :func:`usaf.artifacts.outputs.found_at` reads as an unfinished usaf output (its kind in the marker),
which ``--overwrite`` replaces, never as a user's directory that usaf would then refuse for good.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from usaf.artifacts.manifest import MANIFEST_NAME
from usaf.artifacts.outputs import FILLING_MARKER, MADE_MARKER, own_entries
from usaf.errors import UsafError

_LAST = (MANIFEST_NAME, MADE_MARKER)  # what makes a directory a finished usaf artifact: moved in last, removed last


def fill_in_place(work: Path, target: Path, kind: str, flag: str) -> None:
    """Move every entry of the work directory ``work`` into the existing empty directory ``target`` (its manifest or
    marker last), then remove ``work``. Across file systems (a mount point and its parent) entries are copied."""
    marker = target / FILLING_MARKER
    marker.write_text(kind, encoding="utf-8")
    names = sorted(entry.name for entry in work.iterdir())
    for name in [n for n in names if n not in _LAST] + [n for n in names if n in _LAST]:
        destination = target / name
        if os.path.lexists(destination):  # put there meanwhile (usaf holds the output's lock): someone else's
            marker.unlink(missing_ok=True)  # no longer usaf's alone: no flag may delete it now
            raise UsafError(f"{flag} {target}: {name} appeared there while usaf moved its output in; usaf never "
                            "replaces it", f"move {name} out of {target}, or pass another {flag}")  # fmt: skip
        _move(work / name, destination)
    shutil.rmtree(work, ignore_errors=True)
    marker.unlink()


def clear_in_place(target: Path, kind: str | None) -> None:
    """Delete the entries of the usaf artifact ``target`` (checked replaceable by the caller) and keep the directory
    itself: the marker first, then every entry, its manifest or marker last."""
    (target / FILLING_MARKER).write_text(kind or "", encoding="utf-8")
    names = own_entries(target)
    for name in [n for n in names if n not in _LAST] + [n for n in names if n in _LAST]:
        path = target / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def cannot_be_moved(error: OSError, target: Path) -> bool:
    """Whether renaming ``target`` failed because it is a mount point (EBUSY), the one case emptied in place."""
    return error.errno == errno.EBUSY or os.path.ismount(target)


def _move(source: Path, destination: Path) -> None:
    try:
        os.rename(source, destination)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        shutil.move(os.fspath(source), os.fspath(destination))  # another file system: copied, then deleted
