"""On a CUDA GPU (skipped elsewhere; run by scripts/gpu_check.sh): the engine, the grouped expert path and the CLI
stages on the device against the same work on the CPU, which the other tests tie to dense transformers.

The CPU is the reference here: its engine equals dense autograd (test_engine.py), so a CUDA result equal to the
CPU's, within the device's float32 summation order, is equal to dense autograd too.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FAMILIES
from helpers import ctrl_c_at_step, explain, invoke
from helpers_engine import FAMILY_LAYERS, batch, every_target, random_selection
from usaf.engine import grouped
from usaf.engine.engine import SparseEngine
from usaf.engine.loading import load_quantized_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def engine_on(path, device: str, dtype: torch.dtype = torch.float32, **kwargs) -> SparseEngine:
    loaded = load_quantized_model(path, device=device, compute_dtype=dtype)
    if kwargs.get("targets") == "all":
        kwargs["targets"] = every_target(loaded.spec)
    return SparseEngine(loaded, trainable_layers=[loaded.spec.moe_layers[-1]], **kwargs)


def loss_and_grads(engine: SparseEngine, ids, labels) -> tuple[float, dict[str, torch.Tensor]]:
    parts = engine.loss(ids.to(engine.device), labels.to(engine.device))
    parts.loss.backward()
    grads = {n: d.values.grad.detach().float().cpu() for n, d in engine.deltas().items()}
    grads.update({n: p.grad.detach().float().cpu() for n, p in engine.routers.items()})
    return float(parts.loss.detach()), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_loss_and_sparse_gradients_on_cuda_equal_the_cpus(family, quantized):
    """float32, every target the family has: the frozen prefix (grouped path), the trainable layer's sparse deltas
    (SDDMM), the routers; negative control: the gradients at shifted positions differ."""
    path = quantized(family, num_layers=FAMILY_LAYERS)
    cpu, gpu = engine_on(path, "cpu", targets="all"), engine_on(path, "cuda", targets="all")
    selection = random_selection(cpu)
    cpu.set_deltas(selection)
    gpu.set_deltas({n: s.to(gpu.device) for n, s in selection.items()})
    ids, labels = batch()
    loss_cpu, grads_cpu = loss_and_grads(cpu, ids, labels)
    loss_gpu, grads_gpu = loss_and_grads(gpu, ids, labels)
    assert loss_gpu == pytest.approx(loss_cpu, rel=1e-5)
    assert grads_cpu.keys() == grads_gpu.keys()
    for name, reference in grads_cpu.items():
        assert reference.abs().gt(0).any(), name  # the comparison is not between zeros
        torch.testing.assert_close(grads_gpu[name], reference, rtol=1e-3, atol=1e-6, msg=name)
        if reference.numel() > 1:
            assert not torch.allclose(grads_gpu[name], reference.roll(1), rtol=1e-3, atol=1e-6), name


def test_grouped_mm_runs_on_cuda_in_bfloat16_at_128_experts_and_matches_the_loop(quantized):
    """Qwen3-30B-A3B's routing (128 experts, top-8) in bfloat16: the frozen layers' GEMMs go through torch's grouped
    matmul (spied: the check is not vacuous), and give the per-expert loop's loss within bfloat16's precision."""
    path = quantized("qwen3_moe", num_layers=FAMILY_LAYERS, num_experts=128, num_experts_per_tok=8)
    engine = engine_on(path, "cuda", torch.bfloat16)
    assert all(layer.grouped_mm for layer in engine.loaded.experts.values())
    calls = []
    real = grouped._grouped_mm

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    ids, labels = batch(size=(2, 64))
    grouped._grouped_mm = spy
    try:
        with torch.no_grad():
            with_grouped_mm = float(engine.loss(ids.cuda(), labels.cuda()).loss)
    finally:
        grouped._grouped_mm = real
    assert calls, "the frozen layers never reached torch's grouped matmul"
    for layer in engine.loaded.experts.values():
        layer.grouped_mm = False  # the per-expert loop: one GEMM per routed expert
    with torch.no_grad():
        looped = float(engine.loss(ids.cuda(), labels.cuda()).loss)
    reference = float(engine_on(path, "cpu").loss(ids, labels).loss.detach())  # float32 on the CPU
    assert with_grouped_mm == pytest.approx(looped, rel=1e-2)
    assert with_grouped_mm == pytest.approx(reference, rel=2e-2)


def test_trainable_experts_run_grouped_on_cuda_in_bfloat16_at_128_experts_and_match_the_loop(quantized):
    """CUDA runs a trainable layer's experts grouped (usaf.engine.grouped_deltas; spied: not vacuous): in bfloat16 at
    Qwen3-30B-A3B's routing, its loss and sparse gradients equal the per-expert loop's (the "dense" strategy) within
    bfloat16's precision. Control: the gradients one entry over differ."""
    from usaf.engine import grouped_deltas

    path = quantized("qwen3_moe", num_layers=FAMILY_LAYERS, num_experts=128, num_experts_per_tok=8)
    engine = engine_on(path, "cuda", torch.bfloat16)
    assert all(layer.grouped_deltas for layer in engine.loaded.experts.values())
    selection = random_selection(engine, frac=0.02)
    g = torch.Generator().manual_seed(3)
    values = {n: torch.randn(len(s), generator=g) * 1e-2 for n, s in selection.items()}
    engine.set_deltas({n: s.cuda() for n, s in selection.items()}, {n: v.cuda() for n, v in values.items()})
    ids, labels = batch(size=(2, 64))
    calls = []
    real = grouped_deltas._GroupedDeltaLinear.apply
    grouped_deltas._GroupedDeltaLinear.apply = lambda *args: calls.append(1) or real(*args)
    try:
        grouped_loss, grouped_grads = loss_and_grads(engine, ids, labels)
    finally:
        grouped_deltas._GroupedDeltaLinear.apply = real
    assert len(calls) == 2, "the trainable layer's experts did not run grouped"
    for delta in engine.deltas().values():
        delta.values.grad = None
    for router in engine.routers.values():
        router.grad = None
    for layer in engine.loaded.experts.values():
        layer.grouped_deltas = False  # the per-expert loop
    loop_loss, loop_grads = loss_and_grads(engine, ids, labels)
    assert grouped_loss == pytest.approx(loop_loss, rel=1e-3)
    for name, reference in loop_grads.items():
        assert reference.abs().gt(0).any(), name
        scale = float(reference.abs().max())
        torch.testing.assert_close(grouped_grads[name], reference, rtol=2e-2, atol=2e-2 * scale, msg=name)
        if reference.numel() > 1:
            assert not torch.allclose(grouped_grads[name], reference.roll(1), rtol=2e-2, atol=2e-2 * scale), name


