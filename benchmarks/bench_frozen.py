"""Benchmark: usaf's frozen-layer forward (no graph) against transformers' ``grouped_mm`` forward of the same weights.

What a prefix capture (a first visit in ``usaf train``), ``usaf score`` and ``usaf eval`` run through every frozen
MoE layer, by expert count. Workload, one model per shape: a random-init Qwen3-MoE, 4 layers, hidden 512, ``E``
experts of width 192, top-8 (Qwen3-30B-A3B's ratios), E = 32, 64, 128; plus the train benchmark's shape (32
experts of width 256, top-4). Quantized by ``usaf.stages.quantize.run(method="rtn")`` (4-bit, group 64). One
no-grad forward of the whole model (every layer frozen) on 2 x 256 tokens of standard-library text. Arms,
interleaved in rotating order each round (medians of ``--rounds``):

- **loop, dequantized per forward**: usaf's per-expert loop (the forward before grouped execution), every
  routed expert dequantized on every forward (``usaf.engine.grouped.applies`` patched off);
- **grouped, dequantized per forward**: ``usaf.engine.grouped``: tokens sorted by expert once, routed experts
  dequantized in blocks, torch's grouped matmul per block (the default for frozen layers);
- **loop, resident** / **grouped, resident**: the same with every expert dequantized once beforehand
  (``ExpertWeight.make_resident``, as ``usaf eval`` does when memory allows);
- **transformers grouped_mm**: ``AutoModelForCausalLM`` of the source with every expert tensor replaced by its
  dequantization, transformers' default experts implementation (``grouped_mm``), plain ``model(input_ids)``;
- with ``--block-sweep``, **grouped, dequantized per forward, at n MiB**: the same arm at other block budgets (the
  fp32 size of a block's experts, ``usaf.engine.grouped.HOST_BLOCK_BYTES`` / ``DEVICE_BLOCK_BYTES``).

Checks per shape: grouped and loop logits are bit-identical on CPU fp32 (else the largest difference is
recorded), and usaf's logits against transformers' (the same weights; summation order differs). Also timed: the
dequantization of one layer's ``gate_up`` (all its experts) per expert, in the grouped path's blocks, in one call.

    python benchmarks/bench_frozen.py [--threads 1] [--rounds 7] [--experts 32 64 128] [--device cpu] [--dtype float32]
                                      [--block-sweep 4 8 16] [--out benchmarks/results/frozen.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import RESULTS, machine  # noqa: E402
from bench_eval import reference  # noqa: E402
from bench_reselect import SHAPES, build, text_batch  # noqa: E402
from bench_train import git_commit  # noqa: E402

from usaf.backends import resolve_backend  # noqa: E402
from usaf.engine import grouped  # noqa: E402
from usaf.engine.loading import load_quantized_model  # noqa: E402
from usaf.quant import dequantize  # noqa: E402

ARMS = ("loop_per_forward", "grouped_per_forward", "loop_resident", "grouped_resident", "transformers_grouped_mm")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(
    src: Path, qdir: Path, rounds: int, device: torch.device, dtype: torch.dtype = torch.float32, block_sweep=()
) -> dict:
    """``block_sweep``: block budgets in MiB (``grouped.block_bytes`` of the device) at which the grouped per-forward
    arm is also timed, as arms ``grouped_per_forward_{n}MiB``."""
    backend = resolve_backend(device.type)
    ids = text_batch(qdir)[0].to(device)
    per_forward = load_quantized_model(qdir, device=device, compute_dtype=dtype)
    resident = load_quantized_model(qdir, device=device, compute_dtype=dtype)
    for state in resident.experts.values():
        state.gate_up.make_resident(device)
        state.down.make_resident(device)
    hf = reference(src, per_forward, None).to(device, dtype)
    real_applies = grouped.applies

    budget_name = "HOST_BLOCK_BYTES" if device.type == "cpu" else "DEVICE_BLOCK_BYTES"  # what block_bytes reads
    default_budget = getattr(grouped, budget_name)

    def usaf_arm(loaded, use_grouped: bool, budget: int = default_budget):
        def run() -> torch.Tensor:
            grouped.applies = real_applies if use_grouped else (lambda state, hidden: False)
            setattr(grouped, budget_name, budget)
            try:
                with torch.no_grad():
                    return loaded.model(input_ids=ids).logits
            finally:
                grouped.applies = real_applies
                setattr(grouped, budget_name, default_budget)

        return run

    def hf_arm() -> torch.Tensor:
        with torch.no_grad():
            return hf(input_ids=ids).logits

    arms = {
        "loop_per_forward": usaf_arm(per_forward, False),
        "grouped_per_forward": usaf_arm(per_forward, True),
        "loop_resident": usaf_arm(resident, False),
        "grouped_resident": usaf_arm(resident, True),
    }
    swept = {f"grouped_per_forward_{mib:g}MiB": usaf_arm(per_forward, True, int(mib * 2**20)) for mib in block_sweep}
    arms = {**arms, **swept, "transformers_grouped_mm": hf_arm}  # the reference last (names[:-1] below)
    logits = {name: fn().float().cpu() for name, fn in arms.items()}  # also the warm-up
    times = interleaved(arms, rounds, device, verbose=True)
    names = list(arms)
    medians = {name: statistics.median(t) for name, t in times.items()}
    dequantization = dequantization_by_block(per_forward.experts[0].gate_up.q, rounds, device)
    hf_time = medians["transformers_grouped_mm"]
    per_round = {
        name: [round(hf_t / t, 3) for t, hf_t in zip(times[name], times["transformers_grouped_mm"], strict=True)]
        for name in names[:-1]
    }
    return {
        "seconds": {name: round(t, 4) for name, t in medians.items()},
        "speed_vs_transformers": {name: round(hf_time / medians[name], 3) for name in names[:-1]},
        "speed_vs_transformers_per_round": per_round,
        "grouped_vs_loop_per_forward": round(medians["loop_per_forward"] / medians["grouped_per_forward"], 3),
        "resident_vs_per_forward_grouped": round(medians["grouped_per_forward"] / medians["grouped_resident"], 3),
        "grouped_equals_loop": {
            "per_forward": torch.equal(logits["grouped_per_forward"], logits["loop_per_forward"]),
            "resident": torch.equal(logits["grouped_resident"], logits["loop_resident"]),
            **{name: torch.equal(logits[name], logits["loop_per_forward"]) for name in swept},
        },
        "block_budget_default_mib": default_budget / 2**20,
        "max_abs_diff_vs_transformers": float(
            (logits["grouped_per_forward"] - logits["transformers_grouped_mm"]).abs().max()
        ),
        "routed_experts_layer0": int(per_forward.experts[0].tokens_per_expert.gt(0).sum()),
        "grouped_mm_used": bool(backend.capabilities.grouped_mm),
        "times": {name: [round(t, 4) for t in ts] for name, ts in times.items()},
        "dequantize_layer0_gate_up_seconds": dequantization,
    }


def dequantization_by_block(q, rounds: int, device: torch.device) -> dict[str, float]:
    """Seconds to dequantize every expert of one tensor: one call per expert, in grouped.py's host-sized blocks,
    and in one call (medians of ``rounds``, rotating order)."""
    e, o, i = q.shape
    per_block = max(1, grouped.block_bytes(device) // (4 * o * i))
    ways = {
        "per_expert": [slice(j, j + 1) for j in range(e)],
        f"blocks_of_{per_block}": [slice(j, j + per_block) for j in range(0, e, per_block)],
        "one_call": [slice(0, e)],
    }

    def arm(blocks):
        def run() -> None:
            for experts in blocks:
                dequantize(q, experts=experts, device=device, memory_layout=False)

        return run

    times = interleaved({name: arm(blocks) for name, blocks in ways.items()}, rounds, device)
    return {name: round(statistics.median(t), 4) for name, t in times.items()}


def interleaved(
    arms: dict, rounds: int, device: torch.device, *, verbose: bool = False, between=None
) -> dict[str, list[float]]:
    """Seconds of each arm per round, the arms in rotating order each round (load hits them alike);
    ``between(round)`` runs after each round, outside the timing."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            _sync(device)
            start = time.perf_counter()
            arms[name]()
            _sync(device)
            times[name].append(time.perf_counter() - start)
        if between is not None:
            between(r)
        if verbose:
            print(f"  round {r + 1}/{rounds}: " + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in names), flush=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--experts", type=int, nargs="*", default=None, help="shapes by expert count (default: all)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="compute dtype of every arm (bfloat16: what a GPU trains in, and grouped_mm's fast path)")
    parser.add_argument("--block-sweep", type=float, nargs="*", default=[], metavar="MIB",
                        help="also time the grouped per-forward arm at these dequantization block budgets (MiB)")
    parser.add_argument("--out", type=Path, default=RESULTS / "frozen.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = {k: v for k, v in SHAPES.items() if args.experts is None or v[0] in args.experts and "train" not in k}
    results = {
        "machine": machine(),
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "commit": git_commit(),
        "command": " ".join(["python", *sys.argv]),
        "dtype": args.dtype,
        "shapes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, (experts, width, top_k) in shapes.items():
            print(f"[{name}] building and quantizing", flush=True)
            work = Path(tmp) / name.split()[0]
            qdir = build(work, experts, width, top_k)
            result = measure(work / "model", qdir, args.rounds, device, getattr(torch, args.dtype), args.block_sweep)
            result["shape"] = {"experts": experts, "width": width, "top_k": top_k}
            results["shapes"][name] = result
            print(f"[{name}] " + json.dumps({k: result[k] for k in ("seconds", "speed_vs_transformers")}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
