"""Benchmark: what the attention target costs per training step, side by side with the experts alone.

Workload: the packaged demo model (``usaf.demo.demo_model_dir()``, Qwen3-MoE, 4 layers, hidden 128, 16 experts
top-2), quantized by ``usaf.stages.quantize.run`` (HQQ 4-bit defaults), its top layer trainable with the routers,
frac 0.1 of each target tensor at random positions (the default share on this model; the positions do not change
the arithmetic), a microbatch of 2 x 256 tokens of standard-library text from a cached prefix (as ``usaf train``
after ``usaf score --cache``). Arms: ``--targets experts`` and ``--targets experts,attention``; each step is
``engine.loss`` + backward + ``SparseAdamW.step``, timed after warm-up steps, the arms interleaved (A B A B ...) so
load on the machine hits both alike. Reported: median step seconds per arm, their ratio, trainable entries, and the
bytes of deltas and optimizer state.

    python benchmarks/bench_targets.py [--threads 1] [--repeats 30] [--out benchmarks/results/targets.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import RESULTS, engine_step, interleave, machine  # noqa: E402
from bench_train import git_commit  # noqa: E402

FRAC = 0.1
SEQ, MICROBATCH = 256, 2
ARMS = {"experts": ("experts",), "experts+attention": ("experts", "attention")}


def quantized_demo(work: Path) -> Path:
    from usaf.demo import demo_model_dir
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize

    out = work / "q"
    quantize(QuantizeConfig(model=str(demo_model_dir()), out=out, device="cpu"))
    return out


def text_batch(qdir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) ``(MICROBATCH, SEQ)`` from the tokenizer on ``textwrap.py`` and ``shlex.py``."""
    from usaf.data.tokenizer import load_tokenizer
    from usaf.testing import stdlib_dir

    tokenizer = load_tokenizer(str(qdir), flag="--model")
    text = (stdlib_dir() / "textwrap.py").read_text() + (stdlib_dir() / "shlex.py").read_text()
    ids = torch.tensor(tokenizer(text)["input_ids"][: MICROBATCH * SEQ]).view(MICROBATCH, SEQ)
    return ids, ids.clone()


def make_arm(qdir: Path, targets: tuple[str, ...], batch) -> tuple:
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model
    from usaf.engine.optim import SparseAdamW

    loaded = load_quantized_model(qdir)
    engine = SparseEngine(loaded, trainable_layers=[loaded.spec.moe_layers[-1]], targets=targets)
    g = torch.Generator().manual_seed(0)
    engine.set_deltas(
        {
            name: torch.randperm(math.prod(w.shape), generator=g)[: int(FRAC * math.prod(w.shape))].sort().values
            for name, w in engine.weights.items()
        }
    )
    optimizer = SparseAdamW(engine.parameter_groups(lr=1e-3, router_lr=1e-4, weight_decay=0.0), max_grad_norm=1.0)
    states = engine.prefix_states(batch[0])
    return engine, optimizer, states


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS / "targets.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        qdir = quantized_demo(Path(tmp))
        batch = text_batch(qdir)
        arms = {name: make_arm(qdir, targets, batch) for name, targets in ARMS.items()}
        steps = {name: (lambda a=arm: engine_step(a[0], a[1], batch, a[2])) for name, arm in arms.items()}
        start = time.perf_counter()
        times = interleave(steps, args.repeats, "targets")
        wall = time.perf_counter() - start
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "benchmark": "targets",
        "command": "python benchmarks/bench_targets.py " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "git_commit": git_commit(),
        "workload": {"model": "usaf demo model, top layer", "frac": FRAC, "microbatch": MICROBATCH, "seq": SEQ,
                     "threads": args.threads, "repeats": args.repeats},  # fmt: skip
        "arms": {
            name: {
                "median_step_seconds": medians[name],
                "p90_step_seconds": sorted(t)[int(0.9 * (len(t) - 1))],
                "delta_entries": arms[name][0].trainable_count()["delta_entries"],
                "deltas_bytes": arms[name][0].memory()["deltas"],
                "optimizer_state_bytes": arms[name][1].state_bytes(),
            }
            for name, t in times.items()
        },
        "ratio_attention_over_experts": medians["experts+attention"] / medians["experts"],
        "wall_seconds": wall,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, arm in result["arms"].items():
        print(f"{name:18s} step {arm['median_step_seconds'] * 1e3:6.1f} ms (p90 {arm['p90_step_seconds'] * 1e3:.1f}), "
              f"{arm['delta_entries']:,} entries")  # fmt: skip
    print(f"ratio {result['ratio_attention_over_experts']:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
