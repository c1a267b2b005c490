"""Benchmark: `usaf score` on real text, on CPU: scoring time per token, peak RSS, mask stability.

Workload: the same CPU-sized MoE as ``bench_engine.py`` (a random-init Qwen3-MoE with 8 layers, hidden
512, 32 experts, top-4, expert width 256), built by ``usaf.testing.build_tiny_model`` *with* its tiny
tokenizer (vocab 512), quantized by ``usaf.stages.quantize.run(method="rtn")``. Calibration data is real
text: the source of a few Python standard-library packages, tokenized by ``usaf.stages.tokenize.run``
with the model directory's tokenizer at seq_len 256. Trainable layers: the top 2 of 8 (the stage's
default, the top quarter); microbatch 2 x 256. Every figure is measured side by side in this one run.

1. **time**: ``engine.dense_scores`` over N batches (the stage's candidate pools: ``pool_size`` at frac
   0.005, ``candidates_factor`` 4) versus N engine training steps on the same batches (loss + backward +
   ``SparseAdamW`` step over a random 0.005 selection of the same layers, routers too). No prefix cache in
   either, so both run the full model. Interleaved repeats after warm-up; medians; seconds per token.
2. **rss**: peak RSS (``ru_maxrss``) of a ``python -m usaf score`` subprocess, started through a small
   wrapper process (as in ``bench_engine.py``), versus the accounting: ``engine.memory()`` of an engine
   built as the stage builds it + the accumulators' ``nbytes`` + the RSS of a fresh process after the
   stage's imports.
3. **stability**: the plan manifest's ``stability_mean`` (Jaccard of the masks selected on two disjoint
   halves of the calibration sample) of ``usaf.stages.score.run`` at frac 0.005 with 32 and 64 samples.

    python benchmarks/bench_score.py [--repeats 5] [--quick] [--out benchmarks/results/score.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import (  # noqa: E402
    FRAC,
    MODEL,
    MODEL_QUICK,
    RESULTS,
    TOP,
    WRAPPER,
    engine_step,
    machine,
    make_engine,
)

from usaf.engine.engine import SparseEngine  # noqa: E402
from usaf.engine.loading import load_quantized_model  # noqa: E402

SEQ, SEQ_QUICK = 256, 64
MICROBATCH = 2
CANDIDATES_FACTOR = 4  # the stage's default
PACKAGES = ("email", "json", "http", "asyncio", "logging")  # real text: stdlib sources
CALIB = (32, 64)
CALIB_QUICK = (8, 16)
# The stage's own imports in a fresh process: its RSS is the accounting's baseline.
BASELINE_CHILD = (
    "import usaf.cli.app, usaf.stages.score, usaf.engine.engine, usaf.engine.loading, usaf.data.tokenizer\n"
    "import transformers.models.qwen3_moe.modeling_qwen3_moe\n"
    "import psutil\n"
    "print(psutil.Process().memory_info().rss / 2**20)\n"
)


# -- setup -------------------------------------------------------------------------------------------------------


def build(work: Path, widths: dict, seq: int) -> tuple[Path, Path, dict]:
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize
    from usaf.stages.tokenize import TokenizeConfig
    from usaf.stages.tokenize import run as tokenize
    from usaf.testing import build_tiny_model

    t0 = time.perf_counter()
    kwargs = {k: v for k, v in widths.items() if k != "num_layers"}
    src = build_tiny_model("qwen3_moe", work / "src", num_layers=widths["num_layers"], tokenizer=True, **kwargs)
    manifest, qdir = quantize(QuantizeConfig(model=str(src), out=work / "q4", method="rtn"))
    t1 = time.perf_counter()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    inputs = [stdlib / p for p in PACKAGES]
    tmanifest, tdir = tokenize(TokenizeConfig(inputs=inputs, model=str(qdir), seq_len=seq, out=work / "tokens"))
    t2 = time.perf_counter()
    summary = tmanifest.summary.model_dump(mode="json")
    info = {
        "build_and_quantize_seconds": t1 - t0,
        "tokenize_seconds": t2 - t1,
        "quantize_mean_rel_error": manifest.summary.mean_rel_error,
        "inputs": [str(p) for p in inputs],
        "tokens_summary": {k: v for k, v in summary.items() if k not in ("sources", "tokenizer")},
    }
    print(f"[setup] model in {t1 - t0:.1f}s, tokenized in {t2 - t1:.1f}s", flush=True)
    return qdir, tdir, info


def calibration_batches(qdir: Path, tdir: Path, count: int) -> list:
    from usaf.artifacts.tokens import TRAIN_FILE
    from usaf.data.batches import batches, sample_lines
    from usaf.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(qdir), flag="--model")
    lines = sample_lines(tdir / TRAIN_FILE, count, seed=0, vocab_size=len(tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return list(batches(lines, MICROBATCH, pad))


def stage_engine(qdir: Path) -> tuple[SparseEngine, dict]:
    """An engine built as ``usaf score`` builds it (top quarter of the MoE layers, routers on, no deltas)."""
    from usaf.engine.selection import pool_size

    loaded = load_quantized_model(qdir)
    layers = list(loaded.spec.moe_layers[-TOP:])
    engine = SparseEngine(loaded, trainable_layers=layers, train_router=True)
    shapes = {name: w.shape for name, w in engine.weights.items()}
    layer_of = {name: int(name.split(".layers.")[1].split(".")[0]) for name in shapes}
    return engine, pool_size(shapes, FRAC, "per-tensor", layer_of)


# -- 1. scoring time per token versus a training step per token ----------------------------------------------------


def time_per_token(qdir: Path, tdir: Path, n_batches: int, repeats: int) -> tuple[dict, dict]:
    items = calibration_batches(qdir, tdir, n_batches * MICROBATCH)
    triples = [(b.input_ids, b.labels, b.attention_mask) for b in items]
    tokens = sum(b.tokens for b in items)
    scorer, pools = stage_engine(qdir)
    trainer, optimizer, info = make_engine(qdir, FRAC, "random", None)
    last: dict = {}

    def score() -> float:
        start = time.perf_counter()
        last["acc"] = scorer.dense_scores(triples, candidates=pools, statistic="grad", pool_factor=CANDIDATES_FACTOR)
        return time.perf_counter() - start

    def train() -> float:
        # engine_step takes (ids, labels); real text is packed, so the mask is all ones (checked below).
        return sum(engine_step(trainer, optimizer, (ids, labels), None) for ids, labels, _ in triples)

    if not all(bool(m.all()) for _, _, m in triples):
        raise RuntimeError("calibration batches have padding; the training arm would ignore it")
    for fn in (score, train):
        fn()  # warm-up
    times: dict[str, list[float]] = {"score": [], "train_step": []}
    for i in range(repeats):
        times["score"].append(score())
        times["train_step"].append(train())
        print(f"[time] repeat {i}: score {times['score'][-1]:.3f}s  train {times['train_step'][-1]:.3f}s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "batches_per_repeat": n_batches,
        "tokens_per_repeat": tokens,
        "repeats": repeats,
        "warmup_per_arm": 1,
        "trainable_layers": info["trainable_layers"],
        "train_delta_entries": info["delta_entries"],
        "score_candidate_pools": pools,
        "seconds": times,
        "median_seconds": med,
        "seconds_per_token": {k: v / tokens for k, v in med.items()},
        "tokens_per_s": {k: tokens / v for k, v in med.items()},
        "ratio_score_over_train_step": med["score"] / med["train_step"],
        "target_ratio": 2.0,
    }
    acc = last["acc"]
    accounting = {
        "engine_memory": scorer.memory(),
        "accumulators_nbytes": sum(a.nbytes for a in acc.values()),
    }
    return result, accounting


# -- 2. peak RSS of `python -m usaf score` ------------------------------------------------------------------------


def rss(qdir: Path, tdir: Path, work: Path, calib: int, accounting: dict) -> dict:
    base = subprocess.run([sys.executable, "-c", BASELINE_CHILD], capture_output=True, text=True, check=True)
    baseline_mib = float(base.stdout.strip().splitlines()[-1])
    out = work / "plan-rss"
    cmd = [sys.executable, "-m", "usaf", "score", "--model", str(qdir), "--data", str(tdir), "--out", str(out)]
    cmd += ["--frac", str(FRAC), "--calib-samples", str(calib), "--microbatch", str(MICROBATCH)]
    # The wrapper prints the child's last stdout line and then RUSAGE_CHILDREN.ru_maxrss (KiB).
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if p.returncode != 0:
        raise RuntimeError(f"usaf score failed ({p.returncode}):\n{p.stderr[-4000:]}")
    peak_mib = int(p.stdout.strip().splitlines()[-1]) / 1024
    manifest = json.loads((out / "manifest.json").read_text())
    mem = accounting["engine_memory"]
    # The stage holds three sets of accumulators at once at its end: the full sample's and both halves'.
    accumulators = 3 * accounting["accumulators_nbytes"]
    accounted = {"import_baseline": baseline_mib * 2**20, **mem, "accumulators_x3": accumulators}
    accounted_mib = sum(accounted.values()) / 2**20
    print(f"[rss] peak {peak_mib:.0f} MiB, accounted {accounted_mib:.0f} MiB", flush=True)
    return {
        "command": " ".join(["python", "-m", "usaf", *cmd[3:]]),
        "calib_samples": calib,
        "wall_seconds": wall,
        "peak_rss_mib": peak_mib,
        "import_baseline_rss_mib": baseline_mib,
        "accounted_bytes": accounted,
        "accounted_mib": accounted_mib,
        "ratio_measured_over_accounted": peak_mib / accounted_mib,
        "above_baseline_measured_mib": peak_mib - baseline_mib,
        "above_baseline_accounted_mib": accounted_mib - baseline_mib,
        "subprocess_stability_mean": manifest["summary"].get("stability_mean"),
        "subprocess_seconds": manifest["summary"].get("seconds"),
    }


# -- 3. mask stability ---------------------------------------------------------------------------------------------


def stability(qdir: Path, tdir: Path, work: Path, calibs: tuple[int, ...]) -> dict:
    from usaf.stages.score import ScoreConfig, run

    rows = {}
    for n in calibs:
        start = time.perf_counter()
        manifest, _ = run(
            ScoreConfig(
                model=qdir, data=tdir, out=work / f"plan-{n}", frac=FRAC, calib_samples=n, microbatch=MICROBATCH
            )
        )
        s = manifest.summary
        per_tensor = {t.name: t.stability for t in s.tensors}
        rows[str(n)] = {
            "calib_samples": s.calib_samples,
            "calib_tokens": s.calib_tokens,
            "stability_mean": s.stability_mean,
            "stability_per_tensor": per_tensor,
            "certified": {t.name: t.certified for t in s.tensors},
            "experts_with_selection": {t.name: sum(c > 0 for c in t.per_expert) for t in s.tensors},
            "dead_experts": {str(r.layer): r.dead_experts for r in s.routing},
            "seconds": time.perf_counter() - start,
        }
        print(f"[stability] {n} samples: {s.stability_mean:.4f} ({rows[str(n)]['seconds']:.0f}s)", flush=True)
    # Two independent uniform draws of a fraction f of a tensor overlap in Jaccard f / (2 - f) on average.
    rows["random_masks_expected"] = FRAC / (2 - FRAC)
    return rows


# -- main ----------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timed repeats per arm [5; 3 --quick]")
    parser.add_argument("--batches", type=int, default=None, help="microbatches per timed repeat [2]")
    parser.add_argument("--quick", action="store_true", help="a 4-layer, hidden-256 model at seq 64: a smoke run")
    parser.add_argument("--out", type=Path, default=None, help="[benchmarks/results/score.json]")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 5)
    n_batches = args.batches or 2
    widths = MODEL_QUICK if args.quick else MODEL
    seq = SEQ_QUICK if args.quick else SEQ
    calibs = CALIB_QUICK if args.quick else CALIB
    out = args.out or RESULTS / ("score-quick.json" if args.quick else "score.json")
    torch.manual_seed(0)
    result: dict = {
        "machine": machine(),
        "quick": args.quick,
        "command": " ".join(["python", *sys.argv]),
        "model": {"family": "qwen3_moe", "dtype": "float32", "vocab_size": 512, "quantization": "rtn", **widths},
        "batch": {"microbatch": MICROBATCH, "seq": seq},
        "frac": FRAC,
    }
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="usaf-bench-score-") as tmp:
        work = Path(tmp)
        qdir, tdir, result["setup"] = build(work, widths, seq)
        out.parent.mkdir(parents=True, exist_ok=True)
        result["time"], accounting = time_per_token(qdir, tdir, n_batches, repeats)
        out.write_text(json.dumps(result, indent=2) + "\n")  # partial results survive an interrupted run
        result["rss"] = rss(qdir, tdir, work, calibs[0], accounting)
        out.write_text(json.dumps(result, indent=2) + "\n")
        result["stability"] = stability(qdir, tdir, work, calibs)
    result["total_seconds"] = time.perf_counter() - started
    result["load_average_1min"] = {"start": load_start, "end": os.getloadavg()[0]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"wrote {out}")


def print_summary(r: dict) -> None:
    print(f"\nmachine: {r['machine']['summary']}")
    t = r["time"]
    print(f"1. per token, median of {t['repeats']} interleaved repeats of {t['tokens_per_repeat']} tokens:")
    for k in ("score", "train_step"):
        print(f"  {k:10s} {t['seconds_per_token'][k] * 1e3:7.3f} ms/token  {t['tokens_per_s'][k]:7.0f} tokens/s")
    print(f"  score / train step: {t['ratio_score_over_train_step']:.3f} (target <= 2)")
    m = r["rss"]
    print(
        f"2. peak RSS of `usaf score` ({m['calib_samples']} samples): {m['peak_rss_mib']:.0f} MiB; accounted "
        f"{m['accounted_mib']:.0f} MiB (import baseline {m['import_baseline_rss_mib']:.0f}); "
        f"ratio {m['ratio_measured_over_accounted']:.3f}"
    )
    s = r["stability"]
    for k, v in s.items():
        if isinstance(v, dict):
            print(f"3. stability_mean, {k} samples ({v['calib_tokens']} tokens): {v['stability_mean']:.4f}")
    print(f"   two random masks would overlap {s['random_masks_expected']:.4f}")
    print(f"total {r['total_seconds']:.0f} s; load {r['load_average_1min']}")


if __name__ == "__main__":
    main()
