"""Benchmark: one epoch end to end, ``usaf score`` + ``usaf train --epochs 1``, against LoRA on the same layers.

What a user's typical first run costs: every training step is a first visit (no ``usaf score --cache``) except
those of the calibration sample, whose prefix states score's own pass computed and keeps in the plan by default, and
the score before it (calibration, stability halves, the lr test) is part of the bill. Workload: ``bench_train.py``'s
model (8 layers, hidden 512, random-init Qwen3-MoE, rtn 4-bit g128; the top 2 layers train) at 32 experts (width
256, top-4) and at Qwen3-30B-A3B's ratios (128 experts of width 192, top-8; ``--experts 64``: 64 of them); data: the
stdlib packages ``json`` and ``tomllib`` tokenized at 256 tokens (``bench_train.py``'s; ``--packages`` for more
data: score's cost is fixed, train's and LoRA's grow with it); microbatch 2, fp32, 1 thread. Each arm is timed
whole, in this process:

- **usaf**: ``usaf.stages.score.run`` then ``usaf.stages.train.run`` with ``epochs=1``, as the CLI calls them, at
  their defaults otherwise (``--frac`` 0.005 on the top 2 layers' experts and attention, routers, 64 calibration
  samples, stability halves, the lr test, ``--reselect-every 50``, ``--save-every 50``); model loading included.
- **LoRA**: transformers' model of the unquantized source (fp32, ``grouped_mm`` experts) with peft LoRA on the same
  2 layers' fused experts and attention at the ranks whose count is closest to usaf's trainable count
  (``bench_train.lora_ranks``), ``AdamW(fused=True)``, clipping 1.0, one epoch over the same sequences in
  microbatches of 2 (shuffled, seed 0); model loading and wrapping included.
- **QLoRA**: the same LoRA over the same model with every decoder weight held as 4-bit codes (usaf's format, rtn
  group 128) and dequantized on every forward (``qlora_base.py``), checked against a copy holding the dequantized
  weights; quantizing the base and the checks are not timed (nor is usaf's quantization; ``lora_model``).

Rounds rotate the order (each arm first in turn); medians of ``--rounds``. Not here: any GPU.

    python benchmarks/bench_epoch.py [--threads 1] [--rounds 2] [--experts 32 64 128] [--packages json tomllib]
        [--out benchmarks/results/epoch.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import MODEL, RESULTS, TOP, machine  # noqa: E402
from bench_train import (  # noqa: E402
    MICROBATCH,
    PACKAGES,
    SEQ,
    dense_step,
    git_commit,
    lora_counts_per_rank,
    lora_model,
    lora_ranks,
)

# E64 and E128: Qwen3-30B-A3B's ratios (width 0.375 x hidden, top-8); E64 is the growth curve's middle point
SHAPES = {
    "E32": {},
    "E64": {"num_experts": 64, "moe_intermediate_size": 192, "num_experts_per_tok": 8},
    "E128": {"num_experts": 128, "moe_intermediate_size": 192, "num_experts_per_tok": 8},
}


def prepare(work: Path, widths: dict, packages: tuple[str, ...]) -> tuple[Path, Path, Path]:
    """The source model, its quantization and the tokens (not timed: the same for every arm)."""
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize
    from usaf.stages.tokenize import TokenizeConfig
    from usaf.stages.tokenize import run as tokenize
    from usaf.testing import build_tiny_model

    kwargs = {k: v for k, v in widths.items() if k != "num_layers"}
    src = build_tiny_model("qwen3_moe", work / "src", num_layers=widths["num_layers"], tokenizer=True, **kwargs)
    _, qdir = quantize(QuantizeConfig(model=str(src), out=work / "q4", method="rtn"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    _, tdir = tokenize(TokenizeConfig(inputs=[stdlib / p for p in packages], model=str(qdir), seq_len=SEQ,
                                      out=work / "tokens"))  # fmt: skip
    return src, qdir, tdir


def usaf_epoch(
    qdir: Path, tdir: Path, out: Path, layers: int, cache: bool | None = None, reselect_every: int | None = None
) -> dict:
    """``usaf score`` + ``usaf train --epochs 1``; ``cache``: score's ``--cache``/``--no-cache``, ``reselect_every``:
    train's (None: their defaults)."""
    cadence = {} if reselect_every is None else {"reselect_every": reselect_every}
    from usaf.stages.progress import NullProgress
    from usaf.stages.score import ScoreConfig
    from usaf.stages.score import run as score
    from usaf.stages.train import TrainConfig
    from usaf.stages.train import run as train

    out.mkdir(parents=True)
    start = time.perf_counter()
    progress = NullProgress()
    plan_manifest, plan = score(
        ScoreConfig(model=qdir, data=tdir, out=out / "plan", microbatch=MICROBATCH, train_from=layers - TOP,
                    device="cpu", cache=cache),
        progress=progress,
    )  # fmt: skip
    scored = time.perf_counter()
    run_manifest, run_dir = train(
        TrainConfig(model=qdir, data=tdir, plan=plan, out=out / "run", epochs=1.0, microbatch=MICROBATCH,
                    device="cpu", dtype="float32", **cadence),
        progress=progress,
    )  # fmt: skip
    end = time.perf_counter()
    p, r = plan_manifest.summary, run_manifest.summary
    return {
        "seconds": end - start,
        "score_seconds": scored - start,
        "train_seconds": end - scored,
        "lr_test_seconds": p.lr_test.seconds if p.lr_test is not None else None,
        "lr": r.lr,
        "steps": r.steps,
        "reselections": len(r.reselections),
        "prefix_cache_hits_misses": [r.prefix_cache_hits, r.prefix_cache_misses],
        "plan_prefix_states": p.prefix_cache.samples if p.prefix_cache is not None else 0,
        "trainable": r.expert_entries + r.router_params,
        "first_loss": r.first_loss,
        "final_loss": r.final_loss,
        "frozen_note": next((n for n in progress.notes if "frozen MoE layers" in n), None),
        "losses": [row["loss"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                   if "loss" in row],  # fmt: skip
    }


def lora_epoch(src: Path, tdir: Path, layers: list[int], trainable: int, four_bit: bool = False) -> dict:
    """LoRA's epoch, or QLoRA's (``four_bit``: the same LoRA over a 4-bit base; quantizing it is not timed)."""
    from usaf.data.batches import collate
    from usaf.data.dataset import TokenDataset

    start = time.perf_counter()
    ranks = lora_ranks(trainable, *lora_counts_per_rank(src, layers))
    model, params, info = lora_model(src, layers, *ranks, four_bit=four_bit)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    data = TokenDataset(tdir / "train.jsonl", vocab_size=model.config.vocab_size)
    order = data.order(0, 0).tolist()
    steps = 0
    for first in range(0, len(order), MICROBATCH):
        dense_step(model, params, optimizer, collate([data[i] for i in order[first : first + MICROBATCH]]))
        steps += 1
    seconds = time.perf_counter() - start - info["setup_seconds"]  # quantizing the base, the checks: not timed
    return {"seconds": seconds, "steps": steps, "trainable": info["trainable_params"], "expert_rank": ranks[0],
            "attention_rank": ranks[1], "base": info.get("base")}  # fmt: skip


def measure(name: str, widths: dict, rounds: int, work: Path, packages: tuple[str, ...]) -> dict:
    src, qdir, tdir = prepare(work, widths, packages)
    layers = widths["num_layers"]
    trainable_layers = list(range(layers - TOP, layers))
    arms = ("usaf", "lora", "qlora")
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for r in range(rounds):
        order = arms[r % 3 :] + arms[: r % 3]  # each arm first in turn
        for arm in order:
            if arm == "usaf":
                runs[arm].append(usaf_epoch(qdir, tdir, work / f"usaf-{r}", layers))
            else:
                trainable = (runs["usaf"] or [usaf_epoch(qdir, tdir, work / "usaf-count", layers)])[0]["trainable"]
                runs[arm].append(lora_epoch(src, tdir, trainable_layers, trainable, four_bit=arm == "qlora"))
            print(f"[{name}] round {r + 1}: {arm} {runs[arm][-1]['seconds']:.1f}s", flush=True)
    med = {arm: statistics.median(x["seconds"] for x in v) for arm, v in runs.items()}
    score = statistics.median(x["score_seconds"] for x in runs["usaf"])
    train = statistics.median(x["train_seconds"] for x in runs["usaf"])
    return {
        "median_seconds": med,
        "usaf_score_median_seconds": score,
        "usaf_train_median_seconds": train,
        "lora_over_usaf_end_to_end": med["lora"] / med["usaf"],  # > 1: usaf's whole run is faster
        "lora_over_usaf_train_only": med["lora"] / train,
        "qlora_over_usaf_end_to_end": med["qlora"] / med["usaf"],
        "qlora_over_usaf_train_only": med["qlora"] / train,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--experts", type=int, nargs="*", choices=(32, 64, 128), default=[32, 128],
                        help="shapes by expert count (default 32 128)")
    parser.add_argument("--out", type=Path, default=RESULTS / "epoch.json")
    parser.add_argument("--packages", nargs="+", default=list(PACKAGES),
                        help="stdlib packages to tokenize (the data size: score's cost is fixed, train's grows)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    packages = tuple(args.packages)
    result = {"machine": machine(), "commit": git_commit(), "command": " ".join(["python", *sys.argv]),
              "packages": list(packages), "shapes": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="usaf-bench-epoch-") as tmp:
        for name, extra in SHAPES.items():
            if int(name[1:]) not in args.experts:
                continue
            widths = {**MODEL, **extra}
            result["shapes"][name] = {"model": widths, **measure(name, widths, args.rounds, Path(tmp) / name, packages)}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")  # partial results survive an interrupted run
            s = result["shapes"][name]
            print(f"[{name}] usaf {s['median_seconds']['usaf']:.1f}s (score {s['usaf_score_median_seconds']:.1f}s, "
                  f"train {s['usaf_train_median_seconds']:.1f}s), LoRA {s['median_seconds']['lora']:.1f}s, QLoRA "
                  f"{s['median_seconds']['qlora']:.1f}s: LoRA / usaf {s['lora_over_usaf_end_to_end']:.2f}, QLoRA / "
                  f"usaf {s['qlora_over_usaf_end_to_end']:.2f}", flush=True)  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