def test_upload_reaches_the_device_without_waiting_for_it():
    from usaf.backends.transfer import upload
    from usaf.testing.dispatch import count_dispatch

    host = torch.arange(1000)
    count = count_dispatch(lambda: upload(host, "cuda"))
    assert count.syncs == 0, count.waiting
    assert count_dispatch(lambda: host.to("cuda")).waiting == {"copy to the device": 1}  # control: the plain copy
    moved = upload(host, "cuda")
    host.zero_()  # the copy went through a pinned buffer of its own: the host tensor is free at once
    assert torch.equal(moved.cpu(), torch.arange(1000))


def test_a_grouped_training_step_on_cuda_copies_nothing_to_the_device_that_it_waits_for(quantized):
    """A training step at Qwen3-30B-A3B's routing (128 experts, top-8; frozen layer, grouped trainable experts,
    attention, routers, clipped SparseAdamW) uploads its group offsets, unrouted experts, step tables and clip
    factor through pinned memory: a blocking copy would make the host wait for the device at each (counted by
    usaf.testing.dispatch, whose control is in test_upload_reaches_the_device_without_waiting_for_it). What still
    waits is reading results back: the routing counts, the token count and the gradient norm."""
    from usaf.engine.optim import SparseAdamW
    from usaf.settings.fields import DEFAULT_TARGETS
    from usaf.testing.dispatch import count_dispatch

    path = quantized("qwen3_moe", num_layers=FAMILY_LAYERS, num_experts=128, num_experts_per_tok=8)
    engine = engine_on(path, "cuda", torch.bfloat16, targets=DEFAULT_TARGETS)
    assert all(layer.grouped_deltas for layer in engine.loaded.experts.values())
    engine.set_deltas({n: s.cuda() for n, s in random_selection(engine, frac=0.02).items()})
    optimizer = SparseAdamW(engine.parameter_groups(lr=1e-3, router_lr=1e-3, weight_decay=0.01), max_grad_norm=1e-6)
    ids, labels = (t.cuda() for t in batch(size=(2, 64)))

    def step() -> None:
        optimizer.zero_grad()
        engine.loss(ids, labels).loss.backward()
        assert optimizer.step().clipped

    step()
    count = count_dispatch(step)
    print(f"ops {count.ops}, waits {dict(count.waiting)}")
    assert count.ops > 100
    assert "copy to the device" not in count.waiting, count.waiting
    assert count.syncs <= 4 * len(engine.loaded.experts) + 4, count.waiting


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "pooled"])
def test_dense_scores_run_grouped_on_cuda_and_match_the_loop(exact, quantized):
    """usaf score's dense scores on CUDA at 128 experts top-8: the grouped path feeds each block to its accumulators at
    once (``ScoreAccumulator.add_block``, the pool on the device), and the scores equal the per-expert loop's within
    fp32 rounding, exact and with a pool that loses nothing. Control: another batch's scores differ."""
    import math

    from usaf.engine import grouped_deltas

    path = quantized("qwen3_moe", num_layers=FAMILY_LAYERS, num_experts=128, num_experts_per_tok=8)
    engine = engine_on(path, "cuda")
    batches = [(*batch(seed, size=(2, 64)), None) for seed in (1, 2)]
    lossless = {name: math.prod(w.shape) // 4 for name, w in engine.weights.items()}
    settings = {"candidates": 40 if exact else lossless, "statistic": "grad", "exact": exact}
    calls = []
    real = grouped_deltas._GroupedDeltaLinear.apply

    def scores(grouped: bool, data=batches) -> dict[str, torch.Tensor]:
        for layer in engine.loaded.experts.values():
            layer.grouped_deltas = grouped
        out = {}
        for name, acc in engine.dense_scores(data, **settings).items():
            assert acc.device.type == "cuda" and float(acc.error_bound.max()) == 0
            if exact:
                out[name] = acc.dense_map().view(-1).cpu()  # (E*O*I,)
                continue
            indices, values = acc.pool_entries()
            out[name] = torch.zeros(math.prod(acc.shape)).index_put_((indices.cpu(),), values.cpu())
        return out

    grouped_deltas._GroupedDeltaLinear.apply = lambda *args: calls.append(1) or real(*args)
    try:
        ours = scores(True)
    finally:
        grouped_deltas._GroupedDeltaLinear.apply = real
    assert len(calls) == 2 * len(batches), "the trainable layer's experts did not run grouped"
    loop = scores(False)
    for name, reference in loop.items():
        assert reference.gt(0).any(), name
        torch.testing.assert_close(ours[name], reference, rtol=1e-4, atol=1e-4 * float(reference.max()), msg=name)
    other = scores(True, [(*batch(7, size=(2, 64)), None)])
    assert any(not torch.allclose(other[n], loop[n], rtol=1e-2, atol=1e-2 * float(loop[n].max())) for n in loop)


def train_args(qdir, tokens, plan, out, *extra):
    return ("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", out, "--lr", 0.05,
            "--save-every", 0, "--device", "cuda", *extra)  # fmt: skip


def losses(run) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def interrupted_and_resumed(qdir, tokens, plan, out, *args) -> None:
    """Ctrl-C at step 8 (inside a scoring window when reselecting every 5), then the same command again."""
    with ctrl_c_at_step(8):
        assert invoke(*train_args(qdir, tokens, plan, out, *args)).exit_code == 130
    result = invoke(*train_args(qdir, tokens, plan, out, *args))
    assert result.exit_code == 0 and "resuming from" in result.stderr, explain(result)


def final_deltas(run) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "final" / "deltas.safetensors"))


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


