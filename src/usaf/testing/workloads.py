"""A ready-to-train workload: a random MoE, quantized, random token sequences, and a usaf score plan.

Used to run the real ``usaf quantize``/``score``/``train`` in fresh processes and compare their peak
memory with ``usaf plan``'s prediction (``tests/test_memory_plan.py``, ``benchmarks/bench_plan.py``).
Nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from usaf.stages import score
from usaf.stages.quantize import QuantizeConfig
from usaf.stages.quantize import run as quantize
from usaf.testing.models import TINY_VOCAB, build_tiny_model


@dataclass(frozen=True)
class Workload:
    model: Path  # the usaf quantize output
    data: Path  # tokens JSONL
    plan: Path  # the usaf score output
    samples: int
    seq_len: int
    train_from: int
    frac: float


def write_tokens(path: Path, *, samples: int, seq_len: int, seed: int = 0) -> Path:
    """``samples`` random sequences of ``seq_len`` ids of the tiny tokenizer's vocabulary, labels = ids."""
    rng = random.Random(seed)
    with Path(path).open("w", encoding="utf-8") as f:
        for _ in range(samples):
            ids = [rng.randrange(1, TINY_VOCAB) for _ in range(seq_len)]
            f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
    return Path(path)


def build_workload(
    root: Path,
    *,
    widths: dict[str, Any],
    num_layers: int,
    samples: int,
    seq_len: int,
    train_from: int,
    frac: float = 0.005,
    family: str = "qwen3_moe",
    seed: int = 0,
) -> Workload:
    """In-process: build, quantize (RTN 4-bit, group 128), write ``samples`` sequences, score a plan."""
    root = Path(root)
    source = build_tiny_model(family, root / "source", num_layers=num_layers, seed=seed, **widths)
    _, model = quantize(QuantizeConfig(model=str(source), out=root / "quantized", method="rtn"))
    data = write_tokens(root / "train.jsonl", samples=samples, seq_len=seq_len, seed=seed)
    settings = score.ScoreConfig(
        model=model,
        data=data,
        out=root / "plan",
        frac=frac,
        train_from=train_from,
        calib_samples=min(samples, 8),
        microbatch=2,
        stability=False,
        # no prefix states kept: train computes every one, as a run on more data than the sample does (the run usaf
        # plan sizes; with every state in the plan, train would never dequantize its frozen layers)
        cache=False,
        device="cpu",
    )
    _, plan = score.run(settings)
    return Workload(model, data, plan, samples, seq_len, train_from, frac)


def quantize_command(source: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "usaf",
        "quantize",
        str(source),
        "--out",
        str(out),
        "--method",
        "rtn",
        "--device",
        "cpu",
    ]


def score_command(model: Path, data: Path, out: Path, *, train_from: int, samples: int, microbatch: int) -> list[str]:
    """``usaf score`` with its defaults (stability on, candidates factor 4), on CPU."""
    return [
        sys.executable,
        "-m",
        "usaf",
        "score",
        "--model",
        str(model),
        "--data",
        str(data),
        "--out",
        str(out),
        "--train-from",
        str(train_from),
        "--calib-samples",
        str(samples),
        "--microbatch",
        str(microbatch),
        "--device",
        "cpu",
    ]


def train_command(work: Workload, out: Path, *, microbatch: int, steps: int, reselect_every: int) -> list[str]:
    """The ``usaf train`` command line of ``work`` (CPU, fp32, no intermediate checkpoints)."""
    return [
        sys.executable,
        "-m",
        "usaf",
        "train",
        "--model",
        str(work.model),
        "--plan",
        str(work.plan),
        "--data",
        str(work.data),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--microbatch",
        str(microbatch),
        "--seq-len",
        str(work.seq_len),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--reselect-every",
        str(reselect_every),
        "--save-every",
        "0",
    ]
