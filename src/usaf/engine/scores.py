"""Streaming importance scores over one fused expert tensor ``(E, O, I)`` (method §3 dense-score mode, §4).

What a slice contributes (one of :data:`~usaf.engine.statistics.STATISTICS`) is
:mod:`usaf.engine.statistics`; this module keeps the best of their sums.

Two modes
---------
``exact=True`` keeps a dense fp32 accumulator of the whole tensor: ``4·E·O·I`` bytes (e.g. 1.6 GB for
one Qwen3-30B-A3B layer's ``gate_up`` tensor, 128 × 1536 × 2048), allocated at the first ``add``.
Every result is exact (up to fp32 summation order). For tests, tiny models and machines with RAM to
spare.

The default pooled mode keeps about ``P = pool_factor × candidates`` (index, score) pairs — 12 bytes
each — plus ``counts`` and the two halves of ``error_bound`` (16 bytes per expert): O(P + E) memory,
independent of O·I. The pool is held **per expert** (one segment of local indices and scores per expert),
so one ``add`` of expert ``e`` (transient memory and time O(O·I + its segment)) never touches the
rest of the pool:

1. Pooled entries of expert ``e`` gather their full contribution from the slice (never truncated).
2. Of the other entries, only those that could enter the pool are kept: positive, above the pool's
   *floor* (its minimum score at the last eviction, 0 until the pool first filled), and at most ``P``
   of them (``torch.topk`` on the flattened slice).
3. They join expert ``e``'s segment.

Eviction is deferred: once the pool holds more than ``(1 + OVERFLOW) × P`` entries (and before any read,
state save excepted), the ``P`` best by score over all experts stay, in one vectorized pass, and the floor
becomes the new minimum. An evicted entry loses its history: if it re-enters later, it starts from that
later contribution. Deferring keeps every guarantee below: pooled scores only grow between evictions, so
the stale floor is at most the pool's true minimum (what an eviction at every add would have admitted is
admitted), what is refused or evicted is counted in ``error_bound`` as before, and entries held past ``P``
only keep more history. An add used to merge into one flat pool of ``P`` entries (a membership test and a
top-k over the whole pool per slice): O(E·P) per step, which grew with the square of the expert count
(docs/BENCHMARKS.md, "Reselection cost as experts grow").

Blocks. The grouped engine (:mod:`usaf.engine.grouped_deltas`) hands over consecutive experts at once
(:meth:`ScoreAccumulator.add_block`): the block's pooled entries gather, its entrants are found and its experts'
epochs turn over in one pass, a fixed number of ops per block where one add per expert cost about 23 ops and a
host sync. Two things differ from one add per expert, both within the guarantees below: the block's adds share
the floor as it stood before the block (a cut after one expert's add may have raised it for the next; a stale
floor is allowed, as above), and the block's entrants are held to ``P`` together, as one slice's are (entrants
beyond the block's ``P`` best could not all survive the next cut; one add per expert might keep some of them
until then). What is refused counts in ``error_bound`` like any refusal. When nothing is refused or cut, a
block is exactly its adds one by one.

Zero statistics are never pooled: they carry no evidence, so an expert that was never added has no
candidates. :func:`merge` unions pools (shared indices add) and keeps the ``P`` best the same way.

Exactness (pooled mode)
-----------------------
Contributions are non-negative and are only ever dropped, never invented, so every pooled score is a
*lower bound* of the element's true total, and an unpooled element's pooled score is 0.
``error_bound[e]`` is an upper bound on what any element of expert ``e`` may have lost. Split time
into *epochs* at the adds of expert ``e``: within one epoch an element loses at most one thing —
either its contribution at the add that opens the epoch (it did not get in) or its pooled score when
evicted (it cannot be evicted twice without re-entering, and it can only enter at an add of ``e``).
So ``error_bound[e]`` sums, over the epochs of ``e``, the largest contribution or pooled score of
``e`` dropped in that epoch, and for every element ``x`` of expert ``e``:
``pooled(x) <= true(x) <= pooled(x) + error_bound[e]`` (``pooled(x) = 0`` when ``x`` is not pooled).

``top(k)`` (``k <= P``) returns the true top-k with exact scores in any of these cases:

* **No loss**: the union of the supports (entries with a non-zero statistic) of all slices added has
  at most ``P`` elements. Nothing is truncated or evicted; ``error_bound`` stays 0.
* **Disjoint contributions**: every element receives a non-zero contribution from at most one
  ``add`` — e.g. one batch with one slice per expert (no microbatching). Slices of different experts
  are disjoint, so the pool is the exact running top-P of fixed totals, whatever ``P >= k``.
* **General sufficient condition**: every element of the true top-k set ``T`` enters the pool at its
  first non-zero contribution and is never evicted. Then ``T``'s scores are exact and every other
  pooled score is a lower bound of a total no larger than ``min(T)``.

Otherwise the result is an approximation: an element's score misses whatever it contributed before
its latest entry into the pool. Elements that are large consistently from the first batches enter
at once and stay; elements that become large only in late batches, or that hover around the pool
threshold, are under-scored (by at most ``error_bound[e]``). A larger ``pool_factor`` shrinks the
loss. :meth:`ScoreAccumulator.certified` checks at run time, from the bounds above, whether the top-k
set is provably the true one (a sufficient check: ``False`` does not mean the set is wrong).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from usaf.backends.transfer import device_capabilities, upload
from usaf.engine.score_sinks import ScoreSink
from usaf.engine.score_state import accumulator_state, restore_accumulator
from usaf.engine.selection_ops import kth_smallest, positions, positions_above
from usaf.engine.statistics import STATISTICS, slice_statistic

__all__ = ["OVERFLOW", "ScoreAccumulator", "best_by_score", "merge"]

# The pool is cut back to P entries once it holds more than (1 + OVERFLOW) x P (see the module docstring).
# Each cut is one pass over the pool; a larger margin means fewer of them while the pool fills (the first
# collecting step: about (1 / OVERFLOW) x ln(slices) cuts per tensor) and more memory held between them.
OVERFLOW = 0.5


class ScoreAccumulator:
    """Accumulated importance of one fused expert tensor ``(E, O, I)``, reduced to a pool of candidates.

    See the module docstring for the algorithm and exactly when results are exact.

    Attributes:
        shape: ``(E, O, I)``.
        candidates: the default ``k`` of :meth:`top`.
        statistic: one of :data:`STATISTICS`.
        capacity: pool size ``P = min(pool_factor × candidates, E·O·I)``.
        exact: dense fp32 accumulator instead of the pool.
        counts: ``(E,)`` int64, slices added per expert (routing frequency), in host memory.
        batches: number of :meth:`end_batch` calls.
        error_bound: ``(E,)`` fp32 in host memory (property), upper bound on the score any element of each expert may
            have lost (always 0 in exact mode).
        device: where the state lives; ``None`` until the first ``add`` adopts the gradient's device.
    """

    def __init__(
        self,
        shape: tuple[int, int, int],
        candidates: int,
        statistic: str = "grad",
        *,
        pool_factor: int = 4,
        exact: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        num_experts, out_features, in_features = (int(d) for d in shape)
        if min(num_experts, out_features, in_features) < 1:
            raise ValueError(f"shape must be positive (E, O, I), got {tuple(shape)}")
        if statistic not in STATISTICS:
            raise ValueError(f"unknown statistic {statistic!r}; expected one of {STATISTICS}")
        if candidates < 1 or pool_factor < 1:
            raise ValueError(f"candidates and pool_factor must be >= 1, got {candidates}, {pool_factor}")
        if candidates > num_experts * out_features * in_features:
            raise ValueError(f"candidates {candidates} exceed the {tuple(shape)} tensor's elements")
        self.shape = (num_experts, out_features, in_features)
        self.numel = num_experts * out_features * in_features
        self.candidates = int(candidates)
        self.statistic = statistic
        self.pool_factor = int(pool_factor)
        self.capacity = min(self.pool_factor * self.candidates, self.numel)
        self.exact = bool(exact)
        self.device = torch.device(device) if device is not None else None
        self.batches = 0
        where = self.device or torch.device("cpu")
        # Per-expert bookkeeping stays in host memory whatever the device: one add updates one element of
        # each, through numpy (a torch element update costs ~10 µs, and an add happens per routed expert).
        self.counts = torch.zeros(num_experts, dtype=torch.int64)
        # error_bound = closed epochs' losses + the running max loss of each expert's open epoch.
        self._closed_loss = torch.zeros(num_experts, dtype=torch.float32)
        self._epoch_loss = torch.zeros(num_experts, dtype=torch.float32)
        # The pool, one segment per expert: (n_e,) int64 local flat indices into (O, I), unordered, and
        # (n_e,) fp32 scores aligned with them; sum(n_e) <= (1 + OVERFLOW) x P + one slice's entrants.
        self._local: list[Tensor] = [torch.zeros(0, dtype=torch.int64, device=where)] * num_experts
        self._local_scores: list[Tensor] = [torch.zeros(0, dtype=torch.float32, device=where)] * num_experts
        self._pooled = 0  # sum(n_e)
        self._floor = torch.zeros((), dtype=torch.float32, device=where)  # admission threshold, see the docstring
        self._dense: Tensor | None = None  # (E, O, I) fp32, exact mode only, allocated at first add

    # ------------------------------------------------------------------ accumulation

    @torch.no_grad()
    def add(self, expert: int, grad: Tensor, weight: Tensor | None = None, *, scratch: bool = False) -> None:
        """Add the statistic of one expert slice.

        Args:
            expert: expert index ``e`` in ``[0, E)``.
            grad: ``(O, I)`` dense weight gradient of that expert (any float dtype, any device).
            weight: ``(O, I)`` base weight of the slice; needed for ``grad_x_weight``.
            scratch: ``grad`` is the caller's scratch and may be overwritten (the engine's score sink):
                the statistic is then computed in place, one ``(O, I)`` pass and allocation less.

        Raises:
            ValueError: wrong shape, missing weight, or a non-finite gradient (it would poison the
                ranking; skip such a batch before adding). Nothing is added then.
        """
        self._check_slice(grad)
        self.add_statistic(expert, slice_statistic(self.statistic, grad, weight, in_place=scratch).reshape(-1))

    @torch.no_grad()
    def add_statistic(self, expert: int, stat: Tensor) -> None:
        """Add one expert slice's statistic ``stat (O*I,)`` fp32, already computed; ``stat`` is this call's to edit.

        Raises:
            ValueError: wrong size, or a non-finite statistic (nothing is added then).
        """
        num_experts, out_features, in_features = self.shape
        expert = int(expert)
        if not 0 <= expert < num_experts:
            raise IndexError(f"expert {expert} out of range for {num_experts} experts")
        if stat.numel() != out_features * in_features:
            raise ValueError(f"statistic of {stat.numel()} elements is not one ({out_features}, {in_features}) slice")
        self._adopt(stat.device)
        stat = stat.to(self.device).reshape(-1)  # (O*I,)
        if self.exact:
            # One pass, not isfinite's three: max propagates NaN, and the statistic is never negative.
            if not bool(torch.isfinite(stat.max())):
                raise _non_finite(expert)
            self._dense[expert].view(-1).add_(stat)
        else:
            self._add_to_pool(expert, stat)  # checks finiteness on what it keeps, before it changes anything
        self.counts.numpy()[expert] += 1

    @torch.no_grad()
    def add_block(self, first: int, stats: Tensor, routed: Tensor) -> None:
        """Add the statistics of experts ``first .. first + e - 1`` at once, in a fixed number of ops.

        Args:
            first: the block's first expert.
            stats: ``(e, O*I)`` fp32, this call's to edit: row ``j`` is expert ``first + j``'s statistic.
            routed: ``(e,)`` bool on the host: the rows that are slices. The others are not added (their experts
                had no tokens: no count, no epoch), whatever they hold.

        The same as one :meth:`add_statistic` per routed row, except that the block's adds share one admission
        floor and one cut (see the module docstring's "Blocks"). Raises like :meth:`add_statistic`, naming the
        first expert whose statistic is not finite; nothing is added then.
        """
        num_experts, out_features, in_features = self.shape
        e = stats.shape[0]
        if stats.dim() != 2 or stats.shape[1] != out_features * in_features:
            raise ValueError(f"statistics {tuple(stats.shape)} are not rows of ({out_features}, {in_features}) slices")
        if not 0 <= first <= num_experts - e or tuple(routed.shape) != (e,):
            raise IndexError(f"a block of {e} experts from {first} ({tuple(routed.shape)} routed) out of {num_experts}")
        rows = positions(routed.cpu())  # (r,) on the host
        if not rows.numel():
            return
        self._adopt(stats.device)
        stats = stats.to(self.device)
        if rows.numel() < e:  # not slices: nothing of theirs is seen (not even a non-finite value)
            stats.index_fill_(0, upload(positions(~routed.cpu()), self.device), 0.0)
        if self.exact:
            if not bool(torch.isfinite(stats.max())):  # max propagates NaN; the statistic is never negative
                raise _non_finite(first + _first_non_finite_row(stats))
            self._dense[first : first + e].view(e, -1).add_(stats)
        else:
            self._add_block_to_pool(first, stats, rows)
        self.counts.numpy()[first + rows.numpy()] += 1

    @property
    def sink(self) -> ScoreSink:
        """This accumulator's :class:`~usaf.engine.score_sinks.ScoreSink`: ``sink(expert)(grad, weight)`` adds one
        slice (``grad`` a scratch it overwrites), ``sink.add_block`` a block of experts.

        It is what ``usaf.engine.trainable.TrainableTensor.score_sink`` takes.
        """
        return ScoreSink(self)

    def sink_with(self, other: ScoreAccumulator) -> ScoreSink:
        """Like :attr:`sink`, but every slice is added to this accumulator and to ``other`` (same shape and
        statistic): one gradient, its statistic computed once, two sums (``usaf score``'s sample and the
        stability half a batch belongs to)."""
        return ScoreSink(self, other)

    def _check_slice(self, grad: Tensor) -> None:
        _, out_features, in_features = self.shape
        if tuple(grad.shape) != (out_features, in_features):
            raise ValueError(f"grad {tuple(grad.shape)} is not one ({out_features}, {in_features}) expert slice")

    def end_batch(self) -> None:
        """Mark a batch boundary; optional.

        It only counts batches (for reports): the algorithm needs no boundary, because pooled entries
        take each slice's full contribution as it arrives.
        """
        self.batches += 1

    def _adopt(self, device: torch.device) -> None:
        # The first slice decides where the state lives, so a GPU engine keeps its pool on the GPU.
        if self.device is None:
            # The pool's bookkeeping (nonzero, index_add_, scatter_reduce_) needs index ops: on a device
            # without them (Capabilities.index_ops, DirectML) the state lives in host memory.
            device = torch.device(device)
            self.device = device if device_capabilities(device).index_ops else torch.device("cpu")
            self._to(self.device)
        if self.exact and self._dense is None:
            self._dense = torch.zeros(self.shape, dtype=torch.float32, device=self.device)

    def _to(self, device: torch.device) -> None:
        self._local = [t.to(device) for t in self._local]
        self._local_scores = [t.to(device) for t in self._local_scores]
        self._floor = self._floor.to(device)
        if self._dense is not None:
            self._dense = self._dense.to(device)

    def _add_to_pool(self, expert: int, stat: Tensor) -> None:
        """``stat (O*I,)``, this call's to edit: split into pooled, entering and lost, then committed."""
        # 1. Pooled entries of this expert take their whole contribution, however small.
        local, scores = self._local[expert], self._local_scores[expert]  # (m,), (m,)
        # index_select / index_fill_: an advanced-indexing read or write costs several times more on CPU
        gathered = stat.index_select(0, local)
        stat.index_fill_(0, local, 0)  # accounted for: not an entrant
        # 2. Entrants: only what could enter the pool (positive; above the floor once it has filled).
        enter = positions_above(stat, self._floor)  # (n,) local flat indices
        if enter.numel() > self.capacity:
            enter = enter[stat.index_select(0, enter).topk(self.capacity, sorted=False).indices]
        entering = stat.index_select(0, enter)
        stat.index_fill_(0, enter, 0)
        lost = stat.max()  # the largest contribution that found no place (0 if none)
        # Every non-finite value is in one of the three (NaN is never above the floor, and max keeps NaN),
        # and a sum of non-negative values is finite only if each is: checked on what is kept, instead
        # of in one more pass over the slice.
        if not math.isfinite(float(lost + gathered.sum() + entering.sum())):
            raise _non_finite(expert)
        # 3. Commit. An add of this expert opens its next epoch (see the module docstring): the last one
        #    closes, and the new one's first loss is `lost`. The entrants join this expert's segment; the
        #    pool is cut back to P only once it overflows.
        closed, epoch = self._closed_loss.numpy(), self._epoch_loss.numpy()  # fp32 views: fp32 arithmetic
        closed[expert] += epoch[expert]
        epoch[expert] = float(lost)
        self._local[expert] = torch.cat([local, enter])
        self._local_scores[expert] = torch.cat([scores + gathered, entering])
        self._pooled += enter.numel()
        if self._pooled > (1 + OVERFLOW) * self.capacity:
            self._evict()

    def _add_block_to_pool(self, first: int, stats: Tensor, rows: Tensor) -> None:
        """:meth:`_add_to_pool` for a block: ``stats (e, O*I)``, ``rows (r,)`` its routed rows (host int64)."""
        e, per_expert = stats.shape
        flat = stats.view(-1)  # (e*O*I,) block positions j*O*I + local
        # 1. Pooled entries of the block's experts take their whole contribution (unrouted ones' rows are 0).
        sizes = torch.tensor([t.numel() for t in self._local[first : first + e]])  # (e,) host
        owner = upload(torch.repeat_interleave(torch.arange(e), sizes), stats.device)  # (m,)
        pooled = torch.cat(self._local[first : first + e]) + owner * per_expert  # (m,) block positions
        gathered = flat.index_select(0, pooled)
        flat.index_fill_(0, pooled, 0)
        # 2. Entrants, over the whole block: at most `capacity` of them, as for one slice. More could not all stay
        #    at the next cut; the loop would have let a few stay until then.
        enter = positions_above(flat, self._floor)  # (n,) ascending: grouped by expert
        if enter.numel() > self.capacity:
            best = flat.index_select(0, enter).topk(self.capacity, sorted=False).indices
            enter = enter.index_select(0, best.sort().values)
        entering = flat.index_select(0, enter)
        flat.index_fill_(0, enter, 0)
        lost = stats.amax(dim=1)  # (e,) each expert's largest contribution that found no place
        if not math.isfinite(float(lost.sum() + gathered.sum() + entering.sum())):  # as in _add_to_pool
            bad = ~torch.isfinite(lost)
            bad[owner[~torch.isfinite(gathered)]] = True
            bad[enter[~torch.isfinite(entering)] // per_expert] = True
            raise _non_finite(first + int(positions(bad.cpu())[0]))
        # 3. Commit: each routed expert's epoch turns over; every segment of the block is rebuilt as its old
        #    entries (with what they gathered) then its entrants, the order one add per expert gives.
        closed, epoch = self._closed_loss.numpy(), self._epoch_loss.numpy()
        experts = first + rows.numpy()
        closed[experts] += epoch[experts]
        epoch[experts] = lost.cpu().numpy()[rows.numpy()]
        entrant_owner = enter // per_expert  # (n,)
        order = torch.cat([owner, entrant_owner]).argsort(stable=True)  # (m + n,)
        local = torch.cat([pooled, enter]).index_select(0, order).remainder_(per_expert)  # back to (O, I) positions
        old_scores = torch.cat(self._local_scores[first : first + e])
        scores = torch.cat([old_scores + gathered, entering]).index_select(0, order)
        new_sizes = (sizes + torch.bincount(entrant_owner, minlength=e).cpu()).tolist()
        self._local[first : first + e] = list(local.split(new_sizes))
        self._local_scores[first : first + e] = list(scores.split(new_sizes))
        self._pooled += enter.numel()
        if self._pooled > (1 + OVERFLOW) * self.capacity:
            self._evict()

    def _pool(self) -> tuple[Tensor, Tensor]:
        """The whole pool as it is: ``(indices, scores)``, ``(n,)`` flat int64 and fp32, grouped by expert."""
        per_expert = self.shape[1] * self.shape[2]
        where = self.device or torch.device("cpu")
        sizes = torch.tensor([t.numel() for t in self._local], dtype=torch.int64, device=where)  # (E,)
        experts = torch.repeat_interleave(torch.arange(self.shape[0], device=where), sizes)  # (n,)
        return torch.cat(self._local) + experts * per_expert, torch.cat(self._local_scores)

    def _set_pool(self, indices: Tensor, scores: Tensor) -> None:
        """Replace the pool by ``(indices, scores)`` ``(n,)`` flat, in any order (kept within each expert)."""
        per_expert = self.shape[1] * self.shape[2]
        experts = indices // per_expert
        order = experts.argsort(stable=True)  # grouped by expert, each group in its given order
        indices, scores, experts = indices[order], scores[order], experts[order]
        sizes = torch.bincount(experts, minlength=self.shape[0]).tolist()
        self._local = list((indices - experts * per_expert).split(sizes))
        self._local_scores = list(scores.split(sizes))
        self._pooled = indices.numel()

    def _evict(self) -> None:
        """Keep the ``capacity`` best of the pool; the largest evicted score per expert joins its open epoch.

        The cut is one k-th value, not a top-k with its indices; among scores equal to the cut the
        earlier in pool order stay. Positions map to experts through the segments' ends, so no per-entry
        expert vector is built.
        """
        scores = torch.cat(self._local_scores)  # (n,) grouped by expert
        excess = scores.numel() - self.capacity
        if excess <= 0:
            return
        cut = kth_smallest(scores, excess)  # at most capacity scores lie above it
        keep = scores > cut  # (n,)
        short = self.capacity - int(torch.count_nonzero(keep))
        if short > 0:
            keep[positions(scores == cut)[:short]] = True
        sizes = torch.tensor([t.numel() for t in self._local], device=scores.device)  # (E,)
        evicted = positions(~keep)  # (excess,)
        owner = torch.searchsorted(sizes.cumsum(0), evicted, right=True)  # (excess,) the expert of each
        dropped = torch.zeros(self.shape[0], dtype=torch.float32, device=scores.device)  # (E,)
        dropped.scatter_reduce_(0, owner, scores.index_select(0, evicted), reduce="amax")
        torch.maximum(self._epoch_loss, dropped.cpu(), out=self._epoch_loss)
        kept = (sizes - torch.bincount(owner, minlength=self.shape[0])).tolist()  # a mask keeps the grouping
        stay = positions(keep)
        local, scores = torch.cat(self._local).index_select(0, stay), scores.index_select(0, stay)
        self._local, self._local_scores = list(local.split(kept)), list(scores.split(kept))
        self._pooled = scores.numel()
        self._floor = scores.min()

    def _settle(self) -> None:
        """Cut the pool back to ``capacity`` before it is read (a no-op when it already fits)."""
        if not self.exact and self._pooled > self.capacity:
            self._evict()

    # ------------------------------------------------------------------ results

    @torch.no_grad()
    def dense_map(self) -> Tensor:
        """The full ``(E, O, I)`` statistic (exact mode only; zeros if nothing was added)."""
        if not self.exact:
            raise ValueError("a dense map exists only in exact mode")
        return self._dense if self._dense is not None else torch.zeros(self.shape, dtype=torch.float32)

    def ranked(self) -> tuple[Tensor, Tensor]:
        """All pooled candidates (exact mode: the ``capacity`` best), by score descending.

        Returns:
            ``(indices, scores)``: ``(n,)`` int64 flat indices and ``(n,)`` fp32 scores, ``n <= capacity``;
            only positive scores; equal scores in ascending index order.
        """
        if self.exact:
            if self._dense is None:
                return self._empty()
            scores, indices = self._dense.view(-1).topk(self.capacity)
            positive = scores > 0
            indices, scores = indices[positive], scores[positive]
        else:
            self._settle()
            indices, scores = self._pool()
        by_index = indices.argsort()
        indices, scores = indices[by_index], scores[by_index]
        # Stable sort on score after ordering by index: ties come out in ascending index order.
        order = scores.sort(descending=True, stable=True).indices
        return indices[order].clone(), scores[order].clone()

    @torch.no_grad()
    def pool_entries(self) -> tuple[Tensor, Tensor]:
        """Every pooled candidate (exact mode: the ``capacity`` best), unordered.

        Returns:
            ``(indices, scores)``: ``(n,)`` int64 flat indices and ``(n,)`` fp32 scores, ``n <= capacity``;
            only positive scores. Cheaper than :meth:`ranked` (no sort): for callers that pick from it.
        """
        if self.exact:
            if self._dense is None:
                return self._empty()
            scores, indices = self._dense.view(-1).topk(self.capacity, sorted=False)
            positive = scores > 0
            return indices[positive], scores[positive]
        self._settle()
        return self._pool()

    @torch.no_grad()
    def top(self, k: int | None = None) -> tuple[Tensor, Tensor]:
        """The ``k`` best candidates by score, returned in ascending index order (as ``SparseDelta`` wants).

        Args:
            k: how many; default ``candidates``. Pooled mode requires ``k <= capacity``.

        Returns:
            ``(indices, scores)``: ``(n,)`` int64 sorted ascending and their fp32 scores, ``n <= k``.
            ``n < k`` when fewer than ``k`` elements have a positive score: callers must check
            (selecting fewer weights than asked should fail loudly, method §4). Equal scores at the
            cut: the smaller indices, as in :meth:`ranked`.
        """
        k = self.candidates if k is None else int(k)
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if self.exact and self._dense is not None and k > self.capacity:
            scores, indices = self._dense.view(-1).topk(min(k, self.numel))
            positive = scores > 0
            indices, scores = indices[positive], scores[positive]
            order = indices.argsort()
            return indices[order], scores[order]
        if not self.exact and k > self.capacity:
            raise ValueError(f"k={k} exceeds the pool of {self.capacity}; raise pool_factor")
        indices, scores = self.pool_entries()
        chosen = best_by_score(indices, scores, k)
        return indices[chosen], scores[chosen]

    @torch.no_grad()
    def certified(self, k: int | None = None) -> bool:
        """Whether the set returned by ``top(k)`` is provably the true top-k (ties aside).

        True when the k-th pooled score (a lower bound of every selected total) is at least every
        unselected element's upper bound ``pooled + error_bound[expert]``. Always true in exact mode.
        """
        if self.exact:
            return True
        k = self.candidates if k is None else int(k)
        indices, scores = self.ranked()
        if k == 0:
            return True
        # With fewer than k positives, every unselected total must be provably 0.
        kth = float(scores[k - 1]) if scores.numel() >= k else 0.0
        per_expert = self.shape[1] * self.shape[2]
        bound = self.error_bound.to(scores.device)
        rest = scores[k:] + bound[indices[k:] // per_expert]
        ceiling = max(float(bound.max()), float(rest.max()) if rest.numel() else 0.0)
        return kth >= ceiling

    @property
    def error_bound(self) -> Tensor:
        """``(E,)`` fp32 in host memory: what any element of each expert may have lost (see the module docstring).

        Read after cutting the pool back to ``capacity``, like every result.
        """
        self._settle()
        return self._closed_loss + self._epoch_loss

    @property
    def nbytes(self) -> int:
        """Bytes of accumulated state held now (pool, counts, bounds; the dense array in exact mode)."""
        tensors = [self.counts, self._closed_loss, self._epoch_loss, *self._local, *self._local_scores]
        if self._dense is not None:
            tensors.append(self._dense)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _empty(self) -> tuple[Tensor, Tensor]:
        return self._local[0][:0].clone(), self._local_scores[0][:0].clone()

    # ------------------------------------------------------------------ in-memory snapshot

    def snapshot(self) -> dict[str, Any]:
        """The state as it is now, for :meth:`restore` (a training step that failed discards its partial scores).

        Cheap: the pool's segments are never edited in place (an add or a cut replaces them), so they are shared,
        not copied; only the per-expert bookkeeping (O(E)) and exact mode's dense map are. Use :meth:`state_dict`
        for anything that leaves the process.
        """
        return {
            "device": self.device,
            "batches": self.batches,
            "bookkeeping": (self.counts.clone(), self._closed_loss.clone(), self._epoch_loss.clone()),
            "pool": (list(self._local), list(self._local_scores), self._pooled, self._floor),
            "dense": None if self._dense is None else self._dense.clone(),
        }

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Return to a :meth:`snapshot` of this accumulator (it may be restored again later)."""
        self.device, self.batches = snapshot["device"], snapshot["batches"]
        self.counts, self._closed_loss, self._epoch_loss = (t.clone() for t in snapshot["bookkeeping"])
        local, local_scores, self._pooled, self._floor = snapshot["pool"]
        self._local, self._local_scores = list(local), list(local_scores)
        self._dense = None if snapshot["dense"] is None else snapshot["dense"].clone()

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        """Plain ints/str/bool and CPU tensors (copies), loadable with ``torch.load(weights_only=True)``."""
        return accumulator_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the configuration must match this accumulator's."""
        restore_accumulator(self, state)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device | str | None = None) -> ScoreAccumulator:
        """A new accumulator restored from :meth:`state_dict` (e.g. one gathered from another rank)."""
        acc = cls(
            tuple(state["shape"]),
            int(state["candidates"]),
            state["statistic"],
            pool_factor=int(state["pool_factor"]),
            exact=bool(state["exact"]),
            device=device,
        )
        acc.load_state_dict(state)
        return acc


def best_by_score(indices: Tensor, scores: Tensor, k: int) -> Tensor:
    """Positions of the ``k`` largest ``scores``, equal scores to the smaller index; by index ascending.

    The same set as the first ``k`` of a sort by score (descending) that breaks ties by index, in O(n)
    plus a sort of the ties at the cut: a top-k, not a sort of the whole pool.

    Args:
        indices: ``(n,)`` int64, distinct.
        scores: ``(n,)`` aligned with them.
        k: how many (all ``n`` when ``k >= n``).

    Returns:
        ``(min(k, n),)`` int64 positions into ``indices``, ordered so that ``indices[positions]`` ascends.
    """
    n = indices.numel()
    if k >= n:
        chosen = torch.arange(n, device=indices.device)
    elif k <= 0:
        chosen = torch.zeros(0, dtype=torch.int64, device=indices.device)
    else:
        cut = scores.topk(k, sorted=False).values.min()  # the k-th largest score
        above = (scores > cut).nonzero().squeeze(1)
        tied = (scores == cut).nonzero().squeeze(1)
        tied = tied[indices[tied].argsort()][: k - above.numel()]
        chosen = torch.cat([above, tied])
    return chosen[indices[chosen].argsort()]


def _first_non_finite_row(stats: Tensor) -> int:
    """The first row of ``stats (e, n)`` holding a non-finite value (an error path: its cost does not matter)."""
    return int(positions((~torch.isfinite(stats)).any(dim=1).cpu())[0])


def _non_finite(expert: int) -> ValueError:
    return ValueError(f"non-finite gradient for expert {expert}; skip the batch instead of scoring it")


@torch.no_grad()
def merge(accumulators: Iterable[ScoreAccumulator]) -> ScoreAccumulator:
    """Combine accumulators over disjoint sets of slices (e.g. data-parallel ranks) into a new one.

    Scores of shared indices add, counts and batches add, and the ``capacity`` best stay (pooled
    mode); error bounds add, plus what the merge itself evicts. Exact when every part is exact and
    the union of their pools fits the capacity, or in exact mode.
    """
    parts = list(accumulators)
    if not parts:
        raise ValueError("merge needs at least one accumulator")
    first = parts[0]
    config = (first.shape, first.statistic, first.exact, first.capacity)
    for part in parts[1:]:
        if (part.shape, part.statistic, part.exact, part.capacity) != config:
            raise ValueError("merge needs accumulators with the same shape, statistic, mode and capacity")
    where = next((p.device for p in parts if p.device is not None), None)
    out = ScoreAccumulator(
        first.shape, first.candidates, first.statistic, pool_factor=first.pool_factor, exact=first.exact, device=where
    )
    where = where or torch.device("cpu")
    out.batches = sum(p.batches for p in parts)
    out.counts = sum((p.counts.cpu() for p in parts), out.counts)  # host memory, as every accumulator's
    # Every part's losses (open epochs included) carry over; the merge's evictions open a new epoch.
    out._closed_loss = sum((p.error_bound.cpu() for p in parts), out._closed_loss)
    if first.exact:
        for part in (p for p in parts if p._dense is not None):
            # One running sum: never more than two dense arrays alive at once.
            dense = part._dense.to(where)
            out._dense = dense.clone() if out._dense is None else out._dense.add_(dense)
        return out
    pools = [p._pool() for p in parts]
    indices = torch.cat([pool[0].to(where) for pool in pools])
    scores = torch.cat([pool[1].to(where) for pool in pools])
    unique, inverse = torch.unique(indices, return_inverse=True)
    summed = torch.zeros(unique.numel(), dtype=torch.float32, device=where).index_add_(0, inverse, scores)
    out._set_pool(unique, summed)
    out._settle()
    return out
