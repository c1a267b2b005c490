"""GPU benchmark: usaf's training steps at Qwen3-30B-A3B's real width against a LoRA step on the same layers.

Model: ``bench_plan_gpu.build_loaded``'s stack, Qwen3-30B-A3B's config (hidden 2048, 128 experts of width 768,
top-8) cut to ``--layers`` decoder layers, random weights in bf16, the 4-bit random-code experts on the device.
usaf trains the top ``--trainable`` layers at usaf's default targets (experts and attention) at frac 0.005,
random positions, routers on. LoRA (peft) trains the same layers' q/k/v/o and fused experts at the ranks whose
trainable count is closest to usaf's, on transformers' model of the same config (bf16, random weights, its
default experts implementation). QLoRA is not timed: it needs bitsandbytes, which the GPU machines lack.

Arms, interleaved in rotating order each round, CUDA-synchronised, medians of ``--rounds``; microbatch 2 x 512:

- **first visit**: the prefix through the frozen layers (no graph), then loss + backward + ``SparseAdamW`` step:
  every step of a one-epoch run without ``usaf score --cache``;
- **cached**: the same with the prefix states given (a prefix-cache hit);
- **collecting**: a cached step with RigL's score sinks installed (the ``SCORE_BATCHES`` steps before a
  reselection);
- **cached, per expert** and **collecting, per expert**: those steps with the trainable layers' experts one at a time
  (``LayerExperts.grouped_deltas`` off), where the device runs them grouped (``usaf.engine.grouped_deltas``; CUDA,
  or any device with ``--grouped on``); absent where both would be the loop;
- **LoRA**: forward through every layer + backward + ``AdamW(fused)`` step, gradient clipping at 1.0 in both.

After each round's collecting steps, one ``reselect`` is timed; the RigL cycle's overhead at the default
``--reselect-every 50`` is ``(SCORE_BATCHES x (collecting - cached) + reselect) / (50 x cached)``. Then each arm
once more alone for the allocator's peak above what its model holds.

``--deterministic``: every arm under torch's deterministic algorithms (``usaf train --deterministic``'s setting), to
price bit-reproducibility. ``ops_per_step``: the aten operators one step dispatches (counted by a dispatch mode,
forward, backward and optimizer), a device's kernel launches give or take views and fused fallbacks: what a
launch-bound step pays for; ``device_syncs_per_step``: those of them that make the host wait for the device
(``usaf.testing.dispatch``: scalar reads, outputs sized by the data, copies between host and device not through
pinned memory; none on a CPU). ``--profile FILE``: after the timing, two more steps of the cached arm (grouped and,
where both run, per expert) and of LoRA under torch's profiler; FILE gets each one's operators by device time and by
host time (where a step's time goes: the GPU's kernels or the host launching them).

    python benchmarks/bench_steps_gpu.py [--layers 4] [--trainable 2] [--rounds 7] [--deterministic]
                                         [--profile FILE] [--out benchmarks/results/steps-gpu.json]
    python benchmarks/bench_steps_gpu.py --device cpu --quick     # a smoke test of this script without a GPU
    python benchmarks/bench_steps_gpu.py --device cpu --quick --experts 128 --grouped on --threads 1   # grouped vs
        # per expert on the CPU at 128 experts, narrow: where per-op overhead, as on a GPU, is most of a step
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import token_loss  # noqa: E402
from bench_frozen import _sync, interleaved  # noqa: E402
from bench_plan_gpu import FRAC, RESULTS, build_loaded, model_config, random_positions  # noqa: E402
from bench_train import LORA_ALPHA, git_commit, lora_ranks  # noqa: E402

MICROBATCH, SEQ_LEN = 2, 512
LR = 1e-4
RESELECT_EVERY = 50  # the default --reselect-every


def usaf_arms(
    config: dict,
    device: torch.device,
    trainable: int,
    ids: torch.Tensor,
    grouped: str = "auto",
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[dict, dict]:
    """The engine at usaf's default targets on the top layers; its step functions and a description.

    ``grouped``: ``"auto"`` (the device's choice), ``"on"`` (the trainable layers' experts grouped on any device) or
    ``"cuda-path"`` (the same, run under :func:`cuda_path`).
    """
    from usaf.engine.engine import SparseEngine, budget
    from usaf.engine.optim import SparseAdamW
    from usaf.engine.reselect import collect_scores, reselect, update_fraction
    from usaf.settings.fields import DEFAULT_TARGETS
    from usaf.stages.train.loop import SCORE_BATCHES

    loaded = build_loaded(config, device, dtype)
    layers = list(loaded.spec.moe_layers[-trainable:])
    engine = SparseEngine(loaded, trainable_layers=layers, targets=DEFAULT_TARGETS)
    trained = [loaded.experts[layer] for layer in layers]
    if grouped in ("on", "cuda-path"):
        for state in trained:
            state.grouped_deltas = True
    g = torch.Generator().manual_seed(0)
    engine.set_deltas({n: random_positions(math.prod(w.shape), budget(w.shape, FRAC), g).to(device)
                       for n, w in engine.weights.items()})  # fmt: skip
    optimizer = SparseAdamW(engine.parameter_groups(lr=LR, router_lr=LR, weight_decay=0.0), max_grad_norm=1.0)
    labels = ids.clone()
    with torch.no_grad():
        prefix_states = engine.prefix_states(ids)
    scores = collect_scores(engine)
    sinks = {name: engine.weights[name].score_sink for name in scores}
    scores.close()  # installed per collecting step below

    def step(prefix) -> None:
        optimizer.zero_grad()
        engine.loss(ids, labels, prefix_states=prefix).loss.backward()
        optimizer.step()

    def first_visit() -> None:
        with torch.no_grad():
            prefix = engine.prefix_states(ids)
        step(prefix)

    def collecting() -> None:
        for name, sink in sinks.items():
            engine.weights[name].score_sink = sink
        try:
            step(prefix_states)
            scores.end_batch()
        finally:
            for name in sinks:
                engine.weights[name].score_sink = None

    fraction = update_fraction(RESELECT_EVERY, 1000, 0.2)  # the default cycle's fraction at its first reselection

    def reselection() -> None:
        reselect(engine, optimizer, scores, fraction)

    def per_expert(arm):
        def run() -> None:
            for state in trained:
                state.grouped_deltas = False
            try:
                arm()
            finally:
                for state in trained:
                    state.grouped_deltas = True

        return run

    count = sum(d.nnz for d in engine.deltas().values()) + sum(p.numel() for p in engine.routers.values())
    arms = {"usaf_first_visit": first_visit, "usaf_cached": lambda: step(prefix_states), "usaf_collecting": collecting}
    if all(state.grouped_deltas for state in trained):
        arms["usaf_cached_per_expert"] = per_expert(arms["usaf_cached"])
        arms["usaf_collecting_per_expert"] = per_expert(collecting)
    info = {"layers": layers, "targets": list(DEFAULT_TARGETS), "trainable_params": count,
            "score_batches": SCORE_BATCHES, "reselect_fraction": fraction, "reselect": reselection}  # fmt: skip
    return arms, info


def lora_arm(config: dict, device: torch.device, layers: list[int], target: int, ids: torch.Tensor, dtype: torch.dtype):
    """peft LoRA on transformers' model of ``config``: the layers' q/k/v/o and fused experts, count near ``target``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from usaf.families.meta import build_config

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(build_config(config), dtype=dtype)
    h, i, e = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    per_expert_rank = (e * (h + 2 * i) + e * (i + h)) * len(layers)  # lora_A (r E, in) + lora_B (out, r E)
    per_attention_rank = ((h + q) + 2 * (h + kv) + (q + h)) * len(layers)
    expert_rank, attention_rank = lora_ranks(target, per_expert_rank, per_attention_rank)
    attention = [f"model.layers.{n}.self_attn.{p}" for n in layers for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    peft_model = get_peft_model(model, LoraConfig(
        r=expert_rank, lora_alpha=LORA_ALPHA, target_modules=attention,
        target_parameters=[f"model.layers.{n}.mlp.experts.{p}" for n in layers for p in ("gate_up_proj", "down_proj")],
        rank_pattern={p: attention_rank for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    ))  # fmt: skip
    peft_model.train()
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, fused=device.type == "cuda")
    labels = ids.clone()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = peft_model(input_ids=ids, use_cache=False).logits
        token_loss(logits, labels).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    info = {"expert_rank": expert_rank, "attention_rank": attention_rank,
            "trainable_params": sum(p.numel() for p in params)}  # fmt: skip
    return step, info


def peak_above_resident(fn, device: torch.device) -> int | None:
    """Allocator bytes one call of ``fn`` takes above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def model_record(config: dict, args: argparse.Namespace, **extra) -> dict:
    """The benchmarked stack, for a result file: ``args`` has ``quick``, ``layers`` and ``dtype``."""
    return {
        "base": "Qwen3-30B-A3B config" + (" (quick widths)" if args.quick else ""),
        "layers": args.layers,
        "experts": config["num_experts"],
        "hidden": config["hidden_size"],
        "expert_width": config["moe_intermediate_size"],
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        **extra,
    }


def dispatched_ops(fn) -> dict[str, int]:
    """What one call of ``fn`` dispatches (forward, backward, optimizer): ``ops``, every aten operator, views
    included; ``device_syncs``, those that wait for the device to finish (``usaf.testing.dispatch``: a scalar read,
    an output sized by the data, a copy between host and device not through pinned memory). A sync stops the host
    from queueing kernels ahead of the device, so a launch-bound step pays its whole launch time again after each."""
    from usaf.testing.dispatch import count_dispatch

    counted = count_dispatch(fn)
    return {"ops": counted.ops, "device_syncs": counted.syncs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--trainable", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small widths and seq 64 (a smoke test, e.g. on CPU)")
    parser.add_argument("--experts", type=int, default=None, help="experts per layer (default: the config's)")
    parser.add_argument(
        "--grouped",
        choices=("auto", "on", "cuda-path"),
        default="auto",
        help="the trainable layers' experts grouped: the device's choice, or on any device; cuda-path: also every "
        "sparse linear's delta terms dense, CUDA's two choices on this device (operator counts as a GPU step's)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype, every arm")
    parser.add_argument("--deterministic", action="store_true", help="torch's deterministic algorithms throughout")
    parser.add_argument("--profile", type=Path, default=None, help="write the cached and LoRA steps' profiles here")
    parser.add_argument("--out", type=Path, default=None, help="[benchmarks/results/steps-gpu.json]")
    args = parser.parse_args()
    from usaf.backends.determinism import deterministic_kernels

    with deterministic_kernels(args.deterministic), cuda_path(args.grouped == "cuda-path"):
        run(args)


@contextlib.contextmanager
def cuda_path(on: bool):
    """Inside, every device declares ``Capabilities.dense_delta_terms`` (CUDA's): the attention's delta terms run
    dense and the trainable experts grouped, so a CPU run dispatches what a GPU step would (its times are the CPU's).
    """
    if not on:
        yield
        return
    from usaf.backends import transfer

    own = transfer._capabilities
    transfer._capabilities = lambda kind, index: dataclasses.replace(own(kind, index), dense_delta_terms=True)
    try:
        yield
    finally:
        transfer._capabilities = own


def profile(arms: dict, names: tuple[str, ...], device: torch.device, path: Path) -> None:
    """Two steps of each named arm under torch's profiler: operator tables by device time and by host time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sections = []
    for name in (n for n in names if n in arms):
        _sync(device)
        with torch_profile(activities=activities) as prof:
            for _ in range(2):
                arms[name]()
            _sync(device)
        table = prof.key_averages()
        for key in (["self_device_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
            rows = table.table(sort_by=key, row_limit=30, max_name_column_width=60)
            sections.append(f"== {name}: 2 steps, by {key}\n{rows}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(sections) + "\n")
    print(f"wrote {path}")


def _per_step(arms: dict) -> dict:
    """``ops_per_step`` and ``device_syncs_per_step`` of every arm (:func:`dispatched_ops`)."""
    counted = {name: dispatched_ops(fn) for name, fn in arms.items()}
    return {"ops_per_step": {name: c["ops"] for name, c in counted.items()},
            "device_syncs_per_step": {name: c["device_syncs"] for name, c in counted.items()}}  # fmt: skip


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = model_config(args.layers, args.quick)
    if args.experts:
        config["num_experts"] = args.experts
    seq_len = SEQ_LEN // 8 if args.quick else SEQ_LEN
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, config["vocab_size"], (MICROBATCH, seq_len), generator=g).to(device)

    allocated = lambda: torch.cuda.memory_allocated(device) if device.type == "cuda" else None  # noqa: E731
    arms, usaf = usaf_arms(config, device, args.trainable, ids, args.grouped, getattr(torch, args.dtype))
    usaf["model_bytes"] = allocated()
    reselect_fn = usaf.pop("reselect")
    try:  # peft without target_parameters (< 0.17) cannot wrap fused experts: usaf's arms are still timed
        lora_step, lora = lora_arm(
            config, device, usaf["layers"], usaf["trainable_params"], ids, getattr(torch, args.dtype)
        )
        lora["model_bytes"] = None if device.type != "cuda" else allocated() - usaf["model_bytes"]
        arms["lora"] = lora_step
    except Exception as e:  # noqa: BLE001
        lora = {"error": f"{type(e).__name__}: {e}"}
        print(f"LoRA arm unavailable: {lora['error']}", flush=True)
    for fn in arms.values():  # warm-up: kernels, allocator, cuBLAS
        fn()
    reselect_seconds: list[float] = []

    def timed_reselect(_round: int) -> None:
        _sync(device)
        start = time.perf_counter()
        reselect_fn()
        _sync(device)
        reselect_seconds.append(time.perf_counter() - start)

    times = interleaved(arms, args.rounds, device, verbose=True, between=timed_reselect)
    med = {name: statistics.median(t) for name, t in times.items()}
    med["usaf_reselect"] = statistics.median(reselect_seconds)
    cached = med["usaf_cached"]
    extra = usaf["score_batches"] * (med["usaf_collecting"] - cached) + med["usaf_reselect"]
    import transformers

    results = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "deterministic": args.deterministic,
        "grouped": args.grouped,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": model_record(config, args, microbatch=MICROBATCH, seq_len=seq_len),
        "usaf": usaf,
        "lora": lora,
        "seconds": {name: [round(t, 5) for t in ts] for name, ts in times.items()}
        | {"usaf_reselect": [round(t, 5) for t in reselect_seconds]},  # fmt: skip
        "median_seconds": {k: round(v, 5) for k, v in med.items()},
        "speed_vs_lora": {name: round(med["lora"] / med[name], 3) for name in arms if name != "lora" and "lora" in med},
        "collecting_over_cached": round(med["usaf_collecting"] / cached, 3),
        "reselect_over_cached": round(med["usaf_reselect"] / cached, 3),
        f"rigl_cycle_overhead_at_reselect_every_{RESELECT_EVERY}": round(extra / (RESELECT_EVERY * cached), 4),
        "peak_bytes_above_resident": {name: peak_above_resident(fn, device) for name, fn in arms.items()},
        **_per_step(arms),
    }
    print(json.dumps({k: results[k] for k in ("median_seconds", "speed_vs_lora", "collecting_over_cached",
                                               "reselect_over_cached", "ops_per_step", "device_syncs_per_step")}),
                     flush=True)  # fmt: skip
    out = args.out or RESULTS / ("steps-gpu-quick.json" if args.quick else "steps-gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {out}")
    if args.profile is not None:
        profile(arms, ("usaf_cached", "usaf_cached_per_expert", "lora"), device, args.profile)


if __name__ == "__main__":
    main()
