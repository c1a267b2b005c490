"""Finding the documents of a corpus and the source each one belongs to.

A *source* is the unit that is held out as a whole (a repository, a package, a book), so that
held-out sequences never share a file with training ones. For a directory input the source of a
file is the input's name plus the first ``source_depth`` components of the file's path under it
(``cpython/Lib/json/decoder.py`` with depth 1 under ``Lib`` -> ``Lib/json``); for a single text
file it is the file's name; for a JSONL line it is the line's ``source_field`` (or ``repo``),
else the file's name.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from usaf.artifacts.outputs import usaf_made
from usaf.data.globs import Glob
from usaf.data.ignore import default_skip, git_rules, is_repository_root
from usaf.data.jsonl import iter_jsonl_objects
from usaf.errors import UsafError, not_a

SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__"})
JSONL_SUFFIXES = (".jsonl", ".ndjson")  # .ndjson was tokenized as plain text, JSON syntax and all (found in review)
_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    kind: Literal["text", "jsonl"]
    source: str  # for JSONL: the fallback source of lines without a source field
    bytes: int
    walked: bool = False  # found under a directory input (not named): a .jsonl there may be a project's own data


@dataclass(frozen=True)
class Corpus:
    files: list[CorpusFile]
    skipped_binary: list[Path]
    skipped_links: list[Path] = field(default_factory=list)  # symbolic links not followed (--no-follow-symlinks)
    broken_links: list[Path] = field(default_factory=list)  # symbolic links to nothing
    # skipped by default (--all-files reads them), by reason (usaf.data.ignore): hidden, environment, gitignore
    skipped_default: dict[str, list[Path]] = field(default_factory=dict)
    skipped_usaf: list[Path] = field(default_factory=list)  # usaf's own outputs under a directory input, never read
    skipped_wide: list[Path] = field(default_factory=list)  # UTF-16/UTF-32 text under a directory input
    skipped_special: list[Path] = field(default_factory=list)  # pipes, sockets, devices under a directory input
    # inputs given whose file or directory an earlier input already gave (named twice, or under another): read once
    repeated_inputs: list[Path] = field(default_factory=list)
    # files --include/--exclude left out, and which of them were inputs given by name (said: left out in silence, a
    # JSONL named beside a .py under --include '*.py' looked read, and alone it was "no text or JSONL files"; review)
    filtered_out: list[Path] = field(default_factory=list)
    named_filtered_out: list[Path] = field(default_factory=list)
    unmatched_patterns: list[str] = field(default_factory=list)  # "--exclude tests" that matched no file or directory

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
    source_from_field: bool = False  # a JSONL line's own source, from --source-field (not 'repo' or its file)
    first: bool = True  # False: a later piece of a long text (usaf.data.cuts), continuing the one before
    last: bool = True  # False: more pieces of this text follow
    # fields of the line that hold text too but were not read: 'text' beside 'messages', which one line reads first
    unread_fields: tuple[str, ...] = ()


# Text in UTF-16 or UTF-32 has NUL bytes, so git's rule calls it binary: its byte-order mark tells it apart
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
              (b"\xfe\xff", "UTF-16"))  # fmt: skip


def wide_encoding(path: Path) -> str | None:
    """"UTF-16" or "UTF-32" where ``path`` starts with that byte-order mark, else None."""
    with path.open("rb") as f:
        head = f.read(4)
    return next((name for bom, name in _WIDE_BOMS if head.startswith(bom)), None)


def is_binary(path: Path) -> bool:
    """Git's rule: a NUL byte in the first 8 KiB means binary. The first read of every corpus file: one it may not
    read is refused here, naming it (it was a disk error's "pass a path you may write to"; found in review)."""
    try:
        with path.open("rb") as f:
            return b"\0" in f.read(_SNIFF_BYTES)
    except OSError as e:
        raise unreadable(path, e) from None


def unreadable(path: Path, e: OSError) -> UsafError:
    return UsafError(f"{path}: cannot be read ({e.strerror or e})",
                     "fix its permissions, or leave it out with --exclude")  # fmt: skip


def _first_match(rel: str, globs: list[Glob], root: str | None, matched: set[str]) -> bool:
    """Whether ``rel`` matches one of ``globs`` (:mod:`usaf.data.globs`); the pattern that did is added to ``matched``
    (a pattern that matched nothing is said: it was a no-op in silence, found in review)."""
    for glob in globs:
        if glob.matches(rel, root):
            matched.add(glob.pattern)
            return True
    return False


class _Walk:
    """Walks directory inputs once each: symbolic links followed (or counted), every real directory and file
    read once however many paths lead to it (a link to an ancestor, two links to one repository).

    Real entries come first: links are followed after the tree they sit in, so a link to a directory or file
    of the same tree is the duplicate, not the original.
    """

    def __init__(self, *, follow_symlinks: bool, all_files: bool = False) -> None:
        self.follow = follow_symlinks
        self.all_files = all_files  # False: skip what usaf.data.ignore names (hidden, environments, git's ignores)
        self.seen: set[tuple[int, int]] = set()  # (device, inode) of every directory and file read
        self.skipped_links: list[Path] = []  # not followed (--no-follow-symlinks)
        self.broken_links: list[Path] = []  # pointing at nothing
        self.skipped_default: dict[str, list[Path]] = {}  # reason -> paths (a directory once, not its files)
        self.skipped_usaf: list[Path] = []  # directories usaf made (artifacts, runs): whatever --all-files says

    def read_before(self, path: Path) -> bool:
        """Whether ``path``'s real file or directory was met already (by an earlier input, or under one)."""
        try:
            info = os.stat(path)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) in self.seen

    def first_visit(self, path: Path | str) -> bool:
        """True the first time ``path``'s real file or directory is met; False after, or when it cannot be read."""
        try:
            info = os.stat(path)
        except OSError:
            return False
        key = (info.st_dev, info.st_ino)
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def files(self, root: Path, excluded: Callable[[str], bool]) -> Iterator[tuple[Path, str]]:
        """``(path, relative posix path)`` of every file under ``root``, sorted within each directory.

        Directories ``excluded`` (their path under ``root``) are not entered: an exclude pattern that matches a
        directory matches everything under it (``site-packages``, ``build/*``).
        """
        queue = [(root, "")]  # the input, then each symlinked directory met, with its path under the input
        linked: list[tuple[Path, str]] = []  # symlinked files, read once the real ones are known
        while queue:
            top, base = queue.pop(0)
            yield from self._tree(top, base, excluded, queue, linked)
        for path, rel in linked:
            if self.first_visit(path):
                yield path, rel

    def _tree(
        self,
        top: Path,
        base: str,
        excluded: Callable[[str], bool],
        queue: list[tuple[Path, str]],
        linked: list[tuple[Path, str]],
    ) -> Iterator[tuple[Path, str]]:
        """The real files under ``top`` (``base`` + their path under it); links met are queued or counted."""
        if base and self._usaf_output(top):  # a linked directory (an input given by name was checked first)
            return
        rules = [] if self.all_files else [r for r in [git_rules(top, "")] if r is not None]
        for dirpath, dirnames, filenames in os.walk(top, onerror=_refuse_unreadable):
            if not self.first_visit(dirpath):  # a loop, or a directory another link or input already gave
                dirnames[:] = []
                continue
            rel_dir = os.path.relpath(dirpath, top).replace(os.sep, "/")
            local = "" if rel_dir == "." else rel_dir + "/"  # under top
            prefix = base + local  # under the input
            if local and not self.all_files and is_repository_root(Path(dirpath)):  # a nested repository's rules
                rules += [r for r in [git_rules(Path(dirpath), local)] if r is not None]
            kept = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not excluded(prefix + d))
            kept = [d for d in kept if not self._skipped_by_default(Path(dirpath, d), f"{local}{d}/", rules, True)]
            kept = [d for d in kept if not self._usaf_output(Path(dirpath, d))]
            dirnames[:] = [d for d in kept if not self._is_link(Path(dirpath, d), queue, f"{prefix}{d}/")]
            for name in sorted(filenames):
                path = Path(dirpath, name)
                if self._skipped_by_default(path, local + name, rules, False):
                    continue
                if not self._is_link(path, linked, prefix + name) and self.first_visit(path):
                    yield path, prefix + name

    def _skipped_by_default(self, path: Path, rel: str, rules: list, is_dir: bool) -> bool:
        """Whether ``path`` (``rel`` under the walked tree) is one :mod:`usaf.data.ignore` skips; recorded if so."""
        if self.all_files:
            return False
        reason = default_skip(path, rel, is_dir=is_dir, rules=rules)
        if reason is not None:
            self.skipped_default.setdefault(reason, []).append(path)
        return reason is not None

    def _usaf_output(self, directory: Path) -> bool:
        """Whether usaf made ``directory`` (recorded if so): a workspace's tokens, models, plans, runs and reports
        read back as the user's text put earlier training and held-out sequences into the corpus again as
        pre-tokenized lines, and manifests in as text (found in review; the workspace defaults to the current
        directory)."""
        if usaf_made(directory) is None:
            return False
        self.skipped_usaf.append(directory)
        return True

    def _is_link(self, path: Path, follow_later: list[tuple[Path, str]], rel: str) -> bool:
        """Whether ``path`` is a symbolic link; one to follow is queued, the others are counted."""
        if not path.is_symlink():
            return False
        if not path.exists():
            self.broken_links.append(path)
        elif self.follow:
            follow_later.append((path, rel))
        else:
            self.skipped_links.append(path)
        return True


