"""Stages chain by convention: default output locations, and finding the latest input.

Users write ``usaf quantize Qwen/Qwen3-30B-A3B`` then ``usaf train`` with no paths between them. So
every stage writes, unless told otherwise, to ``<workspace>/<kind>/<timestamp>-<label>``, and a
consumer not given an input looks for artifacts of the kind it needs in the workspace (its direct
subdirectories and one level below). It takes the newest and says which; when the candidates come
from different lineages (say two different source models) it refuses and lists them, because
picking one would be a guess. Explicit paths always win.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Generic, TypeVar

from usaf.artifacts.hashing import sha256_file
from usaf.artifacts.loader import holds_artifacts, load_manifest, load_verified
from usaf.artifacts.manifest import MANIFEST_NAME, Manifest
from usaf.artifacts.outputs import PARTIAL_TAG, usaf_made
from usaf.artifacts.plan import PlanManifest
from usaf.artifacts.quantized import QuantizedModelManifest
from usaf.artifacts.tokens import TRAIN_FILE, TokensManifest, check_tokenizer, check_tokens_file
from usaf.config import source_of
from usaf.errors import UsafError

M = TypeVar("M", bound=Manifest)

WORKSPACE_ENV = "USAF_WORKSPACE"


def workspace_dir(explicit: Path | None = None, *, named: str = "--workspace") -> Path:
    """``--workspace``, else ``$USAF_WORKSPACE``, else the current directory; refused where it is not a directory (a
    file given there was named as an ``--out`` never given, whose lock file could not be made; found in review).
    ``named``: where ``explicit`` was set, named in that refusal."""
    env = os.environ.get(WORKSPACE_ENV)
    if explicit is not None:
        path = Path(explicit)
    elif env:
        path, named = Path(env), WORKSPACE_ENV
    else:
        return Path.cwd()
    if path.exists() and not path.is_dir():
        raise UsafError(f"{named} {path}: not a directory", "pass a directory (a missing one is created)")
    return Path(os.path.abspath(path))  # what stages print: a relative one's were relative, or kept '..' (review)


def settings_workspace(config: Any) -> Path:
    """A stage's workspace (:func:`workspace_dir`), a refusal naming where it was set: ``USAF_WORKSPACE`` and a
    ``--config`` table reach the settings as ``workspace`` too, and were named as a ``--workspace`` never given."""
    return workspace_dir(config.workspace, named=source_of(config, "workspace"))


def _slug(label: str) -> str:
    label = re.sub(r"^\d{8}-\d{6}-", "", label)  # a label taken from another default output: one stamp is enough
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.").lower()
    return slug[:48] or "run"


def default_output(workspace: Path, kind: str, label: str, *, now: datetime | None = None) -> Path:
    """``<workspace>/<kind>/<YYYYmmdd-HHMMSS>-<label>``, unique within the workspace."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = workspace / kind / f"{stamp}-{_slug(label)}"
    candidate, n = base, 1
    # taken too: a name whose interrupted run left its work beside it (a rerun of that run resumes there)
    while candidate.exists() or candidate.with_name(f".{candidate.name}{PARTIAL_TAG}").exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def interrupted_outputs(workspace: Path, kind: str, label: str) -> list[Path]:
    """The default outputs (:func:`default_output`) of ``kind`` and ``label`` whose resumable run was interrupted:
    each one's target, from its ``.NAME.usaf-partial`` directory, newest first (the names start with their time)."""
    return _default_named(workspace, kind, label, rf"\.({_default_name(label)}){re.escape(PARTIAL_TAG)}")


def unfinished_outputs(workspace: Path, kind: str, label: str) -> list[Path]:
    """The default outputs of ``kind`` and ``label`` that are directories without a manifest (a run directory
    written in place, as train's), newest first."""
    found = _default_named(workspace, kind, label, f"({_default_name(label)})")
    return [p for p in found if not (p / MANIFEST_NAME).exists()]


def _default_name(label: str) -> str:
    """A regular expression for :func:`default_output`'s names of ``label``."""
    return rf"\d{{8}}-\d{{6}}-{re.escape(_slug(label))}(?:-\d+)?"


def _default_named(workspace: Path, kind: str, label: str, pattern: str) -> list[Path]:
    """The directories under ``workspace/kind`` whose names match ``pattern`` (its group 1: the output's name), as
    outputs, newest first."""
    directory, compiled = workspace / kind, re.compile(pattern)
    if not directory.is_dir():
        return []
    found = [directory / m.group(1) for p in directory.iterdir() if (m := compiled.fullmatch(p.name)) and p.is_dir()]
    return sorted(found, key=lambda p: p.name, reverse=True)


@dataclass(frozen=True)
class Found(Generic[M]):
    path: Path
    manifest: M


