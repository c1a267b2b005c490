"""Benchmark: what RigL costs per cycle as the expert count grows: score-collecting steps and a reselection.

Workload, one model per shape: a random-init Qwen3-MoE with 4 layers, hidden 512, ``E`` experts of width 192,
top-8 (Qwen3-30B-A3B's expert ratios: width 0.375 x hidden), for E = 32, 64 and 128; plus the train benchmark's
shape (32 experts of width 256, top-4). Quantized by ``usaf.stages.quantize.run(method="rtn")`` (4-bit, group 64).
The top 2 layers train (experts + attention, the default targets, routers on) at frac 0.005 at random positions,
from a cached prefix (as ``usaf train`` after ``usaf score --cache``), on a microbatch of 2 x 256 tokens of
standard-library text. A step is ``engine.loss`` + backward + ``SparseAdamW.step``.

Each round is one RigL cycle as ``usaf train`` runs it (``usaf.stages.train.loop``): ``collect_scores`` (timed:
"setup"), 4 score-collecting steps, then ``reselect`` at ``update_fraction(50, 1000, 0.2)`` = 0.198 (timed, with
the fold into the frozen record). Interleaved with the 4 collecting steps, in rotating order on the same batch:
4 plain steps and 4 steps that collect into the **flat pool**, the accumulator before this benchmark (one pool of
``4 x nnz`` entries per tensor that every expert slice was merged into: kept below as ``FlatPoolAccumulator``, the
reference). Reported per shape: median seconds, the ratios to a plain step, and one cycle's overhead at the default
``--reselect-every 50``: ``(4 x (collecting - plain) + setup + reselect) / (50 x plain)``.

    python benchmarks/bench_reselect.py [--threads 1] [--rounds 5] [--experts 32 64 128]
                                        [--grouped {auto,on}] [--out benchmarks/results/reselect.json]

``--grouped on`` runs the trainable layers' experts grouped (``usaf.engine.grouped_deltas``, CUDA's path) on any
device, plain and collecting steps alike, the collecting steps' sinks then fed a block of experts at a time; ``auto``
is the device's choice (the per-expert loop on the CPU).
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
from bench_engine import RESULTS, engine_step, machine  # noqa: E402
from bench_train import git_commit  # noqa: E402

HIDDEN, LAYERS, TRAINABLE = 512, 4, 2
FRAC = 0.005
SEQ, MICROBATCH = 256, 2
SCORE_BATCHES = 4  # usaf train's collecting steps before a reselection
RESELECT_EVERY = 50  # the default --reselect-every
FRACTION = 0.5 * 0.2 * (1 + math.cos(math.pi * 50 / 750))  # update_fraction(50, 1000, 0.2)
SHAPES = {  # name -> (experts, expert width, top-k)
    "E32": (32, 192, 8),
    "E64": (64, 192, 8),
    "E128": (128, 192, 8),
    "E32-w256-top4 (train benchmark)": (32, 256, 4),
}


class FlatPoolAccumulator:
    """The reference: the accumulator's pooled mode before per-expert segments (usaf 0.x up to this benchmark).

    One flat pool of at most ``P = 4 x candidates`` entries; every expert slice is merged into it at once:
    a membership test over the whole pool, a top-k of the entrants, and an eviction top-k over the pool.
    Only the collection is reproduced (the timing reference); its scores are not used.
    """

    def __init__(self, shape: tuple[int, int, int], candidates: int, pool_factor: int = 4) -> None:
        self.shape = shape
        self.capacity = min(pool_factor * candidates, math.prod(shape))
        self.indices = torch.zeros(0, dtype=torch.int64)
        self.scores = torch.zeros(0, dtype=torch.float32)

    @torch.no_grad()
    def add(self, expert: int, grad: torch.Tensor) -> None:
        stat = grad.detach().to(torch.float32).abs().reshape(-1)  # the "grad" statistic
        if not bool(torch.isfinite(stat).all()):
            raise ValueError("non-finite gradient")
        per_expert = self.shape[1] * self.shape[2]
        low = expert * per_expert
        indices, scores = self.indices, self.scores
        mine = ((indices >= low) & (indices < low + per_expert)).nonzero().squeeze(1)
        local = indices[mine] - low
        scores.index_add_(0, mine, stat[local])
        stat[local] = 0
        floor = scores.min() if indices.numel() >= self.capacity else stat.new_zeros(())
        enter = (stat > floor).nonzero().squeeze(1)
        if enter.numel() > self.capacity:
            enter = enter[stat[enter].topk(self.capacity, sorted=False).indices]
        indices, scores = torch.cat([indices, enter + low]), torch.cat([scores, stat[enter]])
        excess = indices.numel() - self.capacity
        if excess > 0:
            keep = torch.ones(indices.numel(), dtype=torch.bool)
            keep[scores.topk(excess, largest=False, sorted=False).indices] = False
            indices, scores = indices[keep], scores[keep]
        self.indices, self.scores = indices, scores

    def sink(self, expert: int):
        return lambda grad, weight: self.add(expert, grad)


def build(work: Path, experts: int, width: int, top_k: int) -> Path:
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize
    from usaf.testing.models import build_tiny_model

    src = build_tiny_model(
        "qwen3_moe", work / "model", num_layers=LAYERS, hidden_size=HIDDEN, moe_intermediate_size=width,
        num_experts=experts, num_experts_per_tok=top_k, intermediate_size=2 * HIDDEN, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64,
    )  # fmt: skip
    _, qdir = quantize(QuantizeConfig(model=str(src), out=work / "q", method="rtn", group_size=64))
    return qdir


def text_batch(qdir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) ``(MICROBATCH, SEQ)``: the tiny tokenizer on ``json/decoder.py`` and ``json/encoder.py``."""
    from usaf.data.tokenizer import load_tokenizer
    from usaf.testing import stdlib_dir

    tokenizer = load_tokenizer(str(qdir), flag="--model")
    text = "".join((stdlib_dir() / "json" / name).read_text() for name in ("decoder.py", "encoder.py", "__init__.py"))
    ids = torch.tensor(tokenizer(text)["input_ids"][: MICROBATCH * SEQ]).view(MICROBATCH, SEQ)
    return ids, ids.clone()


