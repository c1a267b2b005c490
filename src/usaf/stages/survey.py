"""What a workspace holds (``usaf inspect WORKSPACE``): every output usaf made, finished or not, and the work kept
for a rerun, with what to do about each.

A user who stopped a run with Ctrl-C, or whose machine went down, finds here what was left and how it goes on: an
unfinished training run (its newest complete checkpoint), an interrupted quantize or score (``.NAME.usaf-partial``
beside its output), an eval pass kept in the cache, an output another process is writing. Nothing is read beyond
names, small JSON records and sizes: no artifact is hashed (``usaf inspect ARTIFACT`` verifies one), nothing is
written, and no lock is taken (a lock's holder is read from its file).

Looked at: the workspace's directories and their subdirectories (where default outputs live:
``WORKSPACE/<kind>/<name>``, :func:`usaf.artifacts.workspace.default_output`), and ``WORKSPACE/cache``.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from usaf.artifacts.lock import holder_of
from usaf.artifacts.manifest import MANIFEST_KINDS, MANIFEST_NAME
from usaf.artifacts.outputs import MADE_MARKER, OLD_TAG, PARTIAL_TAG, TMP_TAG, manifest_kind, usaf_made
from usaf.artifacts.run import PLAN_DIR, SETTINGS_FILE, STATE_FILE, RunManifest, checkpoint_dirs
from usaf.errors import UsafError
from usaf.stages.eval.cache import CACHE_SUBDIR, META_FILE, TUNED_SUBDIR
from usaf.stages.quantize import kept_layers
from usaf.stages.quantize_parts import PARTIAL_SETTINGS
from usaf.stages.score_resume import CALIBRATION, PROBES, RANK_CALIBRATION, STORE
from usaf.stages.score_resume import SETTINGS as SCORE_SETTINGS

SCORE_WORK = {CALIBRATION: "the calibration pass", PROBES: "finished lr-test probes",
              STORE: "part of --cache's prefix store"}  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One thing usaf left in the workspace."""

    path: Path
    state: str  # finished, unfinished run, interrupted, kept eval pass, cached base pass, being written, leftover
    kind: str  # the artifact kind ("run", "plan", ...), or what the entry is ("eval cache", "temporary")
    detail: str
    bytes: int
    next: str  # what to do about it
    in_use: str | None = None  # the process writing it, if one is

    def to_dict(self) -> dict:
        return {"path": str(self.path), "state": self.state, "kind": self.kind, "detail": self.detail,
                "bytes": self.bytes, "next": self.next, "in_use": self.in_use}  # fmt: skip


def survey(workspace: Path) -> list[Entry]:
    """Every usaf output, unfinished run, interrupted output, kept eval pass and leftover in ``workspace``."""
    entries: list[Entry] = []
    for child in _directories(workspace):
        if child == workspace / CACHE_SUBDIR.parent:
            entries += _eval_cache(workspace)
            continue
        found = describe(child)
        if found is not None:
            entries.append(found)
            continue
        for grandchild in _directories(child):  # WORKSPACE/<kind>/<name>
            found = describe(grandchild)
            if found is not None:
                entries.append(found)
    return entries


def describe(path: Path) -> Entry | None:
    """What usaf left at ``path`` (an output, or an interrupted one's ``.NAME.usaf-partial``), or None: not usaf's."""
    name = path.name
    if TMP_TAG in name or OLD_TAG in name:
        target = path.parent / name[1:].split(TMP_TAG)[0].split(OLD_TAG)[0]
        writer = holder_of(target)
        if writer is not None:
            return Entry(path, "being written", "temporary", f"the output {target.name}, not yet in place",
                         _size(path), "wait for the process writing it", writer)  # fmt: skip
        after = f"the next write of {target}" if OLD_TAG in name else "the next usaf output written beside it"
        return Entry(path, "leftover", "temporary", f"a killed write of {target.name}", _size(path),
                     f"deleted by {after}; safe to delete")  # fmt: skip
    if name.startswith(".") and name.endswith(PARTIAL_TAG):
        return _interrupted(path, path.parent / name[1 : -len(PARTIAL_TAG)])
    if (path / MANIFEST_NAME).is_file():
        return _finished(path)
    marker = _json(path / MADE_MARKER)  # a directory usaf wrote in another tool's format: tiny-model's (review)
    if isinstance(marker, dict) and isinstance(marker.get("kind"), str):
        return Entry(path, "finished", marker["kind"], "made by usaf", _size(path), f"usaf inspect {path} describes it",
                     holder_of(path))  # fmt: skip
    if (path / SETTINGS_FILE).is_file() or (path / PLAN_DIR).is_dir() or (path / f".{PLAN_DIR}{PARTIAL_TAG}").is_dir():
        return _unfinished_run(path) if usaf_made(path) else None
    return None


