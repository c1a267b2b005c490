"""``--targets dense``: the MLPs of dense (non-MoE) layers as sparse-delta targets (DeepSeek-V3's first layers,
Qwen's ``mlp_only_layers``). The engine against dense autograd, layer choice and refusals, and a CLI run through
RigL, an interruption, export (merged and delta), eval and generate."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import TRANSFORMERS_V5
from helpers import invoke, reference_model
from helpers_engine import (
    FAMILY_LAYERS,
    backward_with_random_deltas,
    hold_deltas,
    reference_loss,
    stored_grad,
)
from usaf.engine.engine import SparseEngine, TargetsError
from usaf.engine.linear_target import LinearTarget
from usaf.engine.loading import load_quantized_model
from usaf.families.modules import FusedView
from usaf.families.targets import linear_target_modules, target_of

# family -> a tiny model with dense layers: deepseek_v3's layer 0; Qwen's every other layer (MoE 1 and 3, dense 0
# and 2), so that a dense layer trains above a frozen prefix and below a MoE layer
DENSE = {
    "deepseek_v3": {"num_layers": FAMILY_LAYERS},
    "qwen3_moe": {"num_layers": 4, "decoder_sparse_step": 2},
    "qwen2_moe": {"num_layers": 4, "decoder_sparse_step": 2},
}


def dense_engine(quantized, family: str, targets=("experts", "attention", "dense")) -> SparseEngine:
    """Every layer from the family's last dense layer up trains."""
    loaded = load_quantized_model(quantized(family, **DENSE[family]))
    first = loaded.spec.dense_layers[-1]
    return SparseEngine(loaded, trainable_layers=range(first, loaded.spec.num_layers), targets=targets)


def test_dense_modules_are_named_in_dense_layers_only(quantized):
    engine = dense_engine(quantized, "deepseek_v3")
    spec = engine.spec
    assert spec.dense_layers == (0,) and engine.dense_layers == (0,) and engine.trainable_layers == (1, 2)
    assert engine.layers == (0, 1, 2) and engine.prefix is None  # the dense layer is the first trained: no prefix
    names = linear_target_modules(engine.model, spec, 0, "dense")
    assert sorted(n.rsplit(".", 1)[1] for n in names) == ["down_proj", "gate_proj", "up_proj"]
    assert all(n.startswith("model.layers.0.mlp.") and target_of(f"{n}.weight", spec) == "dense" for n in names)
    assert linear_target_modules(engine.model, spec, 1, "dense") == []  # a MoE layer has no dense MLP
    assert linear_target_modules(engine.model, spec, 0, "shared") == []  # nor a dense layer a shared expert
    kinds = {target_of(n, spec) for n in engine.weights}
    assert kinds == {"experts", "attention", "dense"}
    assert any(n.startswith("model.layers.0.self_attn.") for n in engine.weights)  # its attention trains too
    assert not any(n.startswith("model.layers.0.mlp.gate.") for n in engine.routers)  # no router there


@pytest.mark.parametrize("family", sorted(DENSE))
def test_dense_targets_forward_and_gradients_equal_dense_autograd(family, tiny_model, quantized):
    """The dense layer's MLP and attention and the MoE layers' targets, with nonzero deltas: the engine's loss and
    sparse gradients are dense autograd's on a transformers model holding ``W + D``. Control: one column over."""
    engine = dense_engine(quantized, family)
    assert (engine.prefix is None) == (family == "deepseek_v3")  # Qwen's: layers 0-1 frozen below the dense layer 2
    dense = [n for n in engine.weights if target_of(n, engine.spec) == "dense"]
    assert len(dense) == 3 and all(isinstance(engine.weights[n], LinearTarget) for n in dense)
    selection, values, ids, labels, loss = backward_with_random_deltas(engine)

    reference = reference_model(tiny_model(family, **DENSE[family]), engine.loaded)
    view = FusedView(reference, engine.spec)
    hold_deltas(view, engine, selection, values)
    expected = reference_loss(reference, ids, labels)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    expected.backward()
    for name, weight in engine.weights.items():
        grad = stored_grad(view, name, transposed=not isinstance(weight, LinearTarget) and weight.q.transposed)
        got = weight.delta.values.grad
        torch.testing.assert_close(got, grad[selection[name]], rtol=1e-4, atol=1e-6, msg=name)
        if name in dense:
            assert got.abs().gt(0).any(), name
            assert not torch.allclose(got, grad[(selection[name] + 1) % grad.numel()], rtol=1e-3, atol=1e-6), name
    trained = {id(p) for p in engine.routers.values()} | {id(d.values) for d in engine.deltas().values()}
    assert all(p.grad is None for p in engine.model.parameters() if id(p) not in trained)


