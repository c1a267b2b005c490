"""Benchmark: DenseMixer's router gradient (``usaf train --dense-router-grad``) against usaf's default.

Workload and machinery are ``bench_evidence.py``'s: the packaged demo model fine-tuned on ``DEMO_DOMAIN`` through
the stage functions (tokenize, quantize HQQ 4-bit, ``usaf score --cache`` per seed, ``usaf.stages.train.run``),
each run in a fresh child, evaluated as ``usaf generate``/``export`` apply a run: perplexity on the demo domain's
held-out test sample and on ``PRETRAIN_DOMAIN``'s held-out sources (forgetting), the same sequences for every run.

Arms, side by side per seed (arm order alternating across seeds): usaf's defaults (lr 3e-3, RigL every 40 steps,
routers on) with and without ``--dense-router-grad``, at router lr 1e-4 (the old default) and 1e-3. Same data order,
same plan per seed. The step-time ratio is dense / default of the median step time, per seed and router lr.

    python benchmarks/bench_router_grad.py [--threads 1] [--steps 250] [--seeds 0 1 2]
                                           [--out benchmarks/results/router_grad.json]

``--domain torch-cpp`` fine-tunes on the evidence's large-shift domain instead, ``--model`` the larger evidence
model (``bench_evidence.py``'s options), ``--router-lrs`` the router lrs compared (default: both above).
``--defaults``: both arms at usaf's defaults instead (``bench_evidence``'s ``usaf_defaults_attention``: the default
targets and share rule, the lr the plan's lr test chose), so the comparison is the flag's effect as a user gets it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import RESULTS, machine  # noqa: E402
from bench_evidence import (  # noqa: E402
    CURVE_WINDOW,
    EVAL_SEQUENCES,
    FRAC,
    LAST_N,
    MICROBATCH,
    PLAN_LR,
    RESELECT_EVERY,
    SEQ,
    STEPS,
    child,
    make_plan,
    setup,
)
from bench_train import git_commit, wrapped  # noqa: E402

from usaf.settings.fields import DEFAULT_TARGETS  # noqa: E402

LR = 3e-3  # usaf train's --lr default
ROUTER_LRS = (1e-4, 1e-3)  # the default before 3a6d538, and the default since
ARMS = {"default": False, "dense_router_grad": True}


def run_one(env: dict, plan: Path, work: Path, *, arm: str, router_lr: float, seed: int, steps: int, lr) -> dict:
    """One arm at one router lr and seed, in a fresh child; ``lr``: the deltas' (``PLAN_LR``: the plan's)."""
    name = f"{arm}-rlr{router_lr:g}-seed{seed}"
    spec = {
        "kind": "usaf",
        "lr": lr,
        "router_lr": router_lr,
        "dense_router_grad": ARMS[arm],
        "seed": seed,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "src": str(env["src"]),
        "qdir": str(env["qdir"]),
        "tokens": str(env["tokens"]),
        "eval": {k: str(v) for k, v in env["eval"].items() if k in ("indomain_heldout", "pretrain_heldout")},
        "plan": str(plan),
        "run_dir": str(work / "runs" / name),
        "reselect_every": RESELECT_EVERY,
        "router": True,
    }
    spec_file = work / "specs" / f"{name}.json"
    spec_file.parent.mkdir(exist_ok=True)
    spec_file.write_text(json.dumps(spec))
    start = time.perf_counter()
    out = wrapped([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_file)])
    r = json.loads(out["stdout"].strip().splitlines()[-1])
    losses, secs = r.pop("losses"), r.pop("step_seconds")
    n = max(1, round(LAST_N * len(losses)))
    result = {
        "arm": arm,
        "router_lr": router_lr,
        "seed": seed,
        "wall_seconds": time.perf_counter() - start,
        "final_train_loss": statistics.fmean(losses[-n:]),
        "loss_curve": [
            round(statistics.fmean(losses[i : i + CURVE_WINDOW]), 4) for i in range(0, len(losses), CURVE_WINDOW)
        ],  # fmt: skip
        "median_step_seconds": statistics.median(secs),
        "ppl_heldout": r["eval"]["indomain_heldout"]["ppl"],
        "ppl_pretrain_heldout": r["eval"]["pretrain_heldout"]["ppl"],
        "skipped_steps": r["skipped_steps"],
        "routing_warnings": r["routing_warnings"],
        "trainable": r["trainable"],
    }
    print(f"[{name}] {result['wall_seconds']:.0f}s: train {result['final_train_loss']:.4f}, ppl held-out "
          f"{result['ppl_heldout']:.3f}, pretrain {result['ppl_pretrain_heldout']:.3f}; "
          f"step {result['median_step_seconds'] * 1e3:.1f} ms", flush=True)  # fmt: skip
    return result


def compare(runs: list[dict], seeds: list[int], router_lrs) -> dict:
    """Per router lr: each seed's dense - default differences, and whether dense wins on every seed."""
    table = {}
    for router_lr in router_lrs:
        by = {(r["arm"], r["seed"]): r for r in runs if r["router_lr"] == router_lr}
        rows = []
        for seed in seeds:
            d, s = by[("default", seed)], by[("dense_router_grad", seed)]
            rows.append({
                "seed": seed,
                "ppl_heldout": [d["ppl_heldout"], s["ppl_heldout"]],
                "ppl_pretrain_heldout": [d["ppl_pretrain_heldout"], s["ppl_pretrain_heldout"]],
                "final_train_loss": [d["final_train_loss"], s["final_train_loss"]],
                "step_time_ratio": s["median_step_seconds"] / d["median_step_seconds"],
            })  # fmt: skip
        table[f"{router_lr:g}"] = {
            "per_seed_default_vs_dense": rows,
            "mean_ppl_heldout": [statistics.fmean(r["ppl_heldout"][i] for r in rows) for i in (0, 1)],
            "mean_ppl_pretrain_heldout": [statistics.fmean(r["ppl_pretrain_heldout"][i] for r in rows) for i in (0, 1)],
            "dense_better_heldout_every_seed": all(r["ppl_heldout"][1] < r["ppl_heldout"][0] for r in rows),
            "dense_better_pretrain_every_seed": all(
                r["ppl_pretrain_heldout"][1] < r["ppl_pretrain_heldout"][0] for r in rows
            ),  # fmt: skip
            "median_step_time_ratio": statistics.median(r["step_time_ratio"] for r in rows),
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps per run [{STEPS}]")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1, help="torch threads here and in the children [1]")
    parser.add_argument("--domain", default="stdlib-net", choices=("stdlib-net", "torch-cpp"))
    parser.add_argument("--model", type=Path, default=None, help="the pretrained model [the demo model]")
    parser.add_argument("--router-lrs", type=float, nargs="+", default=list(ROUTER_LRS))
    parser.add_argument("--defaults", action="store_true", help="usaf's default targets, share and lr test")
    parser.add_argument("--out", type=Path, default=RESULTS / "router_grad.json")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        result = child(json.loads(args.child.read_text()))
        result.pop("model", None)
        print(json.dumps(result))
        return
    torch.set_num_threads(args.threads)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    result: dict = {
        "machine": machine(),
        "usaf_commit": git_commit(),
        "command": " ".join(["python", *sys.argv]),
        "settings": {
            "steps": args.steps,
            "seeds": args.seeds,
            "lr": "the plan's lr test" if args.defaults else LR,
            "targets": ",".join(DEFAULT_TARGETS) if args.defaults else "experts",
            "router_lrs": args.router_lrs,
            "domain": args.domain,
            "model": str(args.model) if args.model else "the demo model",
            "frac": FRAC,
            "reselect_every": RESELECT_EVERY,
            "seq_len": SEQ,
            "microbatch": MICROBATCH,
            "eval_sequences": EVAL_SEQUENCES,
            "threads": args.threads,
        },  # fmt: skip
        "runs": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        result["seconds_so_far"] = time.perf_counter() - started
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="usaf-bench-router-grad-") as tmp:
        work = Path(tmp)
        env = setup(work, SEQ, EVAL_SEQUENCES, args.domain, args.model)
        result["setup"] = env["info"]
        for i, seed in enumerate(args.seeds):
            if args.defaults:
                targets = ",".join(DEFAULT_TARGETS)
                plan, info = make_plan(env, work, seed, None, None, cache=True, calib=64, targets=targets)
                result.setdefault("plans", []).append(info)
            else:
                plan, _ = make_plan(env, work, seed, FRAC, None, cache=True, calib=64)
            order = list(ARMS) if i % 2 == 0 else list(reversed(ARMS))  # alternate which arm runs first
            for router_lr in args.router_lrs:
                for arm in order:
                    result["runs"].append(
                        run_one(
                            env,
                            plan,
                            work,
                            arm=arm,
                            router_lr=router_lr,
                            seed=seed,
                            steps=args.steps,
                            lr=PLAN_LR if args.defaults else LR,
                        )
                    )
                    save()
    result["table"] = compare(result["runs"], args.seeds, args.router_lrs)
    result["total_seconds"] = time.perf_counter() - started
    result["load_average_1min"] = {"start": load_start, "end": os.getloadavg()[0]}
    save()
    print(json.dumps(result["table"], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
