"""Benchmark: `usaf.engine` step time, sparse backward, trainable-state bytes and peak RSS, on CPU.

Workload: the guide's CPU-sized MoE (docs: shared/guide/benchmarks.md), a random-init Qwen3-MoE with
8 layers, hidden 512, 32 experts, top-4, expert width 256 (vocab 512, 8 query / 4 KV heads of 64), built
by ``usaf.testing.build_tiny_model`` in fp32, quantized by ``usaf.stages.quantize.run(method="rtn")``
(4-bit, group 128) and loaded by ``usaf.engine.loading.load_quantized_model``. Batch: one microbatch of
2 x 256 random token ids (seeded), labels = ids. The engine trains sparse deltas on the top 2 layers'
experts (budget ``floor(frac * numel)`` per tensor, frac 0.005, random positions or ``--selection
scores``) plus those layers' routers, with ``SparseAdamW``. Every figure is measured side by side in
this one run; times are medians of interleaved repeats after warm-up steps.

1. **step**: forward + backward + optimizer step of the engine with the prefix cache (the states
   entering layer 6 captured once before timing by ``engine.prefix_states``), without it, and full
   fine-tuning (transformers ``from_pretrained`` of the unquantized source in fp32, its default
   experts implementation, ``torch.optim.AdamW(fused=True)`` over all parameters; also the default,
   unfused AdamW as a fourth arm), same batch, same loss, gradient clipping at 1.0 in every arm.
2. **backward**: ``loss.backward()`` alone, engine (sparse values + routers of layers 6-7) versus the
   transformers model with only layers 6-7's fused expert weights and routers requiring grad (a dense
   weight gradient for the same layers), with its default ``grouped_mm`` and with ``eager`` experts.
3. **bytes** of trainable state + optimizer state, read from the live objects: engine, full fine-tuning,
   and dense training of the same two layers' experts + routers.
4. **rss**: peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``) of a fresh child process that loads the
   model, builds the engine, captures prefix states and takes the timed steps, versus the engine's own
   accounting (``engine.memory(optimizer=...)``, which includes ``SparseAdamW.state_bytes()`` and the
   activations autograd saved in the largest training forward, + prefix-state bytes + the child's RSS after
   its imports). ``--only-rss`` re-measures this figure alone and updates it in the results file.

    python benchmarks/bench_engine.py [--repeats 7] [--quick] [--selection random|scores] [--profile]
                                      [--out benchmarks/results/engine.json]
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import datetime
import io
import json
import os
import platform
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from torch.nn import functional as F

from usaf.engine.engine import SparseEngine, budget
from usaf.engine.loading import load_quantized_model
from usaf.engine.optim import SparseAdamW

RESULTS = Path(__file__).resolve().parent / "results"
# The guide's CPU-sized MoE. Attention: 8 query heads, 4 KV heads of 64 (the tiny default of 4 x 8 is for H=32).
MODEL = {
    "num_layers": 8,
    "hidden_size": 512,
    "moe_intermediate_size": 256,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
MODEL_QUICK = {
    **MODEL,
    "num_layers": 4,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_experts": 8,
    "head_dim": 32,
}
BATCH, SEQ, SEQ_QUICK = 2, 256, 64
VOCAB = 512  # usaf.testing's tiny vocabulary
FRAC = 0.005
TOP = 2  # trainable layers: the top TOP of the model
LR, ROUTER_LR = 1e-2, 1e-3  # values do not affect timing; the docs' calibration found ~1e-2 for deltas
WARMUP = 2  # untimed steps per arm before the interleaved repeats
# The RSS child is started by a small wrapper process, not by this (large) process: Linux carries the
# high-water RSS of the address space a process replaces at exec into its ru_maxrss, so a child forked
# straight from here would report at least this process's RSS. The wrapper also reports
# RUSAGE_CHILDREN.ru_maxrss as a cross-check.
WRAPPER = (
    "import resource, subprocess, sys\n"
    "p = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, text=True)\n"
    "print(p.stdout.strip().splitlines()[-1] if p.returncode == 0 else '')\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(p.returncode)\n"
)


def machine() -> dict:
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "?")
    return {
        "summary": (
            f"{psutil.cpu_count()} CPU cores ({cpu}), {platform.machine()}, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, no GPU used"
        ),
        "cpu": cpu,
        "cpus": psutil.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(),
    }


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


# -- the workload ---------------------------------------------------------------------------------------


def build_and_quantize(work: Path, widths: dict) -> tuple[Path, Path, dict]:
    from usaf.stages.quantize import QuantizeConfig, run
    from usaf.testing import build_tiny_model

    t0 = time.perf_counter()
    kwargs = {k: v for k, v in widths.items() if k != "num_layers"}
    src = build_tiny_model("qwen3_moe", work / "src", num_layers=widths["num_layers"], tokenizer=False, **kwargs)
    t1 = time.perf_counter()
    manifest, qdir = run(QuantizeConfig(model=str(src), out=work / "q4", method="rtn"))
    t2 = time.perf_counter()
    print(f"[setup] built in {t1 - t0:.1f}s, quantized (rtn) in {t2 - t1:.1f}s", flush=True)
    info = {"build_seconds": t1 - t0, "quantize_seconds": t2 - t1, "mean_rel_error": manifest.summary.mean_rel_error}
    return src, qdir, info


def make_batch(seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, seq), generator=g)
    return ids, ids.clone()


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The engine's loss (``SparseEngine.loss`` without router terms): token-weighted next-token CE."""
    logits = logits[:, :-1].float()
    targets = labels[:, 1:]
    tokens = int((targets != -100).sum())
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, targets.reshape(-1), ignore_index=-100, reduction="sum") / max(tokens, 1)


