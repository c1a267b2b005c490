"""Dynamic reselection (method §5): true counts, drop/grow choice, forward invariance, the frozen record,
Adam state surgery, the update-fraction schedule, and a short training run with reselections."""

from __future__ import annotations

import math

import pytest
import torch

from helpers_engine import batch, make_engine, random_selection, train_step
from usaf.engine.experts import ExpertWeight
from usaf.engine.optim import SparseAdamW
from usaf.engine.reselect import collect_scores, cumulative_delta, reselect, update_fraction
from usaf.engine.scores import ScoreAccumulator
from usaf.quant import dequantize

FRACTION = 0.3


def dense_cumulative(weight: ExpertWeight) -> torch.Tensor:
    """``(E, O, I)`` fp32: everything trained into ``weight`` (frozen record + active delta)."""
    indices, values = cumulative_delta(weight)
    out = torch.zeros(weight.shape, dtype=torch.float32)
    out.view(-1)[indices] = values
    return out


def base(weight: ExpertWeight) -> torch.Tensor:
    return dequantize(weight.q, dtype=torch.float32, memory_layout=False)  # (E, O, I)


@torch.no_grad()
def eval_loss(engine, ids, labels) -> torch.Tensor:
    return engine.loss(ids, labels).loss


def setup(quantized, steps: int = 3, exact: bool = True):
    """An engine trained for ``steps`` steps with score sinks on: non-zero deltas, Adam state, grow scores."""
    engine = make_engine(quantized, "qwen3_moe")
    engine.set_deltas(random_selection(engine, frac=0.05))
    optimizer = SparseAdamW(engine.parameter_groups(lr=0.05, router_lr=1e-2, weight_decay=0.0))
    ids, labels = batch(4)
    with collect_scores(engine, exact=exact) as scores:
        for _ in range(steps):
            train_step(engine, optimizer, ids, labels)
            scores.end_batch()
    return engine, optimizer, scores, ids, labels


def test_reselect_replaces_exactly_the_asked_share_by_the_rules(quantized):
    engine, optimizer, scores, _, _ = setup(quantized)
    before = {n: (d.indices.clone(), d.values.detach().clone()) for n, d in engine.deltas().items()}
    report = reselect(engine, optimizer, scores, FRACTION)

    assert set(report.tensors) == set(before)
    for name, (old_idx, old_val) in before.items():
        delta, counts = engine.weights[name].delta, report.tensors[name]
        n = old_idx.numel()
        k = round(FRACTION * n)
        assert counts.candidates >= k > 0
        assert (counts.nnz, counts.target, counts.kept, counts.dropped, counts.grown) == (n, k, n - k, k, k)
        assert counts.turnover == pytest.approx(k / n)
        new_idx = delta.indices
        assert new_idx.numel() == n == delta.values.numel()
        assert bool((new_idx[1:] > new_idx[:-1]).all())  # sorted, unique
        dropped = old_idx[~torch.isin(old_idx, new_idx)]
        grown = new_idx[~torch.isin(new_idx, old_idx)]
        assert dropped.numel() == k and grown.numel() == k  # true counts, not doubled
        # Dropped: the smallest |delta| (no kept entry is smaller than any dropped one).
        dropped_abs = old_val[torch.isin(old_idx, dropped)].abs()
        kept_abs = old_val[~torch.isin(old_idx, dropped)].abs()
        assert float(dropped_abs.max()) <= float(kept_abs.min())
        # Grown: the top-scored entries outside the old active set, from the dense score map.
        dense = scores[name].dense_map().reshape(-1).clone()
        dense[old_idx] = -math.inf
        expected = dense.topk(k).indices.sort().values
        assert torch.equal(grown, expected)
        assert bool((dense[grown] > 0).all())
        # Kept entries keep their values; grown ones start at 0.
        kept_new = torch.isin(new_idx, old_idx)
        torch.testing.assert_close(delta.values.detach()[kept_new], old_val[torch.isin(old_idx, new_idx)])
        assert bool((delta.values.detach()[~kept_new] == 0).all())
    total = report.total
    assert total.grown == sum(c.grown for c in report.tensors.values()) == total.dropped
    assert total.nnz == sum(i.numel() for i, _ in before.values())
    assert 0.25 < total.turnover < 0.35  # the prototype replaced 91–97 %
    assert report.to_dict()["total"]["grown"] == total.grown


