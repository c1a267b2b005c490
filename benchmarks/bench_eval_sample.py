"""Benchmark: how large a sample of a training split ``usaf eval`` needs, on two domains.

Without ``--data``/``--held-out`` eval evaluates the tokens the run trained on. Their training split is the bulk of a
user's data (tens of millions of tokens on a real repository), evaluated twice (base and fine-tuned) to report how
well the run fits text it has seen: hours on a consumer GPU, and its per-token routing sets in RAM. This measures
what a seeded random sample of N of those sequences gives instead, against the whole split, so the default sample
size has a figure behind it.

Workload, per domain (``usaf.demo.DEMO_DOMAIN``: stdlib network, mail and markup Python; ``usaf.demo.CPP_DOMAIN``:
PyTorch's C++ headers): the demo's pipeline through the stage functions (the packaged demo model, ``usaf tokenize``
at 256 tokens per sequence with the domain's held-out sources, ``usaf quantize``, ``usaf score --cache
--no-stability``, ``usaf train --steps 150``), then ``usaf eval`` of the *whole* training and held-out splits. The
per-sequence NLL of both passes is read from eval's own outcome (``stages.eval._evaluate``, wrapped), then, for each
sample size N, ``--draws`` seeded samples of N training sequences without replacement, each summarised the way the
report does (``stats.bootstrap_row``, 1000 resamples): the half-width of its 95 % intervals (base PPL, relative to
the PPL; Δ PPL, relative to the whole split's |Δ PPL|), how far its point estimates lie from the whole split's, and
how often its intervals hold the whole split's value (coverage).

    python benchmarks/bench_eval_sample.py [--draws 200] [--threads 2] [--out benchmarks/results/eval_sample.json]
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
from bench_engine import RESULTS, machine  # noqa: E402

import usaf.stages.eval as eval_stage  # noqa: E402
from usaf.demo import CPP_DOMAIN, DEMO_DOMAIN, demo_model_dir  # noqa: E402
from usaf.settings.eval import EvalConfig  # noqa: E402
from usaf.settings.quantize import QuantizeConfig  # noqa: E402
from usaf.settings.score import ScoreConfig  # noqa: E402
from usaf.settings.tokenize import TokenizeConfig  # noqa: E402
from usaf.settings.train import TrainConfig  # noqa: E402
from usaf.stages import quantize, score, tokenize, train  # noqa: E402
from usaf.stages.eval.inputs import DATA, HELD_OUT  # noqa: E402
from usaf.stages.eval.stats import bootstrap_row, ppl  # noqa: E402

SEQ_LEN, STEPS = 256, 150  # usaf demo's
SIZES = (64, 128, 256, 512, 1024, 2048)


def _pipeline(domain, work: Path, quantized: Path) -> dict:
    """Tokenize, score, train and evaluate whole splits; the per-sequence results of both passes, per set."""
    tokens = work / "tokens"
    tokenize.run(TokenizeConfig(**domain.tokenize_options(), model=str(demo_model_dir()), seq_len=SEQ_LEN, out=tokens))
    plan, run = work / "plan", work / "run"
    score.run(ScoreConfig(model=quantized, data=tokens, cache=True, stability=False, out=plan))
    train.run(TrainConfig(model=quantized, data=tokens, plan=plan, steps=STEPS, out=run))
    kept = {}
    evaluate = eval_stage._evaluate

    def keeping(*args, **kwargs):  # the per-sequence results the report aggregates
        kept["outcome"] = evaluate(*args, **kwargs)
        return kept["outcome"]

    eval_stage._evaluate = keeping
    start = time.perf_counter()
    try:
        eval_stage.run(EvalConfig(model=quantized, checkpoint=run, data=[tokens], held_out=[tokens],
                                  out=work / "eval", workspace=work, plots=False))  # fmt: skip
    finally:
        eval_stage._evaluate = evaluate
    seconds = time.perf_counter() - start
    o = kept["outcome"]
    sets = torch.tensor([s.set == DATA for s in o.sequences])
    per_set = {}
    for name, chosen in ((DATA, sets), (HELD_OUT, ~sets)):
        scored = chosen & (o.base.tokens > 0)
        per_set[name] = (o.base.nll[scored], o.tuned.nll[scored], o.base.tokens[scored])
    return {"sets": per_set, "eval_seconds": seconds, "sequences": len(o.sequences),
            "input_tokens": o.base.input_tokens}  # fmt: skip


def _summary(base: torch.Tensor, tuned: torch.Tensor, tokens: torch.Tensor) -> dict:
    row = bootstrap_row(base, tuned, tokens, samples=1000, seed=0)
    return {"base_ppl": ppl(row.base_nll), "base_ppl_ci": [ppl(row.base_ci[0]), ppl(row.base_ci[1])],
            "delta_ppl": ppl(row.tuned_nll) - ppl(row.base_nll), "delta_ppl_ci": list(row.delta_ppl_ci),
            "sequences": row.sequences, "tokens": row.tokens}  # fmt: skip


def _samples(whole: tuple, full: dict, sizes, draws: int) -> list[dict]:
    base, tuned, tokens = whole
    n = base.numel()
    out = []
    for size in sizes:
        if size >= n:
            continue
        generator = torch.Generator().manual_seed(size)
        widths_base, widths_delta, errors_base, errors_delta, held_base, held_delta = [], [], [], [], 0, 0
        for _ in range(draws):
            pick = torch.randperm(n, generator=generator)[:size]
            s = _summary(base[pick], tuned[pick], tokens[pick])
            lo, hi = s["base_ppl_ci"]
            widths_base.append((hi - lo) / 2 / s["base_ppl"])
            held_base += lo <= full["base_ppl"] <= hi
            dlo, dhi = s["delta_ppl_ci"]
            widths_delta.append((dhi - dlo) / 2 / abs(full["delta_ppl"]))
            held_delta += dlo <= full["delta_ppl"] <= dhi
            errors_base.append(abs(s["base_ppl"] - full["base_ppl"]) / full["base_ppl"])
            errors_delta.append(abs(s["delta_ppl"] - full["delta_ppl"]) / abs(full["delta_ppl"]))
        out.append({
            "sequences": size,
            "base_ppl_halfwidth_rel": statistics.median(widths_base),
            "delta_ppl_halfwidth_rel_to_whole_delta": statistics.median(widths_delta),
            "base_ppl_error_rel_median": statistics.median(errors_base),
            "base_ppl_error_rel_p95": sorted(errors_base)[math.ceil(0.95 * draws) - 1],
            "delta_ppl_error_rel_median": statistics.median(errors_delta),
            "delta_ppl_error_rel_p95": sorted(errors_delta)[math.ceil(0.95 * draws) - 1],
            "coverage_base": held_base / draws,
            "coverage_delta": held_delta / draws,
        })  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=200, help="samples per size")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "eval_sample.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {"machine": machine(), "threads": args.threads, "draws": args.draws, "domains": {}}
    with tempfile.TemporaryDirectory(prefix="usaf-eval-sample-") as tmp:
        quantized = Path(tmp) / "quantized"
        quantize.run(QuantizeConfig(model=str(demo_model_dir()), out=quantized))
        for domain in (DEMO_DOMAIN, CPP_DOMAIN):
            got = _pipeline(domain, Path(tmp) / domain.name, quantized)
            record = {"eval_seconds_whole": got["eval_seconds"], "sequences_whole": got["sequences"],
                      "input_tokens_whole": got["input_tokens"]}  # fmt: skip
            for name, whole in got["sets"].items():
                full = _summary(*whole)
                record[name] = {"whole": full, "samples": _samples(whole, full, SIZES, args.draws) if name == DATA
                                else []}  # fmt: skip
            results["domains"][domain.name] = record
            print(json.dumps({domain.name: record}, indent=1), flush=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
