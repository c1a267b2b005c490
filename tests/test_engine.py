"""The engine against dense autograd, for every family: gradients of the sparse values and the routers,
the frozen-prefix cache, dense scores, and a few optimizer steps."""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES
from helpers import reference_model
from helpers_engine import (
    FAMILY_LAYERS,
    assert_gradients_equal_dense_autograd,
    batch,
    make_engine,
    random_selection,
    reference_loss,
    stored_grad,
    view_of,
)
from usaf.engine.engine import SparseEngine
from usaf.engine.loading import load_quantized_model


@pytest.mark.parametrize("family", FAMILIES)
def test_sparse_and_router_gradients_equal_dense_autograd(family, tiny_model, quantized):
    engine = make_engine(quantized, family)
    selection = random_selection(engine)
    engine.set_deltas(selection)
    ids, labels = batch()
    engine.loss(ids, labels).loss.backward()
    assert_gradients_equal_dense_autograd(engine, selection, tiny_model(family, num_layers=FAMILY_LAYERS), ids, labels)


def test_sparse_gradients_equal_dense_autograd_at_128_experts_top_8(tiny_model, quantized):
    """The training path (tokens sorted by expert once, deltas, routers) at Qwen3-30B-A3B's routing, where most
    of the 128 experts get a handful of tokens and some none; negative control as above."""
    shape = {"num_experts": 128, "num_experts_per_tok": 8}
    loaded = load_quantized_model(quantized("qwen3_moe", num_layers=FAMILY_LAYERS, **shape))
    engine = SparseEngine(loaded, trainable_layers=[loaded.spec.moe_layers[-1]])
    selection = random_selection(engine, frac=0.02)
    engine.set_deltas(selection)
    ids, labels = batch(size=(2, 40))
    engine.loss(ids, labels).loss.backward()
    routed = loaded.experts[engine.trainable_layers[0]].tokens_per_expert.gt(0)
    assert int(routed.sum()) > 100  # most experts got a few of the 80 x 8 assignments: many small groups

    for name, weight in engine.weights.items():
        assert weight.delta.values.grad.abs().gt(0).sum() > weight.delta.nnz // 4, name  # enough entries see a token
    source = tiny_model("qwen3_moe", num_layers=FAMILY_LAYERS, **shape)
    assert_gradients_equal_dense_autograd(engine, selection, source, ids, labels)


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_from_the_prefix_cache_equals_the_full_forward(family, quantized):
    engine = make_engine(quantized, family)
    engine.set_deltas(random_selection(engine))
    ids, labels = batch(1)
    full = engine.loss(ids, labels).loss
    states = engine.prefix_states(ids)
    cached = engine.loss(ids, labels, prefix_states=states).loss
    torch.testing.assert_close(cached, full, rtol=1e-6, atol=1e-6)
    # Negative control: a state from other tokens gives another loss.
    other = engine.prefix_states(batch(2)[0])
    assert not torch.allclose(engine.loss(ids, labels, prefix_states=other).loss, full)


def test_dense_scores_equal_the_naive_top_k(tiny_model, quantized):
    engine = make_engine(quantized, "qwen3_moe")
    ids, labels = batch(3)
    k = 50
    scores = engine.dense_scores([(ids, labels, None)], candidates=k, statistic="grad")

    reference = reference_model(tiny_model("qwen3_moe", num_layers=FAMILY_LAYERS), engine.loaded)
    view = view_of(reference, engine)
    for name in engine.weights:
        view.requires_grad_(name)
    reference_loss(reference, ids, labels).backward()
    for name, weight in engine.weights.items():
        naive = stored_grad(view, name, weight.q.transposed).abs()
        expected = torch.topk(naive, k).indices.sort().values
        got, _ = scores[name].top(k)
        assert torch.equal(got, expected), name
    # No gradient state is left behind by a scoring pass.
    assert all(p.grad is None for p in engine.routers.values())


