"""Profile: where ``usaf score``'s fixed cost goes on the one-epoch benchmark's workload (issue 21, one-epoch goal).

``bench_epoch.py``'s model and data at 32 or 128 experts, score at its defaults (microbatch 2, as there), 1 thread:
one run to warm up, one under cProfile (the calibration pass, the lr test, the score sinks inside the
calibration's backward, the saves of the finished work that let an interrupted score resume), and the calibration
pass again under torch.profiler (its operators' self time: how much of it is matrix products). Seconds of a
profiled run are longer than unprofiled ones; the shares are what compares.

    python benchmarks/profile_score.py [--experts 32] [--out benchmarks/results/profile-score-e32.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import MODEL, RESULTS, TOP, machine  # noqa: E402
from bench_epoch import SHAPES, prepare  # noqa: E402
from bench_train import MICROBATCH, PACKAGES, git_commit  # noqa: E402

# (what, the function's file suffix and name in cProfile's table)
PARTS = {
    "calibration": ("usaf/engine/engine.py", "_dense_scores"),
    "lr_test": ("usaf/stages/lr_test.py", "run_lr_test"),
    "score_sinks": ("usaf/engine/score_sinks.py", "add"),
    "saving_for_resume": ("usaf/stages/score_resume.py", "_save"),  # the pass's end and each probe's
}


def cumulative(stats: pstats.Stats, file_suffix: str, name: str) -> float:
    """Seconds spent in ``name`` of the file ending ``file_suffix``, callees included (0 when not called)."""
    return sum(row[3] for (file, _, func), row in stats.stats.items() if func == name and file.endswith(file_suffix))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, choices=(32, 128), default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from usaf.engine import engine as engine_module
    from usaf.stages.progress import NullProgress
    from usaf.stages.score import ScoreConfig
    from usaf.stages.score import run as score

    name = f"E{args.experts}"
    widths = {**MODEL, **SHAPES[name]}
    work = Path(tempfile.mkdtemp(prefix="profile-score-"))
    _, qdir, tdir = prepare(work, widths, tuple(PACKAGES))

    def run(i: int) -> float:
        config = ScoreConfig(model=qdir, data=tdir, out=work / f"plan{i}", microbatch=MICROBATCH,
                             train_from=widths["num_layers"] - TOP, device="cpu")  # fmt: skip
        start = time.perf_counter()
        score(config, progress=NullProgress())
        return time.perf_counter() - start

    warm = run(0)
    profiler = cProfile.Profile()
    profiler.enable()
    profiled = run(1)
    profiler.disable()
    stats = pstats.Stats(profiler)
    parts = {what: cumulative(stats, *where) for what, where in PARTS.items()}

    engine_class = engine_module.SparseEngine
    real = engine_class._dense_scores
    ops: dict[str, float] = {}

    def traced(self, *a, **k):
        with torch.profiler.profile() as trace:
            result = real(self, *a, **k)
        for event in trace.key_averages():
            ops[event.key] = ops.get(event.key, 0.0) + event.self_cpu_time_total / 1e6
        return result

    engine_class._dense_scores = traced
    try:
        run(2)
    finally:
        engine_class._dense_scores = real
    total = sum(ops.values())
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:12])
    result = {
        "benchmark": "profile_score",
        "commit": git_commit(),
        "machine": machine(),
        "shape": name,
        "widths": widths,
        "score_seconds": warm,
        "profiled_seconds": profiled,
        "profiled_parts_seconds": parts,
        "calibration_ops_self_seconds": top,
        "calibration_mm_share": ops.get("aten::mm", 0.0) / total if total else None,
    }
    out = args.out or RESULTS / f"profile-score-e{args.experts}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"score {warm:.1f} s; profiled {profiled:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()))
    print(f"calibration: aten::mm {100 * result['calibration_mm_share']:.0f} % of operator self time -> {out}")


if __name__ == "__main__":
    main()
