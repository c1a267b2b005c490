"""Tokenized sequences on disk (``train.jsonl``/``heldout.jsonl``) and the pre-shifted-labels trap.

A tokens line is ``{"input_ids": [...], "labels": [...], "source": "..."}`` with labels
*unshifted*: ``labels[i]`` is the target for the model's prediction made *at* position ``i-1``,
the Hugging Face convention (the model shifts internally). The original tool's README built labels
as ``chunk[1:] + [eos]`` — already shifted — which, fed to a Hugging Face model that shifts again,
trains it to predict the token after next. Such files are detected here and refused unless the
caller asks for them to be unshifted.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from usaf.data.jsonl import iter_jsonl_objects
from usaf.data.packing import IGNORE_INDEX
from usaf.errors import UsafError

_MIN_EVIDENCE = 4  # scored positions needed before calling a line shifted


def labels_look_shifted(input_ids: list[int], labels: list[int]) -> bool:
    """True when labels match the *next* input token far more often than the same one.

    Repeated tokens (runs of spaces) match both ways, hence ratios instead of equality.
    """
    same = nxt = scored = 0
    for i in range(len(input_ids) - 1):
        label = labels[i]
        if label == IGNORE_INDEX:
            continue
        scored += 1
        same += label == input_ids[i]
        nxt += label == input_ids[i + 1]
    return scored >= _MIN_EVIDENCE and nxt >= 0.9 * scored and same < 0.5 * scored


def unshift_labels(labels: list[int]) -> list[int]:
    """Pre-shifted -> unshifted: the target of position i moves to i+1; the first token has none."""
    return [IGNORE_INDEX, *labels[:-1]]


@dataclass(frozen=True)
class TokenLine:
    line: int
    input_ids: list[int]
    labels: list[int]
    source: str


def iter_token_file(path: Path, *, vocab_size: int | None = None, max_len: int | None = None) -> Iterator[TokenLine]:
    """Read a tokens JSONL file (usaf's own or the original tool's format), validating each line.

    Raises:
        UsafError: naming ``path:line`` for a malformed line, ids outside the vocabulary, a line
            longer than ``max_len``, or pre-shifted labels.
    """
    for number, obj, _ in iter_jsonl_objects(path, what="tokens JSONL"):
        where = f"{path}:{number}"
        ids = obj.get("input_ids")
        labels = obj.get("labels", ids)
        if not isinstance(ids, list) or not isinstance(labels, list) or len(ids) != len(labels) or not ids:
            raise UsafError(
                f"{where}: needs 'input_ids' and 'labels' as equal-length non-empty lists",
                "tokenize text with `usaf tokenize`",
            )
        if not all(type(v) is int for v in ids) or not all(type(v) is int for v in labels):
            raise UsafError(f"{where}: 'input_ids'/'labels' must hold integers only", "fix the line")
        if vocab_size is not None:
            bad = next((v for v in ids if not 0 <= v < vocab_size), None)
            if bad is not None:
                raise UsafError(
                    f"{where}: token id {bad} is outside the model's vocabulary (size {vocab_size})",
                    "the file was tokenized for another model; re-run `usaf tokenize --model` with this model",
                )
        if max_len is not None and len(ids) > max_len:
            raise UsafError(
                f"{where}: {len(ids)} tokens, longer than {max_len}", "re-tokenize with a smaller --seq-len"
            )
        if labels_look_shifted(ids, labels):
            raise UsafError(
                f"{where}: labels look pre-shifted (labels[i] == input_ids[i+1]); the model would learn "
                "to predict the token after next",
                "re-tokenize with `usaf tokenize FILE --fix-shifted-labels`",
            )
        source = obj.get("source", path.name)
        yield TokenLine(number, ids, labels, source if isinstance(source, str) else str(source))
