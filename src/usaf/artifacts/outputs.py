"""What a command may write over: never one of its inputs, never a directory usaf did not make.

Every writer asks here before any work (and again at the moment it replaces anything):

- :func:`check_not_an_input`: the output is not an input, does not contain one and does not lie inside
  one (``usaf quantize M --out M --force`` would otherwise delete the model it reads);
- :func:`found_at`: what already is at the output, so that ``--overwrite``/``--force`` replaces only a
  usaf artifact (a directory with a usaf ``manifest.json``, or a run usaf is still training), and of the kind
  the command writes (``usaf score --out TOKENS --overwrite`` would otherwise replace a tokens directory with a
  plan), and refuses a user's directory whatever the flag; a symbolic link is refused too (replacing it would
  either write through it into its target or replace the link and leave the target behind);
- :func:`remove_usaf_made`: delete an output that :func:`found_at` says usaf made (rename, then delete, so
  a kill midway leaves a hidden ``.NAME.usaf-old-PID-*`` sibling that the next writer clears, never a
  half-deleted artifact under the real name).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from usaf._version import __version__
from usaf.artifacts.lock import LOCK_TAG
from usaf.artifacts.manifest import MANIFEST_NAME
from usaf.errors import UsafError

OLD_TAG = ".usaf-old-"
TMP_TAG = ".usaf-tmp-"
PARTIAL_TAG = ".usaf-partial"  # a resumable run's work: .NAME.usaf-partial beside its output
SCORE_PARTIAL_MARKER = "score-settings.json"  # what score writes first in its partial directory
MADE_MARKER = ".usaf-made"  # in a directory usaf wrote in another tool's format (a tiny Hugging Face model)
FILLING_MARKER = f"{TMP_TAG}filling"  # in an existing directory usaf fills or empties in place (in_place.py)

InputPaths = Mapping[str, "Path | str | Iterable[Path | str] | None"]  # flag -> the path(s) it named


def check_not_an_input(
    target: Path, flag: str, inputs: InputPaths, *, defaulted: bool = False, runs_own_plan: bool = False
) -> None:
    """Refuse an output that is, contains or lies inside one of ``inputs`` (compared after resolving links), or lies
    inside any usaf artifact (:func:`check_not_inside_an_artifact`), the input named first where both hold.
    ``defaulted``: ``target`` is the workspace's default output, not a ``flag`` given (``usaf tokenize .`` was
    refused as an ``--out`` nobody passed, with no word of the workspace that placed it; found in review).
    ``runs_own_plan``: ``target`` is the plan a run scores for itself, in its run directory (train's score)."""
    check_name_room(Path(target), flag)
    found = output_overlap(target, inputs, runs_own_plan=runs_own_plan)
    if found is not None:
        where, harm, remedy = found
        if defaulted:
            raise UsafError(f"the default output {target} {where}: writing there would {harm}",
                            f"pass --out DIR {remedy}, or --workspace DIR {remedy} (the workspace is the current "
                            "directory unless --workspace or USAF_WORKSPACE names one)")  # fmt: skip
        raise UsafError(f"{flag} {target} {where}: writing there would {harm}", f"pass {_a(flag)} {remedy}")


# The longest name usaf gives a file beside an output: its replaced output, ``.NAME.usaf-old-PID-xxxxxxxx``.
SIBLING_EXTRA = len(f".{OLD_TAG}{'9' * 7}-{'f' * 8}")


def check_name_room(target: Path, flag: str) -> None:
    """Refuse an output whose name leaves no room for the names usaf writes beside it (its temporaries, lock and
    replaced output: :data:`SIBLING_EXTRA` bytes more). A legal name of 245 bytes ended the command with a traceback
    (``File name too long`` for its lock), one of 236 with "cannot create it" of a path that can be made (found in
    review)."""
    size, limit = len(os.fsencode(target.name)), _name_max(target.parent)
    if size + SIBLING_EXTRA > limit:
        raise UsafError(f"{flag} {target}: a name of {size} bytes; usaf writes files beside it under its name and "
                        f"{SIBLING_EXTRA} bytes more (temporaries, a lock), past this file system's {limit}",
                        f"give it a name of at most {limit - SIBLING_EXTRA} bytes")  # fmt: skip


def _name_max(directory: Path) -> int:
    """The longest file name the file system of ``directory`` (or of its nearest existing parent) takes, in bytes."""
    for place in (directory, *directory.parents):
        try:
            return os.pathconf(place, "PC_NAME_MAX")
        except (OSError, ValueError, AttributeError):  # absent yet, or no pathconf (Windows): its parent's, or 255
            continue
    return 255


def _a(flag: str) -> str:
    """``a --out``, ``an OUT`` ("pass a OUT"; found in review)."""
    return f"{'an' if flag[:1] in 'AEIOUaeiou' else 'a'} {flag}"


def output_overlap(target: Path, inputs: InputPaths, *, runs_own_plan: bool = False) -> tuple[str, str, str] | None:
    """How writing at ``target`` would touch an input or a usaf artifact (``check_not_an_input``'s refusal, for a
    caller that goes on without writing there: eval's cache), as ``(where, harm, remedy)``; None where it would not."""
    out = _real(target)
    for name, path in _each_path(inputs):
        if not os.path.lexists(path):
            continue  # a hub id, or a path that does not exist: nothing there to lose
        given = _real(path)
        if out == given:
            shape = "is"
        elif given.is_relative_to(out):
            shape = "contains"
        elif out.is_relative_to(given):
            shape = "lies inside"
        else:
            continue
        named = f"{name} {path}" if name.startswith("-") else str(path)  # not a metavar: "the input INPUTS ." (review)
        return f"{shape} the input {named}", "replace or mix with that input", "outside every input"
    return _inside_an_artifact(target, runs_own_plan=runs_own_plan)


def check_not_inside_an_artifact(target: Path, flag: str) -> None:
    """Refuse an output inside a usaf artifact (one with a manifest, an export's marker, or an unfinished run), an
    input of this command or not: its files would join the artifact's unlisted, and a command that replaced or
    deleted the artifact would take them too. ``usaf score --out RUN/final/plan`` wrote a plan into a trained run,
    ``usaf train --out RUN/checkpoints/mine`` a run into an unfinished one (found in review). ``RUN/plan`` of an
    unfinished run is open only to the score train runs there (``runs_own_plan``): a user's score or export there
    was deleted with the run by ``train --overwrite`` (found in review)."""
    found = _inside_an_artifact(target)
    if found is not None:
        where, harm, remedy = found
        raise UsafError(f"{flag} {target} {where}: writing there would {harm}", f"pass {_a(flag)} {remedy}")


def _inside_an_artifact(target: Path, *, runs_own_plan: bool = False) -> tuple[str, str, str] | None:
    # lazy: artifacts.run imports the writer, which imports this module
    from usaf.artifacts.run import PLAN_DIR, SETTINGS_FILE

    real = _real(target)
    for parent in real.parents:
        finished = _finished(parent)
        if finished is not None:
            what, harm = finished[0], "add files its manifest does not list"
        elif (parent / SETTINGS_FILE).is_file() and not (runs_own_plan and real == parent / PLAN_DIR):
            what, harm = "an unfinished usaf run", "mix files into its run directory"
        else:
            continue
        return f"lies inside {parent}, {what}", harm, "outside every usaf artifact"
    return None


def _finished(directory: Path) -> tuple[str, str] | None:
    """A finished usaf artifact's words and kind (its manifest's, or an export's marker's), or None."""
    kind = manifest_kind(directory)
    if kind is not None:
        return f"a usaf {kind} artifact", kind
    marker = _json_object(directory / MADE_MARKER)
    if marker is not None and isinstance(marker.get("kind"), str):
        return f"a usaf-made {marker['kind']}", marker["kind"]
    return None


def finished_kind(directory: Path) -> str | None:
    """The kind of the finished usaf artifact ``directory`` is (its manifest's or marker's), or None."""
    finished = _finished(directory)
    return finished[1] if finished is not None else None


@dataclass(frozen=True)
class Found:
    """What is at an output path before a command writes it."""

    state: Literal["absent", "empty", "usaf", "foreign", "file", "link"]
    what: str = ""  # for messages: "a usaf plan artifact", "a directory usaf did not make (…)"
    kind: str | None = None  # of a usaf artifact: its manifest's kind ("plan"), a marker's, "run" for an unfinished run
    added: tuple[str, ...] = ()  # in a usaf artifact: files usaf did not write there (a user's, which no flag deletes)


def found_at(target: Path) -> Found:
    target = Path(target)
    if target.is_symlink():
        return Found("link", f"a symbolic link (to {os.readlink(target)})")
    if not target.exists():
        return Found("absent")
    if not target.is_dir():
        return Found("file", "a file, not a directory")
    entries = sorted(p.name for p in target.iterdir())
    if not entries:
        return Found("empty", "an empty directory")
    own = [name for name in entries if not is_bookkeeping(name)]
    if not own:  # only what killed usaf writes left behind (the next writer clears them)
        return Found("usaf", "an unfinished usaf output (only its temporaries)")
    made = _made(target, own)
    if made is not None:
        return Found("usaf", *made, added=added_files(target, made[1]))
    shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
    count = f"{len(entries)} {'entry' if len(entries) == 1 else 'entries'}"
    marks = f"no usaf {MANIFEST_NAME} or {MADE_MARKER} marker"  # tiny-model's outputs have the marker (review)
    return Found("foreign", f"a directory usaf did not make ({count}: {shown}; {marks})")


def usaf_made(directory: Path, entries: list[str] | None = None) -> str | None:
    """What usaf artifact ``directory`` is (``"a usaf plan artifact"``), or None if usaf did not make it."""
    made = _made(directory, entries)
    return made[0] if made is not None else None


def _made(directory: Path, entries: list[str] | None = None) -> tuple[str, str] | None:
    """:func:`usaf_made`'s words and the artifact's kind (:attr:`Found.kind`), or None."""
    # lazy: artifacts.run imports the writer, which imports this module
    from usaf.artifacts.run import PLAN_DIR, SETTINGS_FILE

    finished = _finished(directory)
    if finished is not None:
        return finished
    filling = _filling_kind(directory)
    if filling is not None:  # a kill while usaf moved its output into this directory, or emptied it in place
        return "an unfinished usaf output (stopped while its files were moved in or deleted)", filling
    if (directory / SETTINGS_FILE).is_file():  # written when training starts (atomically; cut by old versions)
        return "an unfinished usaf run", "run"
    entries = entries if entries is not None else own_entries(directory)
    if entries == [PLAN_DIR] and manifest_kind(directory / PLAN_DIR) == "plan":
        return "an unfinished usaf run (its plan scored, no step trained)", "run"
    if entries == [f".{PLAN_DIR}{PARTIAL_TAG}"] and _score_partial(directory / entries[0]):
        return "an unfinished usaf run (stopped while scoring its plan)", "run"
    return None


def _filling_kind(directory: Path) -> str | None:
    """The kind :data:`FILLING_MARKER` names, where ``directory`` holds one (a ``plan`` being moved in), else None."""
    try:
        return (directory / FILLING_MARKER).read_text(encoding="utf-8").strip() or None
    except (OSError, ValueError):
        return None


def _score_partial(directory: Path) -> bool:
    """Whether ``directory`` is score's partial directory: it holds the settings file score writes first, or
    nothing but usaf's temporaries (a kill before that file was in place), or a plan's manifest (a kill after the
    manifest, before the rename, with the settings file gone: a run holding it was "a directory usaf did not
    make"; found in review)."""
    if not directory.is_dir() or directory.is_symlink():
        return False
    own = own_entries(directory)
    return not own or SCORE_PARTIAL_MARKER in own or manifest_kind(directory) == "plan"


def refuse_unless_replaceable(
    target: Path,
    found: Found,
    flag: str,
    *,
    overwrite: bool,
    overwrite_flag: str,
    kinds: Collection[str] = (),
    replacing: bool = True,
) -> None:
    """The one refusal of an existing output, by what it is: a link, a file or a user's directory always; a usaf
    artifact unless ``overwrite``, one of a kind not in ``kinds`` (what the command writes; empty: any) even with it,
    and one holding files usaf did not write there (:attr:`Found.added`) where the caller would replace it
    (``replacing``; False for a look before work that may resume or reuse it, in place). An empty directory is taken
    as it is."""
    if found.state in ("link", "file"):
        raise UsafError(f"{flag} {target}: {found.what}; usaf writes only into a directory of its own",
                        f"pass another {flag}")  # fmt: skip
    if found.state == "foreign":
        raise UsafError(f"{flag} {target}: {found.what}; usaf never replaces or deletes it, with or without "
                        f"{overwrite_flag}", f"pass another {flag}: a new or an empty directory")  # fmt: skip
    if found.state == "usaf" and kinds and found.kind is not None and found.kind not in kinds:
        # before the flag's refusal, which offered the flag this one then refuses (found in review)
        wanted = " or ".join(kinds)
        raise UsafError(f"{flag} {target}: {found.what}; usaf replaces only what this command writes there (kind "
                        f"{wanted}), never another command's output, whatever the flags", f"pass another {flag} "
                        f"(delete {target} yourself if it is no longer needed)")  # fmt: skip
    if found.state == "usaf" and found.added and replacing:  # before the flag is offered: it would delete them
        shown = ", ".join(found.added[:3]) + (", …" if len(found.added) > 3 else "")
        count = f"{len(found.added)} {'file' if len(found.added) == 1 else 'files'}"
        raise UsafError(f"{flag} {target}: {found.what} holding {count} usaf did not write there ({shown}); usaf never "
                        f"deletes them, with or without {overwrite_flag}",
                        f"move them out of {target}, or pass another {flag}")  # fmt: skip
    if found.state == "usaf" and not overwrite:
        raise UsafError(f"{flag} {target}: {found.what} already exists there",
                        f"pass another {flag}, or {overwrite_flag} to replace it")  # fmt: skip


def remove_usaf_made(
    target: Path, flag: str, *, overwrite_flag: str = "--overwrite", kinds: Collection[str] = ()
) -> None:
    """Delete ``target`` if it is an empty directory or usaf's own (of one of ``kinds``, when given); refuse anything
    else."""
    old = set_aside(target, flag, overwrite=True, overwrite_flag=overwrite_flag, kinds=kinds)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def set_aside(
    target: Path, flag: str, *, overwrite: bool, overwrite_flag: str, kinds: Collection[str] = ()
) -> Path | None:
    """Move what is at ``target`` to a hidden :func:`old_sibling` for deletion, where it may be replaced (else
    refused, :func:`refuse_unless_replaceable` with ``kinds``); None when nothing is there, when it is an empty
    directory (kept, to be filled in place), or when it is a mount point (emptied in place:
    :mod:`usaf.artifacts.in_place`).

    Looked at again once moved, under a name nobody else uses: between the first look and the rename another
    process may have put something else there (a user's directory), and what is deleted must be what was checked.
    Found to be something else, it is moved back (where the name is still free) and refused.
    """
    target = Path(target)
    found = found_at(target)
    if found.state == "absent":
        return None
    refuse_unless_replaceable(target, found, flag, overwrite=overwrite, overwrite_flag=overwrite_flag, kinds=kinds)
    if found.state == "empty":  # the user's directory, a mount point: kept, and filled in place (in_place.py)
        return None
    old = old_sibling(target)
    try:
        os.replace(target, old)
    except OSError as e:
        from usaf.artifacts.in_place import cannot_be_moved, clear_in_place  # lazy: in_place imports this module

        if not cannot_be_moved(e, target):
            raise
        # looked at again right before anything is deleted, as the rename's path does: a file added since is kept
        refuse_unless_replaceable(target, found_at(target), flag, overwrite=overwrite, overwrite_flag=overwrite_flag,
                                  kinds=kinds)  # fmt: skip
        clear_in_place(target, found.kind)  # a mount point: its usaf artifact deleted, the directory kept
        return None
    moved = found_at(old)
    try:
        refuse_unless_replaceable(target, moved, flag, overwrite=overwrite, overwrite_flag=overwrite_flag, kinds=kinds)
    except UsafError as refusal:
        if os.path.lexists(target):  # taken again meanwhile: say where it is rather than replace either
            raise UsafError(f"{refusal.message} (it changed while usaf looked; it is now at {old})",
                            refusal.hint) from None  # fmt: skip
        os.rename(old, target)
        raise
    return old


def mark_usaf_made(directory: Path, kind: str) -> None:
    """Record in a directory of another tool's format that usaf made it (so ``--overwrite`` may replace it), and the
    files it wrote (so one added later is known: :func:`added_files`)."""
    files = sorted(_files_under(Path(directory)))
    record = {"kind": kind, "usaf_version": __version__, "files": files}
    (Path(directory) / MADE_MARKER).write_text(json.dumps(record) + "\n")


def added_files(directory: Path, kind: str | None) -> tuple[str, ...]:
    """Files in the usaf artifact ``directory`` that usaf did not write there: neither listed by its manifest (or
    its marker, where that lists them) nor usaf's bookkeeping, nor a run's working files (its settings, metrics,
    checkpoints' files, on-the-fly plan and prefix-state spill files, which its manifest does not list). ``--overwrite``
    deleted them with the artifact: a model card added to an export, notes in an eval report, notes in a run's
    ``checkpoints/`` or its plan (found in review)."""
    record = _json_object(directory / MANIFEST_NAME) or _json_object(directory / MADE_MARKER) or {}
    listed = record.get("files")
    if not isinstance(listed, list):
        if kind != "run":  # a marker from before the files were recorded: nothing to compare with
            return ()
        listed = []  # an unfinished run: only its own working files
    # a manifest's records or a marker's paths; an edited list of another shape lists nothing, and is no crash
    paths = (entry.get("path") if isinstance(entry, dict) else entry for entry in listed)
    known = {path for path in paths if isinstance(path, str)} | {MANIFEST_NAME, MADE_MARKER}
    added = [rel for rel in _files_under(directory) if rel not in known]
    if kind == "run":
        added = [rel for rel in added if not run_working_file(rel)] + _added_to_the_runs_plan(directory)
    return tuple(sorted(added))


def run_working_file(rel: str) -> bool:
    """A file a run writes that its manifest does not list: settings, metrics, prefix-state spills, a checkpoint's
    files (``checkpoints/step-N/``, ``final/`` before the run ends, and the ``.tmp`` a killed write leaves), and its
    on-the-fly plan's (:func:`_added_to_the_runs_plan` looks inside that)."""
    # lazy: artifacts.run imports the writer, which imports this module
    from usaf.artifacts.run import (
        CHECKPOINT_FILES,
        CHECKPOINTS_DIR,
        FINAL_DIR,
        METRICS_FILE,
        PLAN_DIR,
        PREFIX_SPILL,
        PREFIX_SPILL_RANK,
        SETTINGS_FILE,
    )

    spill = re.escape(PREFIX_SPILL) + "|" + re.escape(PREFIX_SPILL_RANK).replace(r"\{\}", r"\d+")
    checkpoint = rf"({re.escape(CHECKPOINTS_DIR)}/step-\d+|{re.escape(FINAL_DIR)})(\.tmp)?/"
    files = "|".join(re.escape(name) for name in CHECKPOINT_FILES)
    plans = rf"({re.escape(PLAN_DIR)}|\.{re.escape(PLAN_DIR)}{re.escape(PARTIAL_TAG)})/.*"
    own = rf"{re.escape(METRICS_FILE)}|{re.escape(SETTINGS_FILE)}|{spill}|{checkpoint}({files})|{plans}"
    return re.fullmatch(own, rel) is not None


def _added_to_the_runs_plan(run: Path) -> list[str]:
    """Files added to the plan a run scored on the fly (a plan artifact of its own), relative to the run."""
    from usaf.artifacts.run import PLAN_DIR  # lazy: as above

    plan = run / PLAN_DIR
    return [f"{PLAN_DIR}/{rel}" for rel in added_files(plan, "plan")] if plan.is_dir() else []


def _files_under(directory: Path) -> Iterable[str]:
    """Every file (or link) under ``directory``, relative, but usaf's bookkeeping."""
    for path in directory.rglob("*"):
        rel = path.relative_to(directory)
        if (path.is_file() or path.is_symlink()) and not any(is_bookkeeping(part) for part in rel.parts):
            yield rel.as_posix()


def old_sibling(target: Path) -> Path:
    """Where a replaced output waits to be deleted; the PID lets a later writer clear one a kill left."""
    target = Path(target)
    return target.parent / f".{target.name}{OLD_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def is_bookkeeping(name: str) -> bool:
    """A temporary, a replaced output waiting for deletion, or a lock file: usaf's, never the user's (a kill
    leaves them; the next writer clears them)."""
    return any(tag in name for tag in (TMP_TAG, OLD_TAG, LOCK_TAG))


def own_entries(directory: Path) -> list[str]:
    """The names in ``directory`` but usaf's bookkeeping (:func:`is_bookkeeping`), sorted."""
    return sorted(p.name for p in Path(directory).iterdir() if not is_bookkeeping(p.name))


def manifest_kind(directory: Path) -> str | None:
    """The kind a usaf manifest in ``directory`` names (``"plan"``), or None: no readable usaf manifest there."""
    data = _json_object(directory / MANIFEST_NAME)
    if data is None or not isinstance(data.get("kind"), str) or "usaf_version" not in data:
        return None
    return data["kind"]


def _json_object(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _real(path: Path | str) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def _each_path(inputs: InputPaths) -> Iterable[tuple[str, Path | str]]:
    for name, value in inputs.items():
        if value is None:
            continue
        if isinstance(value, (str, os.PathLike)):
            yield name, value
        else:
            for path in value:
                if path is not None:
                    yield name, path