def random_positions(numel: int, k: int, seed: int) -> torch.Tensor:
    """``k`` distinct flat indices, uniform, sorted, without a ``numel``-sized permutation (peak RSS)."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.empty(0, dtype=torch.int64)
    while chosen.numel() < k:
        draw = torch.randint(0, numel, (int(1.2 * (k - chosen.numel())) + 16,), generator=g)
        chosen = torch.cat([chosen, draw]).unique()
    return chosen[torch.randperm(chosen.numel(), generator=g)[:k]].sort().values


def make_engine(qdir: Path, frac: float, selection: str, batch) -> tuple[SparseEngine, SparseAdamW, dict]:
    loaded = load_quantized_model(qdir)
    layers = list(loaded.spec.moe_layers[-TOP:])
    engine = SparseEngine(loaded, trainable_layers=layers, train_router=True)
    budgets = {name: budget(w.shape, frac) for name, w in engine.weights.items()}
    if selection == "scores":
        ids, labels = batch
        scores = engine.dense_scores([(ids, labels, None)], candidates=budgets, statistic="grad")
        chosen = {name: scores[name].top(k)[0] for name, k in budgets.items()}
        if any(chosen[n].numel() != k for n, k in budgets.items()):
            raise RuntimeError("dense scores found fewer positive entries than the budget")
    else:
        chosen = {}
        for i, (name, w) in enumerate(engine.weights.items()):
            chosen[name] = random_positions(w.shape[0] * w.shape[1] * w.shape[2], budgets[name], seed=i)
    engine.set_deltas(chosen)
    groups = engine.parameter_groups(lr=LR, router_lr=ROUTER_LR, weight_decay=0.0)
    optimizer = SparseAdamW(groups, max_grad_norm=1.0)
    info = {
        "trainable_layers": layers,
        "budget_per_tensor": budgets,
        "selection": selection,
        **engine.trainable_count(),
    }
    return engine, optimizer, info


def engine_step(engine, optimizer, batch, states) -> float:
    ids, labels = batch
    start = time.perf_counter()
    optimizer.zero_grad()
    engine.loss(ids, labels, prefix_states=states).loss.backward()
    if not optimizer.step().applied:
        raise RuntimeError("SparseAdamW skipped a step")
    return time.perf_counter() - start


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def full_step(model, optimizer, batch) -> float:
    ids, labels = batch
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    token_loss(model(input_ids=ids, use_cache=False).logits, labels).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as SparseAdamW(max_grad_norm=1.0)
    optimizer.step()
    return time.perf_counter() - start


def load_reference(src: Path, experts_implementation: str | None = None):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kwargs)
    return model


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def adamw_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(v for v in s.values() if torch.is_tensor(v)) for s in optimizer.state.values())


def interleave(arms: dict, repeats: int, label: str) -> dict[str, list[float]]:
    """Warm-up steps per arm, then ``repeats`` rounds A B C A B C; returns seconds per arm."""
    for fn in arms.values():
        for _ in range(WARMUP):
            fn()
    times: dict[str, list[float]] = {k: [] for k in arms}
    for i in range(repeats):
        for key, fn in arms.items():
            times[key].append(fn())
        print(f"[{label}] repeat {i}: " + "  ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
    return times


# -- 1. step time, 2. backward, 3. bytes --------------------------------------------------------------------


def step_and_backward(src: Path, qdir: Path, seq: int, repeats: int, selection: str, profile: bool) -> dict:
    batch = make_batch(seq)
    engine, optimizer, engine_info = make_engine(qdir, FRAC, selection, batch)
    states = engine.prefix_states(batch[0])
    full = load_reference(src)
    full.train()
    implementation = full.config._experts_implementation
    # fused=True is torch's fastest CPU AdamW (several times the default for-loop path here): the
    # stronger baseline is the headline; the default AdamW is timed beside it.
    full_opt = torch.optim.AdamW(full.parameters(), lr=1e-4, fused=True)
    full_opt_default = torch.optim.AdamW(full.parameters(), lr=1e-4)

    # 1. step time
    times = interleave(
        {
            "engine_prefix": lambda: engine_step(engine, optimizer, batch, states),
            "engine_no_prefix": lambda: engine_step(engine, optimizer, batch, None),
            "prefix_capture": lambda: timed(lambda: engine.prefix_states(batch[0])),
            "full_finetune": lambda: full_step(full, full_opt, batch),
            "full_finetune_default_adamw": lambda: full_step(full, full_opt_default, batch),
        },
        repeats,
        "step",
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = batch[0].numel()
    step = {
        "repeats": repeats,
        "warmup_steps_per_arm": WARMUP,
        "full_finetune_experts_implementation": implementation,
        "seconds": times,
        "median_seconds": med,
        "tokens_per_s": {k: tokens / v for k, v in med.items()},
        "ratio_engine_prefix_over_full": med["engine_prefix"] / med["full_finetune"],
        "ratio_engine_no_prefix_over_full": med["engine_no_prefix"] / med["full_finetune"],
        "ratio_engine_prefix_over_full_default_adamw": med["engine_prefix"] / med["full_finetune_default_adamw"],
        "ratio_engine_no_prefix_over_full_default_adamw": med["engine_no_prefix"] / med["full_finetune_default_adamw"],
        "full_finetune_optimizer": "torch.optim.AdamW(fused=True), clip_grad_norm_ 1.0",
        "ratio_engine_prefix_over_no_prefix": med["engine_prefix"] / med["engine_no_prefix"],
        # A sample seen once pays the capture too (a forward through the frozen layers, no_grad).
        "ratio_engine_prefix_plus_capture_over_full": (med["engine_prefix"] + med["prefix_capture"])
        / med["full_finetune"],
        "target_engine_over_full": 0.5,
    }

    # 3. bytes (read now, from the live objects)
    full_params = list(full.parameters())
    full_bytes = {
        "params_fp32": tensor_bytes(full_params),
        "adamw_state": adamw_state_bytes(full_opt),
        "grads": tensor_bytes(p.grad for p in full_params if p.grad is not None),
        "param_count": sum(p.numel() for p in full_params),
    }
    full_opt.state.clear()  # free the moments before the backward figure
    full_opt_default.state.clear()

    # 2. backward only: dense weight gradient of the same two layers' experts + routers
    layers = engine_info["trainable_layers"]
    spec = engine.spec
    dense_names = [n for layer in layers for n in (spec.gate_up_name(layer), spec.down_name(layer))]
    dense_names += [n for layer in layers for n in spec.router_names(layer)]
    eager = load_reference(src, "eager")
    dense_params = {}
    for key, model in (("dense_grouped_mm", full), ("dense_eager", eager)):
        model.requires_grad_(False)
        model.eval()  # the engine's model is in eval mode too (no dropout either way in Qwen3-MoE)
        dense_params[key] = [model.get_parameter(n) for n in dense_names]
        for p in dense_params[key]:
            p.requires_grad_(True)

    def engine_backward() -> float:
        optimizer.zero_grad()
        loss = engine.loss(batch[0], batch[1], prefix_states=states).loss
        start = time.perf_counter()
        loss.backward()
        return time.perf_counter() - start

    def dense_backward(model) -> float:
        model.zero_grad(set_to_none=True)
        loss = token_loss(model(input_ids=batch[0], use_cache=False).logits, batch[1])
        start = time.perf_counter()
        loss.backward()
        return time.perf_counter() - start

    bwd_times = interleave(
        {
            "engine_sparse": engine_backward,
            "dense_grouped_mm": lambda: dense_backward(full),
            "dense_eager": lambda: dense_backward(eager),
        },
        repeats,
        "backward",
    )
    bmed = {k: statistics.median(v) for k, v in bwd_times.items()}
    backward = {
        "repeats": repeats,
        "layers": layers,
        "dense_trainable": dense_names,
        "seconds": bwd_times,
        "median_seconds": bmed,
        "ratio_engine_over_dense_grouped_mm": bmed["engine_sparse"] / bmed["dense_grouped_mm"],
        "ratio_engine_over_dense_eager": bmed["engine_sparse"] / bmed["dense_eager"],
    }

    # dense top-2 training: one real AdamW step on the same parameters, then read its state
    dense_opt = torch.optim.AdamW(dense_params["dense_grouped_mm"], lr=1e-4)
    full.zero_grad(set_to_none=True)
    token_loss(full(input_ids=batch[0], use_cache=False).logits, batch[1]).backward()
    dense_opt.step()
    dense_top = {
        "params_fp32": tensor_bytes(dense_params["dense_grouped_mm"]),
        "adamw_state": adamw_state_bytes(dense_opt),
        "grads": tensor_bytes(p.grad for p in dense_params["dense_grouped_mm"]),
        "param_count": sum(p.numel() for p in dense_params["dense_grouped_mm"]),
    }
    bytes_ = trainable_bytes(engine, optimizer, full_bytes, dense_top)
    result = {"engine": engine_info, "step": step, "backward": backward, "bytes": bytes_}
    if profile:
        result["profile"] = {
            "engine_prefix": profile_step(lambda: engine_step(engine, optimizer, batch, states)),
            "engine_no_prefix": profile_step(lambda: engine_step(engine, optimizer, batch, None)),
        }
    return result


def trainable_bytes(engine: SparseEngine, optimizer: SparseAdamW, full: dict, dense_top: dict) -> dict:
    deltas = engine.deltas().values()
    nnz = sum(d.nnz for d in deltas)
    values = tensor_bytes(d.values for d in deltas)
    indices = tensor_bytes(d.indices for d in deltas)
    routers = tensor_bytes(engine.routers.values())
    state = optimizer.state_bytes()
    engine_total = values + indices + routers + state
    # What the engine actually holds beyond the brief's count: derived per-entry buffers, grads, router anchors.
    derived = tensor_bytes(t for d in deltas for t in (d.experts, d.rows, d.cols, d.offsets))
    grads = tensor_bytes(p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
    anchors = optimizer.state_bytes(include_anchors=True) - state
    full_total = full["params_fp32"] + full["adamw_state"]
    dense_total = dense_top["params_fp32"] + dense_top["adamw_state"]
    return {
        "engine": {
            "delta_entries": nnz,
            "delta_values_fp32": values,
            "delta_indices_int64": indices,
            "routers_fp32": routers,
            "sparse_adamw_state": state,
            "total": engine_total,
            "not_in_total": {"derived_index_buffers": derived, "grads": grads, "router_anchors": anchors},
        },
        "full_finetune": {**full, "total": full_total, "not_in_total": {"grads": full["grads"]}},
        "dense_top_layers": {**dense_top, "total": dense_total, "not_in_total": {"grads": dense_top["grads"]}},
        "ratio_engine_over_full": engine_total / full_total,
        "ratio_engine_over_dense_top_layers": engine_total / dense_total,
        "target_engine_over_full": 0.01,
    }


def profile_step(fn) -> dict:
    """cProfile of one engine step plus torch.profiler's top ops by self CPU time."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    rows = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(20)
        rows[key] = [line for line in buf.getvalue().splitlines() if line.strip()]
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as tp:
        fn()
    table = tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    rows["torch_ops"] = table.splitlines()
    return rows


