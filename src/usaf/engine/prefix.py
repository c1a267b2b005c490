"""The frozen prefix: run the model from cached hidden states, and the cache that holds them.

When every layer below ``start`` is frozen, the hidden state entering layer ``start`` is a pure
function of the sample, so it is computed once and reused by every later forward. :class:`PrefixRunner`
does this *inside* the model's own forward, so that attention masks, rotary embeddings and each
family's quirks stay transformers' code: the prefix layers' ``forward`` is wrapped per instance to
pass their input through untouched while a cached state is being injected, and a pre-hook on layer
``start`` swaps its input for the cached state. Capturing works the other way round: a pre-hook on
layer ``start`` records its input and stops the forward there.

:class:`PrefixCache` keeps states in RAM up to a budget and spills the rest to a memory-mapped file.
Keys are content hashes (token ids, model fingerprint, ``start``, dtype, library versions), so a
changed model or setting never reuses a stale state. A cache is handed an opened, read-only
:class:`~usaf.artifacts.prefix_store.PrefixStore` (``usaf score`` writes one into its plan) and
consults it before computing; the store's files are :mod:`usaf.artifacts.prefix_store`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from usaf.artifacts.prefix_store import PrefixStore, read_state


class _StopForward(Exception):
    """Raised by the capture hook: the rest of the forward is not needed."""


class PrefixRunner:
    """Skip layers ``[0, start)`` of ``layers`` by injecting the hidden state that enters ``layers[start]``."""

    def __init__(self, layers: nn.ModuleList, start: int, *, returns_tuple: bool = False) -> None:
        """``returns_tuple``: the layers return ``(hidden, ...)`` (some transformers 4.x families), so a
        skipped layer returns ``(hidden, None)``: ``[0]`` is the state, attentions/router logits are None."""
        if not 0 < start < len(layers):
            raise ValueError(f"prefix start {start} must be inside 1..{len(layers) - 1}")
        self.start = start
        self._inject: torch.Tensor | None = None
        self._captured: torch.Tensor | None = None
        self._capturing = False
        for layer in layers[:start]:
            original = layer.forward

            def forward(hidden_states: torch.Tensor, *args: Any, _original=original, **kwargs: Any) -> torch.Tensor:
                if self._inject is not None:  # skipped: its output is replaced at layer `start` anyway
                    return (hidden_states, None) if returns_tuple else hidden_states
                return _original(hidden_states, *args, **kwargs)

            layer.forward = forward  # this instance only; the class is untouched
        layers[start].register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        hidden = args[0] if args else kwargs["hidden_states"]
        if self._capturing:
            self._captured = hidden.detach()
            raise _StopForward
        if self._inject is None:
            return None
        if self._inject.shape != hidden.shape:
            raise ValueError(f"cached prefix state {tuple(self._inject.shape)} != expected {tuple(hidden.shape)}")
        injected = self._inject.to(hidden.dtype)
        if args:
            return (injected, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": injected}

    @contextlib.contextmanager
    def injecting(self, hidden: torch.Tensor) -> Iterator[None]:
        """Within the block, model forwards start at layer ``start`` from ``hidden (B, T, H)``."""
        self._inject = hidden
        try:
            yield
        finally:
            self._inject = None

    @torch.no_grad()
    def capture(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """The hidden state ``(B, T, H)`` entering layer ``start`` for this batch."""
        self._capturing = True
        try:
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            self._capturing = False
        captured, self._captured = self._captured, None
        if captured is None:
            raise RuntimeError("the forward never reached the prefix boundary layer")
        return captured


class PrefixTap:
    """Records the hidden state entering ``layer`` on every forward, without stopping it (host copies).

    ``usaf eval``'s base pass runs every layer anyway; what enters the checkpoint's first trainable layer is
    the same in the fine-tuned model, so the fine-tuned pass can start there (``SparseEngine.injected``).
    """

    def __init__(self, layer: nn.Module) -> None:
        self.states: list[torch.Tensor] = []  # one (B, T, H) per forward, in host memory
        self._handle = layer.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.states.append(hidden.detach().to("cpu", copy=True))

    def close(self) -> None:
        self._handle.remove()


def padded_states(states: list[torch.Tensor], length: int) -> torch.Tensor:
    """Per-sample states ``(t_i, H)`` as one right-padded batch ``(B, length, H)``, zeros past each sample: a causal
    model's real tokens never see the padding, and its positions score nothing."""
    out = torch.zeros(len(states), length, states[0].shape[-1], dtype=states[0].dtype, device=states[0].device)
    for i, state in enumerate(states):
        out[i, : state.shape[0]] = state
    return out