def test_the_dense_target_needs_dense_layers_among_the_trained(quantized):
    loaded = load_quantized_model(quantized("qwen3_moe", num_layers=FAMILY_LAYERS))  # every layer MoE
    with pytest.raises(TargetsError, match=r"no dense modules .*\(every layer of this model is a MoE layer\)"):
        SparseEngine(loaded, trainable_layers=[2], targets=("experts", "dense"))
    loaded = load_quantized_model(quantized("deepseek_v3", num_layers=FAMILY_LAYERS))
    with pytest.raises(TargetsError, match=r"its dense layers are \[0\]: train from the lowest of them"):
        SparseEngine(loaded, trainable_layers=[2], targets=("experts", "dense"))
    with pytest.raises(ValueError, match="trainable layers must be MoE layers"):  # a dense layer without the target
        SparseEngine(loaded, trainable_layers=[0, 2], targets=("experts",))
    with pytest.raises(ValueError, match="one MoE layer at least"):
        SparseEngine(loaded, trainable_layers=[0], targets=("dense",))


def test_score_refuses_the_dense_target_where_no_dense_layer_trains(quantized, tmp_path):
    """One error naming --targets and the fix, no plan written. Control: --train-from 0 makes the same plan."""
    from helpers_trained import tokenize

    qdir = quantized("deepseek_v3", num_layers=FAMILY_LAYERS, tokenizer=True)
    tokens = tokenize(qdir, tmp_path / "tokens")
    out = tmp_path / "plan"
    args = ("score", "--model", qdir, "--data", tokens, "--targets", "experts,dense", "--calib-samples", 4,
            "--no-stability", "--no-lr-test", "--out", out)  # fmt: skip
    result = invoke(*args)
    assert result.exit_code == 2
    assert "--targets experts,dense" in result.stderr and "--train-from" in result.stderr
    assert not out.exists()
    # a dense layer alone: the hint offered the layer it refused, with no word of the MoE layer it lacks (review)
    alone = invoke(*args[:-2], "--layers", 0, "--targets", "dense", "--out", out)
    said = " ".join(alone.stderr.split())
    assert alone.exit_code == 2 and "(dense), with at least one MoE layer (the plan scores the routed experts)" in said
    assert not out.exists()
    result = invoke(*args, "--train-from", 0)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["summary"]["trainable_layers"] == [0, 1, 2]
    assert any(t["name"].startswith("model.layers.0.mlp.") for t in manifest["summary"]["tensors"])


def test_a_dense_target_run_resumes_exactly_exports_and_evaluates(quantized, tmp_path, monkeypatch):
    """Through the CLI on deepseek_v3 (layer 0 dense): score --targets experts,attention,dense --train-from 0, a RigL
    run interrupted inside a scoring window and resumed equals the straight run; the merged export reloads in
    transformers with the engine's logits (the dense MLP's change included: control), the delta export holds the
    dense tensors, eval and generate apply the run."""
    from helpers_export import engine_logits, export, hf_logits, ids_for
    from helpers_trained import straight_and_resumed, tokenize
    from usaf.artifacts import DeltaManifest, load_verified
    from usaf.artifacts.run import load_trained_change

    qdir = quantized("deepseek_v3", num_layers=FAMILY_LAYERS, tokenizer=True)
    tokens = tokenize(qdir, tmp_path / "tokens")
    plan = tmp_path / "plan"
    result = invoke("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--calib-samples", 8, "--train-from",
                    0, "--targets", "dense,attention,experts", "--no-stability", "--out", plan)  # fmt: skip
    assert result.exit_code == 0, result.output

    straight, resumed = straight_and_resumed(qdir, tokens, plan, tmp_path, monkeypatch)
    a, b = load_trained_change(straight), load_trained_change(resumed)
    assert a.trainable_layers == [0, 1, 2]
    dense = [n for n in a.deltas if n.startswith("model.layers.0.mlp.")]
    assert len(dense) == 3 and a.deltas.keys() == b.deltas.keys()
    for name in a.deltas:
        assert torch.equal(a.deltas[name][0], b.deltas[name][0]) and torch.equal(a.deltas[name][1], b.deltas[name][1])

    ids = ids_for(qdir)
    merged = tmp_path / "hf"
    export("--model", qdir, "--checkpoint", straight, "--out", merged)
    exported = hf_logits(merged, ids)
    torch.testing.assert_close(exported, engine_logits(qdir, a, ids), rtol=0, atol=2e-5)
    zeroed = {n: (i, torch.zeros_like(v)) if n in dense else (i, v) for n, (i, v) in a.deltas.items()}
    without_dense = type(a)(**{**vars(a), "deltas": zeroed})
    assert (exported - engine_logits(qdir, without_dense, ids)).abs().max() > 1e-4  # control: the dense change is in
    delta = tmp_path / "delta"
    export("--model", qdir, "--checkpoint", straight, "--format", "delta", "--out", delta)
    tensors = {t.name for t in load_verified(delta, DeltaManifest).summary.tensors}
    assert set(dense) <= tensors
    reloaded = load_trained_change(delta)
    torch.testing.assert_close(engine_logits(qdir, reloaded, ids), engine_logits(qdir, a, ids), rtol=0, atol=1e-6)

    report = tmp_path / "eval"
    result = invoke("eval", "--model", qdir, "--checkpoint", straight, "--data", tokens, "--held-out", tokens,
                    "--workspace", tmp_path / "ws", "--out", report, "--no-plots")  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads((report / "report.json").read_text())["rows"]
    assert rows and all(r["base"]["ppl"] != r["tuned"]["ppl"] for r in rows)  # the change was applied
    out = invoke("generate", "hello", "--model", qdir, "--checkpoint", straight, "--max-new-tokens", 4, "--seed", 0)
    assert out.exit_code == 0, out.output


