"""Benchmark: cutting a score pool back to its capacity, with the k-th smallest score found by ``np.partition`` or by
the radix select of ``usaf.engine.selection_ops`` (issue 21, item 2: a RigL collecting step's cost).

A pool is cut (``ScoreAccumulator._evict``) each time it holds more than ``(1 + OVERFLOW) x P`` entries; the first
collecting step of a RigL window, whose pools start empty, cuts each of them many times. The cut needs the k-th
smallest of the pooled scores. Two arms, alternating, with identical results (checked):

1. **Synthetic pools** at the 128-expert train benchmark's sizes (``gate_up`` 128 x 384 x 512 and ``down``
   128 x 512 x 192 at frac 0.005: capacities 503,316 and 251,656, filled to the cut's trigger) with uniform,
   heavy-tailed and tied scores: the k-th smallest alone, and a whole cut.
2. **``--steps``**: ``bench_train.py``'s 128-expert model (8 layers, hidden 512, top 2 trainable, microbatch 2 x 256
   tokens of stdlib text, prefix cache hits), RigL windows as ``usaf train`` runs them (``collect_scores``, 4
   collecting steps, ``reselect``), the arm alternating by window: each collecting step's time and the time its cuts
   took, by position in the window.

    python benchmarks/bench_pool_cut.py [--threads 1] [--rounds 15] [--steps] [--windows 6]
        [--out benchmarks/results/pool_cut.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import MODEL, RESULTS, machine  # noqa: E402
from bench_train import CALIB, PACKAGES, SEQ, build, git_commit, stage_trainer, trainer_step  # noqa: E402

TENSORS = {"gate_up": ((128, 384, 512), 125_829), "down": ((128, 512, 192), 62_914)}  # (E, O, I), nnz at frac 0.005
ARMS = ("partition", "radix")


def use(arm: str) -> None:
    """Switch ``kth_smallest``'s host path: the radix select (usaf's) or ``np.partition`` on every array."""
    from usaf.engine import selection_ops

    selection_ops._RADIX_MIN = 2**16 if arm == "radix" else 2**62


def scores_of(kind: str, n: int, gen: np.random.Generator) -> np.ndarray:
    if kind == "uniform":
        return gen.random(n, dtype=np.float32)
    if kind == "heavy-tailed":
        return (gen.pareto(1.5, n) * 1e-4).astype(np.float32)
    return np.round(gen.random(n, dtype=np.float32), 3)  # tied


def full_pool(shape: tuple[int, int, int], nnz: int, kind: str, seed: int):
    """An accumulator whose pool holds one entry more than the cut's trigger, spread evenly over the experts."""
    from usaf.engine.scores import OVERFLOW, ScoreAccumulator

    acc = ScoreAccumulator(shape, nnz, "grad")
    e, o, i = shape
    gen = np.random.default_rng(seed)
    per = int((1 + OVERFLOW) * acc.capacity) // e + 1
    acc._local = [torch.from_numpy(gen.choice(o * i, per, replace=False)) for _ in range(e)]
    acc._local_scores = [torch.from_numpy(scores_of(kind, per, gen)) for _ in range(e)]
    acc._pooled = per * e
    return acc


def synthetic(rounds: int) -> dict:
    from usaf.engine.selection_ops import kth_smallest

    out = {}
    for name, (shape, nnz) in TENSORS.items():
        for kind in ("uniform", "heavy-tailed", "tied"):
            template = full_pool(shape, nnz, kind, seed=len(out))
            pool = (list(template._local), list(template._local_scores), template._pooled)
            scores = torch.cat(template._local_scores)
            excess = scores.numel() - template.capacity
            kth = {a: [] for a in ARMS}
            cut = {a: [] for a in ARMS}
            after = {}
            for r in range(rounds + 1):  # round 0 warms up
                for arm in ARMS if r % 2 else reversed(ARMS):
                    use(arm)
                    start = time.perf_counter()
                    value = kth_smallest(scores, excess)
                    seconds = time.perf_counter() - start
                    template._local, template._local_scores, template._pooled = list(pool[0]), list(pool[1]), pool[2]
                    template._epoch_loss.zero_()
                    start = time.perf_counter()
                    template._evict()
                    cut_seconds = time.perf_counter() - start
                    if r:
                        kth[arm].append(seconds)
                        cut[arm].append(cut_seconds)
                    after[arm] = (float(value), torch.cat(template._local), torch.cat(template._local_scores))
            same = after["radix"][0] == after["partition"][0] and all(
                torch.equal(a, b) for a, b in zip(after["radix"][1:], after["partition"][1:])
            )
            med = {a: (statistics.median(kth[a]), statistics.median(cut[a])) for a in ARMS}
            out[f"{name} {kind}"] = {
                "pool": scores.numel(),
                "k": excess,
                "kth_ms": {a: med[a][0] * 1e3 for a in ARMS},
                "cut_ms": {a: med[a][1] * 1e3 for a in ARMS},
                "identical": same,
            }
            r = out[f"{name} {kind}"]
            print(
                f"[synthetic] {name:7s} {kind:12s} pool {r['pool']:,}: k-th {r['kth_ms']['partition']:.2f} -> "
                f"{r['kth_ms']['radix']:.2f} ms, cut {r['cut_ms']['partition']:.2f} -> {r['cut_ms']['radix']:.2f} ms, "
                f"identical {same}",
                flush=True,
            )
    return out


