"""SIGKILL each stage (train also scoring its own plan) at random moments or fill its disk; rerun; check nothing lost.

    PYTHONPATH=src python scripts/crash_harness.py --kills 30 --disk-full 5 --out benchmarks/results/crash_harness.json

For each stage: one uninterrupted reference run, then ``--kills`` runs killed at a random write
event (a file cut at a random fraction, a rename not done, checkpoint writes included) or after a
random delay, and ``--disk-full`` runs whose disk fills at a random file write (one error line, nothing
torn left), each rerun with the same command and compared with the reference byte for byte (``eval``:
the same report numbers) (usaf.testing.crash, usaf.testing.crash_stages). The JSON feeds
docs/RELIABILITY.md (scripts/reliability_report.py). Exit status 1 if any trial found a problem.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

STAGES = ("quantize", "score", "train", "train-fly", "export", "eval")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=30, help="killed runs per stage")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--disk-full", type=int, default=0, help="full-disk runs per stage (after the kills)")
    parser.add_argument("--stage", action="append", choices=list(STAGES), help="only these stages")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/crash_harness.json"))
    args = parser.parse_args()

    import torch

    from usaf.testing import crash, crash_stages

    # Every run at one thread count, as the test suite does: usaf picks the count by the machine's load
    # (backends/cpu.choose_threads) and a fresh run's bits depend on it, while every trial is compared with the
    # reference bit for bit. (A resume takes its run's count by itself: tests/test_resume_threads.py.)
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    start = time.perf_counter()
    stages = args.stage or list(STAGES)
    records = []
    with tempfile.TemporaryDirectory(prefix="usaf-crash-") as tmp:
        root = Path(tmp)
        setup = crash.build_setup(root / "setup")
        run = crash_stages.build_run(setup, root) if {"export", "eval"} & set(stages) else None
        for name in stages:
            stage = {
                "quantize": lambda: crash.QuantizeStage(setup.model),
                "score": lambda: crash_stages.ScoreStage(setup.quantized, setup.tokens),
                "train": lambda: crash.TrainStage(setup.quantized, setup.tokens, setup.plan),
                "train-fly": lambda: crash_stages.FlyTrainStage(setup.quantized, setup.tokens, setup.plan),
                "export": lambda: crash_stages.ExportStage(setup.quantized, run),
                "eval": lambda: crash_stages.EvalStage(setup.quantized, run, setup.tokens),
            }[name]()
            work = root / name
            work.mkdir()
            record = crash.run_stage(stage, work, kills=args.kills, seed=args.seed, disk_full=args.disk_full)
            for t in record["trials"]:
                mark = "ok " if t["survived"] else ("-- " if not t["killed"] and not t["problems"] else "BAD")
                print(
                    f"{mark} {name} {t['mode']:5s} kill_at={t['kill_at']:3d} frac={t['fraction']:.2f} "
                    f"delay={t['delay_s']:.2f}s torn={t['torn']!s:5s} | {t['event'][:70]} | "
                    f"{t['visible_after_kill']} | resumed={t['resumed_from']} last={t['last_checkpoint']} "
                    f"layers_kept={len(t['complete_layers'])} redone={t['redone']} | {t['problems']}",
                    flush=True,
                )
            records.append(record)
    command = f"PYTHONPATH=src python scripts/crash_harness.py --kills {args.kills} --seed {args.seed}"
    if args.disk_full:
        command += f" --disk-full {args.disk_full}"
    if args.stage:
        command += "".join(f" --stage {s}" for s in args.stage)
    result = {"command": command, "seconds": round(time.perf_counter() - start, 1), "stages": records}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    bad = [t for r in records for t in r["trials"] if t["problems"]]
    for r in records:
        kills = [t for t in r["trials"] if t["mode"] != "disk-full"]
        killed = [t for t in kills if t["killed"]]
        full = [t for t in r["trials"] if t["mode"] == "disk-full"]
        print(
            f"{r['stage']}: {sum(t['survived'] for t in killed)}/{len(killed)} kills survived "
            f"({len(kills) - len(killed)} runs finished before the kill); "
            f"{sum(t['survived'] for t in full)}/{len(full)} full disks answered and recovered"
        )
    print(f"written to {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