# -- the memory planner --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("targets", [("experts", "dense"), ("experts", "attention", "dense")])
def test_the_planner_counts_a_dense_layers_targets_as_the_engine_holds_them(targets, quantized):
    """Delta entries and bytes of the MoE and dense layers: exact against the engine; saved activations with a dense
    first trainable layer against its measurement; ``usaf plan``'s choice trains the dense layers score would."""
    from usaf.engine.engine import budget
    from usaf.memory_plan import Request, make_target, model_facts, plan_memory, read_model
    from usaf.memory_plan import weights as w
    from usaf.memory_plan.activations import Batch, saved_activations

    qdir = quantized("qwen3_moe", **DENSE["qwen3_moe"])
    source = read_model(str(qdir), nbits=None, group_size=None)
    facts = model_facts(source.config)
    engine = dense_engine(quantized, "qwen3_moe", targets)
    assert engine.layers == (2, 3) and engine.dense_layers == (2,)
    frac = 0.05
    g = torch.Generator().manual_seed(0)
    engine.set_deltas({n: torch.randperm(math.prod(t.shape), generator=g)[: budget(t.shape, frac)].sort().values
                       for n, t in engine.weights.items()})  # fmt: skip
    shapes = w.trained_shapes(facts, engine.layers, targets)
    assert sorted(shapes) == sorted(tuple(t.shape) for t in engine.weights.values())
    assert engine.trainable_count()["delta_entries"] == w.shapes_delta_entries(shapes, frac)
    assert engine.memory()["deltas"] == w.shapes_delta_bytes(shapes, frac)
    # saved activations: the graph starts at the dense layer 2
    ids = torch.randint(1, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    engine.loss(ids, ids, prefix_states=engine.prefix_states(ids))
    predicted = sum(saved_activations(facts, 2, Batch(2, 24), 4, targets).values())
    measured = engine.memory()["activations"]
    if TRANSFORMERS_V5:  # the planner models transformers 5's modules (4.x's forward keeps more)
        assert measured <= predicted <= 1.07 * measured  # an upper estimate: +1.7 % and +6.1 % when written
    # usaf plan: --train-from 2 trains the dense layer 2 with the MoE layer 3, and counts its tensors
    target = make_target("cpu", "float32", vram=None, ram=64 * 2**30)
    with_dense = plan_memory(facts, source.quant, target, Request(train_from=2, frac=frac, targets=targets))
    assert with_dense.settings.dense_layers == (2,) and with_dense.settings.train_from == 2
    without = plan_memory(facts, source.quant, target, Request(train_from=2, frac=frac, targets=("experts",)))
    assert without.settings.dense_layers == ()

    def deltas(plan) -> int:
        train = next(p for p in plan.stages if p.stage == "train")
        return next(c.host + c.device for c in train.components if c.name == "deltas + index buffers")

    assert deltas(with_dense) == w.shapes_delta_bytes(shapes, frac) > deltas(without)
    assert not any("--targets dense" in note for note in with_dense.notes)
    above = plan_memory(facts, source.quant, target, Request(train_from=3, frac=frac, targets=targets))
    assert above.settings.dense_layers == () and any(
        "--targets dense: no dense layer at or above layer 3 (the dense layers are [0, 2])" in n for n in above.notes
    )  # score would refuse it: the plan says so instead of counting nothing in silence


def test_dense_targets_take_the_index_free_path_where_the_device_has_no_index_ops(quantized):
    """On DirectML (no index ops) the dense MLP's targets run the index-free sparse kernels, as every linear target.
    Control: with index ops, they do not."""
    loaded = load_quantized_model(quantized("deepseek_v3", **DENSE["deepseek_v3"]))
    for state in loaded.experts.values():
        state.set_index_ops(False)
    engine = SparseEngine(loaded, trainable_layers=[0, 1, 2], targets=("experts", "dense"))
    dense = [w for n, w in engine.weights.items() if target_of(n, engine.spec) == "dense"]
    assert len(dense) == 3 and not any(w.index_ops for w in dense)
    loaded = load_quantized_model(quantized("deepseek_v3", **DENSE["deepseek_v3"]))
    engine = SparseEngine(loaded, trainable_layers=[0, 1, 2], targets=("experts", "dense"))
    assert all(w.index_ops for n, w in engine.weights.items() if target_of(n, engine.spec) == "dense")


def test_a_plan_training_a_dense_layer_needs_the_dense_target(tmp_path):
    """``usaf train`` checks a plan's layers against the model: a dense layer only with the dense target."""
    from types import SimpleNamespace

    from usaf.artifacts.plan import check_plan_layers
    from usaf.errors import UsafError

    def plan(layers, targets):
        return SimpleNamespace(summary=SimpleNamespace(trainable_layers=layers, targets=targets))

    check_plan_layers(tmp_path, plan([0, 1, 2], ["experts", "dense"]), [1, 2], [0])
    with pytest.raises(UsafError, match="trains layer 0, which is no MoE layer"):
        check_plan_layers(tmp_path, plan([0, 1, 2], ["experts"]), [1, 2], [0])
    with pytest.raises(UsafError, match="trains no MoE layer"):
        check_plan_layers(tmp_path, plan([0], ["dense"]), [1, 2], [0])
    with pytest.raises(UsafError, match="trains layer 3, which is no MoE or dense layer"):
        check_plan_layers(tmp_path, plan([1, 3], ["experts", "dense"]), [1, 2], [0])


def test_a_dense_target_run_on_two_ranks_equals_one_process(quantized, tmp_path):
    """Data parallel (torchrun, 2 CPU ranks, microbatch 1) against one process with microbatch 1 × grad-accum 2 (the
    same global batch split the same way): the same losses and final deltas, the dense MLP's included, bit for bit,
    through a RigL reselection (frac 0.3: the grow-score pools hold every candidate, so merging them is exact)."""
    from helpers_distributed import assert_same_deltas, deltas, finished, losses, torchrun
    from helpers_trained import tokenize

    qdir = quantized("deepseek_v3", num_layers=FAMILY_LAYERS, tokenizer=True)
    tokens = tokenize(qdir, tmp_path / "tokens")
    plan = tmp_path / "plan"
    result = invoke("score", "--model", qdir, "--data", tokens, "--frac", 0.3, "--calib-samples", 8, "--train-from", 0,
                    "--targets", "experts,dense", "--no-stability", "--no-lr-test", "--out", plan)  # fmt: skip
    assert result.exit_code == 0, result.output
    args = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 10, "--reselect-every", 5, "--lr",
            0.05, "--seed", 3, "--microbatch", 1, "--save-every", 0]  # fmt: skip
    dp, single = tmp_path / "dp", tmp_path / "single"
    proc = torchrun(*args, "--out", dp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks (OMP_NUM_THREADS=1): the same sums, bit for bit
    try:
        result = invoke(*args, "--grad-accum", 2, "--out", single)
    finally:
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    code, _, stderr = finished(proc)
    assert code == 0 and "data parallel: 2 processes (gloo)" in stderr, stderr
    assert losses(dp) == losses(single)
    a, b = deltas(dp), deltas(single)
    trained = [v for k, v in a.items() if k.startswith("model.layers.0.mlp.") and v.is_floating_point()]
    assert trained and all(v.abs().sum() > 0 for v in trained)  # the dense MLP trained: not vacuous
    assert_same_deltas(a, b)