# -- 4. peak RSS in a fresh child versus the engine's accounting ------------------------------------------------


def rss_child(qdir: Path, seq: int, steps: int, selection: str) -> dict:
    """Runs in the child: everything the engine arm does, with RSS read at each phase (MiB)."""
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401 (imported lazily by the load otherwise)

    def maxrss() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

    baseline = current_rss()
    batch = make_batch(seq)
    engine, optimizer, _ = make_engine(qdir, FRAC, selection, batch)
    after_setup = maxrss()
    states = engine.prefix_states(batch[0])
    after_prefix = maxrss()
    for _ in range(WARMUP + steps):
        engine_step(engine, optimizer, batch, states)
    peak = maxrss()
    rss_end = current_rss()
    # After the peak is read: what of the gap is freed memory glibc keeps, and what one step's graph holds.
    trimmed = malloc_trim()
    rss_trimmed = current_rss()
    optimizer.zero_grad()
    parts = engine.loss(*batch, prefix_states=states)  # forward with the autograd graph alive
    rss_graph = current_rss()
    del parts
    # The engine's own accounting: 4-bit experts, resident bases, deltas (values + every index buffer),
    # routers, other weights, and SparseAdamW.state_bytes() as "optimizer_state".
    memory = engine.memory(optimizer=optimizer)
    accounted = {"import_baseline": baseline * 2**20, **memory, "prefix_states": tensor_bytes([states])}
    return {
        "peak_rss_mib": peak,
        "peak_rss_after_setup_mib": after_setup,
        "peak_rss_after_prefix_capture_mib": after_prefix,
        "rss_at_end_mib": rss_end,
        "malloc_trim_available": trimmed,
        "rss_after_malloc_trim_mib": rss_trimmed,
        "rss_with_one_forward_graph_alive_mib": rss_graph,
        "activations_estimate_mib": rss_graph - rss_trimmed,
        "activations_measured_by_engine_mib": memory.get("activations", 0) / 2**20,
        "import_baseline_rss_mib": baseline,
        "accounted_bytes": accounted,
        "accounted_mib": sum(accounted.values()) / 2**20,
        "steps": WARMUP + steps,
    }


