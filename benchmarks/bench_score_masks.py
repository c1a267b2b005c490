"""Benchmark: how close ``usaf score``'s pooled masks come to the exact top-k, expert by expert and grouped.

Score streams each trainable tensor's statistic into a pool of ``4 × k`` candidates (``engine/scores.py``); a CPU
adds it one expert slice at a time, a CUDA device a block of experts at once (``engine/grouped_deltas.py``,
``ScoreAccumulator.add_block``: the block shares one admission floor and one cut, so its masks may differ from the
loop's). This measures both against the exact masks, on real text at the shapes of ``bench_epoch.py``:

- **exact**: ``usaf score --full-maps`` (a dense accumulator: the true top-k and every weight's total statistic);
- **loop**: score at its defaults on the CPU (one add per expert slice);
- **grouped**: the same with the grouped trainable path switched on for the CPU (``LayerExperts.grouped_deltas``,
  what ``Capabilities.dense_delta_terms`` turns on for CUDA), the path a GPU's score takes.

With ``--dtypes bfloat16 float16``, also score computing in those dtypes on the CPU (the backend's policy replaced,
as a GPU's is: bf16 where native, else fp16, which score runs without loss scaling), against the same fp32 exact.

Per tensor: the share of the exact top-k each pooled mask keeps (``overlap``), the share of the exact top-k's total
statistic it captures (``captured``: the sum of the true totals of its entries over the exact top-k's sum), and the
entries the loop's and the grouped masks do not share (``symmetric_difference``). Score runs without stability
halves, lr test or prefix store (none of them changes the masks); seed 0, 64 calibration sequences, microbatch 4, 1
thread.

    python benchmarks/bench_score_masks.py [--experts 32 128] [--packages json tomllib] [--dtypes bfloat16 float16]
                                           [--out benchmarks/results/score-masks.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import MODEL, RESULTS, TOP, machine  # noqa: E402
from bench_epoch import SHAPES, prepare  # noqa: E402
from bench_train import PACKAGES, git_commit  # noqa: E402


@contextmanager
def grouped_on_cpu(on: bool):
    """Every engine built inside takes the grouped trainable path (``on``), as a CUDA device's does."""
    from usaf.engine.experts import LayerExperts

    real = LayerExperts.set_capabilities

    def forced(self, caps) -> None:
        real(self, caps)
        self.grouped_deltas = True

    LayerExperts.set_capabilities = forced if on else real
    try:
        yield
    finally:
        LayerExperts.set_capabilities = real


@contextmanager
def computing_in(dtype: str | None):
    """Every score run inside computes in ``dtype`` (None: the backend's own), its policy replaced as a GPU's is."""
    import dataclasses

    from usaf.stages import score

    real = score.resolve_backend

    def replaced(*args, **kwargs):
        backend = real(*args, **kwargs)
        backend.policy = dataclasses.replace(backend.policy, compute=getattr(torch, dtype))
        return backend

    score.resolve_backend = replaced if dtype is not None else real
    try:
        yield
    finally:
        score.resolve_backend = real


def masks(
    qdir: Path, tdir: Path, out: Path, layers: int, *, full_maps: bool = False, grouped: bool = False,
    dtype: str | None = None,
):  # fmt: skip
    """``usaf score`` once; its masks (name -> flat indices), its full maps where asked, and its seconds."""
    from safetensors.torch import load_file

    from usaf.artifacts.loader import load_manifest
    from usaf.artifacts.plan import FULL_MAPS_FILE, PlanManifest, read_masks
    from usaf.stages.score import ScoreConfig
    from usaf.stages.score import run as score

    start = time.perf_counter()
    with grouped_on_cpu(grouped), computing_in(dtype):
        score(ScoreConfig(model=qdir, data=tdir, out=out, train_from=layers - TOP, full_maps=full_maps,
                          stability=False, lr_test=False, cache=False, device="cpu"))  # fmt: skip
    seconds = time.perf_counter() - start
    selected = read_masks(out, load_manifest(out, PlanManifest))
    maps = load_file(str(out / FULL_MAPS_FILE)) if full_maps else None
    return selected, maps, seconds


def compare(exact: dict, maps: dict, arms: dict[str, dict]) -> dict:
    """Per tensor: each arm's overlap with the exact top-k and the share of its statistic captured."""
    rows = {}
    for name, best in exact.items():
        true = maps[name].reshape(-1)  # (E*O*I,) each weight's total statistic
        best_sum = float(true[best].sum())
        row = {"k": best.numel()}
        for arm, selected in arms.items():
            mine = selected[name]
            row[f"{arm}_overlap"] = len(set(mine.tolist()) & set(best.tolist())) / best.numel()
            row[f"{arm}_captured"] = float(true[mine].sum()) / best_sum
        row["symmetric_difference"] = len(set(arms["loop"][name].tolist()) ^ set(arms["grouped"][name].tolist()))
        rows[name] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[32, 128], choices=[32, 128])
    parser.add_argument("--packages", nargs="+", default=list(PACKAGES))
    parser.add_argument("--dtypes", nargs="*", default=[], choices=["bfloat16", "float16"],
                        help="also score computing in these dtypes (against the same fp32 exact masks)")
    parser.add_argument("--out", type=Path, default=RESULTS / "score-masks.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {"machine": machine(), "usaf_commit": git_commit(), "command": " ".join(["python", *sys.argv]),
              "packages": args.packages, "shapes": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="usaf-bench-masks-") as tmp:
        for name, extra in SHAPES.items():
            if int(name[1:]) not in args.experts:
                continue
            widths = {**MODEL, **extra}
            work = Path(tmp) / name
            _, qdir, tdir = prepare(work, widths, tuple(args.packages))
            layers = widths["num_layers"]
            exact, maps, exact_s = masks(qdir, tdir, work / "exact", layers, full_maps=True)
            loop, _, loop_s = masks(qdir, tdir, work / "loop", layers)
            grouped, _, grouped_s = masks(qdir, tdir, work / "grouped", layers, grouped=True)
            arms, seconds = {"loop": loop, "grouped": grouped}, {"exact": exact_s, "loop": loop_s, "grouped": grouped_s}
            for dtype in args.dtypes:
                arms[dtype], _, seconds[dtype] = masks(qdir, tdir, work / dtype, layers, dtype=dtype)
            rows = compare(exact, maps, arms)
            result["shapes"][name] = {"model": widths, "tensors": rows, "seconds": seconds}
            for tensor, row in rows.items():
                print(
                    f"[{name}] {tensor}: k {row['k']}, overlap loop {row['loop_overlap']:.3f} grouped "
                    f"{row['grouped_overlap']:.3f}; captured loop {row['loop_captured']:.4f} grouped "
                    f"{row['grouped_captured']:.4f}; loop vs grouped {row['symmetric_difference']}"
                    + "".join(f"; {d} overlap {row[f'{d}_overlap']:.3f} captured {row[f'{d}_captured']:.4f}"
                              for d in args.dtypes),
                    flush=True,
                )  # fmt: skip
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
