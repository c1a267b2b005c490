"""Batched first visits: the sequences a training sequence's frozen-prefix state is computed with (issue 21, item 3).

A first visit runs the frozen layers below the first trainable one and caches their output. Computed for several
sequences at once, the frozen layers' GEMMs are larger and, where the experts are dequantized on every forward,
each routed expert's dequantization is shared by the batch's sequences: 1.1-1.2× (2 sequences) to 1.6× faster
captures on the benchmarks' models, more at Qwen3-30B-A3B's ratios (docs/BENCHMARKS.md, "A first visit's prefix
capture"). But a state computed in a batch differs from one computed alone in the last bits, and a resumed run
recomputes states the straight run had cached (a revisit in a later epoch), so it must compute each with exactly
the same sequences to stay equal to the straight run bit for bit.

So every training sequence has one **company**: a run of consecutive positions of epoch 0's order, ``[c * size,
(c + 1) * size)`` with ``c`` its own position ``// size``, less those whose state the plan's store holds (read, never
computed). ``size`` is a whole number of microbatches (:func:`usaf.settings.train.company_size`): in the first
epoch a first visit computes its own microbatch and the next ones' up to the company's end, and those microbatches
find their states cached; a later miss recomputes the same company, in the same order. Its entries are cached
under the sequence's content key *and* the company (:func:`company_key`), so a sequence whose tokens repeat
elsewhere in the data, or in the held-out data (whose states are computed alone, as before), never takes a state
computed in other company. The size is the run's (kept in its state, so a resumed run has the same companies): an
out-of-memory retry shrinks the training microbatch, not the companies (their capture is then cut into pieces of
the smaller microbatch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from usaf.data.batches import Batch, collate
from usaf.data.dataset import TokenDataset
from usaf.data.tokens import TokenLine
from usaf.engine.prefix import PrefixCache, padded_states


@dataclass(frozen=True)
class Company:
    tag: str  # part of its members' cache keys
    rows: tuple[int, ...]  # dataset indices, in epoch 0's order


def company_key(key: str, company: Company) -> str:
    """The cache key of a state computed in ``company``: ``key`` (the content key) qualified by the company."""
    return f"{key}|{company.tag}"


class FirstEpochCompanies:
    """Each dataset index's :class:`Company`, from epoch 0's order (16 bytes per sequence)."""

    def __init__(self, data: TokenDataset, *, seed: int, size: int) -> None:
        # host bookkeeping in numpy: no tensor op that a device guard (DirectML's) would have to look at
        self.order = data.order(0, seed).numpy().copy()  # (N,) dataset index at each position of epoch 0
        self.position = np.argsort(self.order, kind="stable")  # (N,) each dataset index's position in epoch 0
        self.size = size
        # cache keys computed with a company before their own microbatch asked: that visit still counts as a miss
        # (a state this run computed for it), as when each microbatch was its own company
        self.ahead: set[str] = set()

    def of(self, row: int) -> Company:
        c = int(self.position[row]) // self.size
        members = self.order[c * self.size : (c + 1) * self.size]
        return Company(f"first-epoch company {c} of {self.size}", tuple(int(i) for i in members))


def company_prefix_states(
    engine: Any,
    batch: Batch,
    rows: Sequence[int],
    cache: PrefixCache,
    *,
    model_fingerprint: str,
    companies: FirstEpochCompanies,
    load: Callable[[Sequence[int]], list[TokenLine]],
    pad_id: int,
    chunk: int,
    forget: Callable[[int], bool] | None = None,
) -> torch.Tensor:
    """``(B, T, H)`` prefix states of a training microbatch: from the plan's store, else from the cache, else its
    company computed (and cached) at once. ``forget(row)``: the run never draws that dataset row again, so the state
    it took is dropped from the cache (kept, a one-epoch run filled its RAM and spilled gigabytes to disk for no hit:
    469 → 1,684 MiB in a reviewer's run).

    Args:
        batch: the microbatch, right-padded, on the engine's device; ``rows`` its dataset indices.
        load: dataset indices -> their lines, cut as training cuts them.
        chunk: the most sequences one capture runs (the company's size; the training microbatch after an
            out-of-memory retry made it smaller).
    """
    lengths = batch.attention_mask.sum(dim=1).tolist()
    keys = []  # (cache key, company) per row
    for i, (row, n) in enumerate(zip(rows, lengths)):
        key, company = engine.prefix_key(batch.input_ids[i, : int(n)], model_fingerprint), companies.of(row)
        stored = cache.store is not None and key in cache.store
        keys.append((key if stored else company_key(key, company), company))
    missing = [key not in cache for key, _ in keys]
    first_visits = [miss or key in companies.ahead for (key, _), miss in zip(keys, missing)]
    companies.ahead.difference_update(key for key, _ in keys)
    cache.misses += sum(first_visits)
    cache.hits += len(first_visits) - sum(first_visits)
    asked = {key for key, _ in keys}
    for (key, company), miss in zip(keys, missing):
        if miss and key not in cache:  # not computed with an earlier row's company
            companies.ahead.update(_compute(engine, cache, model_fingerprint, company, load, pad_id, chunk) - asked)
    states = [cache.get(key) for key, _ in keys]
    if forget is not None:  # the store's (not in the cache's own memory) are left alone
        cache.forget(key for (key, _), row in zip(keys, rows)
                     if forget(row) and (cache.store is None or key not in cache.store))  # fmt: skip
    return padded_states(states, batch.input_ids.shape[1]).to(batch.input_ids.device)


def _compute(engine, cache: PrefixCache, fingerprint: str, company: Company, load, pad_id: int, chunk: int) -> set:
    """Every member's state but the store's, computed together (in ``chunk``-sized pieces) and cached; the keys
    cached."""
    members = []
    for line in load(company.rows):
        key = engine.prefix_key(torch.tensor(line.input_ids), fingerprint)
        if cache.store is None or key not in cache.store:
            members.append((line, company_key(key, company)))
    device = engine.device
    cached = set()
    for start in range(0, len(members), chunk):
        piece = members[start : start + chunk]
        batch = collate([line for line, _ in piece], pad_id)
        states = engine.prefix_states(batch.input_ids.to(device), batch.attention_mask.to(device))  # (C, T, H)
        for (line, key), state in zip(piece, states):
            if key not in cache:  # a copy: a view would keep the whole batch's storage for one entry
                cache.put(key, state[: len(line.input_ids)].clone())  # (t, H)
                cached.add(key)
    return cached