def make_engine(qdir: Path, batch, grouped: str = "auto"):
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model
    from usaf.engine.optim import SparseAdamW

    loaded = load_quantized_model(qdir)
    engine = SparseEngine(
        loaded, trainable_layers=loaded.spec.moe_layers[-TRAINABLE:], targets=("experts", "attention")
    )
    if grouped == "on":
        for layer in engine.trainable_layers:
            loaded.experts[layer].grouped_deltas = True
    g = torch.Generator().manual_seed(0)
    engine.set_deltas(
        {
            name: torch.randperm(math.prod(w.shape), generator=g)[: max(1, int(FRAC * math.prod(w.shape)))]
            .sort()
            .values
            for name, w in engine.weights.items()
        }
    )
    optimizer = SparseAdamW(engine.parameter_groups(lr=1e-3, router_lr=1e-4, weight_decay=0.0), max_grad_norm=1.0)
    return engine, optimizer, engine.prefix_states(batch[0])


def with_sinks(engine, accumulators, step):
    """Run ``step`` with ``accumulators``' sinks installed (name -> object with ``.sink``); returns its seconds."""
    for name, weight in engine.weights.items():
        if engine.weights[name].delta is not None:
            weight.score_sink = accumulators[name].sink
    try:
        return step()
    finally:
        for weight in engine.weights.values():
            weight.score_sink = None


