"""Benchmark: `usaf eval`'s forward passes versus a plain transformers forward of the same dequantized model.

Workload: the CPU-sized MoE of ``bench_engine.py`` (random-init Qwen3-MoE, 8 layers, hidden 512, 32 experts,
top-4, expert width 256, vocab 512), fp32, quantized by ``usaf.stages.quantize.run(method="rtn")`` (4-bit,
group 128). Data: 32 sequences of 256 seeded random token ids (labels = ids), microbatch 8 (``usaf eval``'s
default), so each arm runs 4 forwards over 8,192 tokens. Every arm computes the same per-sequence NLL
(``usaf.stages.eval.passes.sequence_nll``); they differ in the model and what runs around the forward:

- **usaf_base**: ``run_pass`` on ``load_quantized_model``'s model, exactly the base pass of ``usaf eval`` with
  its default here: every expert dequantized once (``make_resident``, it fits), routing capture of every layer.
- **usaf_streaming**: the same with ``--streaming``: the 4-bit experts that got tokens are dequantized in every
  forward (the memory-saving mode a model too large for resident experts uses).
- **usaf_tuned**: ``run_pass`` on a third loaded model inside a ``SparseEngine`` whose top 2 layers carry a
  sparse delta (frac 0.005, seeded random positions, random values) and perturbed routers: the fine-tuned
  pass (experts resident, as the stage does it here).
- **transformers**: ``AutoModelForCausalLM.from_pretrained`` of the unquantized source with every expert
  tensor replaced by its dequantization (the same weights ``usaf_base`` computes with), transformers'
  default experts implementation, plain ``model(input_ids, attention_mask)`` + the same NLL loop.
- **transformers_eager**: the same with ``experts_implementation="eager"``.

Arms run interleaved (A B C D E, then E D C B A), after one warm-up each; medians of ``--repeats``;
tokens/s = 8,192 / median seconds. Also the whole stage once (``usaf.stages.eval.run``: base and tuned passes
on a tokens JSONL of the same sequences, bootstrap 1000, report) to show what the rest of the command costs.
Each arm's CPU time is recorded too: on the shared 2-core machine, 2-thread torch runs slow down erratically
while other processes run, small-op code (usaf's per-expert loop) far more than large-op code; ``--threads 1``
gives steadier ratios.

    python benchmarks/bench_eval.py [--repeats 5] [--threads N] [--quick] [--out benchmarks/results/eval.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import MODEL, MODEL_QUICK, RESULTS, VOCAB, machine, random_positions  # noqa: E402

from usaf.backends import resolve_backend  # noqa: E402
from usaf.engine.engine import SparseEngine, budget  # noqa: E402
from usaf.engine.loading import load_quantized_model  # noqa: E402
from usaf.stages.engine_setup import make_resident  # noqa: E402
from usaf.stages.eval.inputs import EvalSequence  # noqa: E402
from usaf.stages.eval.passes import batch_hidden, batches_of, run_pass, sequence_nll  # noqa: E402
from usaf.stages.progress import NullProgress  # noqa: E402

SEQUENCES, SEQ, SEQ_QUICK = 32, 256, 64
MICROBATCH = 8  # usaf eval's default
FRAC, TOP = 0.005, 2
CPU = resolve_backend("cpu")


def build_and_quantize(work: Path, widths: dict) -> tuple[Path, Path, dict]:
    """As ``bench_engine.build_and_quantize``, with the tiny tokenizer (the stage reads it)."""
    from usaf.stages.quantize import QuantizeConfig, run
    from usaf.testing import build_tiny_model

    t0 = time.perf_counter()
    kwargs = {k: v for k, v in widths.items() if k != "num_layers"}
    src = build_tiny_model("qwen3_moe", work / "src", num_layers=widths["num_layers"], tokenizer=True, **kwargs)
    t1 = time.perf_counter()
    manifest, qdir = run(QuantizeConfig(model=str(src), out=work / "q4", method="rtn"))
    t2 = time.perf_counter()
    print(f"[setup] built in {t1 - t0:.1f}s, quantized (rtn) in {t2 - t1:.1f}s", flush=True)
    return src, qdir, {"build_seconds": t1 - t0, "quantize_seconds": t2 - t1}


def make_sequences(seq: int, seed: int = 0) -> list[EvalSequence]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (SEQUENCES, seq), generator=g).tolist()
    return [EvalSequence("held-out", f"s{i % 4}", row, row) for i, row in enumerate(ids)]


def reference(src: Path, loaded, experts_implementation: str | None):
    """transformers' model of the source with each expert tensor replaced by its dequantization."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from usaf.quant import dequantize

    hf_logging.disable_progress_bar()
    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kwargs).eval()
    spec = loaded.spec
    with torch.no_grad():
        for layer, state in loaded.experts.items():
            for name, weight in ((spec.gate_up_name(layer), state.gate_up), (spec.down_name(layer), state.down)):
                model.get_parameter(name).copy_(dequantize(weight.q))
    return model


def tuned_engine(qdir: Path) -> SparseEngine:
    loaded = load_quantized_model(qdir)
    make_resident(loaded, CPU, True)
    engine = SparseEngine(loaded, trainable_layers=list(loaded.spec.moe_layers[-TOP:]), train_router=True)
    g = torch.Generator().manual_seed(1)
    chosen, values = {}, {}
    for i, (name, w) in enumerate(engine.weights.items()):
        chosen[name] = random_positions(w.shape[0] * w.shape[1] * w.shape[2], budget(w.shape, FRAC), seed=i)
        values[name] = 1e-2 * torch.randn(chosen[name].numel(), generator=g)
    engine.set_deltas(chosen, values)
    with torch.no_grad():
        for router in engine.routers.values():
            router.add_(1e-2 * torch.randn(router.shape, generator=g))
    return engine


def plain_pass(model, batches) -> torch.Tensor:
    """A plain transformers evaluation loop: forward, the same per-sequence NLL."""
    out = []
    with torch.no_grad():
        for batch in batches:
            out.append(sequence_nll(model, batch_hidden(model, batch, torch.device("cpu")), batch.labels)[0])
    return torch.cat(out)


def measure(src: Path, qdir: Path, seq: int, repeats: int) -> dict:
    sequences = make_sequences(seq)
    batches = batches_of(sequences, MICROBATCH, 0)
    tokens = sum(b.tokens for b in batches)
    loaded, streamed = load_quantized_model(qdir), load_quantized_model(qdir)
    resident, resident_bytes = make_resident(loaded, CPU, None)  # the stage's default choice
    make_resident(streamed, CPU, False)
    engine = tuned_engine(qdir)
    grouped, eager = reference(src, loaded, None), reference(src, loaded, "eager")
    cpu = torch.device("cpu")
    results: dict[str, torch.Tensor] = {}

    cpu_times: dict[str, list[float]] = {}

    def arm(name, fn):
        def timed() -> float:
            start, cpu_start = time.perf_counter(), time.process_time()
            results[name] = fn()
            cpu_times.setdefault(name, []).append(time.process_time() - cpu_start)
            return time.perf_counter() - start

        return timed

    def usaf(model, experts):
        return lambda: run_pass(model, experts, batches, device=cpu, progress=NullProgress(), description="").nll

    arms = {
        "usaf_base": arm("usaf_base", usaf(loaded.model, loaded.experts)),
        "usaf_streaming": arm("usaf_streaming", usaf(streamed.model, streamed.experts)),
        "usaf_tuned": arm("usaf_tuned", usaf(engine.model, engine.loaded.experts)),
        "transformers": arm("transformers", lambda: plain_pass(grouped, batches)),
        "transformers_eager": arm("transformers_eager", lambda: plain_pass(eager, batches)),
    }
    for fn in arms.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in arms}
    loads: list[float] = []
    for i in range(repeats):
        order = list(arms) if i % 2 == 0 else list(reversed(arms))  # no arm always goes first
        for key in order:
            times[key].append(arms[key]())
        load = os.getloadavg()[0]
        print(f"[eval] repeat {i} (load {load:.1f}): " + "  ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()),
              flush=True)  # fmt: skip
        loads.append(load)
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v[1:]) for k, v in cpu_times.items()}  # [0] is the warm-up
    per_token = {k: float(results[k].sum()) / tokens for k in results}  # mean NLL: the arms compute the same thing
    return {
        "sequences": SEQUENCES,
        "seq": seq,
        "microbatch": MICROBATCH,
        "tokens_per_arm_run": tokens,
        "repeats": repeats,
        "seconds": times,
        "cpu_seconds": cpu_times,
        "load_average_1min_per_repeat": loads,
        "median_seconds": med,
        "tokens_per_s": {k: tokens / v for k, v in med.items()},
        "median_cpu_seconds": cpu_med,
        "ratio_usaf_base_over_transformers": med["transformers"] / med["usaf_base"],
        "cpu_time_ratio_usaf_base_over_transformers": cpu_med["transformers"] / cpu_med["usaf_base"],
        "ratio_usaf_tuned_over_transformers": med["transformers"] / med["usaf_tuned"],
        "ratio_usaf_streaming_over_transformers": med["transformers"] / med["usaf_streaming"],
        "usaf_base_resident": resident,
        "dequantized_experts_bytes": resident_bytes,
        "ratio_usaf_base_over_transformers_eager": med["transformers_eager"] / med["usaf_base"],
        "per_pair_ratio_usaf_base_over_transformers": [
            t / u for t, u in zip(times["transformers"], times["usaf_base"])
        ],
        "mean_nll": per_token,
        "max_abs_nll_diff_usaf_base_vs_transformers": float(
            (results["usaf_base"] - results["transformers"]).abs().max()
        ),
        "trainable_layers_tuned": list(engine.trainable_layers),
    }


