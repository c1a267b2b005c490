"""Benchmark: what the plan's default prefix store (the calibration sample's states) saves a one-epoch run.

``bench_epoch.py``'s usaf arm (``usaf score`` + ``usaf train --epochs 1`` at the defaults, same model, data,
microbatch 2, fp32, 1 thread) twice per round: score at its default, which keeps the prefix states its scoring pass
computed in the plan, and score with ``--no-cache``, which keeps none; rounds alternate which goes first. Both train
the same sequences in the same order; the losses agree to rounding (the kept states come from the calibration's
batches of 2, a first visit computes each sequence alone).

Also recorded: where the two runs' per-step losses part (the first step differing by more than 1e-4, the largest
difference); ``--reselect-every 0`` takes RigL out of that comparison.

    python benchmarks/bench_kept_states.py [--threads 1] [--rounds 2] [--experts 32 128] [--packages json tomllib]
        [--reselect-every N] [--out benchmarks/results/kept-states.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import MODEL, RESULTS, machine  # noqa: E402
from bench_epoch import SHAPES, prepare, usaf_epoch  # noqa: E402
from bench_train import PACKAGES, git_commit  # noqa: E402

ARMS = {"kept": None, "none": False}  # score's cache setting: its default, --no-cache


def parting(a: list[float], b: list[float]) -> dict:
    """Where two runs' per-step losses part: the first step (1-based) differing by more than 1e-4, the largest
    difference, and the final losses."""
    diffs = [abs(x - y) for x, y in zip(a, b)]
    first = next((i + 1 for i, d in enumerate(diffs) if d > 1e-4), None)
    return {"first_step_over_1e-4": first, "max_difference": max(diffs), "final": [a[-1], b[-1]]}


def measure(widths: dict, rounds: int, work: Path, packages: tuple[str, ...], reselect_every: int | None) -> dict:
    _, qdir, tdir = prepare(work, widths, packages)
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(rounds):
        for arm in list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]:
            result = usaf_epoch(qdir, tdir, work / f"{arm}-{r}", widths["num_layers"], cache=ARMS[arm],
                                reselect_every=reselect_every)  # fmt: skip
            runs[arm].append(result)
            hits, misses = result["prefix_cache_hits_misses"]
            print(f"  round {r + 1}: {arm} train {result['train_seconds']:.1f}s ({hits} hits, {misses} misses), "
                  f"score {result['score_seconds']:.1f}s", flush=True)  # fmt: skip
    parts = ("seconds", "score_seconds", "train_seconds")
    median = {arm: {part: statistics.median(x[part] for x in runs[arm]) for part in parts} for arm in ARMS}
    return {
        "median": median,
        "train_none_over_kept": median["none"]["train_seconds"] / median["kept"]["train_seconds"],
        "whole_none_over_kept": median["none"]["seconds"] / median["kept"]["seconds"],
        "losses_part": parting(runs["kept"][0]["losses"], runs["none"][0]["losses"]),
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--experts", type=int, nargs="*", choices=(32, 128), default=[32, 128])
    parser.add_argument("--packages", nargs="+", default=list(PACKAGES))
    parser.add_argument("--reselect-every", type=int, default=None, help="train's (default: its own)")
    parser.add_argument("--out", type=Path, default=RESULTS / "kept-states.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"machine": machine(), "commit": git_commit(), "command": " ".join(["python", *sys.argv]),
              "packages": args.packages, "shapes": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="usaf-bench-kept-") as tmp:
        for name, extra in SHAPES.items():
            if int(name[1:]) not in args.experts:
                continue
            widths = {**MODEL, **extra}
            print(f"[{name}]", flush=True)
            s = measure(widths, args.rounds, Path(tmp) / name, tuple(args.packages), args.reselect_every)
            result["shapes"][name] = {"model": widths, **s}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
            print(f"[{name}] train {s['median']['kept']['train_seconds']:.1f}s kept, "
                  f"{s['median']['none']['train_seconds']:.1f}s none ({s['train_none_over_kept']:.2f}x); whole "
                  f"{s['median']['kept']['seconds']:.1f}s against {s['median']['none']['seconds']:.1f}s; losses "
                  f"{s['losses_part']}", flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
