"""Benchmark: ``usaf score``'s lr test with its probes' common first step run once, against every probe running it.

Every probe of the lr test starts from the base model and takes the same first microbatch, so its first forward and
backward are the same in all of them (``usaf.stages.lr_test.FirstStep``): the test runs it once and the later probes
start from a copy of its gradients. This times the probes both ways on the same engine, alternating, and checks that
each probe's held-back scores are the same bits both ways.

Workload: ``bench_epoch.py``'s model (8 layers, hidden 512, the top 2 trainable; 32 experts of width 256 top-4, and
128 of width 192 top-8), its data; the masks from ``usaf score`` at its defaults without the lr test; the calibration
sample score draws (64 sequences, seed 0), split and batched as the test does (microbatch 2), with their prefix
states computed once before the timing (score's calibration pass hands them over); the four candidate lrs at 16
steps, fp32, 1 thread. Timed per arm: the untrained held-back score and the four probes (none diverges here).

    python benchmarks/bench_lr_probes.py [--threads 1] [--rounds 3] [--experts 32 128]
        [--out benchmarks/results/lr-probes.json]
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
from bench_engine import MODEL, RESULTS, TOP, machine  # noqa: E402
from bench_epoch import SHAPES, prepare  # noqa: E402
from bench_train import MICROBATCH, PACKAGES, git_commit  # noqa: E402

CALIB = 64  # usaf score's default sample


def setup(qdir: Path, tdir: Path, work: Path, layers: int):
    """The engine as ``usaf score`` builds it, the plan's masks, and the sample's probe and held-back batches."""
    from usaf.artifacts import PlanManifest, load_verified
    from usaf.artifacts.plan import read_masks
    from usaf.backends import resolve_backend
    from usaf.data.batches import sample_lines
    from usaf.data.tokenizer import load_tokenizer
    from usaf.engine.engine import SparseEngine
    from usaf.families.targets import resolve_targets
    from usaf.stages import lr_test
    from usaf.stages.engine_setup import frozen_layers_resident, load_for_engine
    from usaf.stages.progress import NullProgress
    from usaf.stages.score import ScoreConfig, trainable_layers
    from usaf.stages.score import run as score

    config = ScoreConfig(model=qdir, data=tdir, out=work / "plan", microbatch=MICROBATCH, train_from=layers - TOP,
                         device="cpu", lr_test=False, cache=False)  # fmt: skip
    _, plan = score(config, progress=NullProgress())
    backend = resolve_backend("cpu")
    loaded, placement = load_for_engine(qdir, backend, backend.policy.compute, None, NullProgress())
    engine = SparseEngine(loaded, trainable_layers=trainable_layers(config, loaded.spec),
                          targets=resolve_targets(config.targets, loaded.spec), **placement)  # fmt: skip
    frozen_layers_resident(engine, backend, NullProgress())
    masks = read_masks(plan, load_verified(plan, PlanManifest))
    tokenizer = load_tokenizer(str(qdir), flag="--model")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id  # as score's
    lines = sample_lines(tdir / "train.jsonl", CALIB, seed=config.seed, vocab_size=len(tokenizer))
    probe_lines, held_lines = lr_test.split(lines)
    train = lr_test._with_prefix(engine, probe_lines, MICROBATCH, pad, None)
    held = lr_test._with_prefix(engine, held_lines, 1, pad, None)
    return engine, masks, train, held


def probes(engine, masks, train, held, shared: bool) -> tuple[float, list]:
    """(seconds, each probe's held-back per-sequence nll): the base score and the four probes, as the test runs them."""
    from usaf.settings.score import LR_TEST_STEPS
    from usaf.stages import lr_test

    first = lr_test.FirstStep() if shared else None
    start = time.perf_counter()
    lr_test._heldout(engine, held)
    scores = [lr_test._probe(engine, masks, train, held, lr, LR_TEST_STEPS, first) for lr in lr_test.CANDIDATES]
    seconds = time.perf_counter() - start
    lr_test._restore(engine)
    return seconds, [s.nll for s in scores]


def measure(widths: dict, rounds: int, work: Path) -> dict:
    _, qdir, tdir = prepare(work, widths, PACKAGES)
    engine, masks, train, held = setup(qdir, tdir, work, widths["num_layers"])
    seconds: dict[str, list[float]] = {"each": [], "shared": []}
    reference = None
    for r in range(rounds):
        for arm in ("each", "shared") if r % 2 == 0 else ("shared", "each"):
            took, nll = probes(engine, masks, train, held, arm == "shared")
            seconds[arm].append(took)
            reference = reference or nll
            if not all(torch.equal(a, b) for a, b in zip(reference, nll, strict=True)):
                raise SystemExit(f"round {r + 1}, {arm}: the held-back scores differ from the first run's")
            print(f"  round {r + 1}: {arm} {took:.2f}s", flush=True)
    median = {arm: statistics.median(v) for arm, v in seconds.items()}
    return {"median_seconds": median, "each_over_shared": median["each"] / median["shared"], "seconds": seconds,
            "probe_batches": len(train), "held_back": len(held), "identical_scores": True}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--experts", type=int, nargs="*", choices=(32, 128), default=[32, 128])
    parser.add_argument("--out", type=Path, default=RESULTS / "lr-probes.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"machine": machine(), "commit": git_commit(), "command": " ".join(["python", *sys.argv]), "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="usaf-bench-lr-probes-") as tmp:
        for name, extra in SHAPES.items():
            if int(name[1:]) not in args.experts:
                continue
            print(f"[{name}]", flush=True)
            result["shapes"][name] = measure({**MODEL, **extra}, args.rounds, Path(tmp) / name)
            print(f"[{name}] each / shared: {result['shapes'][name]['each_over_shared']:.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
