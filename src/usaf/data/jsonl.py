"""Streaming JSONL reading with errors that name ``file:line``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from usaf.errors import UsafError

_COMPACT = (",", ":")


def iter_jsonl_objects(path: Path, *, what: str = "JSONL") -> Iterator[tuple[int, dict[str, Any], int]]:
    """Yield ``(line_number, object, line_bytes)`` for each non-blank line; one object per line.

    Raises:
        UsafError: naming ``path:line`` for a line that is not valid JSON or not a JSON object,
            or for a file that is not UTF-8.
    """
    try:
        f = path.open("rb")
    except OSError as e:
        raise UsafError(f"{path}: cannot read it: {e.strerror}", "check the path and its permissions") from None
    with f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except UnicodeDecodeError:
                raise UsafError(f"{path}:{number}: not UTF-8 text", f"{what} files must be UTF-8") from None
            except json.JSONDecodeError as e:
                # past the line's last character json counts from its newline: a line cut short was "column 1" (review)
                end = len(e.doc.rstrip("\r\n"))
                where = "at the end of the line: cut short?" if e.pos >= end else f"at column {e.pos + 1}"
                raise UsafError(
                    # some of json's messages end in " at" ("Invalid control character at"): said "at at column"
                    f"{path}:{number}: not valid JSON ({e.msg.removesuffix(' at')} {where})",
                    f"each line of a {what} file must be one JSON object",
                ) from None
            except RecursionError:  # '[[[[...' nested deeper than Python's parser recurses
                raise UsafError(
                    f"{path}:{number}: JSON nested too deeply to read", f"each line of a {what} file must be flat"
                ) from None
            if not isinstance(obj, dict):
                raise UsafError(
                    f"{path}:{number}: a JSON {type(obj).__name__}, not an object",
                    f'each line of a {what} file must be one JSON object, e.g. {{"text": "..."}}',
                )
            yield number, obj, len(raw)


def dumps_sequence(input_ids: list[int], labels: list[int], source: str) -> str:
    """One line of a tokens file. A label list equal to its ids is serialised once (plain text)."""
    ids = json.dumps(input_ids, separators=_COMPACT)
    labs = ids if labels == input_ids else json.dumps(labels, separators=_COMPACT)
    return f'{{"input_ids":{ids},"labels":{labs},"source":{json.dumps(source, ensure_ascii=False)}}}\n'