def test_scores_in_halves_equal_separate_passes(quantized):
    """One backward per batch scores the sample and the batch's half: the same (exact) sums, bit for bit, as a pass
    over all the batches and one over each half's. The control: the halves differ from each other."""
    engine = make_engine(quantized, "qwen3_moe")
    tagged = [(h, *batch(seed)) for h, seed in ((0, 1), (1, 2), (0, 3))]
    settings = {"candidates": 50, "statistic": "grad", "exact": True}
    sample, halves = engine.dense_scores_in_halves([(h, ids, labels, None) for h, ids, labels in tagged], **settings)
    want = engine.dense_scores([(ids, labels, None) for _, ids, labels in tagged], **settings)
    want_halves = [
        engine.dense_scores([(ids, labels, None) for h, ids, labels in tagged if h == half], **settings)
        for half in (0, 1)
    ]
    for got, expected in ((sample, want), *zip(halves, want_halves)):
        for name in engine.weights:
            assert torch.equal(got[name].dense_map(), expected[name].dense_map()), name
            assert got[name].batches == expected[name].batches
    assert not all(torch.equal(halves[0][n].dense_map(), halves[1][n].dense_map()) for n in engine.weights), "control"
    assert all(w.score_sink is None for w in engine.weights.values())


def test_optimizer_steps_lower_the_loss_and_leave_the_rest_untouched(quantized):
    from usaf.engine.optim import SparseAdamW

    engine = make_engine(quantized, "qwen3_moe")
    engine.set_deltas(random_selection(engine, frac=0.05))
    trained = {id(p) for group in engine.parameter_groups(lr=1, router_lr=1, weight_decay=0) for p in group["params"]}
    frozen_before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if id(p) not in trained}
    assert len(frozen_before) > 10
    codes_before = {n: w.q.codes.clone() for n, w in engine.weights.items()}
    optimizer = SparseAdamW(engine.parameter_groups(lr=0.1, router_lr=1e-2, weight_decay=0.0), max_grad_norm=1.0)
    ids, labels = batch(4)
    losses = []
    for _ in range(8):
        parts = engine.loss(ids, labels)
        losses.append(parts.loss.item())
        engine.model.zero_grad(set_to_none=True)
        for d in engine.deltas().values():
            d.values.grad = None
        parts.loss.backward()
        assert optimizer.step().applied
    assert losses[-1] < losses[0] - 0.05, losses
    for name, before in frozen_before.items():
        assert torch.equal(engine.model.get_parameter(name), before), name
    for name, weight in engine.weights.items():
        assert torch.equal(weight.q.codes, codes_before[name])
        assert weight.delta.values.abs().sum() > 0


def test_load_stats_and_memory_accounting(quantized):
    engine = make_engine(quantized, "mixtral")
    ids, labels = batch(5)
    with torch.no_grad():
        engine.loss(ids, labels)
    stats = engine.load_stats()
    for load in stats.values():
        assert sum(load.tokens_per_expert) == ids.numel() * engine.spec.top_k
        assert 0 < load.entropy <= torch.log(torch.tensor(float(engine.spec.num_experts))) + 1e-9
        assert load.dead_experts == sum(1 for c in load.tokens_per_expert if c == 0)
    assert all(sum(s.tokens_per_expert) == 0 for s in engine.load_stats().values())  # reset
    memory = engine.memory()
    resident = sum(w.shape[0] * w.shape[1] * w.shape[2] * 4 for w in engine.weights.values())
    assert memory["resident_bases"] == resident
    assert memory["experts_4bit"] > 0 and memory["deltas"] == 0
    engine.set_deltas(random_selection(engine, frac=0.01))
    nnz = engine.trainable_count()["delta_entries"]
    offsets = sum(d.offsets.numel() * 8 for d in engine.deltas().values())
    assert engine.memory()["deltas"] == nnz * (4 + 4 * 8) + offsets  # fp32 value + 4 int64 indices per entry


