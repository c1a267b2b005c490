"""A trainable layer's experts run grouped (``usaf.engine.grouped_deltas``) against dense autograd and the loop.

The grouped path is what a CUDA device runs (``Capabilities.dense_delta_terms``); here it is switched on for the CPU
per layer (``LayerExperts.grouped_deltas``), with torch's grouped matmul (the CPU has one) and without it (one GEMM
per expert). Every check also asserts the grouped path really ran, and the per-expert path did not: a control
against a silent fallback that would make the comparisons vacuous.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import FAMILIES
from helpers_engine import (
    FAMILY_LAYERS,
    assert_gradients_equal_dense_autograd,
    batch,
    loss_and_grads,
    make_engine,
    random_selection,
    train_step,
)
from usaf.backends import resolve_backend
from usaf.engine import experts, grouped_deltas
from usaf.engine.engine import SparseEngine
from usaf.engine.loading import load_quantized_model
from usaf.engine.optim import SparseAdamW

WIDE = {"num_experts": 128, "num_experts_per_tok": 8}  # Qwen3-30B-A3B's routing


@pytest.fixture
def ran(monkeypatch):
    """Counts grouped tensor passes and per-expert linears; ``ran.grouped(engine, on)`` switches the path."""

    class Ran:
        tensors = 0
        experts = 0

        @staticmethod
        def grouped(engine: SparseEngine, on: bool = True, use_grouped_mm: bool | None = None) -> None:
            for state in engine.loaded.experts.values():
                state.grouped_deltas = on
                if use_grouped_mm is not None:
                    state.grouped_mm = use_grouped_mm

    counter = Ran()
    real_apply, real_output = grouped_deltas._GroupedDeltaLinear.apply, experts._expert_output

    def counting_apply(*args):
        counter.tensors += 1
        return real_apply(*args)

    def counting_output(*args, **kwargs):
        counter.experts += 1
        return real_output(*args, **kwargs)

    monkeypatch.setattr(grouped_deltas._GroupedDeltaLinear, "apply", counting_apply)
    monkeypatch.setattr(experts, "_expert_output", counting_output)
    return counter


def _values(selection: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(len(s), generator=g) * 1e-2 for n, s in selection.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_gradients_equal_dense_autograd_for_every_family(family, tiny_model, quantized, ran):
    """Every target the family has (experts, attention, shared): the grouped experts' value gradients are dense
    autograd's at the selected entries, and the routers' too. Control: one column over does not match."""
    engine = make_engine(quantized, family)
    ran.grouped(engine)
    selection = random_selection(engine)
    engine.set_deltas(selection)
    ids, labels = batch()
    engine.loss(ids, labels).loss.backward()
    assert ran.tensors == 2 and ran.experts == 0  # gate_up and down of the one trainable layer, no expert loop
    assert_gradients_equal_dense_autograd(engine, selection, tiny_model(family, num_layers=FAMILY_LAYERS), ids, labels)


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_equals_the_per_expert_loop_with_nonzero_deltas(family, quantized, ran):
    """Deltas with values (the D terms in the forward and in dx): loss and every gradient as the loop's.
    Control: a changed delta value moves the grouped loss."""
    engine = make_engine(quantized, family, targets="all")
    selection = random_selection(engine)
    values = _values(selection)
    engine.set_deltas(selection, values)
    ids, labels = batch(4)
    loop_loss, loop_grads = loss_and_grads(engine, ids, labels)
    assert ran.tensors == 0 and ran.experts > 0
    ran.grouped(engine)
    ran.experts = 0
    loss, grads = loss_and_grads(engine, ids, labels)
    assert ran.tensors == 2 and ran.experts == 0
    torch.testing.assert_close(loss, loop_loss, rtol=1e-6, atol=1e-6)
    for name, grad in loop_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    engine.set_deltas(selection, {n: v + 1e-2 for n, v in values.items()})
    assert not torch.allclose(loss_and_grads(engine, ids, labels)[0], loss, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_grouped_at_128_experts_in_many_blocks_and_chunks(use_grouped_mm, quantized, ran, monkeypatch):
    """Qwen3-30B-A3B's routing (many small groups, some experts with none), the resident base in chunks of 24
    experts and a delta budget of 5 experts a block: blocks are cut at both, and the result is the loop's."""
    from usaf.engine import resident

    real = resident.ResidentBase.dequantized.__func__

    def chunked(cls, q, **kwargs):
        return real(cls, q, **{**kwargs, "max_bytes": 24 * q.shape[1] * q.shape[2] * 4})

    monkeypatch.setattr(resident.ResidentBase, "dequantized", classmethod(chunked))
    loaded = load_quantized_model(quantized("qwen3_moe", num_layers=FAMILY_LAYERS, **WIDE))
    engine = SparseEngine(loaded, trainable_layers=[loaded.spec.moe_layers[-1]])
    state = loaded.experts[engine.trainable_layers[0]]
    assert len(state.gate_up.resident.chunks) == 6  # 128 experts in chunks of 24
    selection = random_selection(engine, frac=0.02)
    engine.set_deltas(selection, _values(selection))
    ids, labels = batch(size=(2, 40))
    loop_loss, loop_grads = loss_and_grads(engine, ids, labels)

    _, o, i = state.gate_up.shape
    monkeypatch.setattr(grouped_deltas, "DELTA_BLOCK_BYTES", 5 * o * i * 4)
    counts = state.tokens_per_expert.tolist()  # this forward's load (reset by nothing since)
    plan = grouped_deltas.blocks(state.gate_up, counts, grouped_deltas.DELTA_BLOCK_BYTES)
    assert all(b.stop - b.first <= 5 and b.first // 24 == (b.stop - 1) // 24 for b in plan)
    covered = [e for b in plan for e in range(b.first, b.stop)]
    assert len(covered) == len(set(covered)) and {e for e, n in enumerate(counts) if n} <= set(covered)
    assert any(b.unrouted.numel() for b in plan), "an unrouted expert inside a block: its gradient must be zero"

    # Each block's group ends go to the device once, not once per grouped product (five a block; on a GPU each an
    # upload): counted where blocks are planned, and every product of the tensors must be handed them.
    uploads = {"per block": 0, "products without them": 0}
    real_grad, real_linear, real_ends = (
        grouped_deltas.grouped_weight_grad, grouped_deltas.grouped_linear, grouped_deltas.group_ends
    )  # fmt: skip

    def unwritten_empty_groups(dy, x, counts, use, ends=None):  # a kernel may leave an empty group's output as is
        uploads["products without them"] += ends is None
        grad = real_grad(dy, x, counts, use, ends)
        grad[counts == 0] = float("nan")
        return grad

    def linear(*args):
        uploads["products without them"] += args[6] is None
        return real_linear(*args)

    def ends(*args):
        uploads["per block"] += 1
        return real_ends(*args)

    monkeypatch.setattr(grouped_deltas, "grouped_weight_grad", unwritten_empty_groups)
    monkeypatch.setattr(grouped_deltas, "grouped_linear", linear)
    monkeypatch.setattr(grouped_deltas, "group_ends", ends)
    ran.grouped(engine, use_grouped_mm=use_grouped_mm)
    loss, grads = loss_and_grads(engine, ids, labels)
    assert ran.tensors == 2
    if use_grouped_mm:
        planned = len(plan) + len(grouped_deltas.blocks(state.down, counts, grouped_deltas.DELTA_BLOCK_BYTES))
        assert uploads == {"per block": planned, "products without them": 0}
    else:
        assert uploads["per block"] == 0
    torch.testing.assert_close(loss, loop_loss, rtol=1e-6, atol=1e-6)
    for name, grad in loop_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        if name in selection:  # the entries of unrouted experts get no gradient, as in the loop
            assert grad.ne(0).any()


def test_blocks_cover_routed_runs_and_their_entries(quantized):
    loaded = load_quantized_model(quantized("qwen3_moe", num_layers=FAMILY_LAYERS, **WIDE))
    engine = SparseEngine(loaded, trainable_layers=[loaded.spec.moe_layers[-1]])
    weight = next(iter(engine.weights.values()))  # a fused (E, O, I) expert tensor
    e, o, i = weight.shape
    engine.set_deltas(random_selection(engine, frac=0.05))
    counts = [3, 0, 2, 5] + [1] * (e - 4)
    plan = grouped_deltas.blocks(weight, counts, budget=2 * o * i * 4)
    assert [(b.first, b.stop) for b in plan][:3] == [(0, 1), (2, 4), (4, 6)]
    assert plan[0].rows == slice(0, 3) and plan[1].rows == slice(3, 10) and plan[1].counts.tolist() == [2, 5]
    bounds = weight.delta._bounds
    assert plan[1].entries == slice(bounds[2], bounds[4])
    assert plan[-1].stop == e and plan[-1].rows.stop == sum(counts)
    # A larger budget keeps the unrouted expert 1 inside the first run, as an empty group.
    plan = grouped_deltas.blocks(weight, counts, budget=4 * o * i * 4)
    assert (plan[0].first, plan[0].stop, plan[0].rows) == (0, 4, slice(0, 10)) and plan[0].unrouted.tolist() == [1]
    assert plan[0].counts.tolist() == [3, 0, 2, 5] and plan[1].unrouted.numel() == 0
    # Unrouted experts at the ends are left out; an expert never spans two resident chunks.
    plan = grouped_deltas.blocks(weight, [0, 0, 4] + [0] * (e - 4) + [1])
    assert [(b.first, b.stop) for b in plan] == [(2, e)] and plan[0].rows == slice(0, 5)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("with_delta", [True, False], ids=["delta", "no-delta"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "pooled"])
def test_dense_scores_run_grouped_and_equal_the_loops(family, with_delta, exact, quantized, ran):
    """``usaf score``'s dense scores (each routed expert's slice gradient to its sink), with a delta and without one
    (the plan's first scoring), exact and pooled with a pool that loses nothing: the grouped path's candidates and
    scores are the loop's. Control: the scores of another batch differ."""
    engine = make_engine(quantized, family)
    if with_delta:
        selection = random_selection(engine)
        engine.set_deltas(selection, _values(selection))
    batches = [(*batch(seed), None) for seed in (1, 2)]
    # Pooled: a capacity of the whole tensor (4 x a quarter), so no block's shared floor or cut can differ.
    lossless = {name: math.prod(w.shape) // 4 for name, w in engine.weights.items()}
    settings = {"candidates": 40 if exact else lossless, "statistic": "grad", "exact": exact}

    def tops(grouped: bool, data=batches) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        ran.grouped(engine, grouped)
        accumulators = engine.dense_scores(data, **settings)
        assert all(float(acc.error_bound.max()) == 0 for acc in accumulators.values())
        return {name: acc.top(40) for name, acc in accumulators.items()}

    loop = tops(False)
    assert ran.tensors == 0 and ran.experts > 0
    ran.experts = 0
    ours = tops(True)
    assert ran.tensors == 2 * len(batches) and ran.experts == 0  # both tensors each batch, no expert loop
    assert ours.keys() == loop.keys() and ours
    for name, (indices, scores) in loop.items():
        assert torch.equal(ours[name][0], indices), name
        torch.testing.assert_close(ours[name][1], scores, rtol=1e-5, atol=1e-8)
    other = tops(True, [(*batch(7), None)])
    assert any(not torch.equal(other[n][0], loop[n][0]) for n in loop)


def test_a_small_pool_fed_by_blocks_keeps_its_bounds(quantized, ran):
    """A pool far smaller than the scores' support, fed a block at a time: every pooled score is a lower bound of the
    exact total and within ``error_bound`` of it, unpooled totals are within it too, and the pool finds as much of the
    exact top as one fed one expert at a time (28 and 25 of 40 for both when written). Control: the regime is lossy
    (a positive bound, pooled scores below some totals), so the bounds are not vacuous."""
    engine = make_engine(quantized, "qwen3_moe")
    batches = [(*batch(seed), None) for seed in (1, 2, 3)]
    ran.grouped(engine, False)
    looped = engine.dense_scores(batches, candidates=40, statistic="grad", exact=False)
    ran.grouped(engine, True)
    exact = engine.dense_scores(batches, candidates=40, statistic="grad", exact=True)
    pooled = engine.dense_scores(batches, candidates=40, statistic="grad", exact=False)
    assert ran.tensors == 2 * 2 * len(batches)
    for name, acc in pooled.items():
        e, o, i = acc.shape
        true = exact[name].dense_map().view(-1)  # (E*O*I,)
        indices, scores = acc.pool_entries()
        bound = acc.error_bound  # (E,)
        assert float(bound.max()) > 0, name  # the regime this test is for: entries were refused or cut
        assert (scores <= true[indices] * (1 + 1e-5)).all(), name
        assert (true[indices] <= (scores + bound[indices // (o * i)]) * (1 + 1e-5)).all(), name
        assert not torch.allclose(scores, true[indices]), name  # some history was lost, and it shows
        unpooled = torch.ones_like(true, dtype=torch.bool)
        unpooled[indices] = False
        assert (true[unpooled] <= bound.repeat_interleave(o * i)[unpooled] * (1 + 1e-5)).all(), name
        best = set(true.topk(40).indices.tolist())
        found, found_looped = (len(set(a.top(40)[0].tolist()) & best) for a in (acc, looped[name]))
        assert found >= found_looped - 2 and found >= 20, (name, found, found_looped)


def test_a_rigl_cycle_reselects_the_same_entries_grouped(quantized, ran):
    """Collecting steps then a reselection (``usaf train --reselect-every``), grouped and looped: the same new masks."""
    from usaf.engine.reselect import collect_scores, reselect

    def cycle(grouped: bool) -> dict[str, torch.Tensor]:
        engine = make_engine(quantized, "qwen3_moe", targets="all")
        ran.grouped(engine, grouped)
        engine.set_deltas(random_selection(engine))
        optimizer = SparseAdamW(engine.parameter_groups(lr=1e-2, router_lr=1e-2, weight_decay=0.0))
        # A pool of the whole tensor: blocks then share no floor or cut that one add per expert would not.
        with collect_scores(engine, pool_factor=10**6) as scores:
            for seed in range(3):
                train_step(engine, optimizer, *batch(seed))
                scores.end_batch()
        reselect(engine, optimizer, scores, 0.3)
        return {n: d.indices.clone() for n, d in engine.deltas().items()}

    ours = cycle(True)
    assert ran.tensors == 6
    loop = cycle(False)
    for name, indices in loop.items():
        assert torch.equal(ours[name], indices), name
    before = random_selection(make_engine(quantized, "qwen3_moe", targets="all"))
    assert any(not torch.equal(before[n], loop[n]) for n in loop)  # control: the reselection moved entries


def test_host_bases_take_the_loop(quantized):
    """A base not resident on the compute device (a pinned host base, copied one expert at a time) runs the loop.
    Control: resident where the forward runs, the grouped path applies."""
    engine = make_engine(quantized, "qwen3_moe")
    state = engine.loaded.experts[engine.trainable_layers[0]]
    state.grouped_deltas = True
    hidden = torch.zeros(1, state.gate_up.shape[2])
    assert grouped_deltas.applies(state, hidden)
    state.gate_up.resident.chunks = [c.to("meta") for c in state.gate_up.resident.chunks]  # another device
    assert not grouped_deltas.applies(state, hidden)
    state.grouped_deltas = False
    assert not grouped_deltas.applies(state, torch.zeros(1, state.gate_up.shape[2], device="meta"))


def test_training_steps_follow_the_loop(quantized, ran):
    """Five optimizer steps with the grouped path follow the loop's losses and values (up to summation order)."""

    def run(grouped: bool):
        engine = make_engine(quantized, "mixtral")
        ran.grouped(engine, grouped)
        engine.set_deltas(random_selection(engine))
        optimizer = SparseAdamW(engine.parameter_groups(lr=1e-2, router_lr=1e-2, weight_decay=0.0), max_grad_norm=1.0)
        losses = [train_step(engine, optimizer, *batch(seed)) for seed in range(5)]
        return losses, {n: d.values.detach().clone() for n, d in engine.deltas().items()}

    grouped_losses, grouped_values = run(True)
    assert ran.tensors == 10
    loop_losses, loop_values = run(False)
    torch.testing.assert_close(torch.tensor(grouped_losses), torch.tensor(loop_losses), rtol=1e-5, atol=1e-5)
    for name, values in loop_values.items():
        assert values.abs().gt(0).any()  # the steps moved them
        torch.testing.assert_close(grouped_values[name], values, rtol=1e-4, atol=1e-6)


def test_the_device_capability_switches_it(quantized):
    """Loading sets it from ``Capabilities.dense_delta_terms``: off on the CPU (the loop), on where a backend asks."""
    engine = make_engine(quantized, "qwen3_moe")
    assert not any(s.grouped_deltas for s in engine.loaded.experts.values())  # the CPU keeps the loop
    caps = resolve_backend("cpu", env={}).capabilities
    state = next(iter(engine.loaded.experts.values()))
    state.set_capabilities(dataclasses.replace(caps, dense_delta_terms=True))
    assert state.grouped_deltas