RESELECTING = ("--steps", 20, "--reselect-every", 5, "--reselect-fraction", 0.3)


def test_train_on_cuda_learns_and_resumes_exactly_with_deterministic(prepared, tmp_path):
    """--deterministic, the device's default precision (bfloat16 on Ampere and later), reselection every 5 steps,
    interrupted inside a scoring window and resumed: the same losses and deltas as the straight run, bit for bit."""
    qdir, tokens, plan = prepared("qwen3_moe")
    args = (*RESELECTING, "--deterministic")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = invoke(*train_args(qdir, tokens, plan, straight, *args))
    assert result.exit_code == 0, explain(result)
    interrupted_and_resumed(qdir, tokens, plan, resumed, *args)
    first, second = losses(straight), losses(resumed)
    assert len(first) == 20 and sum(first[-5:]) < sum(first[:5]), first
    assert second == first
    assert largest_difference(final_deltas(straight), final_deltas(resumed)) == 0.0


def test_train_on_cuda_resumes_within_the_devices_own_noise(prepared, tmp_path):
    """Without --deterministic the GPU's scatter-adds sum in the order their atomics land: two straight runs may
    differ in the last bits, and so may a resumed one. It must differ from the straight run no more than a second
    straight run does (4x, for the luck of the draw); where the two straight runs agree exactly, exactly."""
    qdir, tokens, plan = prepared("qwen3_moe")
    runs = {name: tmp_path / name for name in ("a", "b", "resumed")}
    for name in ("a", "b"):
        result = invoke(*train_args(qdir, tokens, plan, runs[name], *RESELECTING))
        assert result.exit_code == 0, explain(result)
    interrupted_and_resumed(qdir, tokens, plan, runs["resumed"], *RESELECTING)
    a, b, resumed = (final_deltas(run) for run in runs.values())
    noise, off = largest_difference(a, b), largest_difference(a, resumed)
    assert off <= 4 * noise, f"resumed is {off:.3g} from the straight run, a second straight run {noise:.3g}"
    assert losses(runs["resumed"]) == pytest.approx(losses(runs["a"]), rel=1e-2, abs=1e-3)