def test_activation_accounting_measures_what_a_training_forward_saves(quantized):
    engine = make_engine(quantized, "qwen3_moe")
    ids, labels = batch(6, size=(2, 32))
    with torch.no_grad():
        engine.loss(ids, labels)
    assert "activations" not in engine.memory()  # no graph, nothing held for a backward
    engine.loss(ids, labels)
    short = engine.activations.last
    long_ids, long_labels = batch(6, size=(2, 128))
    engine.loss(long_ids, long_labels)
    long = engine.activations.last
    assert engine.memory()["activations"] == engine.activations.peak == long
    # Activations grow with the tokens in the batch (about linearly here); weights are not counted in them:
    assert 3.0 < long / short < 5.0, (short, long)
    weights = engine.memory()
    assert short < weights["other_weights"] + weights["resident_bases"]
    # Frozen layers below the trainable one build no graph (nothing there requires grad), so starting
    # from the cached prefix saves compute, not activation memory.
    states = engine.prefix_states(long_ids)
    engine.loss(long_ids, long_labels, prefix_states=states)
    assert engine.activations.last == long


def test_the_activation_meter_counts_from_its_start_module_only():
    """The engine's meter starts at the first decoder layer: what runs before it (mask building, which is
    torch.func.vmap on transformers 4.x + torch < 2.6 and refuses saved-tensor hooks) runs without hooks."""
    from usaf.engine.activations import SavedTensorMeter

    layer = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)

    def forward(start_at) -> torch.Tensor:
        before = (x * x).sum(dim=0, keepdim=True)  # saves x (2 KiB): before the start module
        if start_at is not None:  # transformers 4.x's mask building on torch < 2.6 (where it would raise under hooks)
            torch.func.vmap(torch.sin)(torch.ones(2, 2))
        return layer(before.expand(256, 64)).tanh().sum()  # saves the (256, 64) input and the tanh output

    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    counts = {}
    for start_at in (None, layer):
        meter = SavedTensorMeter(lambda: weights, start_at=start_at)
        with meter.measure():
            forward(start_at)
        counts[start_at is None] = meter.last
    assert counts[True] - counts[False] == x.numel() * 4  # only x, saved before the layer, is not counted
    assert counts[False] >= 256 * 64 * 4  # the tanh output (the linear saved the expand of a (1, 64) storage)


def test_prefix_cache_spills_to_disk_and_serves_identical_states(quantized, tmp_path, monkeypatch):
    from usaf.engine.prefix import PrefixCache

    engine = make_engine(quantized, "olmoe")
    engine.set_deltas(random_selection(engine))
    ids, labels = batch(6, size=(3, 16))
    mask = torch.ones_like(ids)
    mask[2, 10:] = 0  # a right-padded sample
    one_state = 16 * engine.spec.hidden_size * 4
    cache = PrefixCache(ram_budget_bytes=one_state, spill_path=tmp_path / "prefix.bin")
    computed = []
    real = engine.prefix_states
    monkeypatch.setattr(engine, "prefix_states", lambda x, m=None: computed.append(x.shape) or real(x, m))
    first = engine.cached_prefix_states(ids, cache, model_fingerprint="m", attention_mask=mask)
    assert len(computed) == 3 and len(cache) == 3
    assert cache.nbytes["ram"] == one_state and cache.nbytes["disk"] > 0 and (tmp_path / "prefix.bin").is_file()
    second = engine.cached_prefix_states(ids, cache, model_fingerprint="m", attention_mask=mask)
    assert len(computed) == 3  # all three served from RAM or the memory-mapped file
    assert torch.equal(first, second)
    # Served states equal freshly computed ones at every real position (right padding is invisible).
    direct = real(ids)
    torch.testing.assert_close(first[:2], direct[:2])
    torch.testing.assert_close(first[2, :10], direct[2, :10])
    loss_cached = engine.loss(ids[:2], labels[:2], prefix_states=first[:2]).loss
    torch.testing.assert_close(loss_cached, engine.loss(ids[:2], labels[:2]).loss)
    # Another model fingerprint is another key: nothing stale is reused.
    engine.cached_prefix_states(ids, cache, model_fingerprint="other", attention_mask=mask)
    assert len(computed) == 6
    assert engine.memory(cache=cache)["prefix_cache_disk"] == cache.nbytes["disk"]