def _refuse_unreadable(e: OSError) -> None:
    """A directory the walk may not list: its files were dropped in silence (found in review)."""
    raise unreadable(Path(e.filename), e)


def discover(
    inputs: list[Path],
    *,
    include: list[str],
    exclude: list[str],
    source_depth: int,
    follow_symlinks: bool = True,
    all_files: bool = False,
) -> Corpus:
    """List the corpus files, sorted so that each source's files are contiguous.

    Symbolic links under a directory input are followed unless ``follow_symlinks`` is False (then counted in
    :attr:`Corpus.skipped_links`); inputs given by name are always read. Under a directory input, hidden files
    and directories, environments and what git ignores are skipped unless ``all_files`` (:mod:`usaf.data.ignore`;
    counted in :attr:`Corpus.skipped_default`).

    Raises:
        UsafError: a path that does not exist.
    """
    files: list[CorpusFile] = []
    skipped: list[Path] = []
    wide: list[Path] = []  # UTF-16 or UTF-32 text under a directory input
    special: list[Path] = []  # pipes, sockets, devices under a directory input (skipped in silence; review)
    filtered: list[Path] = []  # left out by --include/--exclude
    named_filtered: list[Path] = []  # of those, inputs given by name
    walk = _Walk(follow_symlinks=follow_symlinks, all_files=all_files)
    includes, excludes = [Glob(p) for p in include], [Glob(p) for p in exclude]
    matched: set[str] = set()  # the patterns that matched a file or a directory
    for given in inputs:
        if not given.is_file() and not given.is_dir():  # a pipe was walked as a directory: "not a directory" (review)
            raise UsafError(f"{given}: {not_a(given, 'file or directory')}", "check the input paths")
    for given in inputs:
        if given.is_dir() and (made := usaf_made(given)) is not None:
            raise UsafError(
                f"{given}: {made}, not text to tokenize (a tokens artifact's lines are token ids already)",
                "pass a tokens artifact to score/train/eval as --data; to tokenize again, give the text it was made "
                "from",
            )
    names = input_names(inputs)
    repeated: list[Path] = []
    for given in inputs:
        if walk.read_before(given):  # read once, said (it was in silence: found in review)
            repeated.append(given)
            continue
        if given.is_file():
            candidates = [(given, names[given], names[given])] if walk.first_visit(given) else []
        else:
            root_name = names[given]
            candidates = []
            excluded = functools.partial(_first_match, globs=excludes, root=root_name, matched=matched)
            for path, rel in walk.files(given, excluded):
                parts = name_text(rel).split("/")
                source = "/".join([root_name, *parts[: max(source_depth, 0)]]) if source_depth else root_name
                candidates.append((path, rel, source))
        for path, rel, source in candidates:
            root = None if given.is_file() else names[given]
            if (includes and not _first_match(rel, includes, root, matched)) or _first_match(rel, excludes, root,
                                                                                             matched):  # fmt: skip
                filtered.append(path)
                if given.is_file():
                    named_filtered.append(path)
                continue
            if not path.is_file():  # a pipe, socket or device under a directory input: counted, not read
                if path.exists():
                    special.append(path)
                continue
            if is_binary(path):
                if (encoding := wide_encoding(path)) is None:
                    skipped.append(path)
                elif given.is_file():  # "1 binary file skipped" and a hint about --include (found in review)
                    raise UsafError(f"{path}: {encoding} text; usaf reads UTF-8",
                                    f"convert it: iconv -f {encoding} -t UTF-8 {path} > {path.stem}.utf8{path.suffix}")
                else:
                    wide.append(path)
                continue
            kind: Literal["text", "jsonl"] = "jsonl" if path.name.lower().endswith(JSONL_SUFFIXES) else "text"
            files.append(CorpusFile(path, kind, source, path.stat().st_size, walked=not given.is_file()))
    files.sort(key=lambda f: f.source)  # stable: keeps walk order within a source
    unmatched = [f"--include {p}" for p in include if p not in matched] + [
        f"--exclude {p}" for p in exclude if p not in matched]  # fmt: skip
    return Corpus(files, skipped, walk.skipped_links, walk.broken_links, walk.skipped_default, walk.skipped_usaf, wide,
                  special, repeated, filtered, named_filtered, unmatched)  # fmt: skip