def find_artifacts(workspace: Path, cls: type[M]) -> list[Found[M]]:
    """Every complete artifact of ``cls``'s kind in the workspace (depth 1 and 2), newest first."""
    found: list[Found[M]] = []
    if not workspace.is_dir():
        return found
    seen: set[Path] = set()
    for manifest_path in [*workspace.glob(f"*/{MANIFEST_NAME}"), *workspace.glob(f"*/*/{MANIFEST_NAME}")]:
        directory = manifest_path.parent.resolve()
        if directory in seen or directory.name.startswith("."):
            continue
        seen.add(directory)
        try:
            manifest = load_manifest(directory, cls)
        except UsafError:
            continue  # another kind, or unreadable: not a candidate
        found.append(Found(directory, manifest))
    found.sort(key=lambda f: f.manifest.created_at, reverse=True)
    return found


def _damaged(workspace: Path, cls: type[Manifest]) -> list[Path]:
    """Directories where the workspace keeps ``cls``'s kind (``WORKSPACE/<kind>/<name>``) whose manifest does not
    load: cut, edited, or of a newer schema."""
    damaged = []
    for manifest_path in sorted((workspace / cls.KIND).glob(f"*/{MANIFEST_NAME}")):
        try:
            load_manifest(manifest_path.parent, cls)
        except UsafError:
            damaged.append(manifest_path.parent)
    return damaged


def pick_latest(
    workspace: Path,
    cls: type[M],
    *,
    flag: str,
    lineage: Callable[[M], str] | None = None,
    accept: Callable[[M], bool] | None = None,
    wanted: str = "",
) -> Found[M]:
    """The newest artifact of ``cls`` in ``workspace``, refusing when lineages differ.

    Args:
        workspace: where to look.
        cls: the manifest class wanted.
        flag: the flag that would name the input explicitly, for messages.
        lineage: what must agree between candidates for "the newest" to be a safe choice
            (e.g. the source model's fingerprint); ``None`` means any newest one will do.
        accept: only candidates for which this is true (e.g. tokens made with the model's tokenizer).
        wanted: how to describe accepted candidates in the error when there are none.
    """
    found = find_artifacts(workspace, cls)
    if accept is not None:
        found = [f for f in found if accept(f.manifest)]
    if not found:
        damaged = _damaged(workspace, cls)  # "no artifact" and "run the stage first" were false of these (review)
        beside = f"; {damaged[0]} is one with a damaged {MANIFEST_NAME}" if damaged else ""
        raise UsafError(
            f"{flag}: not given, and no '{cls.KIND}' artifact{wanted} in the workspace {workspace}{beside}",
            f"pass {flag} PATH, or run the stage that makes '{cls.KIND}' first"
            + (f" (usaf inspect {damaged[0]} says what is wrong with it)" if damaged else ""),
        )
    if lineage is not None:
        groups = {lineage(f.manifest) for f in found}
        if len(groups) > 1:
            more = f" and {len(found) - 6} more" if len(found) > 6 else ""  # 7 origins were listed as 6 (review)
            listing = ", ".join(str(f.path) for f in found[:6]) + more
            raise UsafError(
                f"{flag}: not given, and the workspace {workspace} holds '{cls.KIND}' artifacts "
                f"of {len(groups)} different origins: {listing}",
                f"pass {flag} with the one you mean",
            )
    return found[0]


# -- the inputs a stage was not given ----------------------------------------------------------------------
# ``progress`` below is anything with ``note(str)`` (a stage's Progress): the line says what was picked.


def resolve_model(config: Any, progress: Any) -> tuple[Path, QuantizedModelManifest]:
    """``config.model`` (verified without rehashing its weights), else the workspace's newest quantized model."""
    if config.model is None:
        found = pick_latest(
            settings_workspace(config),
            QuantizedModelManifest,
            flag="--model",
            lineage=lambda m: m.summary.source.origin,
        )
        progress.note(f"using the quantized model {found.path} (newest in the workspace)")
        return found.path, found.manifest
    return config.model, load_verified(config.model, QuantizedModelManifest, flag="--model", hashes=False)


def resolve_data(
    config: Any, tokenizer_fingerprint: str, progress: Any, *, prefer: str | None = None, flag: str = "--data"
) -> tuple[Path, str]:
    """The training sequences file and the fingerprint of what it came from; checks the tokenizer.

    ``prefer``: the fingerprint of the tokens an interrupted run started with; taken from the workspace while they
    are there, whatever newer tokens appeared since (else resuming it was refused as another run's)."""
    data = config.data
    if data is None:
        found = _preferred(settings_workspace(config), TokensManifest, prefer)
        if found is not None:
            progress.note(f"using the tokens {found.path} (the ones this run started with)")
        else:
            found = pick_latest(
                settings_workspace(config),
                TokensManifest,
                flag="--data",
                accept=lambda m: m.summary.tokenizer.fingerprint == tokenizer_fingerprint,
                wanted=" made with this model's tokenizer",
            )
            progress.note(f"using the tokens {found.path} (newest made with this model's tokenizer)")
        data = found.path
    if data.is_dir():
        if not (data / MANIFEST_NAME).is_file() and usaf_made(data) is None:  # another usaf output: its own message
            if (inside := holds_artifacts(data, flag, (TokensManifest.KIND,))) is not None:
                raise inside
            raise UsafError(f"{flag} {data}: not a tokens artifact (no {MANIFEST_NAME}): text to tokenize?",
                            _TOKENIZE_FIRST.format(data=data, flag=flag))  # fmt: skip
        manifest = load_verified(data, TokensManifest, flag=flag)
        check_tokenizer(data, manifest, tokenizer_fingerprint, flag=flag)
        return data / TRAIN_FILE, manifest.fingerprint
    if not data.is_file():
        raise UsafError(f"{flag} {data}: no such file or directory", "pass a tokens directory or a JSONL file")
    if not _looks_like_json_lines(data):
        raise UsafError(f"{flag} {data}: not a tokens JSONL file (its first line is not a JSON object): text to "
                        "tokenize?", _TOKENIZE_FIRST.format(data=data, flag=flag))  # fmt: skip
    check_tokens_file(data, tokenizer_fingerprint, flag=flag)
    return data, sha256_file(data)


