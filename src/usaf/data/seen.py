"""Which sequences are training sequences: token-id digests of a tokens file's lines, compared (``usaf eval``'s
held-out overlap, ``usaf train --eval-data``)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from usaf.data.tokens import iter_token_file

Progress = Any  # a usaf.stages.progress.Progress: the data layer imports no stage module


@dataclass(frozen=True)
class TrainingTokens:
    path: Path  # the train.jsonl of the tokens the run trained on, or the tokens JSONL it was given
    sequences: int | None  # None: not recorded (a JSONL file)


def sequence_digest(ids: Iterable[int]) -> bytes:
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


def found_in_training(
    sequences: Iterable[Iterable[int]], training: TrainingTokens, *, vocab_size: int, context: int | None,
    progress: Progress,
) -> int:  # fmt: skip
    """How many of ``sequences`` (token ids) are a line of the ``training`` tokens, each counted once
    (``usaf train --eval-data``: its held-out loss, on the training data, was reported as held-out; found in
    review)."""
    wanted: dict[bytes, int] = {}
    for ids in sequences:
        digest = sequence_digest(ids)
        wanted[digest] = wanted.get(digest, 0) + 1
    return sum(wanted.pop(digest, 0) for digest in training_digests(training, vocab_size, context, progress))


def training_digests(
    training: TrainingTokens, vocab_size: int, context: int | None, progress: Progress
) -> Iterator[bytes]:
    """Each training line's token-id digest, on a progress bar."""
    progress.start("checking held-out against the training tokens", training.sequences, "sequences")
    try:
        for line in iter_token_file(training.path, vocab_size=vocab_size, context=context):
            yield sequence_digest(line.input_ids)
            progress.advance(1)
    finally:
        progress.finish()
