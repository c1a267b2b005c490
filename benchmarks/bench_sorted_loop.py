"""Benchmark: a trainable layer's experts forward with the tokens sorted by expert once, against the per-expert loop
it replaced (each expert searching, gathering, weighting and adding back its own tokens; issue 21, item 1).

Workload: ``bench_train.py``'s model (8 layers, hidden 512, random-init Qwen3-MoE, rtn 4-bit g128) at 32 experts
(width 256, top-4), 64 (width 192, top-8) and 128 (width 192, top-8); the top 2 layers train (experts and attention
at frac 0.005, random positions, and the routers). A cached training step: the loss from the prefix states entering
layer 6 (captured once), its backward and a ``SparseAdamW`` step, one microbatch of 2 x 256 random tokens. The two
arms run on the same engine in alternating rounds (the old loop is this file's copy, patched in); medians.

    python benchmarks/bench_sorted_loop.py [--threads 1] [--rounds 7] [--out benchmarks/results/sorted_loop.json]
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
from bench_engine import MODEL, RESULTS, TOP, VOCAB, machine  # noqa: E402
from bench_train import git_commit  # noqa: E402

SHAPES = {
    "E32": {},
    "E64": {"num_experts": 64, "moe_intermediate_size": 192, "num_experts_per_tok": 8},
    "E128": {"num_experts": 128, "moe_intermediate_size": 192, "num_experts_per_tok": 8},
}
STEPS = 3  # timed steps per arm and round


def per_expert_loop(self, state, hidden_states, top_k_index, top_k_weights):
    """The loop as it was before the sort (commit 8728b27)."""
    from usaf.engine.experts import _expert_output

    out = torch.zeros_like(hidden_states, dtype=torch.float32)
    counts = state.record_load(top_k_index)
    for expert in torch.nonzero(counts).flatten().tolist():
        token_idx, k_pos = torch.where(top_k_index == expert)
        y = _expert_output(self, state, hidden_states[token_idx], expert)
        out.index_add_(0, token_idx, (y * top_k_weights[token_idx, k_pos, None]).float())
    return out


def measure(widths: dict, rounds: int, work: Path) -> dict:
    from usaf.engine import experts
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model
    from usaf.engine.optim import SparseAdamW
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize
    from usaf.testing import build_tiny_model

    kwargs = {k: v for k, v in widths.items() if k != "num_layers"}
    src = build_tiny_model("qwen3_moe", work / "src", num_layers=widths["num_layers"], **kwargs)
    _, qdir = quantize(QuantizeConfig(model=str(src), out=work / "q4", method="rtn"))
    loaded = load_quantized_model(qdir)
    layers = widths["num_layers"]
    engine = SparseEngine(loaded, trainable_layers=list(range(layers - TOP, layers)), targets=("experts", "attention"))
    g = torch.Generator().manual_seed(0)
    selection = {}
    for name, weight in engine.weights.items():
        numel = weight.shape[0] * weight.shape[1] * weight.shape[2]
        selection[name] = torch.randperm(numel, generator=g)[: int(0.005 * numel)].sort().values
    engine.set_deltas(selection)
    optimizer = SparseAdamW(engine.parameter_groups(lr=1e-3, router_lr=1e-4, weight_decay=0.0), max_grad_norm=1.0)
    ids = torch.randint(0, VOCAB, (2, 256), generator=g)
    states = engine.prefix_states(ids)

    def step() -> None:
        optimizer.zero_grad()
        engine.loss(ids, ids, prefix_states=states).loss.backward()
        optimizer.step()

    sorted_loop = experts._sorted_loop
    arms = {"sorted": sorted_loop, "per_expert": per_expert_loop}
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for arm in arms:  # warm-up
        experts._sorted_loop = arms[arm]
        step()
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else reversed(arms):
            experts._sorted_loop = arms[arm]
            start = time.perf_counter()
            for _ in range(STEPS):
                step()
            times[arm].append((time.perf_counter() - start) / STEPS)
    experts._sorted_loop = sorted_loop
    med = {arm: statistics.median(v) for arm, v in times.items()}
    return {"median_step_seconds": med, "speedup": med["per_expert"] / med["sorted"], "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS / "sorted_loop.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"machine": machine(), "commit": git_commit(), "command": " ".join(["python", *sys.argv]), "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="usaf-bench-sorted-") as tmp:
        for name, extra in SHAPES.items():
            widths = {**MODEL, **extra}
            result["shapes"][name] = {"model": widths, **measure(widths, args.rounds, Path(tmp) / name)}
            s = result["shapes"][name]
            print(f"[{name}] sorted {s['median_step_seconds']['sorted']:.3f}s, per-expert "
                  f"{s['median_step_seconds']['per_expert']:.3f}s: {s['speedup']:.2f}x", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
