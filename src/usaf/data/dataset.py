"""Random access to a tokens JSONL file without holding it in memory (byte offsets of its lines)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch

from usaf.data.tokens import TokenLine, iter_token_file
from usaf.errors import UsafError


class TokenDataset:
    """Every line of a tokens file, validated once, then read back by index.

    The file is read through one handle, opened first and held while the dataset lives: a file put at its path later
    (``usaf tokenize --overwrite`` of the tokens a run trains on) is not what the run reads. Reopened by path, such a
    run crashed at its next read, or trained on the new file's lines at the old, unchecked offsets (found in review).

    Memory: 8 bytes per sequence (its offset), not the sequences themselves.
    """

    def __init__(self, path: Path, *, vocab_size: int, context: int | None = None, cut: int | None = None) -> None:
        """``cut``: where its reader cuts every line (train's ``--seq-len``): some target must lie before it."""
        self.path = Path(path)
        self._file = self.path.open("rb")  # closed with the dataset (close(), or when it is collected)
        self._lock = threading.Lock()  # one seek-and-read at a time on the shared handle
        # validates every line (ids and labels, lengths, no pre-shifted labels) and the file's targets
        lengths = [len(line.input_ids) for line in iter_token_file(self.path, vocab_size=vocab_size,
                                                                   context=context, cut=cut)]  # fmt: skip
        self.longest = max(lengths, default=0)  # tokens, before any cut
        self.tokens = sum(lengths)
        self.cut_tokens = sum(max(0, n - cut) for n in lengths) if cut is not None else 0  # what the cut drops
        offsets = []
        position = 0
        for raw in self._file:
            if raw.strip():
                offsets.append(position)
            position += len(raw)
        if _identity(os.fstat(self._file.fileno())) != _identity(os.stat(self.path)):  # what was validated is held
            self.close()
            raise UsafError(f"{self.path}: changed while it was read", "rerun once nothing writes to it")
        self.offsets = torch.tensor(offsets, dtype=torch.int64)
        self._order: tuple[tuple[int, int], torch.Tensor] | None = None  # ((seed, epoch), order)

    def close(self) -> None:
        self._file.close()

    def __del__(self) -> None:  # a dataset dropped unclosed closes its handle (no ResourceWarning)
        file = getattr(self, "_file", None)  # absent when opening failed
        if file is not None:
            file.close()

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> TokenLine:
        with self._lock:
            self._file.seek(int(self.offsets[index]))
            obj = json.loads(self._file.readline())
        ids = obj["input_ids"]
        return TokenLine(index + 1, ids, obj.get("labels", ids), obj.get("source", ""))

    def order(self, epoch: int, seed: int) -> torch.Tensor:
        """The shuffled order of one epoch, a pure function of (seed, epoch): resume needs no saved order."""
        if self._order is None or self._order[0] != (seed, epoch):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            self._order = ((seed, epoch), torch.randperm(len(self), generator=generator))
        return self._order[1]

    def samples_for_step(self, step: int, per_step: int, seed: int) -> list[TokenLine]:
        """The ``per_step`` sequences of global step ``step`` in the endless sequence of shuffled epochs."""
        return [self[i] for i in self.indices_for_step(step, per_step, seed)]

    def indices_for_step(self, step: int, per_step: int, seed: int) -> list[int]:
        """The dataset indices of :meth:`samples_for_step`'s sequences, in its order."""
        out = []
        for k in range(step * per_step, (step + 1) * per_step):
            epoch, position = divmod(k, len(self))
            out.append(int(self.order(epoch, seed)[position]))
        return out


def _identity(status: os.stat_result) -> tuple[int, int, int, int]:
    """A file's identity and version: another file at the path, or this one written to, changes it."""
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns
