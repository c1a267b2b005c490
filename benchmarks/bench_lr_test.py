"""Benchmark: does ``usaf score``'s lr test land near the best swept lr on both evidence domains (issue 20)?

Workload: the packaged demo model (``usaf.demo.demo_model_dir()``), quantized once (HQQ 4-bit, the defaults), and
both evidence domains tokenized as ``bench_evidence.py`` does (``stdlib-net``: the demo's network/mail modules;
``torch-cpp``: torch's C++ headers, a much larger shift). For each domain and seeds 0, 1, 2: ``usaf score`` through
its stage function as ``bench_evidence.py`` runs it (frac 0.005, or ``--fracs``; 64 calibration sequences; the
prefix store at score's default, ``--cache`` before the lr test's length was measured: the test reads the same
states either way), with the lr test on (its defaults). Recorded per run: the chosen lr, the probes' held-back
losses, the test's seconds and steps, score's total seconds; and the ratio of the chosen lr to that domain's best
swept lr (seed 0, validation PPL, 250 steps, the evidence arm of that frac: ``benchmarks/results/evidence.json`` for
stdlib-net, ``evidence-torch-cpp.json`` for torch-cpp, read from ``--cpp-results`` or, while that sweep runs, its
log ``--cpp-log``).

``--defaults`` runs score as the evidence benchmark's ``usaf_defaults_attention`` arm does instead (the share rule's
frac, experts + attention, no swept reference); ``--model`` another source model (``benchmarks/models/evidence-large``,
``evidence-shared``); ``--lr-test-steps`` other probe lengths than score's default (what a shorter test would choose).

    python benchmarks/bench_lr_test.py [--seeds 0 1 2] [--fracs 0.005] [--defaults] [--model DIR]
                                       [--lr-test-steps N] [--threads 1] [--out benchmarks/results/lr_test.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import RESULTS, machine  # noqa: E402
from bench_evidence import SEQ, domains  # noqa: E402
from bench_train import git_commit  # noqa: E402

ARMS = {0.005: "usaf", 0.02: "usaf_frac_large", 0.05: "usaf_frac_0.05", 0.1: "usaf_frac_0.1"}  # frac -> swept arm
CALIB = 64  # the evidence benchmark's calibration sample
EVIDENCE = {"stdlib-net": RESULTS / "evidence.json", "torch-cpp": RESULTS / "evidence-torch-cpp.json"}


def setup(work: Path, model: Path | None = None) -> dict:
    """Both domains tokenized for ``model`` (default: the demo model), the model quantized once."""
    from usaf.demo import demo_model_dir
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize
    from usaf.stages.tokenize import TokenizeConfig
    from usaf.stages.tokenize import run as tokenize

    src = model or demo_model_dir()
    tokens = {}
    for name, domain in domains().items():
        _, tokens[name] = tokenize(
            TokenizeConfig(**domain.tokenize_options(), model=str(src), seq_len=SEQ, out=work / f"tokens-{name}")
        )
    _, qdir = quantize(QuantizeConfig(model=str(src), out=work / "q4", device="cpu"))
    return {"qdir": qdir, "tokens": tokens}


def score_once(
    env: dict, work: Path, domain: str, seed: int, frac: float | None, steps: int | None, targets: str | None
) -> dict:
    """``usaf score`` with its lr test; ``frac`` None: the share rule; ``steps`` None: the test's default length."""
    from usaf.stages.score import ScoreConfig
    from usaf.stages.score import run as score

    start = time.perf_counter()
    manifest, _ = score(
        ScoreConfig(model=env["qdir"], data=env["tokens"][domain], out=work / f"plan-{domain}-{seed}-{frac}", frac=frac,
                    seed=seed, calib_samples=CALIB, device="cpu", targets=targets, lr_test_steps=steps)
    )  # fmt: skip
    wall = time.perf_counter() - start
    t = manifest.summary.lr_test
    print(f"[{domain} frac {frac} seed {seed}] lr {t.lr:g}: losses {t.heldout_losses} (base {t.base_loss:.4f}); "
          f"test {t.seconds:.1f}s / score {wall:.1f}s", flush=True)  # fmt: skip
    return {"domain": domain, "frac": frac, "seed": seed, **t.model_dump(mode="json"), "score_seconds": wall}


def best_swept(domain: str, frac: float, cpp_results: Path, cpp_log: Path) -> dict | None:
    """The evidence sweep's best lr of the usaf arm at ``frac`` (seed 0, lowest validation PPL), PPL per lr."""
    arm = ARMS[frac]
    path = cpp_results if domain == "torch-cpp" else EVIDENCE[domain]
    if path.is_file():
        data = json.loads(path.read_text())
        if arm in data.get("sweep", {}):
            ppl = {float(lr): v["ppl_validation"] for lr, v in data["sweep"][arm].items()}
            return {"lr": min(ppl, key=ppl.get), "validation_ppl": ppl, "source": str(path)}
    if domain == "torch-cpp" and cpp_log.is_file():  # the sweep is still running: its log's finished runs
        ppl = {}
        for m in re.finditer(rf"\[{re.escape(arm)} lr (\S+) seed 0\].*?val ([0-9.]+)", cpp_log.read_text()):
            ppl[float(m.group(1))] = float(m.group(2))
        if ppl:
            return {"lr": min(ppl, key=ppl.get), "validation_ppl": ppl, "source": f"{cpp_log} (partial)"}
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--domains", nargs="+", default=list(EVIDENCE))
    parser.add_argument("--fracs", type=float, nargs="+", choices=list(ARMS), help="[0.005]; not with --defaults")
    parser.add_argument("--cpp-results", type=Path, default=EVIDENCE["torch-cpp"])
    parser.add_argument("--cpp-log", type=Path, default=Path("/tmp/bench/cpp.log"))
    parser.add_argument("--defaults", action="store_true", help="the share rule's frac, experts + attention")
    parser.add_argument("--model", type=Path, help="the source model (default: the demo model)")
    parser.add_argument("--lr-test-steps", type=int, help="steps per probe (default: score's)")
    parser.add_argument("--out", type=Path, default=RESULTS / "lr_test.json")
    args = parser.parse_args()
    if args.defaults and args.fracs:
        parser.error("--defaults scores at the share rule's frac: drop --fracs")
    fracs, targets = ([None], "experts,attention") if args.defaults else (args.fracs or [0.005], None)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env = setup(work, args.model)
        runs = [
            score_once(env, work, d, s, f, args.lr_test_steps, targets)
            for f in fracs
            for d in args.domains
            for s in args.seeds
        ]
    summary = {}
    for domain, frac in ((d, f) for f in fracs for d in args.domains):
        best = None if frac is None else best_swept(domain, frac, args.cpp_results, args.cpp_log)
        mine = [r for r in runs if r["domain"] == domain and r["frac"] == frac]
        key = domain if frac in (0.005, None) else f"{domain} frac {frac:g}"
        summary[key] = {
            "best_swept": best,
            "chosen": {r["seed"]: r["lr"] for r in mine},
            "ratio_to_best": {r["seed"]: r["lr"] / best["lr"] for r in mine} if best else None,
            "test_seconds": [r["seconds"] for r in mine],
            "score_seconds": [r["score_seconds"] for r in mine],
        }
        print(f"[{key}] chosen {summary[key]['chosen']}, best swept {best and best['lr']}", flush=True)
    result = {
        "machine": machine(),
        "usaf_commit": git_commit(),
        "command": "python benchmarks/bench_lr_test.py " + " ".join(sys.argv[1:]),
        "threads": args.threads,
        "settings": {
            "fracs": fracs,
            "targets": targets,
            "model": str(args.model or "demo"),
            "lr_test_steps": args.lr_test_steps,
            "calib_samples": CALIB,
            "seq_len": SEQ,
            "cache": "the sample's (score's default; --cache before this commit)",
        },
        "runs": runs,
        "summary": summary,
        "total_seconds": time.perf_counter() - start,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
