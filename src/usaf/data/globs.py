"""``--include``/``--exclude`` patterns, read as a ``.gitignore`` reads its lines.

fnmatch's rules surprised users (found in review): its ``*`` crossed ``/`` (``src/*.py`` took ``src/tests/t.py``),
``**/*.py`` missed a file at the top, ``**/tests/**`` kept a top-level ``tests/``, and a directory name
(``--exclude tests``) matched no file. Now:

- a pattern without ``/`` (a trailing one aside) matches any one component of a file's path: a file name
  (``*.py``) or a directory's (``tests``), at any depth;
- a pattern with ``/`` matches the path under the directory input from its start, or the same path with the input's
  name in front (as sources are named: ``repo/tests/*``); ``*`` and ``?`` stay within one component, ``**`` spans
  any number of them, none included;
- a pattern that matches a directory matches everything under it;
- a name is also matched as itself, so ``app[1]`` names the directory ``app[1]``; names compare in Unicode NFC (a
  name copied from macOS is NFD).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from functools import cached_property


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


@dataclass(frozen=True)
class Glob:
    pattern: str

    @cached_property
    def _text(self) -> str:
        return nfc(self.pattern.strip("/"))

    @cached_property
    def anchored(self) -> bool:
        return "/" in self._text

    @cached_property
    def _regex(self) -> re.Pattern[str]:
        return re.compile(_translate(self._text))

    def matches(self, rel: str, root: str | None = None) -> bool:
        """Whether the file at ``rel`` (``/``-separated, under its input) matches; ``root``: the input's name."""
        rel = nfc(rel)
        if not self.anchored:
            return any(self._one(part) for part in rel.split("/"))
        paths = [rel] if root is None else [rel, f"{nfc(root)}/{rel}"]
        return any(self._one(prefix) for path in paths for prefix in _path_and_parents(path))

    def _one(self, text: str) -> bool:
        return text == self._text or self._regex.fullmatch(text) is not None


def matches_any(rel: str, globs: list[Glob], root: str | None = None) -> bool:
    return any(glob.matches(rel, root) for glob in globs)


def _path_and_parents(path: str) -> list[str]:
    """``a/b/c`` -> ``[a, a/b, a/b/c]``."""
    parts = path.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _translate(pattern: str) -> str:
    """A glob as a regular expression over a ``/``-separated path."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if pattern.startswith("**/", i):  # none or more directories
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("/**", i) and i + 3 == n:  # the directory and everything under it
            out.append("(?:/.*)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and (end := _class_end(pattern, i)) is not None:
            body = pattern[i + 1 : end]
            negated = body[:1] in ("!", "^")
            body = body[1:] if negated else body
            out.append(("[^/" if negated else "[") + body.replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def _class_end(pattern: str, start: int) -> int | None:
    """The index of the ``]`` closing the class opened at ``start`` (a ``]`` first in it is a member), or None."""
    i = start + 1
    if i < len(pattern) and pattern[i] in "!^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    end = pattern.find("]", i)
    return None if end < 0 else end