def cache_key(tokens: torch.Tensor, *, model_fingerprint: str, start: int, dtype: torch.dtype) -> str:
    """Content hash of everything the cached state depends on."""
    # lazy: transformers (seconds to import) only for its version in the key; usaf.engine imports without it
    import transformers

    digest = hashlib.sha256()
    digest.update(tokens.to(torch.int64).cpu().numpy().tobytes())
    digest.update(f"|{tuple(tokens.shape)}|{model_fingerprint}|{start}|{dtype}".encode())
    digest.update(f"|torch {torch.__version__}|transformers {transformers.__version__}".encode())
    return digest.hexdigest()


class PrefixCache:
    """Hidden states by key: from a read-only :class:`PrefixStore` when given, else in RAM up to
    ``ram_budget_bytes``, then appended to a memory-mapped file. ``hits``/``misses`` count lookups by
    :meth:`SparseEngine.cached_prefix_states` (a miss is computed, never skipped)."""

    def __init__(self, ram_budget_bytes: int, spill_path: Path | None = None, *, store: PrefixStore | None = None):
        self.ram_budget_bytes = ram_budget_bytes
        self.spill_path = Path(spill_path) if spill_path is not None else None
        self.store = store
        self.hits = 0
        self.misses = 0
        self._ram: dict[str, torch.Tensor] = {}
        self._spilled: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}  # key -> (offset, shape, dtype)
        self._ram_bytes = 0
        self._spill_bytes = 0
        self._mmap: np.memmap | None = None
        self.drop_spill()  # what an earlier start spilled there indexes nothing now: appended to, it grew each start

    def drop_spill(self) -> None:
        """Delete the spill file and forget what it held (at the start, and when the run is done with it)."""
        self._mmap = None
        self._spilled.clear()
        self._spill_bytes = 0
        if self.spill_path is not None:
            self.spill_path.unlink(missing_ok=True)

    def __contains__(self, key: str) -> bool:
        return key in self._ram or key in self._spilled or (self.store is not None and key in self.store)

    def __len__(self) -> int:
        return len(self._ram) + len(self._spilled) + (len(self.store) if self.store is not None else 0)

    @property
    def nbytes(self) -> dict[str, int]:
        return {"ram": self._ram_bytes, "disk": self._spill_bytes}

    def put(self, key: str, state: torch.Tensor) -> None:
        state = state.detach().contiguous().cpu()
        size = state.numel() * state.element_size()
        if self._ram_bytes + size <= self.ram_budget_bytes or self.spill_path is None:
            self._ram[key] = state
            self._ram_bytes += size
            return
        raw = state.view(torch.uint8).numpy()
        with self.spill_path.open("ab") as f:
            offset = f.tell()
            f.write(raw.tobytes())
            f.flush()
            os.fsync(f.fileno())
        self._spilled[key] = (offset, tuple(state.shape), state.dtype)
        self._spill_bytes += size
        self._mmap = None  # the file grew: remap on the next read

    def forget(self, keys: Iterable[str]) -> None:
        """Drop these states (from RAM; a spilled one's bytes stay in the file, unindexed). The store's are never
        dropped."""
        for key in keys:
            if (state := self._ram.pop(key, None)) is not None:
                self._ram_bytes -= state.numel() * state.element_size()
            self._spilled.pop(key, None)

    def get(self, key: str) -> torch.Tensor | None:
        if key in self._ram:
            return self._ram[key]
        if key not in self._spilled:
            return self.store.get(key) if self.store is not None else None
        offset, shape, dtype = self._spilled[key]
        if self._mmap is None:
            self._mmap = np.memmap(self.spill_path, dtype=np.uint8, mode="r")
        return read_state(self._mmap, offset, shape, dtype)
