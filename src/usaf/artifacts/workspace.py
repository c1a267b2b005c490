"""Stages chain by convention: default output locations, and finding the latest input.

Users write ``usaf quantize Qwen/Qwen3-30B-A3B`` then ``usaf train`` with no paths between them. So
every stage writes, unless told otherwise, to ``<workspace>/<kind>/<timestamp>-<label>``, and a
consumer not given an input looks for artifacts of the kind it needs in the workspace (its direct
subdirectories and one level below). It takes the newest and says which; when the candidates come
from different lineages (say two different source models) it refuses and lists them, because
picking one would be a guess. Explicit paths always win.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Generic, TypeVar

from usaf.artifacts.loader import load_manifest
from usaf.artifacts.manifest import MANIFEST_NAME, Manifest
from usaf.errors import UsafError

M = TypeVar("M", bound=Manifest)

WORKSPACE_ENV = "USAF_WORKSPACE"


def workspace_dir(explicit: Path | None = None) -> Path:
    """``--workspace``, else ``$USAF_WORKSPACE``, else the current directory."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get(WORKSPACE_ENV)
    return Path(env) if env else Path.cwd()


def _slug(label: str) -> str:
    label = re.sub(r"^\d{8}-\d{6}-", "", label)  # a label taken from another default output: one stamp is enough
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.").lower()
    return slug[:48] or "run"


def default_output(workspace: Path, kind: str, label: str, *, now: datetime | None = None) -> Path:
    """``<workspace>/<kind>/<YYYYmmdd-HHMMSS>-<label>``, unique within the workspace."""
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    base = workspace / kind / f"{stamp}-{_slug(label)}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


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
        raise UsafError(
            f"{flag}: not given, and no '{cls.KIND}' artifact{wanted} in the workspace {workspace}",
            f"pass {flag} PATH, or run the stage that makes '{cls.KIND}' first",
        )
    if lineage is not None:
        groups = {lineage(f.manifest) for f in found}
        if len(groups) > 1:
            listing = ", ".join(str(f.path) for f in found[:6])
            raise UsafError(
                f"{flag}: not given, and the workspace {workspace} holds '{cls.KIND}' artifacts "
                f"of {len(groups)} different origins: {listing}",
                f"pass {flag} with the one you mean",
            )
    return found[0]
