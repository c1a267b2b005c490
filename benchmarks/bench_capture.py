"""Benchmark: a first visit's frozen-prefix capture, one sequence at a time (what ``usaf train`` does) or batched.

Issue 21, item 3 asks whether capturing the prefix states of many sequences in one no-grad pass would make a
one-epoch run faster. ``usaf train`` computed each missing state alone (``SparseEngine.cached_prefix_states``),
which made a state independent of the batch it came in: what kept a resumed run bit-identical to a straight one.
This measures what batching gains on the frozen layers, and whether it changes the bits. (Since 2026-12-05 train
captures each first-epoch microbatch at once, its company: ``usaf.stages.train.companies``.)

Workload, one model per shape (``bench_reselect.SHAPES``: 4 layers, hidden 512, the top 2 trainable, so 2 frozen
MoE layers with their experts dequantized once, as ``usaf train`` does when they fit): 16 sequences of 256 tokens
of standard-library text (``json``); ``--per-forward``: the frozen experts dequantized on every forward instead (the
mode of a model whose frozen layers do not fit in half the free memory, where batching also shares each
dequantization between the batch's sequences). Arms, interleaved in rotating order each round (medians of ``--rounds``):
the 16 captured one at a time, and in batches of 2, 4, 8 and 16 (``SparseEngine.prefix_states``). Checks: each
batched state against the one-at-a-time state (bit for bit, else the largest difference).

    python benchmarks/bench_capture.py [--threads 1] [--rounds 5] [--experts 32 128] [--per-forward]
                                       [--out benchmarks/results/capture.json]
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
from bench_engine import RESULTS, machine  # noqa: E402
from bench_frozen import interleaved  # noqa: E402
from bench_reselect import SEQ, SHAPES, TRAINABLE, build  # noqa: E402
from bench_train import git_commit  # noqa: E402

SEQUENCES = 16
BATCHES = (2, 4, 8, 16)


def sequences(qdir: Path) -> torch.Tensor:
    """``(SEQUENCES, SEQ)`` token ids: the model's tokenizer on the ``json`` package's sources."""
    from usaf.data.tokenizer import load_tokenizer
    from usaf.testing import stdlib_dir

    tokenizer = load_tokenizer(str(qdir), flag="--model")
    text = "".join(p.read_text() for p in sorted((stdlib_dir() / "json").glob("*.py")))
    ids = tokenizer(text * 4)["input_ids"][: SEQUENCES * SEQ]
    return torch.tensor(ids).view(SEQUENCES, SEQ)


def measure(qdir: Path, rounds: int, per_forward: bool) -> dict:
    from usaf.backends import resolve_backend
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model
    from usaf.stages.engine_setup import make_resident

    loaded = load_quantized_model(qdir)
    engine = SparseEngine(loaded, trainable_layers=loaded.spec.moe_layers[-TRAINABLE:])
    frozen = [layer for layer in loaded.experts if layer not in engine.trainable_layers]
    if not per_forward:
        make_resident(loaded, resolve_backend("cpu"), True, frozen)
    ids = sequences(qdir)

    def capture(batch: int) -> list[torch.Tensor]:
        return [s for i in range(0, SEQUENCES, batch) for s in engine.prefix_states(ids[i : i + batch])]

    one = capture(1)
    checks = {}
    for batch in BATCHES:
        got = capture(batch)
        checks[f"batch_{batch}"] = {
            "bit_identical": all(torch.equal(a, b) for a, b in zip(one, got)),
            "max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(one, got)),
        }
    arms = {"one_at_a_time": lambda: capture(1), **{f"batch_{b}": (lambda b=b: capture(b)) for b in BATCHES}}
    times = interleaved(arms, rounds, torch.device("cpu"), verbose=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "seconds_for_all_sequences": medians,
        "speed_vs_one_at_a_time": {name: medians["one_at_a_time"] / m for name, m in medians.items()},
        "checks": checks,
        "rounds": times,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--experts", type=int, nargs="*", default=[32, 128], help="shapes by expert count")
    parser.add_argument(
        "--per-forward", action="store_true", help="the frozen experts dequantized every forward (not once)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "capture.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = {k: v for k, v in SHAPES.items() if v[0] in args.experts}
    results = {"machine": machine(), "commit": git_commit(), "command": " ".join(["python", *sys.argv]),
               "frozen_experts": "per forward" if args.per_forward else "dequantized once", "shapes": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name, (experts, width, top_k) in shapes.items():
            print(f"[{name}] building and quantizing", flush=True)
            qdir = build(Path(tmp) / name, experts, width, top_k)
            result = measure(qdir, args.rounds, args.per_forward)
            result["shape"] = {"experts": experts, "width": width, "top_k": top_k}
            results["shapes"][name] = result
            print(f"[{name}] " + json.dumps({k: result[k] for k in ("speed_vs_one_at_a_time", "checks")}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
