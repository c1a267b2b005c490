"""Loading and verifying artifacts, with one clear error for each way they can be wrong."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

from pydantic import ValidationError

from usaf._version import __version__
from usaf.artifacts.hashing import combine, hashing_phase, sha256_file
from usaf.artifacts.manifest import MANIFEST_KINDS, MANIFEST_NAME, Manifest, manifest_checksum
from usaf.artifacts.outputs import MADE_MARKER, usaf_made
from usaf.artifacts.safety import contained
from usaf.errors import UsafError

M = TypeVar("M", bound=Manifest)


def run_of_checkpoint(path: Path) -> Path | None:
    """The run directory of ``RUN/checkpoints/step-N`` or ``RUN/final``, or None where ``path`` is neither."""
    # lazy: artifacts.run imports this module
    from usaf.artifacts.run import CHECKPOINTS_DIR, FINAL_DIR, STATE_FILE, SUMS_FILE

    # its checksums.json alone will do: a checkpoint is renamed into place whole, so one without its state.json lost
    # it, and was "not a usaf artifact" (found in review)
    if not (path / STATE_FILE).is_file() and not (path / SUMS_FILE).is_file():
        return None
    if path.parent.name == CHECKPOINTS_DIR:
        return path.parent.parent
    return path.parent if path.name == FINAL_DIR else None


def artifacts_inside(path: Path) -> list[Path]:
    """The usaf artifacts directly in ``path`` (a workspace's ``tokens/``, say), newest name last."""
    try:
        return sorted(child for child in path.iterdir() if (child / MANIFEST_NAME).is_file())
    except OSError:
        return []


def _kind_of(artifact: Path) -> str | None:
    try:
        data = json.loads((artifact / MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get("kind") if isinstance(data, dict) else None


def holds_artifacts(
    path: Path, flag: str, kinds: tuple[str, ...] | None = None, *, from_workspace: bool = True
) -> UsafError | None:
    """The refusal of a directory that holds usaf artifacts as one: a workspace's ``tokens/`` as --data was called
    "text to tokenize?", and tokenizing it, as the hint said, found no text (found in review). ``kinds``: what
    ``flag`` takes; the artifact named is one of them (``--data ws/plan`` was sent to a plan; review).
    ``from_workspace``: whether the command takes ``flag``'s input from ``--workspace`` when it is not given (tokenize's
    --model does not, and a workspace given there was sent to --workspace; review)."""
    inside = artifacts_inside(path)
    if inside:
        fitting = [a for a in inside if kinds is None or _kind_of(a) in kinds]
        many = f"holds {len(inside)} usaf artifact{'s' if len(inside) > 1 else ''}, and is not one"
        if not fitting:
            return UsafError(f"{flag} {path}: {many}, and none of them a {' or '.join(kinds or ())} one",
                             f"pass a {' or '.join(kinds or ())} artifact")  # fmt: skip
        return UsafError(f"{flag} {path}: {many}", f"pass one of them (the newest by name: {flag} {fitting[-1]})")
    held = [a for child in sorted(path.iterdir()) if child.is_dir() for a in artifacts_inside(child)]
    if held:  # a workspace: kind/artifact
        fitting = [a for a in held if kinds is None or _kind_of(a) in kinds]
        one = f" ({flag} {fitting[-1]})" if fitting else ""
        hint = (f"pass --workspace {path} (each command takes the newest it needs there), or an artifact in it{one}"
                if from_workspace else f"pass an artifact in it{one}")  # fmt: skip
        return UsafError(f"{flag} {path}: a usaf workspace, not an artifact", hint)
    return None


def read_manifest_json(path: Path, *, flag: str = "path", kinds: tuple[str, ...] | None = None) -> dict:
    path = Path(path)
    if not path.exists():
        raise UsafError(f"{flag} {path}: no such directory", "check the path")
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        hint = "point at a directory written by a usaf command; an interrupted run leaves none"
        if path.name == MANIFEST_NAME and path.is_file():  # the manifest itself: its directory is the artifact
            hint = f"pass its directory, {path.parent}"
        elif (path / "config.json").is_file():  # the model a user starts from (found in review: no way on was named)
            made = usaf_made(path) if (path / MADE_MARKER).is_file() else None
            if flag != "path":  # a command's input: "not a usaf artifact" of a tiny model usaf made, and a hint that
                what = f"{made}, not quantized" if made else "a Hugging Face model, not one usaf quantized"  # named
                raise UsafError(f"{flag} {path}: {what}",  # no command (found in review)
                                f"run usaf quantize {path} first, and pass the directory it writes (usaf score, "
                                "train, eval, export and generate take a quantized model)")  # fmt: skip
            hint = "a Hugging Face model: usaf score, train, eval and generate take what usaf quantize makes of it"
            if made is not None:  # usaf inspect --verify of a tiny model (review)
                hint = f"{made}, a Hugging Face model with no sha256s to check; {hint.split(': ', 1)[1]}"
        elif path.is_dir() and (inside := holds_artifacts(path, flag, kinds)) is not None:
            raise inside
        elif (run := run_of_checkpoint(path)) is not None:  # "an interrupted run leaves none" was false (review)
            hint = (f"a checkpoint of the run {run}: eval, export and generate take it as --checkpoint; usaf inspect "
                    f"{run} --verify checks its files")  # fmt: skip
        raise UsafError(f"{flag} {path}: not a usaf artifact (no {MANIFEST_NAME})", hint)
    try:
        data = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise UsafError(f"{flag} {manifest_path}: unreadable manifest ({e})", "re-run the stage that made it") from None
    if not isinstance(data, dict) or "kind" not in data or "schema_version" not in data:
        raise UsafError(f"{flag} {manifest_path}: not a usaf manifest (no kind/schema_version)", "re-run the stage")
    return data


@overload
def load_manifest(path: Path, expect: type[M], *, flag: str = ...) -> M: ...
@overload
def load_manifest(path: Path, expect: None = ..., *, flag: str = ...) -> Manifest: ...


def load_manifest(path: Path, expect: type[M] | None = None, *, flag: str = "path") -> Manifest:
    """Load an artifact's manifest, checking its kind and schema version.

    Args:
        path: the artifact directory.
        expect: the manifest class the caller needs; ``None`` accepts any registered kind.
        flag: the flag or argument the path came from, named in errors.
    """
    data = read_manifest_json(path, flag=flag, kinds=(expect.KIND,) if expect is not None else None)
    kind, version = data["kind"], data["schema_version"]
    where = Path(path) / MANIFEST_NAME
    if not isinstance(kind, str) or type(version) is not int:
        raise UsafError(
            f"{flag} {where}: 'kind' must be a string and 'schema_version' an integer, got {kind!r} and {version!r}",
            "the file was edited; re-run the stage that made it",
        )
    if expect is not None and kind != expect.KIND:
        hint = f"pass a directory made by the stage that writes '{expect.KIND}'"
        if kind == "hf_export":  # an export is for transformers, not usaf (found in review)
            hint += "; an exported model loads with transformers (AutoModelForCausalLM.from_pretrained)"
        raise UsafError(f"{flag} {path}: is a '{kind}' artifact, expected '{expect.KIND}' (per its {MANIFEST_NAME})",
                        hint)  # fmt: skip
    cls = expect or MANIFEST_KINDS.get(kind)
    if cls is None:
        raise UsafError(
            f"{flag} {where}: unknown artifact kind '{kind}' (known: {', '.join(sorted(MANIFEST_KINDS))})",
            f"a newer usaf's, if its usaf_version {data.get('usaf_version')!r} is newer than this one's "
            f"{__version__} (then upgrade usaf); else the file was edited: re-run the stage that made it",
        )
    if version != cls.SCHEMA_VERSION:
        newer = isinstance(version, int) and version > cls.SCHEMA_VERSION
        raise UsafError(
            f"{flag} {where}: '{kind}' schema version {version}, this usaf reads version {cls.SCHEMA_VERSION}",
            "upgrade usaf" if newer else "re-run the stage that made it with this usaf",
        )
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UsafError(
            f"{flag} {path / MANIFEST_NAME}: invalid manifest at '{where}': {first['msg']}",
            "the file was edited or truncated; re-run the stage that made it",
        ) from None


@dataclass(frozen=True)
class FileCheck:
    path: str
    ok: bool
    problem: str = ""


def verify_files(path: Path, manifest: Manifest, *, hashes: bool = True, progress: Any = None) -> list[FileCheck]:
    """Check every file the manifest lists: present, same size, and (``hashes``) same sha256, hashed as a phase of
    ``progress`` when given."""
    checks = []
    present = []  # (record, file) of the right size: the ones hashed
    for record in manifest.files:
        file = contained(Path(path), record.path, where=f"{Path(path) / MANIFEST_NAME}")
        if not file.is_file():
            checks.append(FileCheck(record.path, False, "missing"))
        elif (size := file.stat().st_size) != record.bytes:
            how = "truncated?" if size < record.bytes else "modified: grown"  # a grown file was "truncated?" (review)
            checks.append(FileCheck(record.path, False, f"{size} bytes, manifest says {record.bytes} ({how})"))
        else:
            present.append((record, file))
    with hashing_phase(progress if hashes else None, "checking sha256", [f for _, f in present]) as on_bytes:
        for record, file in present:
            if hashes and sha256_file(file, on_bytes) != record.sha256:
                checks.append(FileCheck(record.path, False, "sha256 differs from the manifest (modified)"))
            else:
                checks.append(FileCheck(record.path, True))
    order = {record.path: i for i, record in enumerate(manifest.files)}
    return sorted(checks, key=lambda check: order[check.path])  # the manifest's order, as before


def fingerprint_problem(manifest: Manifest) -> str | None:
    """Why the manifest's fingerprint does not identify its files (an edited manifest), or None.

    Every writer derives the fingerprint from the listed paths and sha256 (:func:`usaf.artifacts.hashing.combine`),
    and consumers trust it as the artifact's identity (lineage checks, resume): one that no longer matches the
    listing would let files be swapped under an old identity.
    """
    combined = combine((record.path, record.sha256) for record in manifest.files)
    if combined == manifest.fingerprint:
        return None
    return (
        f"its fingerprint {manifest.fingerprint[:16]} does not match the sha256 of the files it lists "
        f"(they combine to {combined[:16]}): the manifest was edited"
    )


def edit_problem(manifest: Manifest) -> str | None:
    """Why the manifest is not as usaf wrote it (its content no longer matches its ``manifest_sha256``), or None.

    The files' hashes do not cover the manifest itself: an edited summary (a delta's trainable layers, a plan's lr)
    passed every check before, and a consumer then blamed the model or the data for what the edit said (found in
    review). A manifest an older usaf wrote has no checksum: nothing to compare, so None.
    """
    if manifest.manifest_sha256 is None or manifest_checksum(manifest, as_read=True) == manifest.manifest_sha256:
        return None
    stamped = manifest.manifest_sha256[:16]
    return f"edited after usaf wrote it (what it says no longer matches its manifest_sha256 {stamped})"


def manifest_problem(manifest: Manifest) -> str | None:
    """The first thing wrong with the manifest itself, its files aside: a file its kind always holds not listed, a
    fingerprint that is not its files', an edit since usaf wrote it; or None."""
    return listing_problem(manifest) or fingerprint_problem(manifest) or edit_problem(manifest)


def listing_problem(manifest: Manifest) -> str | None:
    """The first file this kind of artifact always holds that the manifest does not list, or None."""
    listed = {record.path for record in manifest.files}
    missing = [name for name in manifest.required_files() if name not in listed]
    if not missing:
        return None
    return f"does not list {', '.join(missing)}, which every '{manifest.kind}' artifact holds"


def unlisted_files(path: Path, manifest: Manifest) -> list[str]:
    """Files in the artifact directory that its manifest does not list (added after it was made)."""
    listed = {record.path for record in manifest.files} | {MANIFEST_NAME}
    root = Path(path)
    present = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink())
    return sorted(rel for rel in present if rel not in listed)


def load_verified(path: Path, expect: type[M], *, flag: str = "path", hashes: bool = True) -> M:
    """Load a manifest and refuse the artifact if any of its files is missing, truncated or changed, or if the
    manifest itself is wrong (:func:`manifest_problem`)."""
    manifest = load_manifest(path, expect, flag=flag)
    bad = [c for c in verify_files(path, manifest, hashes=hashes) if not c.ok]
    if bad:
        listing = "; ".join(f"{c.path}: {c.problem}" for c in bad[:5])
        raise UsafError(f"{flag} {path}: damaged artifact: {listing}", "re-run the stage that made it")
    problem = manifest_problem(manifest)
    if problem is not None:
        raise UsafError(f"{flag} {Path(path) / MANIFEST_NAME}: {problem}", "re-run the stage that made it")
    return manifest