def _finished(path: Path) -> Entry | None:
    record = _json(path / MANIFEST_NAME)
    if record is None or not isinstance(record.get("kind"), str):
        # a usaf manifest cut or edited was left out, as if nothing were there (found in review); a web app's
        # manifest.json (a JSON object without usaf's fields) is someone else's
        if record is not None and "usaf_version" not in record:
            return None
        # the kind its place in a workspace says (KIND/NAME); else unknown: the workspace's own name was shown (review)
        kind = path.parent.name if path.parent.name in MANIFEST_KINDS else "unknown"
        return Entry(path, "damaged", kind, f"its {MANIFEST_NAME} is unreadable or names no kind",
                     _size(path), f"usaf inspect {path} says what is wrong; make it again with the stage that made it")
    created = str(record.get("created_at", ""))[:16].replace("T", " ")
    detail = f"made {created}" if created else "made by usaf"
    return Entry(path, "finished", record["kind"], detail, _size(path), f"usaf inspect {path} verifies its files",
                 holder_of(path))  # fmt: skip


def _unfinished_run(path: Path) -> Entry:
    settings = _json(path / SETTINGS_FILE) or {}
    planned = settings.get("steps")
    try:
        done = checkpoint_dirs(path, flag="--out")
    except UsafError:  # a checkpoint directory renamed by hand: train says which when it resumes
        done = []
    if done:
        state = _json(done[-1] / STATE_FILE) or {}
        step = state.get("step", "?")
        detail = f"newest checkpoint: step {step}" + (f" of {planned}" if planned else "") + f" ({done[-1].name})"
    elif (path / f".{PLAN_DIR}{PARTIAL_TAG}").is_dir():
        detail = "stopped while scoring its plan (kept in " + f".{PLAN_DIR}{PARTIAL_TAG})"
    else:
        detail = "no checkpoint yet" + (f" of {planned} steps" if planned else "")
    writer = holder_of(path)
    if writer is not None:  # "rerun the command that started it", which its lock refuses (found in review)
        return Entry(path, "unfinished run", "run", detail, _size(path),
                     "being trained now: eval, export and generate take its newest checkpoint; to resume it later, "
                     "stop it (Ctrl-C there saves) and rerun its command", writer)  # fmt: skip
    # train without --out looks for an unfinished run among its workspace's default outputs only (WORKSPACE/run/)
    found = " (without --out it finds this run)" if path.parent.name == RunManifest.KIND else " (with its --out)"
    if not (path / SETTINGS_FILE).is_file():  # stopped while scoring: --resume has no record to take (review)
        return Entry(path, "unfinished run", "run", detail, _size(path),
                     f"rerun the command that started it{found}: its settings are recorded once its plan is scored, "
                     "so --resume alone has none to take; --overwrite starts over")  # fmt: skip
    return Entry(path, "unfinished run", "run", detail, _size(path),
                 f"usaf train --out {path} --resume (the settings it recorded), or rerun the command that started it"
                 f"{found}; --overwrite starts over")  # fmt: skip


def _interrupted(partial: Path, target: Path) -> Entry | None:
    """An interrupted score or quantize (None: a partial directory of neither)."""
    if (partial / SCORE_SETTINGS).is_file():
        kept = [what for name, what in SCORE_WORK.items() if (partial / name).is_file()]
        kind, detail = "plan", "usaf score kept " + (", ".join(kept) if kept else "nothing yet")
        shares = len(list(partial.glob(RANK_CALIBRATION.format("*"))))
        if shares:
            detail += f" (under torchrun: {shares + 1} processes' shares)"
        discard = "--overwrite"
    elif (partial / PARTIAL_SETTINGS).is_file():
        kind, discard = "quantized_model", "--force"
        detail = f"usaf quantize kept {kept_layers(partial)} quantized layers"
    elif manifest_kind(partial) == "quantized_model":  # killed between its manifest and the rename: unseen before
        kind, discard = "quantized_model", "--force"  # (found in review); quantize's rerun only renames it
        detail = "usaf quantize finished it (its manifest is written), only the rename into place is missing"
    elif manifest_kind(partial) == "plan":  # the same for score, whose rerun scores again (its settings are gone)
        kind, discard = "plan", "--overwrite"
        detail = "usaf score finished it (its manifest is written), only the rename is missing; a rerun scores again"
    else:
        return None
    return Entry(partial, "interrupted", kind, f"{detail}; resumes into {target.name}", _size(partial),
                 f"rerun the same command with --out {target} to resume; with {discard} it starts over",
                 holder_of(target))  # fmt: skip


def _eval_cache(workspace: Path) -> list[Entry]:
    entries = []
    for which in (CACHE_SUBDIR, TUNED_SUBDIR):
        for entry in _directories(workspace / which):
            meta = _json(entry / META_FILE)
            if meta is None:
                continue
            batches, tokens = meta.get("batches"), meta.get("input_tokens")
            if batches is None:
                detail = f"{tokens:,} tokens" if isinstance(tokens, int) else "a whole pass"
                entries.append(Entry(entry, "cached base pass", "eval cache", detail, _size(entry),
                                     "reused by the next eval of the same model and sequences; safe to delete"))
            else:
                name = "base" if which == CACHE_SUBDIR else "fine-tuned"
                microbatches = "microbatch" if batches == 1 else "microbatches"
                entries.append(Entry(entry, "kept eval pass", "eval cache", f"the {name} pass after {batches} "
                                     f"{microbatches}", _size(entry), "the same usaf eval resumes it; safe to delete"))
    return entries


def _directories(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return []


def _json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _size(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # gone meanwhile: a writer's temporary
                total += os.lstat(os.path.join(root, name)).st_size
    return total