def current_rss() -> float:
    return psutil.Process().memory_info().rss / 2**20


def malloc_trim() -> bool:
    """glibc's malloc_trim(0): hand freed heap memory back to the OS (False where there is no glibc)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def rss(qdir: Path, seq: int, steps: int, selection: str) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--rss-child",
        str(qdir),
        "--seq",
        str(seq),
        "--repeats",
        str(steps),
        "--selection",
        selection,
    ]
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"RSS child failed ({p.returncode}):\n{p.stderr[-4000:]}")
    line, children_kib = p.stdout.strip().splitlines()[-2:]
    child = json.loads(line)
    child["wrapper_rusage_children_maxrss_mib"] = int(children_kib) / 1024
    child["wall_seconds"] = time.perf_counter() - start
    child["ratio_measured_over_accounted"] = child["peak_rss_mib"] / child["accounted_mib"]
    child["target_agreement"] = 0.2
    print(f"[rss] peak {child['peak_rss_mib']:.0f} MiB, accounted {child['accounted_mib']:.0f} MiB", flush=True)
    return child


# -- main ---------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timed steps per arm [7; 5 with --quick]")
    parser.add_argument("--quick", action="store_true", help="a 4-layer, hidden-256 model at seq 64: a smoke run")
    parser.add_argument(
        "--selection",
        choices=("random", "scores"),
        default="random",
        help="delta positions: seeded uniform random, or engine.dense_scores top-k on the batch",
    )
    parser.add_argument("--profile", action="store_true", help="also profile one engine step (cProfile, torch)")
    parser.add_argument("--out", type=Path, default=None, help="[benchmarks/results/engine.json]")
    parser.add_argument("--seq", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rss-child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--only-rss", action="store_true", help="re-measure only figure 4 and update it in the results file"
    )
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 7)
    if args.rss_child is not None:
        print(json.dumps(rss_child(args.rss_child, args.seq, repeats, args.selection)))
        return
    widths = MODEL_QUICK if args.quick else MODEL
    seq = SEQ_QUICK if args.quick else SEQ
    out = args.out or RESULTS / ("engine-quick.json" if args.quick else "engine.json")
    torch.manual_seed(0)
    result: dict = {
        "machine": machine(),
        "quick": args.quick,
        "command": " ".join(["python", *sys.argv]),
        "model": {
            "family": "qwen3_moe",
            "dtype": "float32",
            "vocab_size": VOCAB,
            "quantization": "rtn 4-bit g128",
            **widths,
        },
        "batch": {"microbatch": BATCH, "seq": seq, "tokens": "random ids in [1, 512), seed 0; labels = ids"},
        "frac": FRAC,
    }
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    if args.only_rss:
        update_rss_only(out, widths, seq, repeats, args.selection)
        return
    with tempfile.TemporaryDirectory(prefix="usaf-bench-engine-") as tmp:
        src, qdir, result["setup"] = build_and_quantize(Path(tmp), widths)
        result.update(step_and_backward(src, qdir, seq, repeats, args.selection, args.profile))
        result["rss"] = rss(qdir, seq, repeats, args.selection)
    result["total_seconds"] = time.perf_counter() - started
    result["load_average_1min"] = {"start": load_start, "end": os.getloadavg()[0]}  # other processes share the CPUs
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"wrote {out}")


def update_rss_only(out: Path, widths: dict, seq: int, repeats: int, selection: str) -> None:
    """Figure 4 alone (a fresh child process), written into the existing results with its own command."""
    result = json.loads(out.read_text()) if out.is_file() else {}
    with tempfile.TemporaryDirectory(prefix="usaf-bench-engine-") as tmp:
        _, qdir, _ = build_and_quantize(Path(tmp), widths)
        result["rss"] = rss(qdir, seq, repeats, selection)
    result["rss"]["command"] = " ".join(["python", *sys.argv])
    result["rss"]["machine"] = machine()
    out.write_text(json.dumps(result, indent=2) + "\n")
    m = result["rss"]
    print(
        f"peak RSS {m['peak_rss_mib']:.0f} MiB, accounted {m['accounted_mib']:.0f} MiB: "
        f"measured / accounted {m['ratio_measured_over_accounted']:.3f}; wrote {out}"
    )


def print_summary(r: dict) -> None:
    mib = 2**20
    print(f"\nmachine: {r['machine']['summary']}")
    s = r["step"]
    med = s["median_seconds"]
    print(f"1. step time (fwd + bwd + optimizer), median of {s['repeats']} interleaved:")
    for k in ("engine_prefix", "engine_no_prefix", "prefix_capture", "full_finetune", "full_finetune_default_adamw"):
        print(f"  {k:27s} {med[k]:7.3f} s  {s['tokens_per_s'][k]:8.0f} tokens/s")
    print(f"  engine (prefix) / full:    {s['ratio_engine_prefix_over_full']:.3f} (target <= 0.5)")
    print(f"  engine (no prefix) / full: {s['ratio_engine_no_prefix_over_full']:.3f} (target <= 0.5)")
    print(f"  (prefix + capture) / full: {s['ratio_engine_prefix_plus_capture_over_full']:.3f}")
    print(f"  prefix / no prefix:        {s['ratio_engine_prefix_over_no_prefix']:.3f}")
    b = r["backward"]
    print(f"2. loss.backward() alone, layers {b['layers']}, median of {b['repeats']}:")
    for k, v in b["median_seconds"].items():
        print(f"  {k:17s} {v:7.3f} s")
    print(
        f"  engine / dense (grouped_mm): {b['ratio_engine_over_dense_grouped_mm']:.3f}"
        f"   engine / dense (eager): {b['ratio_engine_over_dense_eager']:.3f}"
    )
    by = r["bytes"]
    print("3. trainable + optimizer state:")
    print(f"  engine          {by['engine']['total'] / mib:9.2f} MiB ({by['engine']['delta_entries']} delta entries)")
    print(f"  full finetune   {by['full_finetune']['total'] / mib:9.2f} MiB")
    print(f"  dense top {TOP}     {by['dense_top_layers']['total'] / mib:9.2f} MiB")
    print(
        f"  engine / full: {by['ratio_engine_over_full']:.5f} (target <= 0.01)"
        f"   engine / dense top {TOP}: {by['ratio_engine_over_dense_top_layers']:.4f}"
    )
    m = r["rss"]
    print(
        f"4. peak RSS of a fresh engine process: {m['peak_rss_mib']:.0f} MiB; accounted {m['accounted_mib']:.0f} MiB"
        f" (of which import baseline {m['import_baseline_rss_mib']:.0f}); measured / accounted "
        f"{m['ratio_measured_over_accounted']:.3f} (target within 20 %)"
    )
    print(
        f"   at the end: RSS {m['rss_at_end_mib']:.0f} MiB, {m['rss_after_malloc_trim_mib']:.0f} after malloc_trim, "
        f"{m['rss_with_one_forward_graph_alive_mib']:.0f} with one forward's graph alive "
        f"(activations ~{m['activations_estimate_mib']:.0f} MiB)"
    )
    load = r["load_average_1min"]
    print(
        f"total {r['total_seconds']:.0f} s; 1-min load average {load['start']:.1f} at start, {load['end']:.1f} at end"
    )


if __name__ == "__main__":
    main()