def stage_once(qdir: Path, seq: int, work: Path, *, reuse_prefix: bool = True) -> dict:
    """The whole ``usaf eval`` stage once, base + tuned, to show what surrounds the forward passes.

    ``reuse_prefix=False`` makes the fine-tuned pass run every layer (as before it started from the base pass's
    states at the first trained layer), by giving those states no RAM.
    """
    from safetensors.torch import save_file

    from usaf.artifacts.run import DELTAS_FILE, ROUTERS_FILE, SETTINGS_FILE
    from usaf.stages.eval import EvalConfig, passes, run

    work.mkdir(parents=True, exist_ok=True)
    data = work / "heldout.jsonl"
    data.write_text(
        "".join(json.dumps({"input_ids": s.input_ids, "source": s.source}) + "\n" for s in make_sequences(seq))
    )
    engine = tuned_engine(qdir)
    ckpt = work / "run" / "checkpoints" / "step-0000001"
    ckpt.mkdir(parents=True)
    tensors = {}
    for name, weight in engine.weights.items():
        tensors[f"{name}.cumulative_indices"] = weight.delta.indices.contiguous()
        tensors[f"{name}.cumulative_values"] = weight.delta.values.detach().contiguous()
    save_file(tensors, str(ckpt / DELTAS_FILE))
    save_file({n: p.detach().contiguous() for n, p in engine.routers.items()}, str(ckpt / ROUTERS_FILE))
    (ckpt / "state.json").write_text("{}")
    fingerprint = json.loads((qdir / "manifest.json").read_text())["fingerprint"]
    (work / "run" / SETTINGS_FILE).write_text(json.dumps({"model_fingerprint": fingerprint}))
    share = passes.PREFIX_RAM_SHARE
    passes.PREFIX_RAM_SHARE = share if reuse_prefix else 0.0
    start = time.perf_counter()
    try:
        manifest, _ = run(
            EvalConfig(model=qdir, checkpoint=ckpt, held_out=[data], workspace=work, out=work / "report", plots=False)
        )
    finally:
        passes.PREFIX_RAM_SHARE = share
    seconds = time.perf_counter() - start
    s = manifest.summary
    passes = s.base_pass.seconds + s.tuned_pass.seconds
    return {
        "seconds": seconds,
        "base_pass_seconds": s.base_pass.seconds,
        "tuned_pass_seconds": s.tuned_pass.seconds,
        "outside_passes_seconds": seconds - passes,
        "note": "everything else: model loading and dequantizing the experts once (twice for the trainable layers: "
        "the engine makes them resident again), tokenizer, reading the JSONL, the two applied-check forwards, "
        "the bootstrap (1000 resamples x 5 rows), report files, manifest hashing",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed runs per arm [5]")
    parser.add_argument("--quick", action="store_true", help="a 4-layer, hidden-256 model at seq 64: a smoke run")
    parser.add_argument("--out", type=Path, default=None, help="[benchmarks/results/eval.json]")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads [torch's default]")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    widths = MODEL_QUICK if args.quick else MODEL
    seq = SEQ_QUICK if args.quick else SEQ
    out = args.out or RESULTS / ("eval-quick.json" if args.quick else "eval.json")
    torch.manual_seed(0)
    result: dict = {
        "machine": machine(),
        "quick": args.quick,
        "command": " ".join(["python", *sys.argv]),
        "model": {
            "family": "qwen3_moe",
            "dtype": "float32",
            "vocab_size": VOCAB,
            "quantization": "rtn 4-bit g128",
            **widths,
        },  # fmt: skip
    }
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="usaf-bench-eval-") as tmp:
        src, qdir, result["setup"] = build_and_quantize(Path(tmp), widths)
        result["passes"] = measure(src, qdir, seq, args.repeats)
        result["stage"] = stage_once(qdir, seq, Path(tmp) / "reuse")
        result["stage_every_layer"] = stage_once(qdir, seq, Path(tmp) / "every-layer", reuse_prefix=False)
    result["total_seconds"] = time.perf_counter() - started
    result["load_average_1min"] = {"start": load_start, "end": os.getloadavg()[0]}  # other processes share the CPUs
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"wrote {out}")


