"""Benchmark: `usaf plan`'s predicted peak memory against the real commands' measured peak RSS, on CPU.

For each workload (a random-init Qwen3-MoE built by ``usaf.testing``, 4-bit RTN), the real ``usaf
quantize``, ``usaf score`` (defaults: stability on) and ``usaf train`` (4 steps, reselection every 2,
so RigL's score pools exist) run as fresh processes started by a small wrapper (``usaf.testing.rss``),
and their peak RSS is compared with the planner's host peak for the same settings (CPU target, fp32).

The baseline is handled explicitly. Most of a small run's RSS is the usaf process's fixed cost (Python,
torch, transformers, tokenizers); the planner's constant for it (``FRAMEWORK_HOST``) was measured on the
tiny workload, so agreement there only says the constant still holds. The other workloads are judged on
the *model-dependent part* as well: measured peak minus the tiny run's measured fixed cost, against the
predicted peak minus ``FRAMEWORK_HOST``.

In-process, the CPU-sized workload also checks the components the engine accounts for
(``SparseEngine.memory()``) and the activation formula against the engine's measurement.

    python benchmarks/bench_plan.py [--only tiny,cpu-sized,cpu-large] [--out benchmarks/results/plan.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from usaf.memory_plan import Request, make_target, model_facts, plan_memory, read_model
from usaf.memory_plan.target import FRAMEWORK_HOST, GIB, MIB
from usaf.testing.rss import import_baseline, peak_rss
from usaf.testing.workloads import Workload, quantize_command, score_command, train_command, write_tokens

RESULTS = Path(__file__).resolve().parent / "results"
HEADS = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}
WORKLOADS = {
    # The fixed-cost probe: tensors and activations of a few MiB.
    "tiny": {"widths": {}, "layers": 4, "seq_len": 64, "train_from": 2},
    # The guide's CPU-sized MoE (benchmarks/bench_engine.py), top 2 of 8 layers.
    "cpu-sized": {
        "widths": {
            "hidden_size": 512,
            "moe_intermediate_size": 256,
            "num_experts": 32,
            "num_experts_per_tok": 4,
            "intermediate_size": 1024,
            **HEADS,
        },
        "layers": 8,
        "seq_len": 256,
        "train_from": 6,
    },
    # Wider, 4 trainable layers and a 32k vocabulary (the loss's logits then matter): ~1 GiB above the fixed cost.
    "cpu-large": {
        "widths": {
            "hidden_size": 1024,
            "moe_intermediate_size": 512,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "intermediate_size": 2048,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "vocab_size": 32000,
        },
        "layers": 8,
        "seq_len": 256,
        "train_from": 4,
    },
}
SAMPLES = 16
MICROBATCH = 2
STEPS = 4
RESELECT_EVERY = 2
FRAC = 0.005


def machine() -> dict:
    import transformers

    return {
        "summary": (
            f"{psutil.cpu_count()} CPU cores, {platform.machine()}, {psutil.virtual_memory().total / GIB:.0f} GiB, "
            f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
            "no GPU used"
        ),
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def predict(spec: dict) -> dict:
    """The planner's stages for a workload, from its config alone (what ``usaf plan`` sees)."""
    from usaf.memory_plan.source import QuantSettings
    from usaf.testing.models import tiny_config_kwargs

    # build_tiny_model saves fp32 weights, and its config.json says so (what usaf quantize reads)
    widths = tiny_config_kwargs("qwen3_moe", spec["layers"], **spec["widths"])
    config = {"model_type": "qwen3_moe", "dtype": "float32", **widths}
    facts = model_facts(config)
    request = Request(
        seq_len=spec["seq_len"], frac=FRAC, microbatch=MICROBATCH, train_from=spec["train_from"], samples=SAMPLES
    )
    plan = plan_memory(facts, QuantSettings(), make_target("cpu", "float32", None, 16 * GIB), request)
    if not plan.fits:
        raise RuntimeError(f"the planner says it does not fit in 16 GiB: {plan.shortfalls}")
    return {
        "settings": {
            "train_from": plan.settings.train_from,
            "layers": list(plan.settings.layers),
            "microbatch": plan.settings.microbatch,
            "seq_len": plan.settings.seq_len,
        },
        "stages": {
            s.stage: {"host_peak": s.host_peak, "components": {c.name: c.host for c in s.components if c.host}}
            for s in plan.stages
        },
    }


def run_workload(name: str, spec: dict, root: Path) -> dict:
    from usaf.testing.models import build_tiny_model

    t0 = time.perf_counter()
    source = build_tiny_model("qwen3_moe", root / "source", num_layers=spec["layers"], **spec["widths"])
    data = write_tokens(root / "train.jsonl", samples=SAMPLES, seq_len=spec["seq_len"])
    measured = {"quantize": peak_rss(quantize_command(source, root / "quantized"))}
    print(f"[{name}] quantize {measured['quantize'] / MIB:.0f} MiB", flush=True)
    measured["score"] = peak_rss(
        score_command(
            root / "quantized",
            data,
            root / "plan",
            train_from=spec["train_from"],
            samples=SAMPLES,
            microbatch=MICROBATCH,
        )
    )
    print(f"[{name}] score {measured['score'] / MIB:.0f} MiB", flush=True)
    work = Workload(root / "quantized", data, root / "plan", SAMPLES, spec["seq_len"], spec["train_from"], FRAC)
    measured["train"] = peak_rss(
        train_command(work, root / "run", microbatch=MICROBATCH, steps=STEPS, reselect_every=RESELECT_EVERY)
    )
    print(f"[{name}] train {measured['train'] / MIB:.0f} MiB", flush=True)
    result = {"model": {"family": "qwen3_moe", "layers": spec["layers"], **spec["widths"]}, **predict(spec)}
    result["measured_peak_rss"] = measured
    result["seconds"] = time.perf_counter() - t0
    if name == "cpu-sized":
        result["engine_check"] = engine_check(work, spec)
    return result