def test_forward_and_cumulative_delta_are_unchanged_by_a_reselection(quantized):
    engine, optimizer, scores, ids, labels = setup(quantized)
    loss_before = eval_loss(engine, ids, labels)
    cumulative_before = {n: dense_cumulative(w) for n, w in engine.weights.items()}
    indices_before = {n: d.indices.clone() for n, d in engine.deltas().items()}
    reselect(engine, optimizer, scores, FRACTION)

    torch.testing.assert_close(eval_loss(engine, ids, labels), loss_before, rtol=1e-6, atol=1e-6)
    for name, weight in engine.weights.items():
        assert not torch.equal(weight.delta.indices, indices_before[name])  # something did change
        assert weight.frozen_indices.numel() == round(FRACTION * indices_before[name].numel())
        # base + cumulative_delta is the pre-reselection trained weight, bit for bit.
        assert torch.equal(dense_cumulative(weight), cumulative_before[name])
        # The resident base carries the frozen record, rounded once: what a rebuild would give.
        frozen = torch.zeros(weight.shape).view(-1).index_put_((weight.frozen_indices,), weight.frozen_values)
        expected = (base(weight) + frozen.view(weight.shape)).to(weight.resident.dtype)
        assert torch.equal(weight.resident.dense(), expected)
        rebuilt = ExpertWeight(weight.q, compute_dtype=weight.compute_dtype, device=torch.device("cpu"))
        rebuilt.frozen_indices, rebuilt.frozen_values = weight.frozen_indices, weight.frozen_values
        rebuilt.make_resident()
        assert torch.equal(rebuilt.resident.dense(), weight.resident.dense())


def test_adam_state_moves_with_kept_entries_and_grown_entries_start_fresh(quantized):
    engine, optimizer, scores, ids, labels = setup(quantized)
    before = {}
    for name, delta in engine.deltas().items():
        state = {k: v.clone() for k, v in optimizer.state_for(delta.values).items()}
        before[name] = (delta.indices.clone(), state)
    reselect(engine, optimizer, scores, FRACTION)

    for name, (old_idx, old_state) in before.items():
        delta = engine.weights[name].delta
        state = optimizer.state_for(delta.values)
        kept_new = torch.isin(delta.indices, old_idx)
        kept_old = torch.isin(old_idx, delta.indices)  # same indices, both in ascending order
        assert bool((old_state["step"][kept_old] == 3).all())
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert state[key].shape == delta.values.shape
            assert torch.equal(state[key][kept_new], old_state[key][kept_old]), key
            assert bool((state[key][~kept_new] == 0).all()), key
        # Negative control: the state left at the old positions would not match.
        assert not torch.equal(state["exp_avg"][kept_new], old_state["exp_avg"][: int(kept_new.sum())])
    # Training continues: grown entries count their own first step, kept entries their fourth.
    train_step(engine, optimizer, ids, labels)
    for name, (old_idx, _) in before.items():
        delta = engine.weights[name].delta
        step = optimizer.state_for(delta.values)["step"]
        kept_new = torch.isin(delta.indices, old_idx)
        assert bool((step[kept_new] == 4).all()) and bool((step[~kept_new] == 1).all())


def test_growth_is_limited_by_the_candidates_and_a_zero_fraction_changes_nothing(quantized):
    engine, optimizer, _, _, _ = setup(quantized, steps=1)
    name, delta = next(iter(engine.deltas().items()))
    weight = engine.weights[name]
    old_idx = delta.indices.clone()
    _, out_features, in_features = weight.shape
    # Scores on 3 outside entries of expert 0 and on 2 active ones (which must not count).
    outside = torch.tensor([i for i in range(out_features * in_features) if i not in set(old_idx.tolist())][:3])
    grad = torch.zeros(out_features, in_features)
    grad.view(-1)[outside] = torch.tensor([1.0, 3.0, 2.0])
    assert int(old_idx[1]) < out_features * in_features  # two active entries in expert 0
    grad.view(-1)[old_idx[:2]] = 5.0  # the best scores, but active: not candidates
    acc = ScoreAccumulator(weight.shape, 4, "grad")
    acc.add(0, grad)
    others = {n: ScoreAccumulator(w.shape, 1) for n, w in engine.weights.items() if n != name}
    report = reselect(engine, optimizer, {name: acc, **others}, 0.5)

    counts = report.tensors[name]
    assert counts.target == round(0.5 * old_idx.numel()) > 3
    assert (counts.candidates, counts.grown, counts.dropped, counts.nnz) == (3, 3, 3, old_idx.numel())
    assert set(delta.indices.tolist()) - set(old_idx.tolist()) == set(outside.tolist())
    assert all(c.grown == 0 and c.candidates == 0 for n, c in report.tensors.items() if n != name)
    # A zero fraction leaves every set, value and record as it was.
    indices, values = delta.indices.clone(), delta.values.detach().clone()
    frozen = weight.frozen_indices.clone()
    report = reselect(engine, optimizer, {name: acc, **others}, 0.0)
    assert report.total.grown == 0 and report.total.kept == report.total.nnz
    assert torch.equal(delta.indices, indices) and torch.equal(delta.values.detach(), values)
    assert torch.equal(weight.frozen_indices, frozen)


