"""Benchmark: ``usaf score``'s lr test computing in fp16 and bf16 against fp32, on two domains.

A GPU's score computes in its policy's dtype: bf16 where native, else fp16 (DirectML, older cards), which train
runs with dynamic loss scaling and score's lr test without: its probes take plain fp16 steps, whose small
gradients may underflow. This measures what that does to the test a user's run takes its lr from: the held-back
loss of every probe and the lr chosen, fp32 against each dtype, score as ``usaf demo`` runs it (the packaged demo
model, 256 tokens a sequence, no stability halves, no prefix store), its backend's policy replaced as a GPU's is
(``bench_score_masks.computing_in``). Domains: ``usaf.demo.DEMO_DOMAIN`` and ``CPP_DOMAIN``. 1 thread (fp16 and
bf16 matrix products on a CPU are slow: about 8x fp32's).

    python benchmarks/bench_lr_test_dtypes.py [--dtypes float16 bfloat16] [--out benchmarks/results/lr-test-dtypes.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import RESULTS, machine  # noqa: E402
from bench_score_masks import computing_in  # noqa: E402

from usaf.demo import CPP_DOMAIN, DEMO_DOMAIN, demo_model_dir  # noqa: E402
from usaf.settings.quantize import QuantizeConfig  # noqa: E402
from usaf.settings.score import ScoreConfig  # noqa: E402
from usaf.settings.tokenize import TokenizeConfig  # noqa: E402
from usaf.stages import quantize, score, tokenize  # noqa: E402

SEQ_LEN = 256  # usaf demo's


def lr_test(quantized: Path, tokens: Path, out: Path, dtype: str) -> dict:
    start = time.perf_counter()
    with computing_in(None if dtype == "float32" else dtype):
        manifest, _ = score.run(ScoreConfig(model=quantized, data=tokens, out=out, stability=False, cache=False,
                                            device="cpu"))  # fmt: skip
    record = manifest.summary.lr_test
    return {"lr": record.lr, "candidates": record.candidates, "heldout_losses": record.heldout_losses,
            "base_loss": record.base_loss, "probes_run": record.probes_run,
            "seconds": time.perf_counter() - start}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"], choices=["float16", "bfloat16"])
    parser.add_argument("--out", type=Path, default=RESULTS / "lr-test-dtypes.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {"machine": machine(), "threads": 1, "domains": {}}
    with tempfile.TemporaryDirectory(prefix="usaf-lr-dtypes-") as tmp:
        quantized = Path(tmp) / "quantized"
        quantize.run(QuantizeConfig(model=str(demo_model_dir()), out=quantized))
        for domain in (DEMO_DOMAIN, CPP_DOMAIN):
            tokens = Path(tmp) / domain.name / "tokens"
            tokenize.run(TokenizeConfig(**domain.tokenize_options(), model=str(demo_model_dir()), seq_len=SEQ_LEN,
                                        out=tokens))  # fmt: skip
            arms = {}
            for dtype in ("float32", *args.dtypes):
                arms[dtype] = lr_test(quantized, tokens, Path(tmp) / domain.name / dtype, dtype)
                print(domain.name, dtype, json.dumps(arms[dtype]), flush=True)
            results["domains"][domain.name] = arms
    args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
