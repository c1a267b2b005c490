"""The prefix store a plan may hold (``usaf score --cache``): every training sequence's frozen-prefix state.

Two files in the plan directory: ``prefix_states.bin``, the raw tensors one after another, and
``prefix_index.json``, ``key -> [offset, shape, dtype]`` plus the meta (model fingerprint, first trainable
layer). Written once, then read through a memory map; entries are immutable, so any number of runs can
share a store. Keys are content hashes (:func:`usaf.engine.prefix.cache_key`): a store made for other
data, another device or dtype simply misses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

STATES_FILE = "prefix_states.bin"
INDEX_FILE = "prefix_index.json"

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


class PrefixStore:
    """Persistent prefix states: one binary file of raw tensors and a JSON index ``key -> [offset, shape, dtype]``.

    Written once (:meth:`write`), then read through a memory map; entries are immutable, so any number
    of runs can share a store.
    """

    def __init__(self, states_path: Path, index_path: Path) -> None:
        self.states_path = Path(states_path)
        index = json.loads(Path(index_path).read_text(encoding="utf-8"))
        self.meta = {k: v for k, v in index.items() if k != "entries"}
        self._entries = {k: (int(o), tuple(shape), _DTYPES[dt]) for k, (o, shape, dt) in index["entries"].items()}
        self._mmap: np.memmap | None = None

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> torch.Tensor | None:
        if key not in self._entries:
            return None
        if self._mmap is None:
            self._mmap = np.memmap(self.states_path, dtype=np.uint8, mode="r")
        offset, shape, dtype = self._entries[key]
        return read_state(self._mmap, offset, shape, dtype)

    @staticmethod
    def write(states_path: Path, index_path: Path, items, *, meta: dict) -> dict[str, int]:
        """Write ``(key, state (t, H))`` pairs; returns ``{"samples", "tokens", "bytes"}``."""
        entries: dict[str, list] = {}
        tokens = 0
        with Path(states_path).open("wb") as f:
            for key, state in items:
                if key in entries:
                    continue  # a repeated sequence: one state serves every occurrence
                state = state.detach().contiguous().cpu()
                entries[key] = [f.tell(), list(state.shape), str(state.dtype).removeprefix("torch.")]
                f.write(state.view(torch.uint8).numpy().tobytes())
                tokens += int(state.shape[0])
            size = f.tell()
            f.flush()
            os.fsync(f.fileno())
        Path(index_path).write_text(json.dumps({**meta, "entries": entries}), encoding="utf-8")
        return {"samples": len(entries), "tokens": tokens, "bytes": size}


def read_state(mmap: np.memmap, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` stored raw at ``offset`` of a byte memory map."""
    size = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(np.array(mmap[offset : offset + size]))
    return raw.view(dtype).reshape(shape)


def open_store(plan_dir: Path) -> PrefixStore | None:
    """The plan's prefix store, or None when the plan has none."""
    if not (Path(plan_dir) / INDEX_FILE).is_file():
        return None
    return PrefixStore(Path(plan_dir) / STATES_FILE, Path(plan_dir) / INDEX_FILE)


def write_store(plan_dir: Path, items, *, meta: dict) -> dict[str, int]:
    """Write ``(key, state (t, H))`` pairs as ``plan_dir``'s store; returns ``{"samples", "tokens", "bytes"}``."""
    return PrefixStore.write(Path(plan_dir) / STATES_FILE, Path(plan_dir) / INDEX_FILE, items, meta=meta)
