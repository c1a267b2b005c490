"""Benchmark: what keeping the trained weight ``W + D`` merged across steps could save a cached step (upper bound).

On the CPU in fp32 a trainable expert with many tokens runs ``sparse_linear``'s ``"merge"``: it forms ``W + D`` (a copy
of the expert's base and a scatter of its delta) in the forward and again in the backward; one with few tokens adds
gathered terms to ``x W^T``. Keeping every trainable expert's ``W + D`` resident and writing only the delta's entries
after each optimizer step would remove that work. This times the cached step of ``bench_train.py``'s model with every
trainable expert's ``W + D`` formed once before the timing and never updated (so the numbers are wrong: timing only;
``dvalues`` still come from the sampled product) against the real step, on one trainer, in interleaved rounds.

    python benchmarks/bench_merged_weights.py --threads 1 --rounds 6 [--experts 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train  # noqa: E402
from bench_engine import MODEL, RESULTS, machine  # noqa: E402


class _Merged(torch.autograd.Function):
    """``x @ M^T`` with ``M`` precomputed; ``dx = dy @ M``, ``dvalues`` the sampled product at the delta's entries."""

    @staticmethod
    def forward(ctx, x, merged, rows, cols, values):
        ctx.save_for_backward(x, merged, rows, cols)
        return F.linear(x, merged)  # (T, O)

    @staticmethod
    def backward(ctx, dy):
        from usaf.engine.sparse_linear import _sampled_product_csr

        x, merged, rows, cols = ctx.saved_tensors
        return dy @ merged, None, None, None, _sampled_product_csr(dy, x, rows, cols)


def merged_linear(real):
    """``TrainableTensor.linear`` with each expert's ``W + D`` formed on first use and kept (stale afterwards)."""
    from usaf.engine.sparse_linear import _merged_weight

    kept: dict[tuple[int, int], torch.Tensor] = {}

    def linear(self, x, expert, bias=None, *, score=True):
        if self.delta is None or self.score_sink is not None or bias is not None:
            return real(self, x, expert, bias, score=score)
        rows, cols, values = self.delta.expert_entries(expert)
        key = (id(self), expert)
        if key not in kept:
            kept[key] = _merged_weight(self.base(expert, x.device), rows, cols, values.detach(), x.dtype)
        return _Merged.apply(x, kept[key], rows, cols, values)

    return linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, choices=(32, 128), default=32)
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds of 3 timed steps per arm [6]")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from usaf.engine import trainable

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    widths = dict(MODEL)
    if args.experts != 32:
        widths.update(num_experts=args.experts, moe_intermediate_size=3 * widths["hidden_size"] // 8,
                      num_experts_per_tok=8)  # fmt: skip
    real = trainable.TrainableTensor.linear
    merged = merged_linear(real)
    with tempfile.TemporaryDirectory(prefix="usaf-bench-merged-") as tmp:
        work = Path(tmp)
        _, qdir, tdir, plan, _ = bench_train.build(work, widths, bench_train.SEQ, bench_train.CALIB,
                                                  bench_train.PACKAGES)  # fmt: skip
        trainer, _ = bench_train.stage_trainer(qdir, tdir, plan, work / "run")
        for step in range(3):  # warm-up
            bench_train.trainer_step(trainer, step)
        times: dict[str, list[float]] = {"real": [], "merged_kept": []}
        for r in range(args.rounds):
            for arm in ("real", "merged_kept") if r % 2 == 0 else ("merged_kept", "real"):
                trainable.TrainableTensor.linear = merged if arm == "merged_kept" else real
                try:
                    for step in range(3, 6):
                        bench_train.trainer_step(trainer, step)  # settle: the same arm's step first
                        times[arm].append(bench_train.trainer_step(trainer, step))
                finally:
                    trainable.TrainableTensor.linear = real
    med = {arm: statistics.median(v) for arm, v in times.items()}
    result = {
        "machine": machine(),
        "command": " ".join(["python", *sys.argv]),
        "experts": args.experts,
        "threads": args.threads,
        "seconds": times,
        "median_seconds": med,
        "upper_bound_speedup": med["real"] / med["merged_kept"],
    }
    out = args.out or RESULTS / f"merged-weights-e{args.experts}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"cached step: real {med['real']:.4f} s, W + D kept {med['merged_kept']:.4f} s: "
          f"upper bound {result['upper_bound_speedup']:.3f}x; wrote {out}")  # fmt: skip


if __name__ == "__main__":
    main()