def print_summary(r: dict) -> None:
    p = r["passes"]
    print(f"\nmachine: {r['machine']['summary']}")
    print(f"eval passes over {p['tokens_per_arm_run']:,} tokens ({p['sequences']} x {p['seq']}, microbatch "
          f"{p['microbatch']}), median of {p['repeats']} interleaved:")  # fmt: skip
    for k, v in p["median_seconds"].items():
        print(f"  {k:19s} {v:7.3f} s  {p['tokens_per_s'][k]:8.0f} tokens/s  mean NLL {p['mean_nll'][k]:.6f}")
    print(f"  usaf base / transformers (speed):  {p['ratio_usaf_base_over_transformers']:.3f} (target >= 0.8); "
          f"by CPU time {p['cpu_time_ratio_usaf_base_over_transformers']:.3f}")  # fmt: skip
    print(f"  usaf tuned / transformers (speed): {p['ratio_usaf_tuned_over_transformers']:.3f}")
    print(f"  usaf streaming / transformers:     {p['ratio_usaf_streaming_over_transformers']:.3f}")
    print(f"  usaf base / transformers eager:    {p['ratio_usaf_base_over_transformers_eager']:.3f}")
    print(f"  max |NLL diff| usaf base vs transformers: {p['max_abs_nll_diff_usaf_base_vs_transformers']:.2e}")
    for key, label in (("stage", "whole stage once"), ("stage_every_layer", "the same, tuned pass on every layer")):
        s = r[key]
        print(
            f"{label}: {s['seconds']:.1f} s (base pass {s['base_pass_seconds']:.2f} s, tuned pass "
            f"{s['tuned_pass_seconds']:.2f} s, everything else {s['outside_passes_seconds']:.1f} s)"
        )
    load = r["load_average_1min"]
    print(
        f"total {r['total_seconds']:.0f} s; 1-min load average {load['start']:.1f} at start, {load['end']:.1f} at end"
    )


if __name__ == "__main__":
    main()