def test_eval_on_cuda_equals_the_cpus(prepared, tmp_path, monkeypatch):
    """`usaf eval` in float32 (USE_AMP=0) on the GPU and on the CPU: the same rows within float32 summation order."""
    monkeypatch.setenv("USE_AMP", "0")
    qdir, tokens, run = _trained(prepared, tmp_path, steps=6)
    reports = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"report-{device}"
        result = invoke("eval", "--model", qdir, "--checkpoint", run, "--data", tokens, "--held-out", tokens,
                        "--workspace", tmp_path / f"ws-{device}", "--out", out, "--no-plots",
                        "--device", device)  # fmt: skip
        assert result.exit_code == 0, explain(result)
        reports[device] = json.loads((out / "report.json").read_text())["rows"]
    assert len(reports["cpu"]) == len(reports["cuda"]) > 0
    for cpu_row, gpu_row in zip(reports["cpu"], reports["cuda"]):
        for key in ("base", "tuned"):
            assert gpu_row[key]["nll"] == pytest.approx(cpu_row[key]["nll"], rel=1e-4), (key, cpu_row, gpu_row)
    assert any(r["tuned"]["nll"] != r["base"]["nll"] for r in reports["cuda"])  # the checkpoint changed something


def test_score_on_cuda_selects_what_the_cpu_selects(prepared, tmp_path, monkeypatch):
    """`usaf score` on the GPU in float32 (USE_AMP=0): the plan's masks agree with the CPU's (ties at the cut may
    differ)."""
    monkeypatch.setenv("USE_AMP", "0")
    from safetensors.torch import load_file

    qdir, tokens, _ = prepared("qwen3_moe")
    masks = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"plan-{device}"
        result = invoke("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--calib-samples", 8,
                        "--train-from", 2, "--no-stability", "--no-lr-test", "--device", device,
                        "--out", out)  # fmt: skip
        assert result.exit_code == 0, explain(result)
        masks[device] = {p.name: load_file(str(p)) for p in out.glob("*.safetensors")}
    assert masks["cpu"].keys() == masks["cuda"].keys() and masks["cpu"]
    for file, tensors in masks["cpu"].items():
        for name, cpu_tensor in tensors.items():
            gpu_tensor = masks["cuda"][file][name]
            if cpu_tensor.dtype in (torch.int64, torch.int32) and cpu_tensor.dim() == 1:  # selected positions
                shared = len(set(cpu_tensor.tolist()) & set(gpu_tensor.tolist()))
                assert shared >= 0.95 * len(cpu_tensor), (file, name, shared, len(cpu_tensor))


