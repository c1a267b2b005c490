"""GPU benchmark: the frozen-layer forward at Qwen3-30B-A3B's real width, by dequantization block size.

What a frozen MoE layer runs when its experts are not dequantized once (a model too large for that: Qwen3-30B-A3B
on a 12 GB card, streamed or not): every forward dequantizes the routed experts in blocks of
``usaf.engine.grouped.DEVICE_BLOCK_BYTES`` (64 MiB of fp32, both tensors: 3 experts at this width, 43 blocks a
layer at 128 experts) and runs each block's GEMMs grouped. Each block costs a fixed number of kernel launches
(dequantization, the grouped matmuls, the combine), so a small block on a fast GPU may leave it launch-bound; a
large one holds more device memory (the planner counts one block: ``frozen-layer dequantization``).

Model: ``bench_plan_gpu.build_loaded``'s stack (Qwen3-30B-A3B's config cut to ``--layers`` decoder layers, random
weights in bf16, random 4-bit experts on the device), every layer frozen; one no-grad forward of 2 x 512 tokens.
Arms, interleaved in rotating order each round, medians of ``--rounds``: **per forward at n MiB** for each
``--block-sweep`` budget (the device's block budget; the host's on a CPU), and **resident** (every expert
dequantized once beforehand, ``ExpertWeight.make_resident``: the floor). For each: seconds, the aten operators one
forward dispatches and those that make the host wait for the device (``usaf.testing.dispatch``), blocks per layer,
and (CUDA) the allocator's peak above what the model holds.

    python benchmarks/bench_frozen_gpu.py [--layers 4] [--rounds 7] [--block-sweep 16 64 256 1024]
                                          [--out benchmarks/results/frozen-gpu-real-width.json]
    python benchmarks/bench_frozen_gpu.py --device cpu --quick --threads 1   # a smoke test without a GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frozen import interleaved  # noqa: E402
from bench_plan_gpu import RESULTS, build_loaded, model_config  # noqa: E402
from bench_steps_gpu import MICROBATCH, SEQ_LEN, dispatched_ops, model_record, peak_above_resident  # noqa: E402
from bench_train import git_commit  # noqa: E402

from usaf.backends.transfer import is_host  # noqa: E402
from usaf.engine import grouped  # noqa: E402

MIB = 2**20


def blocks_per_layer(loaded, budget: int) -> int:
    """How many blocks a layer's forward runs when every expert is routed (as at 128 experts top-8 on 1,024 tokens)."""
    state = next(iter(loaded.experts.values()))
    per_expert = 4 * sum(w.shape[1] * w.shape[2] for w in (state.gate_up, state.down))  # fp32 bytes, as _blocks
    return -(-state.num_experts // max(1, budget // per_expert))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block-sweep", type=float, nargs="+", default=[16, 64, 256, 1024], metavar="MIB")
    parser.add_argument("--quick", action="store_true", help="small widths and seq 64 (a smoke test, e.g. on CPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--out", type=Path, default=None, help="[benchmarks/results/frozen-gpu-real-width.json]")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = model_config(args.layers, args.quick)
    seq_len = SEQ_LEN // 8 if args.quick else SEQ_LEN
    ids = torch.randint(1, config["vocab_size"], (MICROBATCH, seq_len), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    per_forward = build_loaded(config, device, dtype)
    resident = build_loaded(config, device, dtype)
    for state in resident.experts.values():
        state.gate_up.make_resident(device)
        state.down.make_resident(device)
    budget_name = "HOST_BLOCK_BYTES" if is_host(device) else "DEVICE_BLOCK_BYTES"  # what grouped.block_bytes reads
    default_budget = getattr(grouped, budget_name)

    def arm(loaded, budget: int = default_budget):
        def run() -> torch.Tensor:
            setattr(grouped, budget_name, budget)
            try:
                with torch.no_grad():
                    return loaded.model(input_ids=ids).logits
            finally:
                setattr(grouped, budget_name, default_budget)

        return run

    budgets = {f"per_forward_{mib:g}MiB": int(mib * MIB) for mib in args.block_sweep}
    arms = {name: arm(per_forward, budget) for name, budget in budgets.items()} | {"resident": arm(resident)}
    logits = {name: fn().float().cpu() for name, fn in arms.items()}  # also the warm-up
    times = interleaved(arms, args.rounds, device, verbose=True)
    med = {name: statistics.median(t) for name, t in times.items()}
    counted = {name: dispatched_ops(fn) for name, fn in arms.items()}
    results = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "torch": torch.__version__,
        "model": model_record(config, args, tokens=MICROBATCH * seq_len),
        "default_block_mib": default_budget / MIB,
        "blocks_per_layer": {name: blocks_per_layer(per_forward, b) for name, b in budgets.items()},
        "median_seconds": {name: round(t, 5) for name, t in med.items()},
        "speed_vs_resident": {name: round(med["resident"] / t, 3) for name, t in med.items() if name != "resident"},
        "ops_per_forward": {name: c["ops"] for name, c in counted.items()},
        "device_syncs_per_forward": {name: c["device_syncs"] for name, c in counted.items()},
        "peak_bytes_above_model": {name: peak_above_resident(fn, device) for name, fn in arms.items()},
        "logits_equal_to_resident": {name: torch.equal(v, logits["resident"]) for name, v in logits.items()},
        "seconds": {name: [round(t, 5) for t in ts] for name, ts in times.items()},
    }
    shown = ("median_seconds", "speed_vs_resident", "blocks_per_layer", "ops_per_forward", "device_syncs_per_forward")
    print(json.dumps({k: results[k] for k in shown}), flush=True)
    out = args.out or RESULTS / ("frozen-gpu-real-width-quick.json" if args.quick else "frozen-gpu-real-width.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
