"""Write a ``torch.load``-able file one entry at a time, holding one entry's tensors in memory.

Why: the quantized experts of a 30B MoE are ~15 GB, produced one layer at a time, and consumers load
them with ``torch.load(path, weights_only=True, mmap=True)``. ``torch.save`` needs the whole dict in
memory first. :class:`StreamingTorchSave` writes each tensor's bytes into the archive as soon as it
is added and keeps only a placeholder; at :meth:`~StreamingTorchSave.close` it pickles the small
top-level ``{name: entry}`` dict with the placeholders standing in for tensors.

The archive is what ``torch.serialization._save`` writes (torch 2.x zip format), built with the
same torch internals, which a test pins (byte-identical ``data.pkl`` and records versus
``torch.save`` of the same dict, and loading with ``weights_only=True`` and ``mmap=True``):

- ``torch._C.PyTorchFileWriter(file, compute_crc32, storage_alignment)`` with ``write_record`` and
  ``write_end_of_file``; options from ``torch.serialization.get_crc32_options`` and
  ``_get_storage_alignment``.
- records ``data/<key>`` (raw storage bytes, native byte order; keys "0", "1", ... in pickling
  order), ``data.pkl``, ``.format_version`` ("1"), ``.storage_alignment`` and ``byteorder``. The
  storages are written before ``data.pkl`` (torch writes it first); ``torch.load`` looks records
  up by name, so the order does not matter to it.
- a tensor pickles as ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
  requires_grad, OrderedDict())`` where ``storage`` is the persistent id
  ``("storage", torch.<Type>Storage, key, "cpu", numel)``, the legacy typed-storage class from
  ``torch.storage._dtype_to_storage_type_map`` (so only the dtypes in that map are accepted:
  bool, uint8, int8/16/32/64, float16, bfloat16, float32, float64, complex64/128).

Tensors are stored contiguous, on the CPU, as plain tensors owning exactly their bytes: a view is
copied first (``torch.save`` would write its whole base storage and keep the strides).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import sys
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.serialization import DEFAULT_PROTOCOL

from usaf.errors import take_signals

try:  # torch >= 2.5
    from torch.serialization import _get_storage_alignment, get_crc32_options
except ImportError:  # torch 2.4 (the DirectML configuration): crc32 always on, records aligned to 64 bytes
    _get_storage_alignment = get_crc32_options = None


def _storage_alignment() -> int:
    return 64 if _get_storage_alignment is None else _get_storage_alignment()


def _file_writer(file: Any) -> Any:
    if get_crc32_options is None:
        return torch._C.PyTorchFileWriter(file)
    return torch._C.PyTorchFileWriter(file, get_crc32_options(), _get_storage_alignment())


_TMP_TAG = ".usaf-tmp-"  # same tag as usaf.artifacts.writer, so stray temporaries are recognisable


@contextlib.contextmanager
def _stop_signals_deferred() -> Iterator[None]:
    """A stop signal (Ctrl-C, SIGTERM, SIGHUP) that arrives while a record is written is delivered after it.

    Raised inside the writer's call into the file, the signal's KeyboardInterrupt tore the archive the C++ writer was
    building; its destructor then wrote the zip's end over the torn record, threw, and the process aborted with a C++
    stack dump instead of stopping (``usaf quantize`` Ctrl-C'd while assembling experts_q4.pt; found in review).
    Main thread only (Python's rule for signal handlers); elsewhere signals are the main thread's anyway.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = take_signals(lambda signum, _frame: received.append(signum))  # an ignored one stays ignored
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if received:
            signal.raise_signal(received[0])  # to the handler it would have met, now that the record is whole


class _StorageRef:
    """Stands in for a storage already written as ``data/<key>``; pickled as a persistent id."""

    __slots__ = ("key", "storage_type", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key = key
        self.storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
        self.numel = numel


class _TensorRef:
    """Stands in for a tensor whose bytes are written; pickles exactly as ``Tensor.__reduce_ex__`` does."""

    __slots__ = ("storage", "size", "stride", "requires_grad")

    def __init__(self, storage: _StorageRef, size: tuple[int, ...], stride: tuple[int, ...], requires_grad: bool):
        self.storage, self.size, self.stride, self.requires_grad = storage, size, stride, requires_grad

    def __reduce__(self):
        args = (self.storage, 0, self.size, self.stride, self.requires_grad, OrderedDict())
        return torch._utils._rebuild_tensor_v2, args


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel)
        return None


class StreamingTorchSave:
    """Context manager writing ``{name: entry}`` to ``path`` entry by entry.

    The file is built under a temporary sibling name and renamed into place by :meth:`close`; an
    exception inside the ``with`` block (or :meth:`abort`) deletes it, so ``path`` is either
    complete or untouched.

    Example::

        with StreamingTorchSave(out / "experts_q4.pt") as archive:
            for name, q in quantized_layers():
                archive.add(name, q.to_dict())
        torch.load(out / "experts_q4.pt", weights_only=True, mmap=True)
    """

    def __init__(self, path: str | os.PathLike, *, before_rename: Callable[[Path], None] | None = None) -> None:
        """``before_rename``: called with the finished temporary's path just before it is renamed to ``path`` (to
        record its checksum: no moment then has the file in place without its record)."""
        self.path = Path(path)
        self._before_rename = before_rename
        self._tmp = self.path.with_name(f".{self.path.name}{_TMP_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._entries: dict[str, Any] = {}
        self._next_key = 0
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed in close()/abort())
        self._writer = _file_writer(self._file)

    def __enter__(self) -> StreamingTorchSave:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def add(self, name: str, entry: Any) -> None:
        """Write ``entry``'s tensors now and remember the rest under ``name``.

        ``entry``: a tensor, int, float, str, bool or None, or a dict/list/tuple of those (nested).

        Raises:
            ValueError: a repeated name, or the writer is closed.
            TypeError: a value or tensor dtype that cannot be stored.
        """
        if self._writer is None:
            raise ValueError(f"{self.path}: writer is closed")
        if not isinstance(name, str):
            raise TypeError(f"entry names must be str, got {type(name).__name__}")
        if name in self._entries:
            raise ValueError(f"{self.path}: entry {name!r} added twice")
        with _stop_signals_deferred():
            self._entries[name] = self._stash(entry, name)

    def close(self) -> None:
        """Write ``data.pkl`` and the format records, finish the archive and rename it into place."""
        if self._writer is None:
            raise ValueError(f"{self.path}: writer is closed")
        try:
            buf = _pickle(self._entries)
            w = self._writer
            with _stop_signals_deferred():
                w.write_record("data.pkl", buf, len(buf))
                if _get_storage_alignment is not None:  # torch 2.4's torch.save writes neither record
                    w.write_record(".format_version", "1", 1)  # 1: storages numbered, not sorted by name
                    alignment = str(_storage_alignment())
                    w.write_record(".storage_alignment", alignment, len(alignment))
                w.write_record("byteorder", sys.byteorder, len(sys.byteorder))
                w.write_end_of_file()
                self._writer = None
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            if self._before_rename is not None:
                self._before_rename(self._tmp)
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Discard the partial file (idempotent)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            # Finished here, failing or not: a writer whose write failed (a full disk) wrote the zip's end from its
            # destructor, which threw there, and the process aborted with a C++ stack dump (usaf score on a full disk;
            # found in review). A failed end still marks it finished, so the destructor then writes nothing.
            with contextlib.suppress(Exception):
                writer.write_end_of_file()
            del writer
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)
        self._entries = {}

    def _stash(self, value: Any, where: str) -> Any:
        """``value`` with every tensor written and replaced by a :class:`_TensorRef`."""
        if isinstance(value, torch.Tensor):
            return self._write_tensor(value, where)
        if isinstance(value, dict):
            return {k: self._stash(v, f"{where}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._stash(v, f"{where}[{i}]") for i, v in enumerate(value))
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"{where}: cannot store a {type(value).__name__}")

    def _write_tensor(self, t: torch.Tensor, where: str) -> _TensorRef:
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            raise TypeError(f"{where}: only dense tensors can be stored, got {t.layout}")
        if t.dtype not in torch.storage._dtype_to_storage_type_map():
            raise TypeError(f"{where}: dtype {t.dtype} is not supported")
        requires_grad = t.requires_grad
        t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view: store only its own bytes
        key = str(self._next_key)
        self._next_key += 1
        storage = t.untyped_storage()
        self._writer.write_record(f"data/{key}", storage, storage.nbytes())
        return _TensorRef(_StorageRef(key, t.dtype, t.numel()), tuple(t.shape), t.stride(), requires_grad)


def _pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()
