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
from usaf.data.packing import IGNORE_INDEX, scored_targets  # noqa: F401 (scored_targets: imported from here)
from usaf.errors import UsafError

MIN_SHIFT_EVIDENCE = 4  # scored positions needed before calling a line shifted


def labels_look_shifted(input_ids: list[int], labels: list[int]) -> bool:
    """True when labels match the *next* input token far more often than the same one.

    Repeated tokens (runs of spaces) match both ways, hence ratios instead of equality.
    """
    return shift_evidence(input_ids, labels) is True


def shift_evidence(input_ids: list[int], labels: list[int]) -> bool | None:
    """Whether the labels are pre-shifted (see :func:`labels_look_shifted`); None where the line is too short to
    tell (under ``MIN_SHIFT_EVIDENCE`` scored positions): a file's other lines decide it."""
    return _verdict(*_shift_counts(input_ids, labels))


def _shift_counts(input_ids: list[int], labels: list[int]) -> tuple[int, int, int]:
    """(labels equal to their own token, to the next token, scored positions) over the positions that have a next."""
    same = nxt = scored = 0
    for i in range(len(input_ids) - 1):
        label = labels[i]
        if label == IGNORE_INDEX:
            continue
        scored += 1
        same += label == input_ids[i]
        nxt += label == input_ids[i + 1]
    return same, nxt, scored


def _verdict(same: int, nxt: int, scored: int) -> bool | None:
    if scored < MIN_SHIFT_EVIDENCE:
        return None
    return nxt >= 0.9 * scored and same < 0.5 * scored


def file_looks_shifted(path: Path) -> bool | None:
    """Whether the first pre-tokenized line of ``path`` long enough to tell is pre-shifted: the original tool wrote
    whole files so, and its short lines (too short to tell alone) are shifted like the rest. In a file of short
    lines only, their positions together tell (a file of one 4-token shifted line was relabelled by nothing and
    said to have none; found in review); None where even they are too few."""
    pooled = [0, 0, 0]
    for _, obj, _ in iter_jsonl_objects(path):
        ids = obj.get("input_ids")
        labels = obj.get("labels", ids)
        if isinstance(ids, list) and isinstance(labels, list) and len(ids) == len(labels):
            counts = _shift_counts(ids, labels)
            verdict = _verdict(*counts)
            if verdict is not None:
                return verdict
            pooled = [a + b for a, b in zip(pooled, counts)]
    return _verdict(*pooled)


def unshift_labels(labels: list[int]) -> list[int]:
    """Pre-shifted -> unshifted: the target of position i moves to i+1; the first token has none."""
    return [IGNORE_INDEX, *labels[:-1]]


@dataclass(frozen=True)
class TokenLine:
    line: int
    input_ids: list[int]
    labels: list[int]
    source: str


def check_token_values(where: str, ids: list[int], labels: list[int], *, vocab_size: int) -> None:
    """Every id a token of the vocabulary, every label -100 or one (integers already checked).

    Raises:
        UsafError: naming ``where`` (``file:line``) and the first value out of range.
    """
    bad = next((v for v in ids if not 0 <= v < vocab_size), None)
    if bad is not None:
        raise UsafError(
            f"{where}: token id {bad} is outside the model's vocabulary (size {vocab_size})",
            f"token ids are 0 to {vocab_size - 1}: {IGNORE_INDEX} marks a label not scored, in labels, not input_ids"
            if bad < 0  # "tokenized for another model" was no cause of a negative id (found in review)
            else "the file was tokenized for another model; re-run `usaf tokenize --model` with this model",
        )
    if labels is ids or labels == ids:  # the common case (plain text): checked above, at C speed here
        return
    bad = next((v for v in labels if v != IGNORE_INDEX and not 0 <= v < vocab_size), None)
    if bad is not None:
        raise UsafError(
            f"{where}: label {bad} is neither {IGNORE_INDEX} (not scored) nor a token id of the model's vocabulary "
            f"(0 to {vocab_size - 1})",
            f"labels are the ids to predict, or {IGNORE_INDEX}; fix the line or re-tokenize with `usaf tokenize`",
        )