def name_text(name: str) -> str:
    """A file name as text: the bytes of a name that is not UTF-8 (a Latin-1 name from an old archive; Python holds
    them as surrogate escapes, which no UTF-8 file can hold) shown as ``\\xNN``. A source name is a label, written
    into every sequence's line and the manifest: an escaped one crashed the write (found in review)."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def input_names(inputs: list[Path]) -> dict[Path, str]:
    """Each input's name as its sources begin: its own name, with as many parent names as tell it from another
    input of the same name (``pA/src`` and ``pB/src``, not one source ``src`` holding both; found in review)."""
    resolved = {given: given.resolve() for given in inputs}
    depth = dict.fromkeys(inputs, 1)

    def name(given: Path) -> str:
        return "/".join(resolved[given].parts[-depth[given] :])

    while True:
        by_name: dict[str, set[Path]] = {}
        for given in inputs:
            by_name.setdefault(name(given), set()).add(resolved[given])
        clashing = [g for g in inputs if len(by_name[name(g)]) > 1 and depth[g] < len(resolved[g].parts) - 1]
        if not clashing:
            return {given: name_text(name(given)) for given in inputs}
        for given in clashing:
            depth[given] += 1


def read_text_document(
    file: CorpusFile, *, decode_errors: str, on_undecodable: Callable[[Path], None] | None = None
) -> Document | None:
    """The file as one document; ``None`` if it is to be skipped (undecodable with 'skip'). A file that is not UTF-8,
    skipped or read with its bad bytes replaced, is handed to ``on_undecodable``, to be counted and said."""
    data = file.path.read_bytes()
    try:  # -sig: a byte-order mark opening the file (Windows editors write one) is no text (found in review)
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        if decode_errors in ("skip", "replace") and on_undecodable is not None:
            on_undecodable(file.path)
        if decode_errors == "skip":
            return None
        if decode_errors == "replace":
            text = data.decode("utf-8-sig", errors="replace")
        else:
            raise UsafError(
                f"{file.path}: not UTF-8 text (byte {e.start})",
                "exclude it with --exclude, or pass --decode-errors replace|skip",
            ) from None
    return Document(source=file.source, origin=str(file.path), nbytes=len(data), text=text)


def _refuse_lone_surrogates(value: Any, where: str) -> None:
    """JSON's ``\\ud800`` escapes decode to a string no UTF-8 writer or tokenizer takes (a traceback deep in the
    tokenizer or at the output, found in review): one line naming the file and line instead."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise UsafError(
                f"{where}: holds a lone surrogate escape (such as \\ud800), which is no Unicode text",
                "fix the line: a character outside the BMP is a surrogate pair, or write it as UTF-8",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_lone_surrogates(key, where)
            _refuse_lone_surrogates(item, where)
    elif isinstance(value, list) and not (value and isinstance(value[0], int)):  # token ids: no text to check
        for item in value:
            _refuse_lone_surrogates(item, where)


