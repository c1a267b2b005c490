"""The frozen-prefix states ``usaf score`` keeps in its plan's store (the store's files are
:mod:`usaf.artifacts.prefix_store`'s); ``usaf train`` opens that store and keeps a per-run cache for the rest.

By default the store holds the calibration sample's states, which the scoring pass computed anyway
(:func:`write_sample_store`); with ``--cache``, every training sequence's (:func:`write_store`, which takes the
sample's states as they are and computes the others).

A store is only a speed-up: keys are content hashes (tokens, model fingerprint, first trainable layer,
dtype, library versions), so a store made on another device/dtype or for other data simply misses,
and every miss is computed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from usaf.artifacts import prefix_store
from usaf.artifacts.disk import check_free_space
from usaf.data.batches import collate
from usaf.data.tokens import TokenLine, iter_token_file
from usaf.errors import StopSignal, UsafError
from usaf.stages.progress import Progress

SAVE_EVERY_S = 60.0  # a --cache store's progress is saved this often (and at a stop request) for a resume


def write_store(
    engine,
    data_file: Path,
    out_dir: Path,
    *,
    model_fingerprint: str,
    vocab_size: int,
    pad_id: int,
    microbatch: int,
    progress: Progress,
    known: dict[str, torch.Tensor] | None = None,
    resume: dict[str, Any] | None = None,
    stop: Any = None,
    on_save: Callable[[dict[str, Any]], bool] | None = None,
) -> dict[str, int]:
    """Compute the prefix state of every sequence of ``data_file`` (batched) into ``out_dir``'s store; a sequence
    whose key ``known`` holds (the calibration sample's states, by key) is stored as it is there.

    Resumable: where no batch is pending (after a line stored from ``known``, or a batch computed), every
    ``SAVE_EVERY_S`` seconds and before a stop request (``stop.check()``) is raised, ``on_save`` gets the store's
    progress (``{"lines": lines of the file done, "store": StoreWriter.progress()}``); ``resume`` (one of those)
    goes on from there, byte for byte as a store written in one go, where the bytes it kept are those it recorded
    (their sha256); else the store starts over, with a note."""
    lengths = [len(line.input_ids) for line in iter_token_file(data_file, vocab_size=vocab_size)]
    total = len(lengths)
    device = next(engine.model.parameters()).device
    known = known or {}
    done = int(resume["lines"]) if resume else 0
    writer = prefix_store.StoreWriter(Path(out_dir) / prefix_store.STATES_FILE, resume=resume and resume["store"])
    if writer.doubt is not None:  # a changed byte that still reads as a number would be taken into the plan
        progress.note(f"{writer.states_path}: not as usaf wrote it ({writer.doubt}): the prefix store starts over")
        writer.restart()
        done = 0
    last_save = time.perf_counter()

    def save(lines: int) -> None:
        nonlocal last_save
        if on_save is not None:
            on_save({"lines": lines, "store": writer.progress()})
        last_save = time.perf_counter()

    def boundary(lines: int) -> None:
        """No batch pending after ``lines`` lines: save when it is time, or when a stop is requested."""
        if stop is not None:
            try:
                stop.check()
            except StopSignal:
                save(lines)
                raise
        if time.perf_counter() - last_save >= SAVE_EVERY_S:
            save(lines)

    def states():
        progress.start("prefix cache", total, "sequences", done=done)
        pending = []
        for n, line in enumerate(iter_token_file(data_file, vocab_size=vocab_size)):
            if n < done:
                continue
            key = engine.prefix_key(torch.tensor(line.input_ids), model_fingerprint) if known else None
            if key in known:
                yield key, known[key]
                progress.advance(1)
            else:
                pending.append(line)
                if len(pending) < microbatch:
                    continue
                yield from _batch_states(engine, pending, pad_id, device, model_fingerprint)
                progress.advance(len(pending))
                pending = []
            if not pending:
                boundary(n + 1)
        if pending:
            yield from _batch_states(engine, pending, pad_id, device, model_fingerprint)
            progress.advance(len(pending))
        progress.finish()

    meta = {"model_fingerprint": model_fingerprint, "start": engine.prefix.start}
    needed = sum(lengths[done:])
    try:
        for key, state in _room_checked(states(), out_dir, needed):
            writer.add(key, state)
    except BaseException:
        writer.abort()
        raise
    return writer.close(Path(out_dir) / prefix_store.INDEX_FILE, meta=meta)


def sample_states_by_key(engine, lines: list[TokenLine], states: dict[int, torch.Tensor], model_fingerprint: str):
    """The calibration sample's prefix states ``(t, H)`` (``states``: by line number) by their cache key."""
    return {
        engine.prefix_key(torch.tensor(line.input_ids), model_fingerprint): states[line.line]
        for line in lines
        if line.line in states
    }


def write_sample_store(
    engine, by_key: dict[str, torch.Tensor], out_dir: Path, *, model_fingerprint: str, progress: Progress
) -> dict[str, int] | None:
    """``by_key`` (the calibration sample's states) as ``out_dir``'s store; None, with a note, when the disk has
    no room for them: the states are a speed-up nobody asked for by name, not worth failing the plan."""
    if not by_key:
        return None
    needed = sum(state.numel() * state.element_size() for state in by_key.values())
    try:
        check_free_space(out_dir, needed, flag=None, what="the calibration sample's prefix states")
    except UsafError as e:
        progress.note(f"prefix states not kept in the plan: {e.message}")
        return None
    meta = {"model_fingerprint": model_fingerprint, "start": engine.prefix.start}
    return prefix_store.write_store(out_dir, by_key.items(), meta=meta)


def _room_checked(items, out_dir: Path, tokens: int):
    """The states, refused before the first is written when the store (tokens x H x element size) cannot fit."""
    for n, (key, state) in enumerate(items):  # state: (t, H)
        if n == 0:
            needed = tokens * state.shape[-1] * state.element_size()
            check_free_space(out_dir, needed, flag=None, what="the prefix states of --cache")
        yield key, state


def _batch_states(engine, lines, pad_id: int, device: torch.device, model_fingerprint: str):
    batch = collate(lines, pad_id)
    hidden = engine.prefix_states(batch.input_ids.to(device), batch.attention_mask.to(device))  # (B, T, H)
    for i, line in enumerate(lines):
        n = len(line.input_ids)
        yield engine.prefix_key(batch.input_ids[i, :n], model_fingerprint), hidden[i, :n]
