"""The manifest envelope every artifact shares, and the registry of artifact kinds.

An artifact is a directory whose ``manifest.json`` (written last) says what it is (``kind``,
``schema_version``), what made it (``usaf_version``, ``config``, ``environment``), from what
(``inputs`` with fingerprints) and what it holds (``files`` with sizes and sha256). A stage's
manifest subclasses :class:`Manifest`, fixes ``kind``/``schema_version`` and types ``summary``;
:func:`register` makes it known to the loader and to ``usaf inspect``.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from datetime import datetime
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from usaf._version import __version__
from usaf.artifacts.safety import unsafe_relative_path

MANIFEST_NAME = "manifest.json"


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class FileRecord(Record):
    path: str = Field(description="path relative to the artifact directory, '/'-separated")
    bytes: int = Field(ge=0)
    sha256: str

    @field_validator("path")
    @classmethod
    def _inside(cls, value: str) -> str:
        # A listed path is opened relative to the artifact: '../x' or '/x' would name a file outside it.
        problem = unsafe_relative_path(value)
        if problem is not None:
            raise ValueError(f"{value!r} escapes the artifact directory ({problem})")
        return value


class InputRecord(Record):
    role: str = Field(description="what the input is for: 'tokenizer', 'corpus', 'model', ...")
    kind: str = Field(description="an artifact kind, or 'hf_model', 'files', 'hub'")
    path: str
    fingerprint: str = Field(description="sha256 of the input's content (an artifact's own fingerprint)")


class EnvironmentRecord(Record):
    python: str
    platform: str
    usaf: str
    torch: str | None = None
    transformers: str | None = None
    tokenizers: str | None = None
    backend: str | None = None
    device: str | None = None
    dtype: str | None = None
    seed: int | None = None


class Manifest(Record):
    """The shared envelope. Subclasses set ``KIND``/``SCHEMA_VERSION`` and a typed ``summary``."""

    KIND: ClassVar[str] = ""
    SCHEMA_VERSION: ClassVar[int] = 0
    DESCRIPTION: ClassVar[str] = ""

    kind: str
    schema_version: int
    usaf_version: str
    created_at: datetime
    fingerprint: str = Field(description="sha256 over the files' paths and hashes: the artifact's identity")
    inputs: list[InputRecord]
    config: dict[str, Any] = Field(description="the resolved settings that made this artifact")
    environment: EnvironmentRecord
    files: list[FileRecord]
    summary: Any = None
    manifest_sha256: str | None = Field(
        None,
        description="sha256 of this manifest's other fields (manifest_checksum), so that an edit to it shows; "
        "None in a manifest an older usaf wrote (not checked then)",
    )

    def required_files(self) -> tuple[str, ...]:
        """Files every artifact of this kind holds; :func:`usaf.artifacts.loader.load_verified` refuses a manifest
        that does not list one (listed files are the ones checked, so an unlisted one would go unchecked)."""
        return ()

    def file(self, path: str) -> FileRecord:
        for record in self.files:
            if record.path == path:
                return record
        raise KeyError(path)


def manifest_checksum(manifest: Manifest, *, as_read: bool = False) -> str:
    """sha256 of what the manifest says, its own ``manifest_sha256`` left out: the fields as they read back from its
    JSON (what a consumer sees), keys sorted, so key order, spacing and a value's spelling do not count.

    ``as_read``: of a manifest loaded from its file, the fields the file holds only. A field a later usaf added (with
    its default) is not in an older file: counted, every artifact made before it read as "edited after usaf wrote
    it" (found in review, 2026-12-07: a tokens count added to the summary). A writer's manifest holds every field,
    and writes every one, so both readings agree on what usaf wrote since."""
    content = json.loads(manifest.model_dump_json(exclude={"manifest_sha256"}, exclude_unset=as_read))
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


M = TypeVar("M", bound=Manifest)

MANIFEST_KINDS: dict[str, type[Manifest]] = {}


def register(cls: type[M]) -> type[M]:
    """Class decorator: make an artifact kind known to the loader and ``usaf inspect``."""
    if not cls.KIND or cls.SCHEMA_VERSION < 1:
        raise TypeError(f"{cls.__name__} must set KIND and SCHEMA_VERSION")
    MANIFEST_KINDS[cls.KIND] = cls
    return cls


def current_environment(**extra: Any) -> EnvironmentRecord:
    """Versions of what produced an artifact; torch/transformers only if already imported."""

    def version_of(module: str) -> str | None:
        mod = sys.modules.get(module)
        return getattr(mod, "__version__", None) if mod else None

    return EnvironmentRecord(
        python=platform.python_version(),
        platform=platform.platform(),
        usaf=__version__,
        torch=version_of("torch"),
        transformers=version_of("transformers"),
        tokenizers=version_of("tokenizers"),
        **extra,
    )
