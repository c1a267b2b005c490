"""Finding the documents of a corpus and the source each one belongs to.

A *source* is the unit that is held out as a whole (a repository, a package, a book), so that
held-out sequences never share a file with training ones. For a directory input the source of a
file is the input's name plus the first ``source_depth`` components of the file's path under it
(``cpython/Lib/json/decoder.py`` with depth 1 under ``Lib`` -> ``Lib/json``); for a single text
file it is the file's name; for a JSONL line it is the line's ``source_field`` (or ``repo``),
else the file's name.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from usaf.data.jsonl import iter_jsonl_objects
from usaf.errors import UsafError

SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__"})
JSONL_SUFFIXES = (".jsonl",)
_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    kind: Literal["text", "jsonl"]
    source: str  # for JSONL: the fallback source of lines without a source field
    bytes: int


@dataclass(frozen=True)
class Corpus:
    files: list[CorpusFile]
    skipped_binary: list[Path]

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)


@dataclass
class Document:
    source: str
    origin: str  # "path" or "path:line", for error messages
    nbytes: int
    from_jsonl: bool = False  # JSONL lines may interleave sources; files of a directory walk do not
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    labels: list[int] | None = None


def is_binary(path: Path) -> bool:
    """Git's rule: a NUL byte in the first 8 KiB means binary."""
    with path.open("rb") as f:
        return b"\0" in f.read(_SNIFF_BYTES)


def _matches(rel: str, patterns: list[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(name, p) for p in patterns)


def _walk_sorted(root: Path, exclude: list[str]) -> Iterator[tuple[Path, str]]:
    """``(path, relative posix path)`` of every file under ``root``, in sorted order.

    Directories that an exclude glob covers entirely (``site-packages/*``) are not entered.
    """
    top = str(root)
    for dirpath, dirnames, filenames in os.walk(top):
        rel_dir = os.path.relpath(dirpath, top).replace(os.sep, "/")
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not _matches(prefix + d + "/\0", exclude))
        for name in sorted(filenames):
            yield Path(dirpath, name), prefix + name


def discover(inputs: list[Path], *, include: list[str], exclude: list[str], source_depth: int) -> Corpus:
    """List the corpus files, sorted so that each source's files are contiguous.

    Raises:
        UsafError: a path that does not exist.
    """
    files: list[CorpusFile] = []
    skipped: list[Path] = []
    for given in inputs:
        if not given.exists():
            raise UsafError(f"{given}: no such file or directory", "check the input paths")
        if given.is_file():
            candidates = [(given, given.name, given.name)]
        else:
            root_name = given.resolve().name
            candidates = []
            for path, rel in _walk_sorted(given, exclude):
                parts = rel.split("/")
                source = "/".join([root_name, *parts[: max(source_depth, 0)]]) if source_depth else root_name
                candidates.append((path, rel, source))
        for path, rel, source in candidates:
            if include and not _matches(rel, include):
                continue
            if exclude and _matches(rel, exclude):
                continue
            if not path.is_file():
                continue
            if is_binary(path):
                skipped.append(path)
                continue
            kind: Literal["text", "jsonl"] = "jsonl" if path.name.endswith(JSONL_SUFFIXES) else "text"
            files.append(CorpusFile(path, kind, source, path.stat().st_size))
    files.sort(key=lambda f: f.source)  # stable: keeps walk order within a source
    return Corpus(files, skipped)


def read_text_document(file: CorpusFile, *, decode_errors: str) -> Document | None:
    """The file as one document; ``None`` if it is to be skipped (undecodable with 'skip')."""
    data = file.path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if decode_errors == "skip":
            return None
        if decode_errors == "replace":
            text = data.decode("utf-8", errors="replace")
        else:
            raise UsafError(
                f"{file.path}: not UTF-8 text (byte {e.start})",
                "exclude it with --exclude, or pass --decode-errors replace|skip",
            ) from None
    return Document(source=file.source, origin=str(file.path), nbytes=len(data), text=text)


def jsonl_document(
    file: CorpusFile, number: int, obj: dict[str, Any], nbytes: int, *, text_field: str, source_field: str
) -> Document:
    """Interpret one JSONL object: pre-tokenized, chat ``messages``, or a text field."""
    where = f"{file.path}:{number}"
    source = obj.get(source_field, obj.get("repo", file.source))
    if not isinstance(source, str) or not source:
        raise UsafError(f"{where}: '{source_field}' must be a non-empty string", "fix the line")
    if "input_ids" in obj:
        ids, labels = obj["input_ids"], obj.get("labels", obj["input_ids"])
        if not _int_list(ids) or not _int_list(labels) or len(ids) != len(labels) or not ids:
            raise UsafError(
                f"{where}: 'input_ids' and 'labels' must be equal-length non-empty lists of integers",
                "fix the line, or give raw text in a text field instead",
            )
        return Document(source, where, nbytes, True, input_ids=ids, labels=labels)
    if "messages" in obj:
        messages = obj["messages"]
        ok = (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        )
        if not ok:
            raise UsafError(
                f'{where}: \'messages\' must be a non-empty list of {{"role": str, "content": str}}',
                "fix the line",
            )
        return Document(source, where, nbytes, True, messages=messages)
    if text_field in obj:
        text = obj[text_field]
        if not isinstance(text, str):
            raise UsafError(f"{where}: '{text_field}' is a {type(text).__name__}, not a string", "fix the line")
        return Document(source, where, nbytes, True, text=text)
    keys = ", ".join(sorted(obj)) or "none"
    raise UsafError(
        f"{where}: no '{text_field}' field (keys: {keys})",
        "pass --text-field NAME, or give 'messages' (chat) or 'input_ids' (pre-tokenized)",
    )


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def iter_documents(file: CorpusFile, *, text_field: str, source_field: str, decode_errors: str) -> Iterator[Document]:
    if file.kind == "text":
        doc = read_text_document(file, decode_errors=decode_errors)
        if doc is not None:
            yield doc
        return
    for number, obj, nbytes in iter_jsonl_objects(file.path):
        yield jsonl_document(file, number, obj, nbytes, text_field=text_field, source_field=source_field)
