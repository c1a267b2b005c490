"""The prefix store a plan may hold: frozen-prefix states of training sequences (``usaf score``: the calibration
sample's by default, every sequence's with ``--cache``).

Two files in the plan directory: ``prefix_states.bin``, the raw tensors one after another, and
``prefix_index.json``, ``key -> [offset, shape, dtype]`` plus the meta (model fingerprint, first trainable
layer). Written once, then read through a memory map; entries are immutable, so any number of runs can
share a store. Keys are content hashes (:func:`usaf.engine.prefix.cache_key`): a store made for other
data, another device or dtype simply misses.

The index is checked when the store is opened (:func:`open_store`): every entry a 2-D state of a known dtype
lying inside the states file, the whole agreeing with the plan's manifest (samples, tokens, bytes, dtype) and
with the model's hidden size. A truncated or edited store is refused by name instead of feeding the engine
states of the wrong size.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from usaf.artifacts.hashing import sha256_rest
from usaf.errors import UsafError

if TYPE_CHECKING:  # the record's module (plan) imports this one's names lazily
    from usaf.artifacts.plan import PrefixCacheRecord

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
        self.index_path = Path(index_path)
        index = _read_index(self.index_path)
        self.meta = {k: v for k, v in index.items() if k != "entries"}
        self._entries = {key: _entry(self.index_path, key, value) for key, value in index["entries"].items()}
        # Mapped now, with the index: mapped at the first read (after the model loaded, minutes at 30B), a plan
        # replaced meanwhile served its states under this index (found in review). An empty file cannot be mapped.
        empty = not self._entries or self.states_path.stat().st_size == 0
        self._mmap = None if empty else np.memmap(self.states_path, dtype=np.uint8, mode="r")

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> torch.Tensor | None:
        if key not in self._entries:
            return None
        offset, shape, dtype = self._entries[key]
        return read_state(self._mmap, offset, shape, dtype)

    @staticmethod
    def write(states_path: Path, index_path: Path, items, *, meta: dict) -> dict[str, int]:
        """Write ``(key, state (t, H))`` pairs; returns ``{"samples", "tokens", "bytes"}``."""
        writer = StoreWriter(states_path)
        try:
            for key, state in items:
                writer.add(key, state)
        except BaseException:
            writer.abort()
            raise
        return writer.close(index_path, meta=meta)


class StoreWriter:
    """A store written entry by entry, and resumable: :meth:`progress` is what has been written (entries, tokens,
    bytes, and those bytes' sha256), and a writer opened with it (``resume``) cuts the states file back to those bytes
    and appends after them, so a store written in two runs is byte-identical to one written in one.

    A resumed writer hashes the bytes it keeps: where they are not those the progress recorded (:attr:`doubt` says
    why), a changed byte that still reads as a number would enter the plan with fresh hashes, so the caller starts
    the store over (:meth:`restart`)."""

    def __init__(self, states_path: Path, *, resume: dict[str, Any] | None = None) -> None:
        self.states_path = Path(states_path)
        self.doubt: str | None = None
        if resume is None:
            self.restart()
            return
        self._file = self.states_path.open("r+b")
        self._file.truncate(int(resume["bytes"]))  # what a stop wrote after its last save
        self._sha256 = sha256_rest(self._file)
        self.entries: dict[str, list] = {key: list(value) for key, value in resume["entries"].items()}
        self.tokens = int(resume["tokens"])
        if "sha256" not in resume:
            self.doubt = "no checksum"  # saved by a usaf from before the record: the bytes cannot be vouched for
        elif resume["sha256"] != self._sha256.hexdigest():
            self.doubt = "its sha256 is not the one recorded"

    def restart(self) -> None:
        """Start the store over: an empty states file, nothing written."""
        if getattr(self, "_file", None) is not None:
            self._file.close()
        self._file = self.states_path.open("wb")
        self._sha256 = hashlib.sha256()
        self.entries = {}
        self.tokens = 0

    def add(self, key: str, state: torch.Tensor) -> None:
        if key in self.entries:
            return  # a repeated sequence: one state serves every occurrence
        state = state.detach().contiguous().cpu()
        self.entries[key] = [self._file.tell(), list(state.shape), str(state.dtype).removeprefix("torch.")]
        raw = state.view(torch.uint8).numpy().tobytes()
        self._file.write(raw)
        self._sha256.update(raw)
        self.tokens += int(state.shape[0])

    def progress(self) -> dict[str, Any]:
        """What is written, flushed to the disk: a resumed writer starts from it."""
        self._file.flush()
        os.fsync(self._file.fileno())
        return {"entries": dict(self.entries), "tokens": self.tokens, "bytes": self._file.tell(),
                "sha256": self._sha256.hexdigest()}  # fmt: skip

    def close(self, index_path: Path, *, meta: dict) -> dict[str, int]:
        """Finish the states file and write the index; ``{"samples", "tokens", "bytes"}``."""
        size = self.progress()["bytes"]
        self._file.close()
        Path(index_path).write_text(json.dumps({**meta, "entries": self.entries}), encoding="utf-8")
        return {"samples": len(self.entries), "tokens": self.tokens, "bytes": size}

    def abort(self) -> None:
        self._file.close()


def read_state(mmap: np.memmap, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` stored raw at ``offset`` of a byte memory map."""
    size = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(np.array(mmap[offset : offset + size]))
    return raw.view(dtype).reshape(shape)


def open_store(
    plan_dir: Path, record: PrefixCacheRecord | None, *, hidden_size: int | None = None, flag: str = "--plan"
) -> PrefixStore | None:
    """The plan's prefix store, checked against its manifest's ``record`` and the model's ``hidden_size``; None
    when the plan records none (``usaf score --no-cache``, or a usaf before the default store)."""
    if record is None:
        return None
    states, index = Path(plan_dir) / STATES_FILE, Path(plan_dir) / INDEX_FILE
    for path in (states, index):
        if not path.is_file():
            _refuse(flag, path, "missing, though the plan's manifest records a prefix store")
    store = PrefixStore(states, index)
    _check_entries(store, states.stat().st_size, flag=flag)
    _check_against(store, record, states.stat().st_size, hidden_size, flag=flag)
    return store


def _read_index(path: Path) -> dict[str, Any]:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        _refuse("--plan", path, f"unreadable index ({type(e).__name__}: {str(e)[:200]})")
    if not isinstance(index, dict) or not isinstance(index.get("entries"), dict):
        _refuse("--plan", path, "must be a JSON object with an 'entries' object")
    return index


def _entry(path: Path, key: str, value: object) -> tuple[int, tuple[int, ...], torch.dtype]:
    """One index entry ``[offset, [t, H], dtype]`` as ``(offset, shape, dtype)``, refused unless well formed."""

    def is_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not (isinstance(value, list) and len(value) == 3):
        _refuse("--plan", path, f"entry {key[:16]} must be [offset, shape, dtype], got {str(value)[:80]}")
    offset, shape, dtype = value
    if not (is_int(offset) and offset >= 0):
        _refuse("--plan", path, f"entry {key[:16]}: offset must be a non-negative integer, got {offset!r}")
    if not (isinstance(shape, list) and len(shape) == 2 and all(is_int(d) and d > 0 for d in shape)):
        _refuse("--plan", path, f"entry {key[:16]}: shape must be [tokens, hidden size], got {shape!r}")
    if dtype not in _DTYPES:
        _refuse("--plan", path, f"entry {key[:16]}: unknown dtype {dtype!r} (known: {', '.join(_DTYPES)})")
    return offset, tuple(shape), _DTYPES[dtype]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()


def _check_entries(store: PrefixStore, size: int, *, flag: str) -> None:
    """Every entry inside the states file (a truncated one would be read as a short state)."""
    for key, (offset, shape, dtype) in store._entries.items():
        if offset + _nbytes(shape, dtype) > size:
            _refuse(flag, store.index_path, f"entry {key[:16]} ends at byte {offset + _nbytes(shape, dtype):,}, "
                                            f"past the {size:,} bytes of {STATES_FILE}")  # fmt: skip


def _check_against(
    store: PrefixStore, record: PrefixCacheRecord, size: int, hidden_size: int | None, *, flag: str
) -> None:
    """The store as the plan's manifest records it, with states as wide as the model's."""
    if size != record.bytes:
        _refuse(flag, store.states_path, f"{size:,} bytes, the plan's manifest records {record.bytes:,}")
    entries = store._entries.values()
    tokens = sum(shape[0] for _, shape, _ in entries)
    if (len(entries), tokens) != (record.samples, record.tokens):
        _refuse(flag, store.index_path, f"{len(entries)} states of {tokens} tokens, the plan's manifest records "
                                        f"{record.samples} of {record.tokens}")  # fmt: skip
    for key, (_, shape, dtype) in store._entries.items():
        if str(dtype).removeprefix("torch.") != record.dtype:
            _refuse(flag, store.index_path, f"entry {key[:16]} is {dtype}, the plan's manifest records {record.dtype}")
        if hidden_size is not None and shape[1] != hidden_size:
            _refuse(flag, store.index_path, f"entry {key[:16]} is {shape[1]} wide, the model's hidden size is "
                                            f"{hidden_size}")  # fmt: skip
    if store.meta.get("start") != record.start:
        _refuse(flag, store.index_path, f"states entering layer {store.meta.get('start')!r}, the plan's manifest "
                                        f"records layer {record.start}")  # fmt: skip


def _refuse(flag: str, path: Path, problem: str) -> NoReturn:
    raise UsafError(f"{flag} {path}: {problem}", "the prefix store is damaged or was edited; re-run usaf score")


def write_store(plan_dir: Path, items, *, meta: dict) -> dict[str, int]:
    """Write ``(key, state (t, H))`` pairs as ``plan_dir``'s store; returns ``{"samples", "tokens", "bytes"}``."""
    return PrefixStore.write(Path(plan_dir) / STATES_FILE, Path(plan_dir) / INDEX_FILE, items, meta=meta)