def check_length(where: str, length: int, context: int | None) -> None:
    """Refuse a sequence the model cannot take in one piece (positions it never saw; memory to match)."""
    if context is not None and length > context:
        raise UsafError(
            f"{where}: {length} tokens, longer than the model's context of {context} (max_position_embeddings)",
            f"tokenize the text with `usaf tokenize --seq-len {context}` or less; a pre-tokenized line goes in pieces "
            f"of {context} tokens or fewer",  # re-tokenizing such a line refused it again (found in review)
        )


def nothing_to_score(path: Path, cut: int | None = None) -> UsafError:
    """The error for a file whose sequences hold no target at all (train would run at loss 0, eval report nothing);
    ``cut``: where they are cut (train's ``--seq-len``), which left none."""
    if cut is not None:
        return UsafError(
            f"{path}: no token to learn from or to score in the first {cut} tokens of any sequence (--seq-len "
            f"{cut} cuts them there; every label before is {IGNORE_INDEX})",
            "raise --seq-len, or drop it to train on the sequences as tokenized",
        )
    return UsafError(
        f"{path}: no token to learn from or to score: every label is {IGNORE_INDEX} or every sequence is 1 token "
        "long (a sequence's first token has no earlier position to predict it)",
        "tokenize text whose labels are not all -100 (a chat needs assistant turns), in sequences of 2+ tokens",
    )


def iter_token_file(
    path: Path, *, vocab_size: int, context: int | None = None, cut: int | None = None
) -> Iterator[TokenLine]:
    """Read a tokens JSONL file (usaf's own or the original tool's format), validating each line.

    The one reader of token files: train, score, eval and the prefix cache all go through it, so the
    limits below hold in every stage. A file as a whole must have a position to score (lines without
    one are fine among others); that is checked when the last line has been read.

    Args:
        path: the tokens JSONL file.
        vocab_size: the model's vocabulary; ids must be below it, labels too (or -100).
        context: the model's longest sequence (``max_sequence_length``); ``None`` when unknown.
        cut: where the reader cuts every line (train's ``--seq-len``): the targets counted are those before it.

    Raises:
        UsafError: naming ``path:line`` for a malformed line, ids or labels outside the vocabulary, a line
            longer than ``context``, or pre-shifted labels; naming ``path`` for a file with nothing to score.
    """
    lines = scored = 0
    for number, obj, _ in iter_jsonl_objects(path, what="tokens JSONL"):
        where = f"{path}:{number}"
        ids = obj.get("input_ids")
        labels = obj.get("labels", ids)
        if not isinstance(ids, list) or not isinstance(labels, list) or len(ids) != len(labels) or not ids:
            # labels may be left out (the ids then): "needs 'input_ids' and 'labels'" was said of a line of text
            what = "no 'input_ids'" if ids is None else "needs 'input_ids' (and 'labels', if any) as equal-length"
            raise UsafError(
                f"{where}: {what} non-empty lists" if ids is not None else f"{where}: {what} (a list of token ids; "
                f"'labels' is optional); the keys are {', '.join(map(repr, list(obj)[:5]))}",
                "tokenize text or chat lines with `usaf tokenize`, and pass its output",
            )
        if not all(type(v) is int for v in ids) or not all(type(v) is int for v in labels):
            raise UsafError(f"{where}: 'input_ids'/'labels' must hold integers only", "fix the line")
        check_token_values(where, ids, labels, vocab_size=vocab_size)
        check_length(where, len(ids), context)
        if labels_look_shifted(ids, labels):
            raise UsafError(
                f"{where}: labels look pre-shifted (labels[i] == input_ids[i+1]); the model would learn "
                "to predict the token after next",
                "re-tokenize with `usaf tokenize FILE --fix-shifted-labels`",
            )
        lines += 1
        scored += scored_targets(labels if cut is None else labels[:cut])
        source = obj.get("source", path.name)
        yield TokenLine(number, ids, labels, source if isinstance(source, str) else str(source))
    if lines and not scored:  # an empty file is its caller's to name ("no sequences", "no held-out split")
        raise nothing_to_score(path, cut)
