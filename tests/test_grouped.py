"""The grouped experts forward (``usaf.engine.grouped``) against the per-expert loop it replaces where no graph is kept.

On CPU in fp32 the two add the same per-expert products into each token in the same order, so the logits must be
bit-identical (gpt-oss's biases are added after the grouped matmul rather than inside ``F.linear``: close, not
identical). Each check also asserts the grouped path really ran (a negative control against a silent fallback).
It runs in both CI environments: transformers 5 dispatches through its experts registry, 4.57 through usaf's
``LegacyExperts`` (the DirectML configuration's per-expert layout).
"""

from __future__ import annotations

import pytest
import torch

from conftest import FAMILIES
from helpers import RecordingProgress
from usaf.engine import grouped


@pytest.fixture
def calls(monkeypatch):
    """Counts grouped forwards; ``calls.loop()`` makes every forward take the per-expert loop instead."""

    class Calls:
        grouped = 0

        def loop(self):
            monkeypatch.setattr(grouped, "applies", lambda state, hidden: False)

    counter = Calls()
    real = grouped.grouped_forward

    def counting(*args, **kwargs):
        counter.grouped += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(grouped, "grouped_forward", counting)
    return counter


def _logits(loaded, ids):
    with torch.no_grad():
        return loaded.model(input_ids=ids).logits


def _ids(seed: int, shape=(2, 24)) -> torch.Tensor:
    return torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(seed))