def engine_check(work: Workload, spec: dict) -> dict:
    """The engine's own accounting (one training forward) against the planner's components, in-process."""
    from usaf.engine.engine import SparseEngine, budget
    from usaf.engine.loading import load_quantized_model
    from usaf.engine.optim import SparseAdamW
    from usaf.memory_plan import activations as act
    from usaf.memory_plan import weights as w

    loaded = load_quantized_model(work.model)
    layers = [layer for layer in loaded.spec.moe_layers if layer >= work.train_from]
    engine = SparseEngine(loaded, trainable_layers=layers)
    g = torch.Generator().manual_seed(0)
    engine.set_deltas(
        {
            n: torch.randperm(math.prod(x.shape), generator=g)[: budget(x.shape, FRAC)].sort().values
            for n, x in engine.weights.items()
        }
    )
    optimizer = SparseAdamW(engine.parameter_groups(lr=1e-2, router_lr=1e-4, weight_decay=0.0))
    ids = torch.randint(1, 500, (MICROBATCH, work.seq_len), generator=g)
    engine.loss(ids, ids, prefix_states=engine.prefix_states(ids)).loss.backward()
    memory = engine.memory(optimizer=optimizer)
    source = read_model(str(work.model), nbits=None, group_size=None)
    facts = model_facts(source.config)
    batch = act.Batch(MICROBATCH, work.seq_len, padded=False)  # this batch has no padding
    predicted = {
        "experts_4bit": sum(w.layer_quantized_bytes(facts, n, source.quant) for n in facts.spec.moe_layers),
        "resident_bases": w.resident_bytes(facts, len(layers), 4),
        "deltas": w.delta_bytes(facts, len(layers), FRAC),
        "routers": 4 * w.router_params(facts, layers),
        "other_weights": w.other_weight_bytes(facts, layers, 4),
        "activations": sum(act.saved_activations(facts, layers[0], batch, 4).values()),
        "optimizer_state": w.OPTIMIZER_BYTES_PER_PARAM
        * (engine.trainable_count()["delta_entries"] + w.router_params(facts, layers)),
    }
    return {k: {"engine": memory[k], "planner": v, "ratio": v / memory[k]} for k, v in predicted.items()}


def summarize(results: dict) -> None:
    fixed = results["workloads"]["tiny"]["measured_peak_rss"]["train"] - (
        results["workloads"]["tiny"]["stages"]["train"]["host_peak"] - FRAMEWORK_HOST
    )
    results["fixed_cost_measured"] = fixed
    for name, r in results["workloads"].items():
        r["ratios"] = {}
        for stage, measured in r["measured_peak_rss"].items():
            predicted = r["stages"][stage]["host_peak"]
            part = {
                "predicted_over_measured": predicted / measured,
                "model_part_predicted_mib": (predicted - FRAMEWORK_HOST) / MIB,
                "model_part_measured_mib": (measured - fixed) / MIB,
            }
            if name != "tiny" and measured > fixed:
                part["model_part_predicted_over_measured"] = (predicted - FRAMEWORK_HOST) / (measured - fixed)
            r["ratios"][stage] = part
            print(
                f"{name:10s} {stage:9s} predicted {predicted / MIB:7.0f} MiB, measured {measured / MIB:7.0f} MiB: "
                f"{predicted / measured:.3f}"
                + (
                    f"; model part {part['model_part_predicted_mib']:.0f} vs {part['model_part_measured_mib']:.0f} MiB"
                    f" ({part['model_part_predicted_over_measured']:.3f})"
                    if "model_part_predicted_over_measured" in part
                    else ""
                )
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads [all; tiny is needed]")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan.json")
    parser.add_argument(
        "--repredict",
        action="store_true",
        help="keep the measurements in --out, recompute the predictions with the current planner",
    )
    args = parser.parse_args()
    if args.repredict:
        results = json.loads(args.out.read_text())
        for name, r in results["workloads"].items():
            r.update(predict(WORKLOADS[name]))
        results["repredicted"] = {"command": " ".join(["python", *sys.argv]), "date": datetime.date.today().isoformat()}
        summarize(results)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
        return
    names = [n for n in args.only.split(",") if n]
    if "tiny" not in names:
        parser.error("the tiny workload measures the fixed cost the others are judged against")
    started = time.perf_counter()
    results = {
        "machine": machine(),
        "command": " ".join(["python", *sys.argv]),
        "load_average_1min_start": os.getloadavg()[0],
        "settings": {
            "samples": SAMPLES,
            "microbatch": MICROBATCH,
            "steps": STEPS,
            "reselect_every": RESELECT_EVERY,
            "frac": FRAC,
            "dtype": "float32",
            "quantization": "rtn 4-bit g128",
        },
        "framework_host_constant_mib": FRAMEWORK_HOST / MIB,
        "import_only_rss_mib": import_baseline() / MIB,
        "workloads": {},
    }
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"usaf-bench-plan-{name}-") as tmp:
            results["workloads"][name] = run_workload(name, WORKLOADS[name], Path(tmp))
    summarize(results)
    results["total_seconds"] = time.perf_counter() - started
    results["load_average_1min_end"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