def test_router_losses_are_the_trainable_layers_own_and_reach_only_the_routers(quantized):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    engine = make_engine(quantized, "qwen3_moe", aux_loss_coef=0.5, z_loss_coef=0.1)
    ids, labels = batch(7)
    parts = engine.loss(ids, labels)
    outputs = engine.model(input_ids=ids, output_router_logits=True, use_cache=False)
    config = engine.model.config
    top_logits = outputs.router_logits[engine.spec.moe_layers.index(engine.trainable_layers[0])]
    # The trainable layer's own load-balancing loss, not the model's (which pools every layer's counts).
    expected_aux = load_balancing_loss_func((top_logits,), config.num_experts, config.num_experts_per_tok)
    torch.testing.assert_close(parts.aux, expected_aux)
    pooled = load_balancing_loss_func(outputs.router_logits, config.num_experts, config.num_experts_per_tok)
    assert not torch.allclose(parts.aux, pooled)  # control: the comparison above can tell the two apart
    torch.testing.assert_close(parts.z, torch.logsumexp(top_logits.float(), -1).pow(2).mean())
    torch.testing.assert_close(parts.loss, parts.ce + 0.5 * parts.aux + 0.1 * parts.z)
    # The router terms' gradient reaches the trainable routers (and nothing else trains).
    (0.5 * parts.aux + 0.1 * parts.z).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in engine.routers.values())
    # A family without a load-balancing loss says so instead of silently training without it.
    with pytest.raises(ValueError, match="no load-balancing loss"):
        make_engine(quantized, "deepseek_v3", aux_loss_coef=0.1).loss(ids, labels)


def test_the_z_loss_from_a_cached_prefix_equals_the_full_forwards(quantized):
    """From cached prefix states the frozen layers below do not run and record no router logits; the z-loss
    must still pick the trainable layers' own (it indexed by layer position and crashed: usaf train's default
    prefix cache with --z-loss-coef)."""
    engine = make_engine(quantized, "qwen3_moe", z_loss_coef=0.01)
    assert engine.prefix is not None  # the top layer trains: the layers below are a frozen prefix
    ids, labels = batch(3)
    full = engine.loss(ids, labels)
    cached = engine.loss(ids, labels, prefix_states=engine.prefix_states(ids))
    torch.testing.assert_close(cached.z, full.z)
    torch.testing.assert_close(cached.loss, full.loss)
    assert full.z > 0  # negative control for a vacuous comparison: the term is there


def test_the_load_balancing_loss_and_its_gradient_from_a_cached_prefix_equal_the_full_forwards(quantized):
    """The load-balancing loss is the trainable layers' own: the model's pooled loss also counted the frozen
    layers' routing, which a cached step never runs, so a cached step's router gradient differed."""
    engine = make_engine(quantized, "qwen3_moe", aux_loss_coef=0.5)
    ids, labels = batch(3)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # padding is not counted in the balance
    grads = []
    for states in (None, engine.prefix_states(ids, mask)):
        engine.model.zero_grad(set_to_none=True)
        parts = engine.loss(ids, labels, mask, prefix_states=states)
        parts.aux.backward()
        grads.append((parts.aux.detach(), [p.grad.clone() for p in engine.routers.values()]))
    (full, full_grads), (cached, cached_grads) = grads
    torch.testing.assert_close(cached, full)
    for a, b in zip(full_grads, cached_grads):
        torch.testing.assert_close(b, a)
    assert full > 0 and all(g.abs().sum() > 0 for g in full_grads)  # not vacuous


def test_resident_bases_go_to_the_device_only_when_they_fit():
    from types import SimpleNamespace

    from usaf.engine.engine import resident_placement

    def backend(kind: str, free: int | None, pinned: bool):
        memory = SimpleNamespace(device_free=free)
        return SimpleNamespace(
            device=torch.device(kind), memory=lambda: memory, capabilities=SimpleNamespace(pinned_memory=pinned)
        )

    assert resident_placement(backend("cpu", None, False), 10**12) == (torch.device("cpu"), False)
    assert resident_placement(backend("cuda", 10 * 2**30, True), 2**30) == (torch.device("cuda"), False)
    assert resident_placement(backend("cuda", 2**30, True), 2**30) == (torch.device("cpu"), True)
    assert resident_placement(backend("cuda", None, False), 1) == (torch.device("cpu"), False)  # unknown free