# raw text given where tokens are read: the hints pointed at usaf artifacts and JSON lines, never at tokenize (review)
_TOKENIZE_FIRST = "tokenize it first: usaf tokenize {data} --model MODEL --out TOKENS, then pass {flag} TOKENS"


def _looks_like_json_lines(path: Path) -> bool:
    """Whether the first non-blank line of ``path`` is JSON, or begins as an object or array does: one that is JSON
    but no object, or broken, is the reader's to name, with its line (an empty file too). Else it is text."""
    try:
        with path.open("rb") as f:
            for line in f:
                line = line.removeprefix(b"\xef\xbb\xbf").strip()  # a UTF-8 byte-order mark: the reader takes it
                if line:
                    return line[:1] in (b"{", b"[") or _parses(line)
    except OSError:  # the reader names it
        return True
    return True


def _parses(line: bytes) -> bool:
    try:
        json.loads(line)
    except (ValueError, RecursionError):
        return False
    return True


def _preferred(workspace: Path, cls: type[M], fingerprint: str | None) -> Found[M] | None:
    """The workspace's artifact of ``cls`` with this fingerprint (the newest such), or None."""
    if fingerprint is None:
        return None
    return next((f for f in find_artifacts(workspace, cls) if f.manifest.fingerprint == fingerprint), None)


def resolve_plan(
    plan: Path | None,
    workspace: Path | None,
    model: tuple[Path, str],
    progress: Any,
    *,
    outside: Path | None = None,
    differences: Callable[[PlanManifest], list[str]] | None = None,
    prefer: str | None = None,
) -> tuple[Path, PlanManifest] | None:
    """``plan`` (read and verified once), else the workspace's newest plan made for ``model`` (its directory and
    fingerprint) that ``differences`` finds nothing against (the settings given that it was scored without), not one
    inside ``outside`` (a run directory, whose own plan its run finds), else None; ``prefer``: the fingerprint of the
    plan an interrupted run started with, taken before any newer one.

    Refuses a plan made for another quantized model.
    """
    model_dir, model_fingerprint = model
    if plan is not None:
        path, manifest = plan, load_verified(plan, PlanManifest, flag="--plan")
    else:
        own = outside.resolve() if outside is not None else None
        found = find_artifacts(workspace_dir(workspace), PlanManifest)
        mine = [a for a in found if a.manifest.summary.model_fingerprint == model_fingerprint
                and (own is None or own not in a.path.parents)]  # fmt: skip
        taken = [a for a in mine if differences is None or not differences(a.manifest)]
        started = next((a for a in taken if a.manifest.fingerprint == prefer), None) if prefer else None
        if started is not None:  # an interrupted run's own plan, whatever newer plans appeared since
            progress.note(f"using the plan {started.path} (the one this run started with)")
            check_plan_model(started.path, started.manifest, model)
            return started.path, started.manifest
        if differences is not None and mine and mine[0] not in taken:  # the newest is not it: say why, once
            progress.note(f"not using the plan {mine[0].path} (newest made for this model): scored with "
                          f"{'; '.join(differences(mine[0].manifest))}")  # fmt: skip
        if not taken:
            return None
        path, manifest = taken[0].path, taken[0].manifest  # newest first
        suffix = "" if taken[0] is mine[0] else " with the selection given"
        progress.note(f"using the plan {path} (newest made for this model{suffix})")
    check_plan_model(path, manifest, model)
    return path, manifest


def check_plan_model(path: Path, plan: PlanManifest, model: tuple[Path, str]) -> None:
    """Refuse a plan made for another quantized model than ``model`` (its directory and fingerprint)."""
    model_dir, model_fingerprint = model
    if plan.summary.model_fingerprint != model_fingerprint:
        raise UsafError(
            f"--plan {path}: made for another quantized model (fingerprint {plan.summary.model_fingerprint[:16]}), "
            f"not --model {model_dir} (fingerprint {model_fingerprint[:16]})",
            f"re-run usaf score --model {model_dir}",
        )
