"""Benchmark: one epoch of ``usaf train`` with each first visit's microbatch captured at once (its company, usaf's
way since issue 21 item 3) against each sequence captured alone (the way before), side by side.

Workload: ``bench_epoch.py``'s model and data (8 layers, hidden 512, top 2 trainable; 128 experts of width 192
top-8, or 32 of width 256 top-4; 146 sequences of 256 tokens of stdlib ``json`` + ``tomllib``), ``usaf score`` at its
defaults once (its plan keeps the 64 calibration sequences' states, as by default), then ``usaf train --epochs 1``
at microbatch 2, fp32, in two modes: the frozen layers dequantized once (what the stage chooses here) and per
forward (what it chooses for a model whose frozen layers do not fit in half the free memory). The arms alternate
within each round; each run's train time, final loss and prefix hits and misses are recorded. ``--microbatch``: score's
and train's (a first-epoch company is a microbatch less the plan's states: larger ones batch more of the capture);
``--modes``: the frozen layers' modes to run.

    python benchmarks/bench_first_visits.py [--threads 1] [--rounds 2] [--experts 128] [--microbatch 2]
        [--modes once per-forward] [--out benchmarks/results/first-visits.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import MODEL, RESULTS, TOP, machine  # noqa: E402
from bench_epoch import SHAPES, prepare  # noqa: E402
from bench_train import MICROBATCH, PACKAGES, git_commit  # noqa: E402

ARMS = ("company", "alone")
MODES = {"once": "dequantized once", "per-forward": "per forward"}  # --modes: the frozen layers'


def one_epoch(qdir: Path, tdir: Path, plan: Path, out: Path, arm: str, mode: str, microbatch: int) -> dict:
    from usaf.stages import engine_setup
    from usaf.stages.progress import NullProgress
    from usaf.stages.train import TrainConfig, companies
    from usaf.stages.train import run as train

    patches = contextlib.ExitStack()
    if arm == "alone":  # each sequence its own company: the capture of before, one sequence at a time

        def alone(self, row: int):
            return companies.Company(f"alone {row}", (row,))

        patches.enter_context(mock.patch.object(companies.FirstEpochCompanies, "of", alone))
    if mode == "per forward":
        patches.enter_context(mock.patch.object(engine_setup, "frozen_layers_resident", lambda *args: False))
    start = time.perf_counter()
    with patches:
        manifest, run_dir = train(
            TrainConfig(model=qdir, data=tdir, plan=plan, out=out, epochs=1.0, microbatch=microbatch, device="cpu",
                        dtype="float32"),
            progress=NullProgress(),
        )  # fmt: skip
    seconds = time.perf_counter() - start
    s = manifest.summary
    return {"seconds": seconds, "final_loss": s.final_loss, "hits_misses": [s.prefix_cache_hits, s.prefix_cache_misses]}


def main() -> None:
    from usaf.stages.progress import NullProgress
    from usaf.stages.score import ScoreConfig
    from usaf.stages.score import run as score

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--experts", type=int, choices=(32, 128), default=128)
    parser.add_argument("--microbatch", type=int, default=MICROBATCH, help="score's and train's")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--out", type=Path, default=RESULTS / "first-visits.json")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    widths = {**MODEL, **SHAPES["E128" if args.experts == 128 else "E32"]}
    result = {"machine": machine(), "commit": git_commit(), "command": " ".join(["python", *sys.argv]),
              "model": widths, "microbatch": args.microbatch, "modes": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="usaf-bench-first-visits-") as tmp:
        work = Path(tmp)
        _, qdir, tdir = prepare(work, widths, PACKAGES)
        settings = ScoreConfig(model=qdir, data=tdir, out=work / "plan", microbatch=args.microbatch,
                               train_from=widths["num_layers"] - TOP, device="cpu")  # fmt: skip
        _, plan = score(settings, progress=NullProgress())
        for mode in (MODES[flag] for flag in args.modes):
            runs = {arm: [] for arm in ARMS}
            for r in range(args.rounds):
                for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                    out = work / f"run-{mode.replace(' ', '-')}-{arm}-{r}"
                    runs[arm].append(one_epoch(qdir, tdir, plan, out, arm, mode, args.microbatch))
                    print(f"[{mode}] round {r}: {arm} {runs[arm][-1]}", flush=True)
            medians = {arm: statistics.median(x["seconds"] for x in runs[arm]) for arm in ARMS}
            result["modes"][mode] = {
                "median_train_seconds": medians,
                "speed_company_over_alone": medians["alone"] / medians["company"],
                "runs": runs,
            }
            print(f"[{mode}] {json.dumps({k: round(v, 2) for k, v in medians.items()})}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