def test_collect_scores_installs_and_removes_the_sinks(quantized):
    engine, _, scores, _, _ = setup(quantized, steps=2, exact=False)
    assert all(w.score_sink is None for w in engine.weights.values())
    for name, acc in scores.items():
        assert acc.batches == 2 and int(acc.counts.sum()) > 0, name
        assert acc.candidates == engine.weights[name].delta.nnz
    with collect_scores(engine), pytest.raises(RuntimeError, match="already installed"):
        collect_scores(engine)
    assert all(w.score_sink is None for w in engine.weights.values())
    with pytest.raises(KeyError, match="no grow scores"):
        reselect(engine, None, {}, 0.1)


def test_update_fraction_is_a_cosine_to_zero_at_three_quarters():
    assert update_fraction(0, 1000, 0.3) == pytest.approx(0.3)
    assert update_fraction(375, 1000, 0.3) == pytest.approx(0.15)  # half-way to the end
    assert update_fraction(125, 1000, 0.3) == pytest.approx(0.3 * 0.5 * (1 + math.cos(math.pi / 6)))
    assert update_fraction(749, 1000, 0.3) > 0
    assert update_fraction(750, 1000, 0.3) == 0.0
    assert update_fraction(999, 1000, 0.3) == 0.0
    assert update_fraction(5000, 1000, 0.3) == 0.0
    assert update_fraction(50, 100, 0.2, end=1.0) == pytest.approx(0.1)
    values = [update_fraction(s, 100, 0.25) for s in range(100)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # never increases
    with pytest.raises(ValueError):
        update_fraction(0, 0, 0.3)


def run_with_reselections(quantized, monkeypatch, *, discard: bool):
    """Train 12 steps, reselecting after steps 4 and 8; track every increment applied to any delta entry."""
    if discard:  # the negative control: dropped values are thrown away instead of folded
        monkeypatch.setattr(ExpertWeight, "fold", lambda self, indices, values: None)
    engine = make_engine(quantized, "qwen3_moe")
    engine.set_deltas(random_selection(engine, frac=0.05))
    optimizer = SparseAdamW(engine.parameter_groups(lr=0.05, router_lr=1e-2, weight_decay=0.0))
    ids, labels = batch(4)
    trained = {n: torch.zeros(w.shape) for n, w in engine.weights.items()}  # (E, O, I) sum of increments
    losses, reports = [], []
    scores = collect_scores(engine)
    for step in range(12):
        before = {n: (d.indices.clone(), d.values.detach().clone()) for n, d in engine.deltas().items()}
        losses.append(train_step(engine, optimizer, ids, labels))
        for name, (idx, val) in before.items():
            trained[name].view(-1).index_add_(0, idx, engine.weights[name].delta.values.detach() - val)
        if step in (3, 7):
            scores.close()
            reports.append(reselect(engine, optimizer, scores, update_fraction(step + 1, 12, FRACTION, end=1.0)))
            scores = collect_scores(engine)
    scores.close()
    return engine, losses, reports, trained


def test_training_with_reselections_keeps_every_trained_value(quantized, monkeypatch):
    engine, losses, reports, trained = run_with_reselections(quantized, monkeypatch, discard=False)
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(r.total.grown > 0 and r.total.grown == r.total.dropped for r in reports)
    assert reports[0].total.turnover > reports[1].total.turnover  # the fraction decays
    for name, weight in engine.weights.items():
        indices, _ = cumulative_delta(weight)
        touched = trained[name].reshape(-1).nonzero().squeeze(1)
        assert bool(torch.isin(touched, indices).all()), name  # every value ever trained is recorded
        assert weight.frozen_indices.numel() > 0
        torch.testing.assert_close(dense_cumulative(weight), trained[name], rtol=1e-5, atol=1e-6)


def test_negative_control_discarding_dropped_values_loses_them(quantized, monkeypatch):
    engine, _, reports, trained = run_with_reselections(quantized, monkeypatch, discard=True)
    assert reports[0].total.dropped > 0
    for name, weight in engine.weights.items():
        lost = (dense_cumulative(weight) - trained[name]).abs().max()
        assert float(lost) > 1e-3, name  # effective weights differ from what was trained
