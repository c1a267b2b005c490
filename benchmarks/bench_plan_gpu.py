"""GPU benchmark: `usaf plan`'s predicted device peak of a training step against the CUDA allocator's peak,
on a stack of randomly initialised layers with Qwen3-30B-A3B's real dimensions.

The model: Qwen3-30B-A3B's published config (``tests/data/qwen3-30b-a3b``: H 2048, 128 experts, top-8, expert
width 768, 32 query / 4 KV heads of 128, vocabulary 151936) cut to ``--layers`` decoder layers, built on the
meta device with usaf's experts implementation; non-expert weights random (std 0.02, norms 1), experts 4-bit
with random codes (group 128), everything on the GPU in bf16 — the engine's "device" placement, what
``usaf train`` does today. No checkpoint is read: usaf's loader is bypassed, its pieces (``ExpertWeight``,
``LayerExperts``, ``SparseEngine``) are used as the loader would.

A run: the top ``--trainable`` layers train (frac 0.005, random positions), the prefix states of one
padded microbatch are captured, then ``--steps`` steps (loss, backward, ``SparseAdamW``) under RigL's
score collection (its pools and dense slice gradients exist in the 4 steps before a reselection).

Measured: ``torch.cuda.max_memory_allocated`` from just after CUDA initialisation (the allocator's peak:
excludes the CUDA context and cached-but-free blocks), ``max_memory_reserved``, the device memory the
context takes (in use after initialisation, before any tensor), host RSS after initialisation and a cuBLAS
matmul (the planner assumes 1 GiB for the CUDA runtime), and ``engine.memory()``'s components including the
activations autograd saved (on CUDA, where the attention kernels differ from the CPU ones the formula was
read from). Predicted: the planner's ``train`` device peak for the same settings, minus its context.

    python benchmarks/bench_plan_gpu.py [--layers 4] [--trainable 2] [--out benchmarks/results/plan-gpu.json]
    python benchmarks/bench_plan_gpu.py --device cpu --quick     # a smoke test of this script without a GPU
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
QWEN3_30B = ROOT / "tests" / "data" / "qwen3-30b-a3b" / "config.json"
QUICK = {
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 4096,
}
FRAC = 0.005
RUNS = ((2, 512), (1, 1024))  # (microbatch, seq_len)
MIB = 2**20


def model_config(layers: int, quick: bool) -> dict:
    config = json.loads(QWEN3_30B.read_text())
    config["num_hidden_layers"] = layers
    config["max_window_layers"] = layers
    if quick:
        config.update(QUICK)
    return config


def random_quantized(shape: tuple[int, int, int], device: torch.device):
    """A 4-bit tensor with uniformly random codes; weights ``(code - 7.5) * 0.02 / 7.5`` lie in [-0.02, 0.02]."""
    from usaf.quant import QuantizedTensor, effective_group_size, packed_width

    e, o, i = shape
    group = effective_group_size(i, 128)
    codes = torch.randint(0, 256, (e, o, packed_width(i, 4)), dtype=torch.uint8, device=device)
    scale = torch.full((e, o, i // group), 0.02 / 7.5, dtype=torch.float16, device=device)
    return QuantizedTensor(
        codes=codes,
        scale=scale,
        zero=torch.full_like(scale, 7.5),
        shape=shape,
        nbits=4,
        group_size=group,
        method="rtn",
        transposed=False,
        source_dtype="bfloat16",
    )


def build_loaded(config: dict, device: torch.device, dtype: torch.dtype, experts_device: torch.device | None = None):
    """What ``usaf.engine.loading.load_quantized_model`` returns, with random weights instead of files
    (the 4-bit experts on ``experts_device``, default ``device``: ``"cpu"`` for streaming)."""
    from transformers import AutoModelForCausalLM

    from usaf.backends.transfer import device_capabilities
    from usaf.engine.experts import IMPLEMENTATION, ExpertWeight, LayerExperts, register
    from usaf.engine.loading import LoadedModel
    from usaf.families import resolve_family
    from usaf.families.meta import build_config

    spec = resolve_family(config)
    register()
    with torch.device("meta"):
        cfg = build_config(config)
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation=IMPLEMENTATION, dtype=dtype)
    shapes = {
        "gate_up_proj": (spec.num_experts, 2 * spec.expert_width, spec.hidden_size),
        "down_proj": (spec.num_experts, spec.hidden_size, spec.expert_width),
    }
    experts = {}
    for layer in spec.moe_layers:
        module = model.get_submodule(spec.experts_prefix(layer))
        weights = []
        for attr in ("gate_up_proj", "down_proj"):
            q = random_quantized(shapes[attr], experts_device or device)
            weights.append(ExpertWeight(q, compute_dtype=dtype, device=experts_device or device))
            delattr(module, attr)  # the meta fused parameter: usaf computes instead
        module.usaf_experts = LayerExperts(layer, *weights)
        # as loading does: the device's grouped matmul, index ops and grouped deltas (this was
        # missing, so the GPU check's step and planner figures of 2026-12-04 ran every GEMM one expert at a time)
        module.usaf_experts.set_capabilities(device_capabilities(device))
        experts[layer] = module.usaf_experts
    for name, param in list(model.named_parameters()):
        owner_name, _, attr = name.rpartition(".")
        value = torch.empty(param.shape, dtype=param.dtype, device=device)
        value.fill_(1.0) if "norm" in owner_name else value.normal_(0.0, 0.02)
        model.get_submodule(owner_name)._parameters[attr] = nn.Parameter(value, requires_grad=False)
    for module in model.modules():  # computed buffers (rotary inv_freq): rebuilt from their module's config
        if any(b is not None and b.is_meta for b in module._buffers.values()):
            with torch.device(device):
                fresh = type(module)(config=module.config)
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:
                    module._buffers[key] = fresh._buffers[key]
    model.requires_grad_(False)
    model.eval()
    return LoadedModel(model, spec, experts, manifest=None, path=Path("."))


def random_positions(numel: int, k: int, g: torch.Generator) -> torch.Tensor:
    """``k`` distinct sorted flat indices, without a ``numel``-sized permutation."""
    chosen = torch.empty(0, dtype=torch.int64)
    while chosen.numel() < k:
        draw = torch.randint(0, numel, (int(1.2 * (k - chosen.numel())) + 16,), generator=g)
        chosen = torch.cat([chosen, draw]).unique()
    return chosen[torch.randperm(chosen.numel(), generator=g)[:k]].sort().values


def predicted(config: dict, layers: tuple[int, ...], microbatch: int, seq_len: int, kind: str,
              placement: str = "device") -> dict:  # fmt: skip
    from usaf.memory_plan import model_facts
    from usaf.memory_plan.activations import Batch, saved_activations
    from usaf.memory_plan.source import QuantSettings
    from usaf.memory_plan.stages import Settings, train_stage
    from usaf.memory_plan.target import GIB, Target

    facts = model_facts(config)
    target = Target(
        kind=kind, dtype="bfloat16", device_budget=1024 * GIB if kind != "cpu" else None, host_budget=1024 * GIB
    )
    settings = Settings(layers, microbatch, 1, seq_len, FRAC, placement if kind != "cpu" else "host")
    stage = train_stage(facts, QuantSettings(), target, settings)
    side = "device" if kind != "cpu" else "host"
    components = {c.name: getattr(c, side) for c in stage.components if getattr(c, side)}
    excluded = ("device context", "framework (Python, torch)", "prefix cache in RAM", "checkpoint staging")
    return {
        "components": components,
        "allocated_peak": sum(v for k, v in components.items() if k not in excluded),
        "activations": sum(saved_activations(facts, layers[0], Batch(microbatch, seq_len), 2).values()),
        "context": target.context,
    }


def run(config: dict, device: torch.device, trainable: int, microbatch: int, seq_len: int, steps: int) -> dict:
    from usaf.engine.engine import SparseEngine, budget
    from usaf.engine.optim import SparseAdamW
    from usaf.engine.reselect import collect_scores

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_allocated = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    loaded = build_loaded(config, device, torch.bfloat16)
    layers = tuple(loaded.spec.moe_layers[-trainable:])
    engine = SparseEngine(loaded, trainable_layers=list(layers))
    g = torch.Generator().manual_seed(0)
    engine.set_deltas(
        {n: random_positions(math.prod(w.shape), budget(w.shape, FRAC), g) for n, w in engine.weights.items()}
    )
    optimizer = SparseAdamW(engine.parameter_groups(lr=1e-2, router_lr=1e-4, weight_decay=0.0), max_grad_norm=1.0)
    ids = torch.randint(1, config["vocab_size"], (microbatch, seq_len), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[-1, seq_len - seq_len // 8 :] = 0  # right padding in the last row: the planner's (conservative) case
    labels = ids.masked_fill(mask == 0, -100)
    states = engine.prefix_states(ids, mask)
    losses = []
    with collect_scores(engine) as scores:
        for _ in range(steps):
            optimizer.zero_grad()
            parts = engine.loss(ids, labels, mask, prefix_states=states)
            parts.loss.backward()
            optimizer.step()
            scores.end_batch()
            losses.append(float(parts.loss.detach()))
    memory = engine.memory(optimizer=optimizer)
    result = {
        "microbatch": microbatch,
        "seq_len": seq_len,
        "trainable_layers": list(layers),
        "losses": losses,
        "engine_memory": memory,
        "seconds": time.perf_counter() - t0,
    }
    if cuda:
        torch.cuda.synchronize()
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated() - start_allocated
        result["max_memory_reserved"] = torch.cuda.max_memory_reserved()
    pred = predicted(config, layers, microbatch, seq_len, "cuda" if cuda else "cpu")
    result["predicted"] = pred
    result["activations_predicted_over_measured"] = pred["activations"] / memory["activations"]
    if cuda:
        result["allocated_predicted_over_measured"] = pred["allocated_peak"] / result["max_memory_allocated"]
    del engine, optimizer, loaded, scores, states
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def streaming(config: dict, device: torch.device, trainable: int, microbatch: int, seq_len: int, repeats: int,
              stream: bool) -> dict:  # fmt: skip
    """Step times with the frozen layers' 4-bit experts on the device or streamed from pinned host memory.

    Two steps, each timed ``repeats`` times after one warm-up: *uncached* (the prefix computed through the
    frozen layers, then loss + backward: what a prefix-cache miss, score or eval pays) and *cached* (the
    prefix states given: the usual training step, which never runs the frozen layers). Plus the allocator's
    peak and the planner's prediction for the same placement.
    """
    from usaf.engine.engine import SparseEngine, budget
    from usaf.engine.optim import SparseAdamW

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_allocated = torch.cuda.memory_allocated()
    loaded = build_loaded(config, device, torch.bfloat16, experts_device=torch.device("cpu") if stream else None)
    layers = tuple(loaded.spec.moe_layers[-trainable:])
    engine = SparseEngine(loaded, trainable_layers=list(layers), stream_experts=stream, pin_experts=stream and cuda)
    g = torch.Generator().manual_seed(0)
    engine.set_deltas(
        {n: random_positions(math.prod(w.shape), budget(w.shape, FRAC), g) for n, w in engine.weights.items()}
    )
    optimizer = SparseAdamW(engine.parameter_groups(lr=1e-2, router_lr=1e-4, weight_decay=0.0), max_grad_norm=1.0)
    ids = torch.randint(1, config["vocab_size"], (microbatch, seq_len), generator=g).to(device)
    labels = ids.clone()

    def step(cached_states):
        optimizer.zero_grad()
        states = cached_states if cached_states is not None else engine.prefix_states(ids)
        engine.loss(ids, labels, prefix_states=states).loss.backward()
        optimizer.step()

    def timed(cached_states) -> list[float]:
        step(cached_states)  # warm-up
        times = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(cached_states)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times

    uncached = timed(None)
    cached = timed(engine.prefix_states(ids))
    result = {
        "stream": stream,
        "microbatch": microbatch,
        "seq_len": seq_len,
        "trainable_layers": list(layers),
        "uncached_step_seconds": uncached,
        "cached_step_seconds": cached,
        "uncached_tokens_per_s": microbatch * seq_len / statistics.median(uncached),
        "cached_tokens_per_s": microbatch * seq_len / statistics.median(cached),
    }
    if engine.streamer is not None:
        result["streamer"] = engine.streamer.stats.as_dict()
    if cuda:
        torch.cuda.synchronize()
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated() - start_allocated
        pred = predicted(config, layers, microbatch, seq_len, "cuda", "stream" if stream else "device")
        result["predicted_allocated_peak"] = pred["allocated_peak"]
        result["allocated_predicted_over_measured"] = pred["allocated_peak"] / result["max_memory_allocated"]
    if engine.streamer is not None:
        engine.streamer.close()
    return result  # the caller collects the engine's memory


def decoding(config: dict, device: torch.device, repeats: int, arm: str) -> dict:
    """A decoding forward (one token, every layer frozen, as ``usaf generate`` without a change): the time per
    forward with the 4-bit experts on the device (``arm`` "resident"), streamed a whole layer ahead ("layers": what
    every forward did until 2026-12-06) or streamed reading the routed experts alone ("routed": what a forward of
    few tokens does since), and the bytes of layer copies each moved."""
    from usaf.engine.streaming import ExpertStreamer

    cuda = device.type == "cuda"
    stream = arm != "resident"
    loaded = build_loaded(config, device, torch.bfloat16, experts_device=torch.device("cpu") if stream else None)
    streamer = None
    if stream:
        streamer = ExpertStreamer(loaded.model.model.layers, loaded.experts, list(loaded.experts), device, pin=cuda,
                                  copy=not cuda, top_k=loaded.spec.top_k if arm == "routed" else None)  # fmt: skip
    ids = torch.randint(1, config["vocab_size"], (1, 1), generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    with torch.no_grad():
        for i in range(repeats + 1):  # the first: a warm-up
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loaded.model(ids)
            if cuda:
                torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
    result = {"arm": arm, "forward_seconds": times, "ms_per_token": 1000 * statistics.median(times)}
    if streamer is not None:
        result["streamer"] = streamer.stats.as_dict()
        streamer.close()
    return result


def quantize_speed(config: dict, device: torch.device, repeats: int) -> dict:
    """``usaf quantize``'s HQQ on one layer's fused gate_up tensor of this width, on ``device``: MB/s of bf16 source."""
    from usaf.quant import quantize_experts

    experts, width, hidden = config["num_experts"], config["moe_intermediate_size"], config["hidden_size"]
    weight = torch.randn(experts, 2 * width, hidden, dtype=torch.bfloat16) * 0.02
    quantize_experts(weight[:2], method="hqq", device=device)  # warm-up (kernels, solver)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        quantize_experts(weight, method="hqq", device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    source_mb = weight.numel() * 2 / 1e6
    return {"shape": list(weight.shape), "source_mb": source_mb, "seconds": seconds,
            "mb_per_s": source_mb / statistics.median(seconds)}  # fmt: skip


def cuda_fixed_costs(device: torch.device) -> dict:
    """Device memory the context takes and host RSS once CUDA (and cuBLAS) are initialised."""
    rss_before = psutil.Process().memory_info().rss
    torch.cuda.init()
    x = torch.ones(256, 256, device=device)
    (x @ x).sum().item()  # cuBLAS handle and workspace
    del x
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(device)
    return {
        "device_total": total,
        "device_in_use_after_init": total - free - torch.cuda.memory_reserved(device),
        "host_rss_before_cuda_mib": rss_before / MIB,
        "host_rss_after_cuda_mib": psutil.Process().memory_info().rss / MIB,
        "device_name": torch.cuda.get_device_name(device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--trainable", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small widths (a smoke test, e.g. on CPU)")
    parser.add_argument("--out", type=Path, default=None, help="[benchmarks/results/plan-gpu.json]")
    parser.add_argument("--streaming", action="store_true",
                        help="also time steps and a decoding forward with the experts streamed from host memory vs "
                        "on the device, and HQQ quantization speed")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per streaming arm")
    args = parser.parse_args()
    device = torch.device(args.device)
    out = args.out or RESULTS / ("plan-gpu-quick.json" if args.quick else "plan-gpu.json")
    config = model_config(args.layers, args.quick)
    import transformers

    results = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "model": {"base": "Qwen3-30B-A3B config" + (" (quick widths)" if args.quick else ""), "layers": args.layers},
        "runs": [],
    }
    if device.type == "cuda":
        results["cuda"] = cuda_fixed_costs(device)
        print(json.dumps(results["cuda"]), flush=True)
    for microbatch, seq_len in RUNS:
        seq = seq_len // 8 if args.quick else seq_len
        r = run(config, device, args.trainable, microbatch, seq, args.steps)
        results["runs"].append(r)
        ratio = r["activations_predicted_over_measured"]
        line = f"microbatch {microbatch} x {seq}: activations predicted/measured {ratio:.3f}"
        if "max_memory_allocated" in r:
            line += (
                f"; allocated peak measured {r['max_memory_allocated'] / MIB:.0f} MiB, predicted "
                f"{r['predicted']['allocated_peak'] / MIB:.0f} MiB ({r['allocated_predicted_over_measured']:.3f})"
            )
        print(line, flush=True)
    if args.streaming:
        microbatch, seq_len = RUNS[0]
        seq = seq_len // 8 if args.quick else seq_len
        results["streaming"] = []
        for stream in (False, True, False, True):  # interleaved: the machine's state drifts
            r = streaming(config, device, args.trainable, microbatch, seq, args.repeats, stream)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            results["streaming"].append(r)
            print(f"streaming {'on ' if stream else 'off'}: uncached {r['uncached_tokens_per_s']:.0f} tok/s, "
                  f"cached {r['cached_tokens_per_s']:.0f} tok/s"
                  + (f", peak {r['max_memory_allocated'] / MIB:.0f} MiB" if "max_memory_allocated" in r else ""),
                  flush=True)  # fmt: skip
        results["decoding"] = []
        for arm in ("resident", "layers", "routed") * 2:  # interleaved: the machine's state drifts
            r = decoding(config, device, 3 * args.repeats, arm)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            results["decoding"].append(r)
            moved = r.get("streamer", {}).get("bytes", 0) / MIB
            print(f"decoding, experts {arm}: {r['ms_per_token']:.1f} ms a token, {moved:.0f} MiB of layer copies",
                  flush=True)  # fmt: skip
        results["quantize"] = quantize_speed(config, device, args.repeats)
        print(f"HQQ quantize on {device}: {results['quantize']['mb_per_s']:.1f} MB/s of bf16 source", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
