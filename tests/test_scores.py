"""usaf.engine.scores: streaming top-k of an accumulated gradient statistic against the naive dense one."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from usaf.engine.scores import OVERFLOW, ScoreAccumulator, best_by_score, merge
from usaf.engine.selection_ops import kth_smallest, positions, positions_above
from usaf.engine.statistics import STATISTICS, slice_statistic

SHAPE = (6, 12, 20)  # (E, O, I): 1440 elements


def naive_statistic(statistic: str, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The statistic computed on whole dense tensors, independently of the module's slice code."""
    return {"grad": grad.abs(), "grad2": grad.square(), "grad_x_weight": (weight * grad).abs()}[statistic]


def naive_top(total: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of a dense ``(E, O, I)`` total as (indices ascending, scores)."""
    scores, indices = total.reshape(-1).topk(k)
    order = indices.argsort()
    return indices[order], scores[order]


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    return len(set(a.tolist()) & set(b.tolist())) / max(len(b), 1)


def stream(acc_list, slices, total=None, weight=None):
    """Add ``(batch, expert, grad)`` slices to every accumulator; keep the naive dense total."""
    last_batch = None
    for batch, expert, grad in slices:
        if last_batch is not None and batch != last_batch:
            for acc in acc_list:
                acc.end_batch()
        last_batch = batch
        w = None if weight is None else weight[expert]
        for acc in acc_list:
            acc.add(expert, grad, w)
        if total is not None:
            total[expert] += naive_statistic(acc_list[0].statistic, grad, w if w is not None else torch.ones_like(grad))
    for acc in acc_list:
        acc.end_batch()


def make_slices(gen, shape, batches, *, micro=2, present=0.8, signal=0.0, support=None, skip=()):
    """``(batch, expert, grad)``: Gaussian gradients ``signal·mu + z``, microbatched, some experts absent."""
    num_experts, out_features, in_features = shape
    mu = torch.randn(shape, generator=gen) * signal
    out = []
    for batch in range(batches):
        for _ in range(micro):
            for expert in torch.randperm(num_experts, generator=gen).tolist():
                if expert in skip or torch.rand((), generator=gen) >= present:
                    continue
                grad = mu[expert] + torch.randn(out_features, in_features, generator=gen)
                if support is not None:  # zero outside a fixed support, and randomly within it
                    keep = support[expert] & (torch.rand(out_features, in_features, generator=gen) < 0.7)
                    grad = grad * keep
                out.append((batch, expert, grad))
    return out


def assert_same_top(acc: ScoreAccumulator, total: torch.Tensor, k: int) -> None:
    indices, scores = acc.top(k)
    want_indices, want_scores = naive_top(total, k)
    assert torch.equal(indices, want_indices)
    torch.testing.assert_close(scores, want_scores)


# ---------------------------------------------------------------- exact regimes


@pytest.mark.parametrize("statistic", STATISTICS)
def test_one_batch_equals_naive_top_k(statistic):
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(SHAPE, generator=gen)
    weight = torch.randn(SHAPE, generator=gen)
    # pool_factor=1: the pool is exactly k, the tightest case the one-batch guarantee covers.
    acc = ScoreAccumulator(SHAPE, 40, statistic, pool_factor=1)
    for expert in torch.randperm(SHAPE[0], generator=gen).tolist():
        acc.add(expert, grad[expert], weight[expert])
    acc.end_batch()
    indices, _ = acc.top()
    assert torch.equal(indices, indices.sort().values)
    assert_same_top(acc, naive_statistic(statistic, grad, weight), 40)
    ranked_indices, ranked_scores = acc.ranked()
    assert torch.all(ranked_scores[:-1] >= ranked_scores[1:])
    assert set(ranked_indices.tolist()) == set(indices.tolist())
    assert acc.certified()  # one epoch per expert: every loss is below the final k-th score


@pytest.mark.parametrize("statistic", STATISTICS)
def test_k_batches_with_pool_covering_dense_support_equal_naive(statistic):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(SHAPE, generator=gen)
    numel = SHAPE[0] * SHAPE[1] * SHAPE[2]
    acc = ScoreAccumulator(SHAPE, 30, statistic, pool_factor=numel // 30 + 1)  # capacity = E·O·I
    total = torch.zeros(SHAPE)
    stream([acc], make_slices(gen, SHAPE, 5, signal=1.0), total, weight)
    assert_same_top(acc, total, 30)
    assert float(acc.error_bound.max()) == 0.0 and acc.certified()


@pytest.mark.parametrize("statistic", STATISTICS)
def test_k_batches_with_pool_covering_sparse_support_equal_naive(statistic):
    """The condition is about the union of supports, not E·O·I: a pool of 240 for 1440 elements."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(SHAPE, generator=gen)
    support = torch.zeros(SHAPE, dtype=torch.bool)
    support.view(-1)[torch.randperm(support.numel(), generator=gen)[:200]] = True
    acc = ScoreAccumulator(SHAPE, 30, statistic, pool_factor=8)
    total = torch.zeros(SHAPE)
    stream([acc], make_slices(gen, SHAPE, 6, support=support), total, weight)
    assert acc.capacity == 240 < total.numel()
    assert_same_top(acc, total, 30)
    assert float(acc.error_bound.max()) == 0.0 and acc.certified()


@pytest.mark.parametrize("statistic", STATISTICS)
def test_exact_mode_equals_naive_always(statistic):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(SHAPE, generator=gen)
    acc = ScoreAccumulator(SHAPE, 30, statistic, pool_factor=1, exact=True)
    total = torch.zeros(SHAPE)
    stream([acc], make_slices(gen, SHAPE, 6), total, weight)
    assert_same_top(acc, total, 30)
    assert_same_top(acc, total, 500)  # beyond the pool: exact mode reads the dense array
    assert acc.nbytes >= 4 * total.numel() and acc.certified()


def test_microbatch_slices_add_their_statistics():
    """Two slices of one expert are two samples: |g1| + |g2|, not |g1 + g2| (documented)."""
    g1, g2 = torch.tensor([[1.0, -2.0]]), torch.tensor([[-1.0, 3.0]])
    acc = ScoreAccumulator((1, 1, 2), 2, "grad", exact=True)
    acc.add(0, g1)
    acc.add(0, g2)
    indices, scores = acc.top()
    assert indices.tolist() == [0, 1] and scores.tolist() == [2.0, 5.0]


# ---------------------------------------------------------------- approximate regime


@pytest.mark.parametrize("statistic", STATISTICS)
def test_approximate_regime_overlap_and_bounds(statistic):
    """Pool 2 % of the tensor, 16 batches × 2 microbatches, dense Gaussian grads ``3·mu + z``."""
    gen = torch.Generator().manual_seed(0)
    shape = (8, 32, 64)
    weight = torch.randn(shape, generator=gen)
    acc = ScoreAccumulator(shape, 80, statistic, pool_factor=4)  # k = 0.5 % of 16384, pool = 320
    total = torch.zeros(shape)
    stream([acc], make_slices(gen, shape, 16, present=0.9, signal=3.0), total, weight)
    indices, _ = acc.top()
    measured = overlap(indices, naive_top(total, 80)[0])
    print(f"{statistic}: overlap with the naive top-k {measured:.3f}, certified {acc.certified()}")
    assert measured >= 0.9
    # The documented bounds: pooled <= true <= pooled + error_bound[expert], for every element.
    pooled = torch.zeros(total.numel())
    pool_indices, pool_scores = acc.ranked()
    pooled[pool_indices] = pool_scores
    bound = acc.error_bound.repeat_interleave(shape[1] * shape[2])
    slack = 1e-4 * total.reshape(-1)  # fp32 summation order
    assert torch.all(pooled <= total.reshape(-1) + slack)
    assert torch.all(total.reshape(-1) <= pooled + bound + slack)
    assert float(acc.error_bound.max()) > 0  # this regime really loses history


def test_negative_control_wrong_statistic_differs():
    """Accumulating |g| on heavy-tailed grads does not reproduce g²'s top-k: the comparison can fail."""
    gen = torch.Generator().manual_seed(4)
    acc = ScoreAccumulator(SHAPE, 30, "grad", pool_factor=1, exact=True)
    total_grad, total_grad2 = torch.zeros(SHAPE), torch.zeros(SHAPE)
    for _ in range(8):
        for expert in range(SHAPE[0]):
            # Heavy tails: a Gaussian scaled by u^(-1/3) (power-law tail, index 3). g² is ruled by
            # single spikes, |g| much less so.
            scale = torch.rand(SHAPE[1:], generator=gen).pow(-1 / 3)
            grad = torch.randn(SHAPE[1:], generator=gen) * scale
            acc.add(expert, grad)
            total_grad[expert] += grad.abs()
            total_grad2[expert] += grad.square()
    indices, _ = acc.top()
    assert overlap(indices, naive_top(total_grad, 30)[0]) == 1.0
    mismatched = overlap(indices, naive_top(total_grad2, 30)[0])
    print(f"grad accumulated vs grad2's naive top-k: overlap {mismatched:.3f}")
    assert mismatched < 0.9


# ---------------------------------------------------------------- bookkeeping, merge, resume, memory


@pytest.mark.parametrize("exact", [False, True])
def test_unrouted_experts_get_no_candidates_and_counts(exact):
    gen = torch.Generator().manual_seed(5)
    acc = ScoreAccumulator(SHAPE, 30, "grad", pool_factor=4, exact=exact)
    slices = make_slices(gen, SHAPE, 4, skip=(1, 4))
    stream([acc], slices)
    per_expert = SHAPE[1] * SHAPE[2]
    for indices in (acc.top()[0], acc.ranked()[0]):
        assert not set((indices // per_expert).tolist()) & {1, 4}
    want = torch.bincount(torch.tensor([e for _, e, _ in slices]), minlength=SHAPE[0])
    assert torch.equal(acc.counts, want) and want[1] == want[4] == 0
    assert acc.batches == 4


@pytest.mark.parametrize("exact", [False, True])
def test_merge_of_disjoint_halves_equals_one_accumulator(exact):
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(SHAPE, generator=gen)
    numel = SHAPE[0] * SHAPE[1] * SHAPE[2]
    config = dict(pool_factor=numel // 30 + 1, exact=exact)  # pooled: capacity covers the support
    whole, half_a, half_b = (ScoreAccumulator(SHAPE, 30, "grad_x_weight", **config) for _ in range(3))
    slices = make_slices(gen, SHAPE, 6)
    stream([whole], slices, weight=weight)
    stream([half_a], slices[0::2], weight=weight)
    stream([half_b], slices[1::2], weight=weight)
    merged = merge([half_a, half_b])
    assert torch.equal(merged.counts, whole.counts)
    indices, scores = merged.top()
    want_indices, want_scores = whole.top()
    assert torch.equal(indices, want_indices)
    torch.testing.assert_close(scores, want_scores)


def test_merge_bounds_hold_in_the_approximate_regime():
    gen = torch.Generator().manual_seed(7)
    parts = [ScoreAccumulator(SHAPE, 10, "grad", pool_factor=2) for _ in range(2)]
    total = torch.zeros(SHAPE)
    slices = make_slices(gen, SHAPE, 6, signal=1.0)
    for i, part in enumerate(parts):
        stream([part], slices[i::2], total)
    merged = merge(parts)
    pooled = torch.zeros(total.numel())
    pooled[merged.ranked()[0]] = merged.ranked()[1]
    bound = merged.error_bound.repeat_interleave(SHAPE[1] * SHAPE[2])
    assert merged.ranked()[0].numel() == merged.capacity == 20
    assert torch.all(pooled <= total.reshape(-1) + 1e-4)
    assert torch.all(total.reshape(-1) <= pooled + bound + 1e-4)


@pytest.mark.parametrize("exact", [False, True])
def test_state_dict_round_trip_resumes_exactly(tmp_path, exact):
    gen = torch.Generator().manual_seed(8)
    slices = make_slices(gen, SHAPE, 6, signal=1.0)
    first, rest = slices[: len(slices) // 2], slices[len(slices) // 2 :]
    config = dict(pool_factor=2, exact=exact)
    uninterrupted = ScoreAccumulator(SHAPE, 20, "grad2", **config)
    stream([uninterrupted], slices)
    before = ScoreAccumulator(SHAPE, 20, "grad2", **config)
    stream([before], first)
    torch.save(before.state_dict(), tmp_path / "scores.pt")
    resumed = ScoreAccumulator.from_state_dict(torch.load(tmp_path / "scores.pt", weights_only=True))
    for key, value in before.state_dict().items():
        got = resumed.state_dict()[key]
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
    stream([resumed], rest)
    for got, want in zip(resumed.ranked(), uninterrupted.ranked()):
        assert torch.equal(got, want)
    assert torch.equal(resumed.error_bound, uninterrupted.error_bound)
    assert torch.equal(resumed.counts, uninterrupted.counts)
    with pytest.raises(ValueError, match="does not match"):
        ScoreAccumulator(SHAPE, 20, "grad", **config).load_state_dict(before.state_dict())


def test_pooled_nbytes_is_independent_of_tensor_size():
    gen = torch.Generator().manual_seed(9)
    held = []
    for shape in ((4, 16, 16), (4, 512, 1024)):  # 1,024 vs 2,097,152 elements
        acc = ScoreAccumulator(shape, 64, "grad", pool_factor=4)
        for expert in range(shape[0]):
            acc.add(expert, torch.randn(shape[1:], generator=gen))
        assert acc.ranked()[0].numel() == acc.capacity == 256  # the pool is full
        held.append(acc.nbytes)
    # 12 bytes per pooled entry (int64 index + fp32 score) + 16 per expert (int64 count + 2 fp32 bounds).
    assert held[0] == held[1] == 12 * 256 + 16 * 4


def test_invalid_input_is_refused():
    acc = ScoreAccumulator(SHAPE, 10, "grad_x_weight")
    grad = torch.randn(SHAPE[1:])
    with pytest.raises(ValueError, match="base weight"):
        acc.add(0, grad)
    with pytest.raises(ValueError, match="expert slice"):
        acc.add(0, grad.t(), grad.t())
    with pytest.raises(IndexError):
        acc.add(SHAPE[0], grad, grad)
    with pytest.raises(ValueError, match="non-finite"):
        acc.add(0, torch.full(SHAPE[1:], float("nan")), grad)
    with pytest.raises(ValueError, match="exceeds the pool"):
        acc.top(acc.capacity + 1)
    with pytest.raises(ValueError, match="unknown statistic"):
        ScoreAccumulator(SHAPE, 10, "hessian")
    with pytest.raises(ValueError, match="unknown statistic"):
        slice_statistic("hessian", grad)
    with pytest.raises(ValueError, match="exceed"):
        ScoreAccumulator(SHAPE, 1441)
    assert acc.counts.sum() == 0  # refused slices were not counted


def test_sink_adds_like_add():
    gen = torch.Generator().manual_seed(10)
    grad, weight = torch.randn(SHAPE[1:], generator=gen), torch.randn(SHAPE[1:], generator=gen)
    via_sink, via_add = (ScoreAccumulator(SHAPE, 10, "grad_x_weight") for _ in range(2))
    kept = grad.clone()
    via_add.add(2, grad, weight)
    assert torch.equal(grad, kept)  # add leaves the caller's gradient alone
    via_sink.sink(2)(grad, weight)  # the engine's sink: its gradient is a scratch the sink may overwrite
    for got, want in zip(via_sink.top(), via_add.top()):
        assert torch.equal(got, want)
    assert via_sink.counts[2] == 1


@pytest.mark.parametrize("exact", [False, True], ids=["pooled", "exact"])
def test_a_paired_sink_adds_to_both_like_two_adds(exact):
    """usaf score's one pass for the sample and a stability half: each slice reaches both accumulators as two
    separate adds would. The control: the comparison sees one slice missing."""
    gen = torch.Generator().manual_seed(12)
    slices = make_slices(gen, SHAPE, 3)
    weight = torch.randn(SHAPE, generator=gen)
    paired, half, alone_a, alone_b = (ScoreAccumulator(SHAPE, 40, "grad_x_weight", exact=exact) for _ in range(4))
    sink = paired.sink_with(half)
    for _, expert, grad in slices:
        alone_a.add(expert, grad, weight[expert])
        alone_b.add(expert, grad, weight[expert])
        sink(expert)(grad.clone(), weight[expert])
    for got, want in ((paired, alone_a), (half, alone_b)):
        for a, b in zip(got.top(), want.top()):
            assert torch.equal(a, b)
        assert torch.equal(got.counts, want.counts)
    short = ScoreAccumulator(SHAPE, 40, "grad_x_weight", exact=exact)
    for _, expert, grad in slices[1:]:
        short.add(expert, grad, weight[expert])
    assert not all(torch.equal(a, b) for a, b in zip(short.top(), half.top())), "control: one slice less shows"
    with pytest.raises(ValueError, match="cannot pair"):
        paired.sink_with(ScoreAccumulator(SHAPE, 40, "grad", exact=exact))


# ---------------------------------------------------------------- the per-expert pool and its selection primitives


def test_selection_primitives_equal_torchs_own_ops():
    gen = torch.Generator().manual_seed(11)
    values = torch.randint(0, 50, (5000,), generator=gen).float()  # many ties, and values equal to the cut
    for threshold in (0.0, 25.0, 49.0, 60.0):
        want = (values > threshold).nonzero().squeeze(1)
        assert torch.equal(positions_above(values, torch.tensor(threshold)), want)
    mask = values > 30
    assert torch.equal(positions(mask), mask.nonzero().squeeze(1))
    for k in (1, 17, 2500, 5000):
        assert kth_smallest(values, k) == values.kthvalue(k).values


def test_kth_smallest_of_a_pool_sized_array_partitions_one_bin_and_equals_kthvalue(monkeypatch):
    """The host's radix select (a pool's cut): the same value as torch's kthvalue, for every kind of fp32 array."""
    gen = torch.Generator().manual_seed(14)
    n = 200_000  # above the radix select's minimum
    arrays = {
        "uniform": torch.rand(n, generator=gen),
        "heavy-tailed scores": torch.rand(n, generator=gen).pow(8) * 1e-4,
        "ties at every cut": torch.randint(0, 40, (n,), generator=gen).float(),
        "zeros and +inf": torch.cat([torch.zeros(n // 2), torch.rand(n, generator=gen), torch.full((3,), math.inf)]),
        "subnormal": torch.rand(n, generator=gen) * 1e-40,
        "negative values (bit order is not value order)": torch.randn(n, generator=gen),
        "-0.0": torch.cat([torch.rand(n, generator=gen), torch.tensor([-0.0])]),
    }
    sizes = []
    real_partition = np.partition
    monkeypatch.setattr(np, "partition", lambda a, kth: sizes.append(a.size) or real_partition(a, kth))
    for name, values in arrays.items():
        for k in (1, 2, values.numel() // 3, values.numel() - 1, values.numel()):
            assert kth_smallest(values, k) == values.kthvalue(k).values, (name, k)
    # the non-negative arrays partitioned one bin each time, the others the whole array (control: the spy sees both)
    assert min(sizes) < n // 10 and max(sizes) >= n
    assert kth_smallest(torch.tensor([3.0, -1.0, 2.0]), 1) == -1.0  # small arrays: a plain partition


def test_best_by_score_equals_a_sort_that_breaks_ties_by_index():
    gen = torch.Generator().manual_seed(12)
    indices = torch.randperm(10_000, generator=gen)[:3000]
    scores = torch.randint(0, 40, (3000,), generator=gen).float()  # ties at every cut
    by_index = indices.argsort()
    order = scores[by_index].sort(descending=True, stable=True).indices
    for k in (0, 1, 100, 2999, 3000, 4000):
        want = indices[by_index][order][:k].sort().values
        assert torch.equal(indices[best_by_score(indices, scores, k)], want), k
    wrong = indices[scores.sort(descending=True, stable=True).indices][:100].sort().values
    assert not torch.equal(indices[best_by_score(indices, scores, 100)], wrong)  # ties broken otherwise differ


def test_the_pool_overflows_by_a_bounded_margin_and_reads_at_capacity():
    gen = torch.Generator().manual_seed(13)
    shape = (8, 32, 64)
    acc = ScoreAccumulator(shape, 50, "grad", pool_factor=4)  # capacity 200, slices of 2048
    held = []
    for _ in range(3):
        for expert in range(shape[0]):
            acc.add(expert, torch.randn(shape[1:], generator=gen))
            held.append(acc._pooled)
    assert max(held) > acc.capacity  # the deferral is real: more than P entries were held between cuts
    assert max(held) <= (1 + OVERFLOW) * acc.capacity + shape[1] * shape[2]  # one slice's entrants at most past it
    assert acc.ranked()[0].numel() == acc.capacity == acc._pooled  # every read sees the pool cut back to P


def test_a_state_saved_while_the_pool_overflows_resumes_exactly(tmp_path):
    gen = torch.Generator().manual_seed(14)
    slices = make_slices(gen, SHAPE, 6, signal=0.5)
    cut = next(i for i in range(1, len(slices)) if _overflowing_after(slices[:i]))
    uninterrupted = ScoreAccumulator(SHAPE, 20, "grad", pool_factor=2)
    stream([uninterrupted], slices)
    before = ScoreAccumulator(SHAPE, 20, "grad", pool_factor=2)
    stream([before], slices[:cut])
    assert before._pooled > before.capacity  # saved mid-overflow, not cut back (saving changes nothing)
    torch.save(before.state_dict(), tmp_path / "scores.pt")
    resumed = ScoreAccumulator.from_state_dict(torch.load(tmp_path / "scores.pt", weights_only=True))
    stream([resumed], slices[cut:])
    for got, want in zip(resumed.ranked(), uninterrupted.ranked()):
        assert torch.equal(got, want)
    assert torch.equal(resumed.error_bound, uninterrupted.error_bound)


def _overflowing_after(slices) -> bool:
    acc = ScoreAccumulator(SHAPE, 20, "grad", pool_factor=2)
    stream([acc], slices)
    return acc._pooled > acc.capacity


def test_a_state_from_the_flat_pool_restores():
    """A checkpoint written before the pool was held per expert: one flat pool in any order, no floor."""
    gen = torch.Generator().manual_seed(15)
    slices = make_slices(gen, SHAPE, 4, signal=0.5)
    acc = ScoreAccumulator(SHAPE, 20, "grad", pool_factor=2)
    stream([acc], slices)
    acc.ranked()  # cut back to capacity, as the flat pool always was
    state = acc.state_dict()
    shuffle = torch.randperm(state["indices"].numel(), generator=gen)
    old = {**state, "indices": state["indices"][shuffle], "scores": state["scores"][shuffle]}
    del old["floor"]
    restored = ScoreAccumulator.from_state_dict(old)
    for got, want in zip(restored.ranked(), acc.ranked()):
        assert torch.equal(got, want)
    # full: the floor is the pool's minimum, the flat pool's own admission rule (never above what is pooled)
    assert restored._floor == state["scores"].min() >= acc._floor
    stream([restored], make_slices(gen, SHAPE, 2, signal=0.5))  # and it goes on adding
    assert restored.ranked()[0].numel() == restored.capacity


# NaN is never above the floor (refused); inf always is (it enters); either may hit a pooled entry.
@pytest.mark.parametrize(
    ("where", "bad"),
    [("pooled", float("nan")), ("pooled", float("inf")), ("entering", float("inf")), ("refused", float("nan"))],
)
def test_a_non_finite_slice_is_refused_wherever_it_lands_and_changes_nothing(where, bad):
    gen = torch.Generator().manual_seed(16)
    acc = ScoreAccumulator(SHAPE, 20, "grad", pool_factor=2)
    stream([acc], make_slices(gen, SHAPE, 3, signal=0.5))
    local = acc._local[2]
    assert local.numel() and acc._floor > 0
    grad = torch.zeros(SHAPE[1:])  # every value at 0: below the floor, so refused unless placed otherwise
    position = {"pooled": int(local[0]), "entering": 0, "refused": 0}[where]
    if where == "entering":
        position = next(i for i in range(grad.numel()) if i not in set(local.tolist()))
    grad.view(-1)[position] = bad
    saved = acc.state_dict()
    with pytest.raises(ValueError, match="non-finite gradient for expert 2"):
        acc.sink(2)(grad, None)
    for key, value in acc.state_dict().items():
        assert torch.equal(value, saved[key]) if isinstance(value, torch.Tensor) else value == saved[key], key


@pytest.mark.parametrize("exact", [False, True])
def test_a_snapshot_restores_the_state_before_a_failed_step(exact):
    """What the trainer does when a step runs out of memory: the attempt's partial scores are dropped."""
    gen = torch.Generator().manual_seed(17)
    slices = make_slices(gen, SHAPE, 6, signal=0.5)
    first, failed, rest = slices[:20], slices[20:40], slices[40:]
    uninterrupted = ScoreAccumulator(SHAPE, 20, "grad", pool_factor=2, exact=exact)
    stream([uninterrupted], first + rest)
    acc = ScoreAccumulator(SHAPE, 20, "grad", pool_factor=2, exact=exact)
    stream([acc], first)
    before = acc.state_dict()
    snapshot = acc.snapshot()
    stream([acc], failed)  # adds and, pooled, cuts the pool: the segments the snapshot holds are not edited
    assert not torch.equal(acc.state_dict()["counts"], before["counts"])  # negative control: it did change
    acc.restore(snapshot)
    for key, value in acc.state_dict().items():
        assert torch.equal(value, before[key]) if isinstance(value, torch.Tensor) else value == before[key], key
    stream([acc], failed)
    acc.restore(snapshot)  # a second restore of the same snapshot: the first did not hand it out to be edited
    stream([acc], rest)
    for got, want in zip(acc.ranked(), uninterrupted.ranked()):
        assert torch.equal(got, want)
    assert torch.equal(acc.error_bound, uninterrupted.error_bound) and torch.equal(acc.counts, uninterrupted.counts)


# ---------------------------------------------------------------- blocks of experts at once (the grouped engine)


def block_rounds(gen, shape, rounds, *, signal=0.5, support=None):
    """``(first, grads (e, O, I), routed (e,))`` per block: every round cuts the experts into blocks of 1 to 4, some
    experts unrouted (their rows hold noise that must not be seen), as the grouped engine's backward hands them."""
    num_experts, out_features, in_features = shape
    mu = torch.randn(shape, generator=gen) * signal
    out = []
    for _ in range(rounds):
        first = 0
        while first < num_experts:
            e = min(int(torch.randint(1, 5, (), generator=gen)), num_experts - first)
            grads = mu[first : first + e] + torch.randn(e, out_features, in_features, generator=gen)
            if support is not None:
                grads = grads * support[first : first + e]
            routed = torch.rand(e, generator=gen) < 0.75
            out.append((first, grads, routed))
            first += e
    return out


def feed(acc: ScoreAccumulator, blocks, *, as_blocks: bool) -> None:
    """Each block to ``acc``, whole or one routed expert at a time (descending, as the loop's backward)."""
    for first, grads, routed in blocks:
        if as_blocks:
            acc.sink.add_block(first, grads.clone(), None, routed)
            continue
        for j in reversed(range(grads.shape[0])):
            if routed[j]:
                acc.sink(first + j)(grads[j].clone(), None)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "pooled-lossless"])
def test_a_block_adds_like_its_slices_one_by_one(exact):
    """Without a refusal or a cut, a block is exactly its routed rows added one by one: pool order, scores, counts and
    bounds. Unrouted rows are not seen (NaN there changes nothing). Control: counting an unrouted row shows."""
    gen = torch.Generator().manual_seed(20)
    shape = (10, 6, 8)
    support = torch.rand(shape, generator=gen) < 0.3
    blocks = block_rounds(gen, shape, 3, support=support)
    first, grads, routed = next(b for b in blocks if not b[2].all())
    grads[positions(~routed)[0]] = float("nan")  # an unrouted row: never read
    capacity = int(support.sum())  # every entry with a non-zero statistic fits: nothing refused or cut
    one_by_one, whole = (ScoreAccumulator(shape, capacity, "grad", pool_factor=1, exact=exact) for _ in range(2))
    feed(one_by_one, blocks, as_blocks=False)
    feed(whole, blocks, as_blocks=True)
    got, want = whole.state_dict(), one_by_one.state_dict()
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key
    assert float(whole.error_bound.max()) == 0
    miscounted = ScoreAccumulator(shape, capacity, "grad", pool_factor=1, exact=exact)
    feed(miscounted, [(f, g.nan_to_num(), torch.ones_like(r)) for f, g, r in blocks], as_blocks=True)
    assert not torch.equal(miscounted.counts, whole.counts)


@pytest.mark.parametrize("statistic", STATISTICS)
def test_blocks_into_a_small_pool_keep_every_bound(statistic):
    """A pool far smaller than the support, fed by blocks: pooled scores are lower bounds of the exact totals and
    within ``error_bound`` of them, unpooled totals within it too, the pool never holds more than one slice's
    worth past its overflow margin, and ``certified`` is never wrong. Control: the regime is lossy."""
    gen = torch.Generator().manual_seed(21)
    shape = (8, 16, 24)
    blocks = block_rounds(gen, shape, 6)
    weight = torch.randn(shape, generator=gen)
    acc = ScoreAccumulator(shape, 30, statistic, pool_factor=2)
    exact = ScoreAccumulator(shape, 30, statistic, exact=True)
    held = []
    for first, grads, routed in blocks:
        base = weight[first : first + grads.shape[0]]
        acc.sink.add_block(first, grads.clone(), base, routed)
        exact.sink.add_block(first, grads.clone(), base, routed)
        held.append(acc._pooled)
    assert max(held) <= (1 + OVERFLOW) * acc.capacity + acc.capacity
    true = exact.dense_map().view(-1)
    indices, scores = acc.pool_entries()
    per_expert = shape[1] * shape[2]
    bound = acc.error_bound
    assert float(bound.max()) > 0 and not torch.allclose(scores, true[indices])  # lossy
    assert (scores <= true[indices] * (1 + 1e-5)).all()
    assert (true[indices] <= (scores + bound[indices // per_expert]) * (1 + 1e-5)).all()
    unpooled = torch.ones_like(true, dtype=torch.bool)
    unpooled[indices] = False
    assert (true[unpooled] <= bound.repeat_interleave(per_expert)[unpooled] * (1 + 1e-5)).all()
    for k in (1, 5, 30):
        if acc.certified(k):
            assert set(acc.top(k)[0].tolist()) == set(true.topk(k).indices.tolist())


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "pooled"])
def test_a_non_finite_block_is_refused_naming_its_expert_and_changes_nothing(exact):
    gen = torch.Generator().manual_seed(22)
    shape = (8, 6, 8)
    acc = ScoreAccumulator(shape, 10, "grad", pool_factor=2, exact=exact)
    feed(acc, block_rounds(gen, shape, 2), as_blocks=True)
    saved = acc.state_dict()
    grads = torch.randn(3, 6, 8, generator=gen)
    grads[1, 2, 3] = float("inf")
    with pytest.raises(ValueError, match="non-finite gradient for expert 5"):
        acc.sink.add_block(4, grads, None, torch.ones(3, dtype=torch.bool))
    for key, value in acc.state_dict().items():
        assert torch.equal(value, saved[key]) if isinstance(value, torch.Tensor) else value == saved[key], key
    with pytest.raises(IndexError, match="out of 8"):
        acc.add_block(6, torch.zeros(3, 48), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="not rows of"):
        acc.add_block(0, torch.zeros(3, 47), torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "pooled"])
def test_a_paired_sink_adds_a_block_to_both(exact):
    """usaf score's sample and stability half, fed by blocks: each equals an accumulator fed alone."""
    gen = torch.Generator().manual_seed(23)
    shape = (8, 6, 8)
    blocks = block_rounds(gen, shape, 3)
    paired, half, alone = (ScoreAccumulator(shape, 10, "grad", pool_factor=2, exact=exact) for _ in range(3))
    sink = paired.sink_with(half)
    for first, grads, routed in blocks:
        sink.add_block(first, grads.clone(), None, routed)
    feed(alone, blocks, as_blocks=True)
    for acc in (paired, half):
        for got, want in zip(acc.ranked(), alone.ranked()):
            assert torch.equal(got, want)
        assert torch.equal(acc.counts, alone.counts)


def test_a_per_expert_budget_names_why_an_expert_has_too_few_candidates():
    """"it received too few calibration tokens" was said of an expert outscored out of the pool as of one that got no
    token (found in review). The expert that got none is named so; a tiny frac's pool holds one an expert."""
    from usaf.engine.selection import SelectionError, pool_size, select

    shape = (3, 4, 4)
    assert pool_size({"w": shape}, 1e-9, "per-expert", {"w": 0}) == {"w": 3}  # one an expert, not one in all
    acc = ScoreAccumulator(shape, candidates=3)
    for expert in (0, 1):  # expert 2 is never routed to
        acc.add(expert, torch.rand(4, 4) + 0.1)
    acc.end_batch()
    with pytest.raises(SelectionError, match=r"expert 2 has 0 scored weights .*\(it received no calibration token\)"):
        select({"w": acc}, frac=1e-9, mode="per-expert", layer_of={"w": 0})
    acc.add(2, torch.rand(4, 4) + 0.1)  # the control: routed to, it is served
    acc.end_batch()
    assert select({"w": acc}, frac=1e-9, mode="per-expert", layer_of={"w": 0})["w"].numel() == 3
    # exact maps: each expert's own best, though another's scores are all higher (its best-of-tensor held none)
    exact = ScoreAccumulator(shape, candidates=3, exact=True)
    for expert, scale in ((0, 10.0), (1, 10.0), (2, 0.01)):
        exact.add(expert, (torch.rand(4, 4) + 0.1) * scale)
    exact.end_batch()
    chosen = select({"w": exact}, frac=1e-9, mode="per-expert", layer_of={"w": 0})["w"]
    assert sorted((chosen // 16).tolist()) == [0, 1, 2]
    dense = exact.dense_map()
    assert all(dense.view(3, -1)[e].argmax() == chosen[e] % 16 for e in range(3))