def test_score_with_its_lr_test_runs_on_cuda(prepared, tmp_path):
    """`usaf score` as a user runs it on a GPU (--lr-test: the suite turns the test off by default, conftest.py):
    the device's default precision and the lr test, whose probes train on the GPU; the plan records an lr among
    the probes and a finite held-back loss for each probe that ran."""
    from usaf.artifacts import PlanManifest, load_verified

    qdir, tokens, _ = prepared("qwen3_moe")
    out = tmp_path / "plan"
    result = invoke("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--calib-samples", 8,
                    "--train-from", 2, "--no-stability", "--lr-test", "--device", "cuda", "--out", out)  # fmt: skip
    assert result.exit_code == 0, explain(result)
    record = load_verified(out, PlanManifest).summary.lr_test
    assert record is not None and record.lr in record.candidates and record.steps > 0
    assert any(loss is not None for loss in record.heldout_losses)


def test_generate_on_cuda_streams_in_the_devices_dtype_and_matches_resident(prepared, tmp_path):
    """`usaf generate` as a user runs it on a GPU: the device's compute dtype (bf16 where native) and, streamed, the
    frozen layers' experts copied to the device on a side stream; greedy text equal to resident experts'."""
    from usaf.backends import resolve_backend

    qdir, _, run = _trained(prepared, tmp_path, steps=4)
    outs = {}
    for flag in ("--stream-experts", "--no-stream-experts"):
        result = invoke("generate", "def parse(", "--model", qdir, "--checkpoint", run, "--device", "cuda",
                        "--temperature", 0, "--max-new-tokens", 12, "--no-chat", "--json", flag)  # fmt: skip
        assert result.exit_code == 0, explain(result)
        outs[flag] = json.loads(result.stdout)
    compute = str(resolve_backend("cuda").policy.compute).removeprefix("torch.")
    assert all(out["dtype"] == compute and out["new_tokens"] > 0 for out in outs.values())
    assert outs["--stream-experts"]["streamed"] and not outs["--no-stream-experts"]["streamed"]
    assert outs["--stream-experts"]["text"] == outs["--no-stream-experts"]["text"]


def test_streamed_decoding_on_cuda_reads_routed_experts_from_pinned_host_memory(quantized, monkeypatch):
    """A new token's forward (1 token, top-2 of 16 experts) reads its routed experts from the pinned host codes
    instead of copying each layer on the side stream; the prompt's forward copies. The same greedy text as resident
    experts (the CPU test: tests/test_generate.py)."""
    from dataclasses import replace

    from usaf.engine import streaming
    from usaf.settings.generate import GenerateConfig
    from usaf.stages import generate as stage

    qdir = quantized("qwen3_moe", num_layers=2, tokenizer=True, num_experts=16)
    closed = []
    real_close = streaming.ExpertStreamer.close
    monkeypatch.setattr(streaming.ExpertStreamer, "close", lambda self: (closed.append(replace(self.stats)),
                                                                         real_close(self)))  # fmt: skip
    texts = {stream: stage.run(GenerateConfig(prompt="def parse(", model=qdir, no_checkpoint=True, device="cuda",
                                              temperature=0, max_new_tokens=8, stream_experts=stream)).text
             for stream in (True, False)}  # fmt: skip
    assert texts[True] == texts[False]
    (stats,) = closed
    assert stats.routed_only > 0 and stats.copies == 3, stats


def _trained(prepared, tmp_path, *, steps: int):
    """(the quantized model, its tokens, a run of ``steps`` trained on them, on the default device)."""
    qdir, tokens, plan = prepared("qwen3_moe")
    run = tmp_path / "run"
    result = invoke("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", run, "--lr", 0.05,
                    "--steps", steps, "--save-every", 0)  # fmt: skip
    assert result.exit_code == 0, explain(result)
    return qdir, tokens, run