def _compare(family: str, ours: torch.Tensor, loop: torch.Tensor) -> None:
    if family == "gpt_oss":  # biases added after the grouped matmul, not inside addmm
        torch.testing.assert_close(ours, loop, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(ours, loop)


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_forward_equals_the_loop_for_every_family(family, quantized, calls, monkeypatch):
    from usaf.engine.loading import load_quantized_model

    loaded = load_quantized_model(quantized(family))
    ids = _ids(1)
    ours = _logits(loaded, ids)
    assert calls.grouped == len(loaded.experts)  # every MoE layer ran grouped
    calls.loop()
    loop = _logits(loaded, ids)
    assert calls.grouped == len(loaded.experts)
    _compare(family, ours, loop)


@pytest.mark.parametrize("block_bytes", [1, None])
@pytest.mark.parametrize("grouped_mm", [True, False])
def test_grouped_forward_at_128_experts_top_8(block_bytes, grouped_mm, tiny_model, tmp_path, calls, monkeypatch):
    """Qwen3-30B-A3B's routing (128 experts, top-8), in one block or one expert per block, with torch's grouped
    matmul or a GEMM per expert; and over resident bases (views, no dequantization)."""
    from usaf.engine.loading import load_quantized_model
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize

    source = tiny_model("qwen3_moe", num_experts=128, num_experts_per_tok=8)
    _, qdir = quantize(QuantizeConfig(model=str(source), out=tmp_path / "q", method="rtn", group_size=8))
    if block_bytes is not None:
        monkeypatch.setattr(grouped, "HOST_BLOCK_BYTES", block_bytes)
    loaded = load_quantized_model(qdir)
    for state in loaded.experts.values():
        state.grouped_mm = grouped_mm
    ids = _ids(2, (2, 40))
    ours = _logits(loaded, ids)
    assert calls.grouped == len(loaded.experts)
    routed = int(loaded.experts[0].tokens_per_expert.gt(0).sum())
    assert routed > 100  # most of the 128 experts got tokens: many groups, many blocks
    for state in loaded.experts.values():
        state.gate_up.make_resident()
        state.down.make_resident()
    resident = _logits(loaded, ids)
    calls.loop()
    loop = _logits(loaded, ids)
    assert torch.equal(ours, loop) and torch.equal(resident, loop)


def test_blocks_respect_the_budget_and_resident_chunks(tiny_model, tmp_path, monkeypatch):
    from usaf.engine.loading import load_quantized_model
    from usaf.engine.resident import ResidentBase
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize

    source = tiny_model("qwen3_moe", num_experts=16, num_experts_per_tok=4)
    _, qdir = quantize(QuantizeConfig(model=str(source), out=tmp_path / "q", method="rtn", group_size=8))
    state = load_quantized_model(qdir).experts[0]
    counts = torch.tensor([3, 0, 2, 5, 0, 0, 1, 4, 0, 2, 2, 0, 0, 0, 7, 1])
    cpu = torch.device("cpu")
    per_expert = 4 * sum(w.shape[1] * w.shape[2] for w in (state.gate_up, state.down))
    monkeypatch.setattr(grouped, "HOST_BLOCK_BYTES", 2 * per_expert)
    blocks = list(grouped._blocks(state, counts, cpu))
    assert [len(b.ids) for b in blocks] == [2, 2, 2, 2, 1]  # 9 routed experts, two a block
    assert all(len(b.ids) * per_expert <= grouped.HOST_BLOCK_BYTES for b in blocks)
    assert torch.equal(torch.cat([b.ids for b in blocks]), torch.nonzero(counts).flatten())  # routed only
    assert blocks[0].rows.start == 0 and blocks[-1].rows.stop == int(counts.sum())
    # rows are contiguous and each block's rows are its experts' counts
    assert all(a.rows.stop == b.rows.start for a, b in zip(blocks, blocks[1:], strict=False))
    assert all(torch.equal(b.counts, counts[b.ids]) for b in blocks)
    assert all(b.rows.stop - b.rows.start == int(b.counts.sum()) for b in blocks)
    # a run of consecutive experts is read as a slice (views of the codes), a selection with gaps as indices
    assert all(isinstance(b.experts, slice) == (int(b.ids[-1]) - int(b.ids[0]) + 1 == len(b.ids)) for b in blocks)
    assert {isinstance(b.experts, slice) for b in blocks} == {True, False}  # both kinds occur here: not vacuous
    # resident in chunks of 5 experts (gate_up) and 3 (down): runs of consecutive experts that cross no chunk of either
    for weight, per_chunk in ((state.gate_up, 5), (state.down, 3)):
        expert_bytes = 4 * weight.shape[1] * weight.shape[2]
        weight.resident = ResidentBase.dequantized(
            weight.q, dtype=torch.float32, device=cpu, max_bytes=per_chunk * expert_bytes
        )
        assert weight.resident.per_chunk == per_chunk
    runs = [(b.ids.tolist(), b.rows.start, b.rows.stop) for b in grouped._blocks(state, counts, cpu)]
    assert all(isinstance(b.experts, slice) for b in grouped._blocks(state, counts, cpu))  # views of the resident
    assert runs == [
        ([0, 1, 2], 0, 5), ([3], 5, 10), ([6, 7], 10, 15), ([9], 15, 17), ([10], 17, 19), ([14], 19, 26), ([15], 26, 27)
    ]  # fmt: skip


def test_grouped_path_is_not_taken_with_a_graph_or_a_delta(quantized):
    """Negative controls: training forwards (a graph), layers with a delta or a score sink keep the loop."""
    from usaf.engine.loading import load_quantized_model

    loaded = load_quantized_model(quantized("qwen3_moe"))
    state = loaded.experts[loaded.spec.moe_layers[-1]]
    hidden = torch.zeros(3, 32)
    with torch.no_grad():
        assert grouped.applies(state, hidden)
    assert grouped.applies(state, hidden)  # grad mode on, but nothing requires grad: no graph
    assert not grouped.applies(state, hidden.requires_grad_())
    state.down.score_sink = lambda expert: None
    with torch.no_grad():
        assert not grouped.applies(state, hidden)
    state.down.score_sink = None
    state.set_index_ops(False)
    with torch.no_grad():
        assert not grouped.applies(state, hidden)  # DirectML: the index-free forward


# -- the frozen layers dequantized once (usaf.stages.engine_setup.frozen_layers_resident) ---------------------------


def test_frozen_layers_stay_4_bit_when_they_do_not_fit_or_stream(quantized, monkeypatch):
    from usaf.backends import resolve_backend
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model
    from usaf.stages.engine_setup import frozen_layers_resident
    from usaf.stages.progress import NullProgress

    backend = resolve_backend("cpu")

    def engine(**placement):
        loaded = load_quantized_model(quantized("qwen3_moe", num_layers=3, tokenizer=True))
        return SparseEngine(loaded, trainable_layers=[2], **placement)

    monkeypatch.setattr(type(backend), "free_memory", lambda self: 1000)  # far less than two layers' experts
    e, progress = engine(), NullProgress()
    assert not frozen_layers_resident(e, backend, progress)
    assert e.loaded.experts[0].gate_up.resident is None and "dequantized per forward" in progress.notes[-1]
    monkeypatch.undo()
    e = engine(stream_experts="copy")
    assert not frozen_layers_resident(e, backend, NullProgress()) and e.loaded.experts[0].gate_up.resident is None
    e = engine()  # the control: with the memory, they are made resident
    assert frozen_layers_resident(e, backend, NullProgress()) and e.loaded.experts[1].down.resident is not None


def test_dequantizing_once_is_a_progress_phase_of_its_bytes(quantized):
    """Dequantizing the frozen layers once shows as a phase of bytes, advanced per tensor to the bytes it reports;
    per forward (nothing dequantized now) there is no phase."""
    from usaf.backends import resolve_backend
    from usaf.engine.loading import load_quantized_model
    from usaf.stages.engine_setup import make_resident

    backend = resolve_backend("cpu")
    loaded = load_quantized_model(quantized("qwen3_moe", num_layers=3, tokenizer=True))
    progress = RecordingProgress()
    assert make_resident(loaded, backend, False, [0, 1], progress)[0] is False and progress.events == []
    resident, nbytes = make_resident(loaded, backend, True, [0, 1], progress)
    assert resident and nbytes > 0
    assert progress.events[0] == ("dequantizing experts once", nbytes, "bytes") and progress.events[-1] == "finish"
    steps = progress.events[1:-1]
    assert len(steps) == 4 and sum(amount for amount, _ in steps) == nbytes  # gate_up and down of 2 layers


def _per_expert_loop(self, state, hidden_states, top_k_index, top_k_weights):
    """The training forward as it was: every expert searches, gathers, weights and adds back its own tokens."""
    from usaf.engine.experts import _expert_output

    out = torch.zeros_like(hidden_states, dtype=torch.float32)
    counts = state.record_load(top_k_index)
    for expert in torch.nonzero(counts).flatten().tolist():
        token_idx, k_pos = torch.where(top_k_index == expert)
        y = _expert_output(self, state, hidden_states[token_idx], expert)
        out.index_add_(0, token_idx, (y * top_k_weights[token_idx, k_pos, None]).float())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_training_forward_sorted_once_equals_the_per_expert_loop(family, quantized, monkeypatch):
    """A trainable layer with deltas, with a graph (the loop's path): tokens sorted by expert once give the per-expert
    loop's loss bit for bit (the same products, added in the same order) and its gradients up to the order autograd
    sums the gathers' backward. The control: a changed delta value moves the loss."""
    from helpers_engine import batch, make_engine, random_selection
    from usaf.engine import experts

    engine = make_engine(quantized, family)
    selection = random_selection(engine)
    values = {n: torch.randn(len(s), generator=torch.Generator().manual_seed(3)) * 1e-2 for n, s in selection.items()}
    ids, labels = batch(4)

    def loss_and_grads():
        engine.set_deltas(selection, values)
        loss = engine.loss(ids, labels).loss
        loss.backward()
        return loss.detach(), {n: d.values.grad.clone() for n, d in engine.deltas().items()}

    ours, our_grads = loss_and_grads()
    monkeypatch.setattr(experts, "_sorted_loop", _per_expert_loop)
    loop, loop_grads = loss_and_grads()
    assert torch.equal(ours, loop)
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, loop_grads[name], rtol=1e-5, atol=1e-7)
    values = {n: v + 1e-2 for n, v in values.items()}
    assert not torch.equal(loss_and_grads()[0], loop), "control: the deltas are in the loss"