def steps(windows: int, work: Path) -> dict:
    from usaf.engine import scores as scores_module
    from usaf.engine.reselect import collect_scores, reselect, update_fraction
    from usaf.stages.train.loop import SCORE_BATCHES

    widths = {**MODEL, "num_experts": 128, "moe_intermediate_size": 3 * MODEL["hidden_size"] // 8}
    widths["num_experts_per_tok"] = 8
    _, qdir, tdir, plan, _ = build(work, widths, SEQ, CALIB, PACKAGES)
    trainer, _ = stage_trainer(qdir, tdir, plan, work / "run")
    cuts = {"count": 0, "seconds": 0.0}
    evict = scores_module.ScoreAccumulator._evict

    def timed_evict(self):
        start = time.perf_counter()
        evict(self)
        cuts["count"] += 1
        cuts["seconds"] += time.perf_counter() - start

    scores_module.ScoreAccumulator._evict = timed_evict
    fraction = update_fraction(50, 1000, trainer.config.reselect_fraction)
    step = 0
    for _ in range(2):
        trainer_step(trainer, step)
        step += 1
    plain: list[float] = []
    by_arm = {a: {key: [[] for _ in range(SCORE_BATCHES)] for key in ("step_s", "cut_s")} for a in ARMS}
    cut_counts = []
    for w in range(windows):
        arm = ARMS[w % 2]
        use(arm)
        plain.append(trainer_step(trainer, step))
        scores = collect_scores(trainer.engine)
        trainer.collector = scores
        counts = []
        for j in range(SCORE_BATCHES):
            cuts.update(count=0, seconds=0.0)
            by_arm[arm]["step_s"][j].append(trainer_step(trainer, step + j))
            by_arm[arm]["cut_s"][j].append(cuts["seconds"])
            counts.append(cuts["count"])
        trainer.collector = None
        scores.close()
        trainer.record_reselection(step, reselect(trainer.engine, trainer.optimizer, scores, fraction))
        step += SCORE_BATCHES
        cut_counts.append(counts)
        print(
            f"[steps] window {w} ({arm}): collecting steps "
            + " ".join(
                f"{s[-1]:.3f}s ({c} cuts, {t[-1]:.3f}s)"
                for s, t, c in zip(by_arm[arm]["step_s"], by_arm[arm]["cut_s"], counts)
            ),
            flush=True,
        )
    scores_module.ScoreAccumulator._evict = evict
    use("radix")
    return {
        "model": widths,
        "score_batches": SCORE_BATCHES,
        "plain_step_median_s": statistics.median(plain),
        "cuts_per_step": cut_counts,
        "median_by_position": {
            a: {k: [statistics.median(v) for v in by_arm[a][k]] for k in ("step_s", "cut_s")} for a in ARMS
        },
        "seconds": by_arm,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15, help="synthetic rounds per arm")
    parser.add_argument("--steps", action="store_true", help="also RigL windows on the 128-expert train model")
    parser.add_argument("--windows", type=int, default=6, help="RigL windows (arms alternate by window)")
    parser.add_argument("--out", type=Path, default=RESULTS / "pool_cut.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"command": " ".join(sys.argv), "commit": git_commit(), "machine": machine()}
    result["synthetic"] = synthetic(args.rounds)
    if args.steps:
        with tempfile.TemporaryDirectory(prefix="usaf-pool-cut-") as tmp:
            result["steps"] = steps(args.windows, Path(tmp))
    use("radix")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