def jsonl_document(
    file: CorpusFile, number: int, obj: dict[str, Any], nbytes: int, *, text_field: str, source_field: str
) -> Document:
    """Interpret one JSONL object: pre-tokenized, chat ``messages``, or a text field."""
    where = f"{file.path}:{number}"
    _refuse_lone_surrogates(obj, where)
    source = obj.get(source_field, obj.get("repo", file.source))
    if not isinstance(source, str) or not source:
        raise UsafError(f"{where}: '{source_field}' must be a non-empty string", "fix the line")
    named = source_field in obj
    # one line is read by the first of these it holds; the others were dropped in silence (found in review)
    held = [key for key in dict.fromkeys(("input_ids", "messages", text_field)) if key in obj]
    unread = tuple(held[1:])
    if "input_ids" in obj:
        ids, labels = obj["input_ids"], obj.get("labels", obj["input_ids"])
        if not _int_list(ids) or not _int_list(labels) or len(ids) != len(labels) or not ids:
            raise UsafError(
                f"{where}: 'input_ids' and 'labels' must be equal-length non-empty lists of integers",
                "fix the line, or give raw text in a text field instead",
            )
        return Document(source, where, nbytes, True, input_ids=ids, labels=labels, source_from_field=named,
                        unread_fields=unread)
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
        return Document(source, where, nbytes, True, messages=messages, source_from_field=named, unread_fields=unread)
    if text_field in obj:
        text = obj[text_field]
        if not isinstance(text, str):
            kind = {"int": "an integer", "float": "a number", "bool": "a boolean", "list": "a list",
                    "dict": "an object", "NoneType": "null"}.get(type(text).__name__, type(text).__name__)  # "a int"
            raise UsafError(f"{where}: '{text_field}' is {kind}, not a string", "fix the line")
        return Document(source, where, nbytes, True, text=text, source_from_field=named)
    keys = ", ".join(sorted(obj)) or "none"
    hint = "pass --text-field NAME, or give 'messages' (chat) or 'input_ids' (pre-tokenized)"
    if file.walked:  # a repository's test fixture, say, not corpus lines (the hint sent its user to --text-field)
        hint += f"; or --exclude '{file.path.name}': a JSONL file under a directory input is read as corpus lines"
    raise UsafError(f"{where}: no '{text_field}' field (keys: {keys})", hint)


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def iter_documents(
    file: CorpusFile,
    *,
    text_field: str,
    source_field: str,
    decode_errors: str,
    on_undecodable: Callable[[Path], None] | None = None,
) -> Iterator[Document]:
    """The file's documents; a text file that is not UTF-8, skipped or read with its bad bytes replaced
    (``--decode-errors``), is handed to ``on_undecodable``, to be counted and said."""
    if file.kind == "text":
        doc = read_text_document(file, decode_errors=decode_errors, on_undecodable=on_undecodable)
        if doc is not None:
            yield doc
        return
    for number, obj, nbytes in iter_jsonl_objects(file.path):
        yield jsonl_document(file, number, obj, nbytes, text_field=text_field, source_field=source_field)