def measure(qdir: Path, rounds: int, grouped: str = "auto") -> dict:
    from usaf.engine.reselect import collect_scores, reselect

    batch = text_batch(qdir)
    engine, optimizer, states = make_engine(qdir, batch, grouped)
    step = lambda: engine_step(engine, optimizer, batch, states)  # noqa: E731
    for _ in range(2):  # warm-up
        step()
    times: dict[str, list[float]] = {"plain": [], "collecting": [], "collecting_flat_pool": [], "setup": [],
                                     "reselect": []}  # fmt: skip
    grown = []
    for r in range(rounds):
        start = time.perf_counter()
        scores = collect_scores(engine)
        times["setup"].append(time.perf_counter() - start)
        scores.close()  # re-installed around each collecting step below
        flat = {
            name: FlatPoolAccumulator(w.shape, max(w.delta.nnz, 1)) for name, w in engine.weights.items()
            if w.delta is not None
        }  # fmt: skip
        arms = {
            "plain": step,
            "collecting": lambda acc=scores.accumulators: with_sinks(engine, acc, step),
            "collecting_flat_pool": lambda acc=flat: with_sinks(engine, acc, step),
        }
        order = list(arms)
        for j in range(SCORE_BATCHES):
            shift = (r + j) % len(order)
            for name in order[shift:] + order[:shift]:
                times[name].append(arms[name]())
            scores.end_batch()
        start = time.perf_counter()
        report = reselect(engine, optimizer, scores.accumulators, FRACTION)
        times["reselect"].append(time.perf_counter() - start)
        grown.append(report.total.grown)
        print(f"  round {r}: " + "  ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
    counts = engine.trainable_count()
    return {
        "seconds": times,
        **summary(times),
        "delta_entries": counts["delta_entries"],
        "grown_per_reselection": grown,
    }


def summary(times: dict[str, list[float]]) -> dict:
    """Medians and ratios from the per-step seconds; the first collecting step of each cycle fills the pools."""
    med = {name: statistics.median(t) for name, t in times.items()}
    plain = med["plain"]

    def cycle(collecting: float) -> float:
        return (SCORE_BATCHES * (collecting - plain) + med["setup"] + med["reselect"]) / (RESELECT_EVERY * plain)

    collecting = times["collecting"]
    first = collecting[::SCORE_BATCHES]  # each cycle's first: the pools start empty
    later = [t for i, t in enumerate(collecting) if i % SCORE_BATCHES]
    return {
        "median_seconds": med,
        "ratio_collecting_over_plain": med["collecting"] / plain,
        "ratio_first_collecting_over_plain": statistics.median(first) / plain,
        "ratio_later_collecting_over_plain": statistics.median(later) / plain,
        "ratio_collecting_flat_pool_over_plain": med["collecting_flat_pool"] / plain,
        "ratio_reselect_over_plain": med["reselect"] / plain,
        "cycle_overhead_at_reselect_every_50": cycle(med["collecting"]),
        "cycle_overhead_flat_pool_at_reselect_every_50": cycle(med["collecting_flat_pool"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="RigL cycles per shape")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE",
                        help=f"of {list(SHAPES)} [all]")  # fmt: skip
    parser.add_argument("--grouped", choices=("auto", "on"), default="auto",
                        help="trainable experts grouped: the device's choice, or on any device")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS / "reselect.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {
        "benchmark": "reselect",
        "command": "python benchmarks/bench_reselect.py " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "git_commit": git_commit(),
        "workload": {
            "hidden": HIDDEN,
            "layers": LAYERS,
            "trainable_layers": TRAINABLE,
            "frac": FRAC,
            "targets": "experts,attention",
            "microbatch": MICROBATCH,
            "seq": SEQ,
            "score_batches": SCORE_BATCHES,
            "fraction": FRACTION,
            "threads": args.threads,
            "rounds": args.rounds,
            "grouped": args.grouped,
        },  # fmt: skip
        "shapes": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.shapes:
        experts, width, top_k = SHAPES[name]
        print(f"[{name}] {experts} experts of width {width}, top-{top_k}", flush=True)
        with tempfile.TemporaryDirectory(prefix="usaf-bench-reselect-") as tmp:
            qdir = build(Path(tmp), experts, width, top_k)
            shape = {"experts": experts, "width": width, "top_k": top_k, **measure(qdir, args.rounds, args.grouped)}
        result["shapes"][name] = shape
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # partial results survive an interrupted run
        plain = shape["median_seconds"]["plain"]
        print(
            f"[{name}] plain {plain:.3f}s  collecting x{shape['ratio_collecting_over_plain']:.2f}"
            f" (flat pool x{shape['ratio_collecting_flat_pool_over_plain']:.2f})  reselect "
            f"x{shape['ratio_reselect_over_plain']:.2f}  cycle {shape['cycle_overhead_at_reselect_every_50']:.1%} "
            f"(flat pool {shape['cycle_overhead_flat_pool_at_reselect_every_50']:.1%})",
            flush=True,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
