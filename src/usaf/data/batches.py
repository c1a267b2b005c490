"""Token sequences from a tokens artifact or JSONL file, sampled and padded into batches."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from usaf.data.packing import IGNORE_INDEX
from usaf.data.tokens import TokenLine, iter_token_file


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # (B, T) int64, right-padded
    labels: torch.Tensor  # (B, T) int64, -100 on padding
    attention_mask: torch.Tensor  # (B, T) int64, 1 on real tokens
    rows: tuple[int, ...] | None = None  # each row's index in its TokenDataset, where it came from one (training)

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())


def sample_lines(path: Path, count: int, *, seed: int, vocab_size: int, context: int | None = None) -> list[TokenLine]:
    """``count`` lines chosen uniformly at random in one pass (reservoir sampling), in file order.

    Memory holds ``count`` lines, not the file; every line is validated (:func:`iter_token_file`).
    """
    rng = random.Random(seed)
    reservoir: list[TokenLine] = []
    for seen, line in enumerate(iter_token_file(path, vocab_size=vocab_size, context=context)):
        if len(reservoir) < count:
            reservoir.append(line)
        else:
            j = rng.randrange(seen + 1)
            if j < count:
                reservoir[j] = line
    return sorted(reservoir, key=lambda line: line.line)


def collate(lines: list[TokenLine], pad_id: int = 0, *, rows: tuple[int, ...] | None = None) -> Batch:
    """Right-pad to the longest line; padding is masked out of attention and loss. ``rows``: see :class:`Batch`."""
    length = max(len(line.input_ids) for line in lines)
    ids = torch.full((len(lines), length), pad_id, dtype=torch.int64)
    labels = torch.full((len(lines), length), IGNORE_INDEX, dtype=torch.int64)
    mask = torch.zeros((len(lines), length), dtype=torch.int64)
    for i, line in enumerate(lines):
        n = len(line.input_ids)
        ids[i, :n] = torch.tensor(line.input_ids)
        labels[i, :n] = torch.tensor(line.labels)
        mask[i, :n] = 1
    return Batch(ids, labels, mask, rows)


def batches(lines: list[TokenLine], microbatch: int, pad_id: int = 0) -> Iterator[Batch]:
    for start in range(0, len(lines), microbatch):
        yield collate(lines[start : start + microbatch], pad_id)
