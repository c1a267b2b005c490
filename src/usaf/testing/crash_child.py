"""Run ``usaf`` with its file writes numbered, and SIGKILL itself at one of them: a crash at a chosen moment.

    python -m usaf.testing.crash_child EVENTS KILL_AT FRACTION -- quantize MODEL --out OUT ...
    python -m usaf.testing.crash_child EVENTS KILL_AT:enospc FRACTION -- ...    (a full disk instead of a kill)

Every write-side operation usaf's stages use (``safetensors.torch.save_file``, ``torch.save``,
``Path.write_text``, ``os.replace``, ``shutil.rmtree``, the streaming ``experts_q4.pt`` writer) is
numbered and logged to ``EVENTS`` (one ``N<TAB>kind<TAB>path`` line, line-buffered, so the log
survives the kill). At event number ``KILL_AT`` (0: never) the process leaves the disk as a kill at
that moment would and sends itself SIGKILL:

- a file write is done, then cut to ``FRACTION`` of its bytes (a writer killed mid-file leaves a prefix);
  ``save_file`` also leaves that prefix in a ``.tmpXXXXXX`` sibling, as safetensors >= 0.8 does (it writes
  through its own temporary and renames it: a kill mid-write leaves the temporary, not the target);
- a rename or a tree removal is not done (``rmtree`` removes ``FRACTION`` of the files first);
- the streaming writer's ``add`` is done (its temporary holds that many layers), ``close`` is not.

With ``KILL_AT:enospc`` the event is a full disk instead: a file write leaves its torn prefix (as above)
and raises what the writer raises on a full disk (safetensors' ``os error 28``, torch.save's
``RuntimeError``, ``OSError(ENOSPC)`` for the others: ``usaf.testing.faults``); the process goes on to
answer it (one error line, exit 2, or a note where the write was optional). The log marks it ``FAULT``.

Nothing here changes what usaf writes when no kill is due: the hooks call the real functions.
Used by :mod:`usaf.testing.crash` (``scripts/crash_harness.py``, ``tests/test_crash_safety.py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import uuid
from pathlib import Path

import safetensors.torch
import torch

from usaf.quant import ptfile
from usaf.testing.faults import make_error


def _truncate(path: object, fraction: float) -> None:
    path = Path(str(path))
    if path.is_file():
        size = path.stat().st_size
        os.truncate(path, int(size * fraction))


# the form a full disk takes at each kind of write (what that writer raises)
_DISK_FULL_FORM = {"save_file": "safetensors", "torch.save": "torch"}


def install(events_path: str, kill_at: int, fraction: float, *, disk_full: bool = False) -> None:
    log = open(events_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (open until the process ends)
    count = 0

    def event(kind: str, path: object, partial=None) -> bool:
        """Log the event; at KILL_AT run ``partial`` (the torn state) and die, or raise a full disk's error
        (``disk_full``). True: do the real thing."""
        nonlocal count
        count += 1
        log.write(f"{count}\t{kind}\t{path}\n")
        if count == kill_at:
            if partial is not None:
                partial()
            if disk_full:
                log.write(f"{count}\tFAULT\t{path}\n")
                raise make_error(_DISK_FULL_FORM.get(kind, "enospc"), path)
            log.write(f"{count}\tKILL\t{path}\n")
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return True

    real_save_file = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        def torn():
            real_save_file(tensors, filename, metadata=metadata)
            if not disk_full:  # on ENOSPC the library removes its temporary itself
                library_temporary = Path(filename).parent / f".tmp{uuid.uuid4().hex[:6]}"
                library_temporary.write_bytes(Path(filename).read_bytes())
                _truncate(library_temporary, fraction)
            _truncate(filename, fraction)

        event("save_file", filename, torn)
        return real_save_file(tensors, filename, metadata=metadata)

    safetensors.torch.save_file = save_file

    real_torch_save = torch.save

    def torch_save(obj, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):

            def torn():
                real_torch_save(obj, f, *args, **kwargs)
                _truncate(f, fraction)

            event("torch.save", f, torn)
        return real_torch_save(obj, f, *args, **kwargs)

    torch.save = torch_save

    real_write_text = Path.write_text

    def write_text(self, data, *args, **kwargs):
        def torn():
            real_write_text(self, data[: int(len(data) * fraction)], *args, **kwargs)

        event("write_text", self, torn)
        return real_write_text(self, data, *args, **kwargs)

    Path.write_text = write_text

    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        event("replace", dst)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace

    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        def torn():
            files = sorted(p for p in Path(path).rglob("*") if p.is_file())
            for p in files[: int(len(files) * fraction)]:
                p.unlink()

        event("rmtree", path, torn)
        return real_rmtree(path, *args, **kwargs)

    shutil.rmtree = rmtree

    real_add, real_close = ptfile.StreamingTorchSave.add, ptfile.StreamingTorchSave.close

    def add(self, name, entry):
        result = real_add(self, name, entry)
        event("ptfile.add", self.path)
        return result

    def close(self):
        event("ptfile.close", self.path)
        return real_close(self)

    ptfile.StreamingTorchSave.add, ptfile.StreamingTorchSave.close = add, close


def main() -> None:
    events, kill_at, fraction, sep, *args = sys.argv[1:]
    if sep != "--":
        raise SystemExit("usage: python -m usaf.testing.crash_child EVENTS KILL_AT[:enospc] FRACTION -- USAF_ARGS...")
    at, _, mode = kill_at.partition(":")
    install(events, int(at), float(fraction), disk_full=mode == "enospc")
    # lazy: after install() has patched the writers (modules bind save_file when imported)
    from usaf.cli.app import app

    app(args=args, prog_name="usaf")


if __name__ == "__main__":
    main()
