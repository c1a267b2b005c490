"""Benchmark: data-parallel `usaf train` under torchrun on CPU (gloo): bytes all-reduced, step-time scaling.

1. **bytes per step**: what one optimizer step all-reduces (read from the run's ``metrics.jsonl``, the
   ``world.allreduce_bytes`` the trainer counts: sparse values + routers + one flag per tensor, fp32),
   against what DDP of full fine-tuning would all-reduce for the same model (every parameter's gradient:
   fp32, and bf16 as DDP sends bf16 parameters' gradients). Also computed, not run, for Qwen3-30B-A3B's
   published config (``tests/data/qwen3-30b-a3b/config.json``) at usaf's defaults (frac 0.005 of the top
   quarter's expert weights + those layers' routers).
2. **scaling from 1 to 2 processes** on ``bench_engine.py``'s CPU-sized MoE (8 layers, hidden 512, 32
   experts, top-4, width 256; frac 0.005 of the top 2 layers; prefix cache from ``score --cache``):
   the real CLI, ``python -m usaf train`` with microbatch 2 against
   ``python -m torch.distributed.run --nproc-per-node 2 -m usaf train`` with microbatch 1 (the same global
   batch: strong scaling) and with microbatch 2 (twice the batch: weak scaling), every process at 1 torch
   thread, runs interleaved A B C A B C. The figure is the median of the trainer's own per-step seconds
   (``metrics.jsonl``), after the first 3 steps. On a 2-core machine this says how much the collectives cost
   next to the compute, not how fast a real multi-GPU run would be.

    python benchmarks/bench_distributed.py [--steps 40] [--repeats 3] [--quick]
                                           [--out benchmarks/results/distributed.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import FRAC, MODEL, MODEL_QUICK, RESULTS, machine  # noqa: E402
from bench_train import CALIB, CALIB_QUICK, PACKAGES, PACKAGES_QUICK, SEQ, SEQ_QUICK, build, git_commit  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
QWEN3_30B = REPO / "tests" / "data" / "qwen3-30b-a3b" / "config.json"
SKIP_STEPS = 3  # first steps: allocator warm-up, first prefix lookups


def env() -> dict:
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), out.get("PYTHONPATH")) if p)
    out["OMP_NUM_THREADS"] = "1"
    return out


def train_command(qdir: Path, tdir: Path, plan: Path, out: Path, steps: int, microbatch: int, nproc: int) -> list:
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*launcher, "-m", "usaf", "train", "--model", str(qdir), "--data", str(tdir), "--plan", str(plan),
            "--out", str(out), "--steps", str(steps), "--microbatch", str(microbatch), "--reselect-every", "0",
            "--save-every", "0", "--device", "cpu"]  # fmt: skip


def step_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"loss"' in line]


def scaling(qdir: Path, tdir: Path, plan: Path, work: Path, steps: int, repeats: int) -> dict:
    arms = {"1 process, microbatch 2": (2, 1), "2 processes, microbatch 1": (1, 2), "2 processes, microbatch 2": (2, 2)}
    medians: dict[str, list[float]] = {name: [] for name in arms}
    walls: dict[str, list[float]] = {name: [] for name in arms}
    sent: dict[str, int] = {}
    for repeat in range(repeats):
        for name, (microbatch, nproc) in arms.items():
            out = work / f"run-{repeat}-{microbatch}-{nproc}"
            start = time.perf_counter()
            p = subprocess.run(train_command(qdir, tdir, plan, out, steps, microbatch, nproc), env=env(),
                               capture_output=True, text=True)  # fmt: skip
            if p.returncode != 0:
                sys.exit(f"{name} failed:\n{p.stderr[-3000:]}")
            walls[name].append(time.perf_counter() - start)
            records = step_records(out)[SKIP_STEPS:]
            medians[name].append(statistics.median(r["seconds"] for r in records))
            sent[name] = records[-1].get("world", {}).get("allreduce_bytes", 0)
            print(f"[scaling] {repeat} {name}: median step {medians[name][-1] * 1000:.1f} ms", flush=True)
    base = statistics.median(medians["1 process, microbatch 2"])
    return {
        "steps": steps,
        "repeats": repeats,
        "median_step_seconds": {k: statistics.median(v) for k, v in medians.items()},
        "per_repeat_median_step_seconds": medians,
        "wall_seconds": walls,
        "step_time_ratio_to_1_process": {k: statistics.median(v) / base for k, v in medians.items()},
        "sequences_per_second": {k: arms[k][0] * arms[k][1] / statistics.median(v) for k, v in medians.items()},
        "allreduce_bytes_per_step": sent,
    }


def model_params(src: Path) -> int:
    """Parameters of the unquantized source checkpoint (what DDP of full fine-tuning would reduce)."""
    from safetensors import safe_open

    total = 0
    for file in src.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += math.prod(f.get_slice(name).get_shape())
    return total


def qwen3_30b_bytes() -> dict:
    """usaf's per-step all-reduce at its defaults versus DDP of full fine-tuning, for Qwen3-30B-A3B."""
    from usaf.memory_plan.model import model_facts
    from usaf.stages.score import DEFAULT_TOP_FRACTION

    facts = model_facts(json.loads(QWEN3_30B.read_text()))
    moe = list(facts.spec.moe_layers)
    top = moe[-max(1, math.ceil(DEFAULT_TOP_FRACTION * len(moe))) :]
    total = (facts.global_numel + sum(facts.layer_numel.values()) + sum(facts.router_numel.values())
             + facts.expert_params_per_layer * len(moe))  # fmt: skip
    entries = round(FRAC * facts.expert_params_per_layer * len(top))
    routers = sum(facts.router_numel[layer] for layer in top)
    usaf = 4 * (entries + routers + 3 * len(top))  # gate_up, down, router per layer: one flag each
    return {
        "model_params": total,
        "trainable_layers": len(top),
        "expert_entries": entries,
        "router_params": routers,
        "usaf_bytes": usaf,
        "ddp_full_fp32_bytes": 4 * total,
        "ddp_full_bf16_bytes": 2 * total,
        "ratio_fp32": usaf / (4 * total),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small model, 12 steps, 1 repeat: a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS / "distributed.json")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    widths, seq, calib, packages = (MODEL_QUICK, SEQ_QUICK, CALIB_QUICK, PACKAGES_QUICK) if args.quick else (
        MODEL, SEQ, CALIB, PACKAGES)  # fmt: skip
    steps, repeats = (12, 1) if args.quick else (args.steps, args.repeats)
    with tempfile.TemporaryDirectory(prefix="usaf-bench-dp-") as tmp:
        work = Path(tmp)
        src, qdir, tdir, plan, info = build(work, widths, seq, calib, packages)
        result = {
            "machine": machine(),
            "commit": git_commit(),
            "model": widths,
            "setup": info,
            "scaling": scaling(qdir, tdir, plan, work, steps, repeats),
        }
        params = model_params(src)
        sent = max(result["scaling"]["allreduce_bytes_per_step"].values())
        result["bytes"] = {
            "cpu_moe": {"model_params": params, "usaf_bytes": sent, "ddp_full_fp32_bytes": 4 * params,
                        "ratio_fp32": sent / (4 * params)},  # fmt: skip
            "qwen3_30b_a3b": qwen3_30b_bytes(),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("scaling", "bytes")}, indent=1))


if __name__ == "__main__":
    main()