def test_a_block_of_consecutive_experts_reads_views_of_the_codes(tiny_model, tmp_path):
    """``ExpertWeight.block`` dequantizes a run of consecutive experts, given as a slice, from views (no gather of
    codes, scales and zeros, no upload of the selection on a device); a selection with a gap gathers (the control).
    The same values as :func:`dequantize` of those experts."""
    from usaf.engine.loading import load_quantized_model
    from usaf.quant import dequantize
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize
    from usaf.testing.dispatch import DispatchCount

    source = tiny_model("qwen3_moe", num_experts=16, num_experts_per_tok=4)
    _, qdir = quantize(QuantizeConfig(model=str(source), out=tmp_path / "q", method="rtn", group_size=8))
    weight = load_quantized_model(qdir).experts[0].gate_up
    cpu = torch.device("cpu")
    for experts, selection, gathers in (([4, 5, 6, 7], slice(4, 8), 0), ([4, 5, 7], torch.tensor([4, 5, 7]), 3)):
        with DispatchCount() as count:
            block = weight.block(selection, cpu)
        assert sum(n for name, n in count.names.items() if name.startswith("index_select")) == gathers
        expected = dequantize(weight.q, experts=experts, dtype=weight.compute_dtype, memory_layout=False)
        assert torch.equal(block, expected)


def test_loading_is_a_progress_phase_of_every_tensor(quantized):
    """``load_for_engine`` shows the load as a phase counting every base tensor of the shards and both expert
    tensors of every MoE layer, advanced once per tensor, to the end."""
    from safetensors import safe_open

    from usaf.backends import resolve_backend
    from usaf.stages.change import model_with_change
    from usaf.stages.engine_setup import load_for_engine

    qdir = quantized("qwen3_moe", num_layers=3, tokenizer=True)
    base = sum(len(safe_open(str(f), "pt").keys()) for f in qdir.glob("*.safetensors"))
    progress = RecordingProgress()
    load_for_engine(qdir, resolve_backend("cpu"), torch.float32, False, progress)
    expected = base + 2 * 3  # gate_up and down of the 3 MoE layers
    assert progress.events[0] == ("loading the model", expected, "tensors")
    assert progress.events[1:] == [(1, {})] * expected + ["finish"]
    progress = RecordingProgress()  # generate's load (the model with a change, here none)
    model_with_change(qdir, None, device=torch.device("cpu"), progress=progress)
    assert progress.events == [("loading the model", expected, "tensors"), *[(1, {})] * expected, "finish"]
