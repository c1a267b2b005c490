"""Benchmark: `usaf quantize` speed, memory, reconstruction error, and dequantization time.

Four parts, all on synthetic (random-init) Qwen3-MoE checkpoints built by ``usaf.testing.build_tiny_model``
in bfloat16, each figure a comparison made side by side in this run:

1. **throughput**: the real stage (``usaf.stages.quantize.run``, end to end: header reading, lazy loading
   and fusing, quantizing, per-tensor error, layer files, base shards, ``experts_q4.pt``, manifest) with
   ``--method hqq`` and ``--method rtn``, versus a bare ``hqq`` loop over the same expert slices (the fused
   tensors are loaded before the clock starts; only ``Quantizer.quantize`` on each ``[O, I]`` slice is
   timed). Arms run usaf-hqq, bare, usaf-rtn, then in reverse order, per repeat; figures are ratios of medians.
2. **memory**: peak RSS of the real CLI (``python -m usaf quantize DIR --out OUT --method rtn``) in a child
   process, for the same layer shape with few and many layers, next to one layer's expert bytes and the
   process baseline (``python -c "import usaf.stages.quantize"``). Each child runs under a fresh wrapper
   process that prints ``getrusage(RUSAGE_CHILDREN).ru_maxrss``.
3. **error**: relative Frobenius reconstruction error ``||W - deq||_F / ||W||_F`` (as in the manifest),
   hqq versus rtn, per bit width and group size, on the throughput model's expert tensors.
4. **dequant**: ``usaf.quant.dequantize`` of Qwen3-30B-A3B-shaped experts (gate_up ``[1536, 2048]``, down
   ``[2048, 768]``; one expert and 8 of them, as top-8 routing asks for) to fp32 and bf16, versus a plain
   copy of the output size (``torch.empty_like(out).copy_(src)``), interleaved.

Speed figures are wall-clock; each arm's CPU time is recorded too. On a shared 2-core machine, 2-thread torch
runs slow down erratically (3-10x) while other processes run; ``--threads 1`` trades absolute speed for
less erratic timings (the load average is recorded with every repeat).

    python benchmarks/bench_quantize.py [--repeats 5] [--quick] [--parts throughput,memory,error,dequant]
        [--profile] [--threads N] [--speed-layers N] [--out benchmarks/results/quantize.json]

``--quick`` (small models, 2 repeats) writes ``benchmarks/results/quantize-quick.json`` unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import psutil
import torch

from usaf.families import map_checkpoint, read_checkpoint
from usaf.families.mapping import load_expert_layer
from usaf.quant import dequantize, quantize_experts, relative_error
from usaf.quant import tensor as quant_tensor
from usaf.quant.packing import unpack_blocks
from usaf.stages.quantize import QuantizeConfig, run
from usaf.testing import build_tiny_model

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("throughput", "memory", "error", "dequant")
GROUP = 128
# The guide's CPU-sized MoE (docs: shared/guide/benchmarks.md): 8 layers, hidden 512, 32 experts of width 256.
SPEED_MODEL = {"num_layers": 8, "hidden_size": 512, "moe_intermediate_size": 256, "num_experts": 32}
SPEED_MODEL_QUICK = {"num_layers": 2, "hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 8}
# Memory: one layer's experts = 32 x (768x768 + 768x384) bf16 = 56.6 MB, visible above the ~0.4 GB baseline.
MEMORY_MODEL = {"hidden_size": 768, "moe_intermediate_size": 384, "num_experts": 32}
MEMORY_LAYERS = (4, 16)
MEMORY_MODEL_QUICK = {"hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 8}
MEMORY_LAYERS_QUICK = (2, 4)
ERROR_SETTINGS = [(4, 64), (4, 128), (2, 128), (3, 128), (8, 128)]  # (nbits, group size)
ERROR_LAYERS = 2  # layers of the throughput model whose expert tensors are measured
# Qwen3-30B-A3B: hidden 2048, expert width 768 -> gate_up (O=1536, I=2048), down (O=2048, I=768); top-8.
QWEN3_30B_SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}
TOP_K = 8
DEQUANT_EXPERTS = 16  # stack size the 8 routed experts are picked from (non-contiguous indices)

WRAPPER = (
    "import resource, subprocess, sys\n"
    "p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)\n"
    "sys.stderr.write(p.stderr[-4000:] if p.returncode else '')\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, p.returncode)\n"
)


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")), "?")
    import hqq
    import transformers

    return {
        "summary": (
            f"{psutil.cpu_count()} CPU cores ({cpu}), {platform.machine()}, "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), no GPU used"
        ),
        "cpu": cpu,
        "cpus": psutil.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hqq": getattr(hqq, "__version__", "?"),
        "date": datetime.date.today().isoformat(),
        "source": _git_state(),
    }


def _git_state() -> str:
    """The commit measured, and whether the working tree had uncommitted changes under src/ (read-only git)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=root, capture_output=True, text=True)
    except OSError:
        return "?"
    changed = len(dirty.stdout.splitlines())
    return head.stdout.strip() + (f" + {changed} uncommitted paths under src/" if changed else "")


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def build(out: Path, num_layers: int, widths: dict) -> Path:
    return build_tiny_model(
        "qwen3_moe",
        out,
        num_layers=num_layers,
        hidden_size=widths["hidden_size"],
        moe_intermediate_size=widths["moe_intermediate_size"],
        num_experts=widths["num_experts"],
        num_experts_per_tok=4,
        tokenizer=False,
        dtype="bfloat16",
    )


def expert_tensors(model_dir: Path, layers: int | None = None) -> list[tuple[str, torch.Tensor]]:
    """(in-memory name, fused (E, O, I) bf16 tensor) of every gate_up/down expert tensor, as the stage reads them."""
    plan = map_checkpoint(model_dir)
    infos = read_checkpoint(model_dir)
    out = []
    for layer in plan.experts[:layers]:
        assert not layer.layout.transposed
        fused = load_expert_layer(model_dir, layer, infos)
        out += [(t.target, fused[t.target]) for t in layer.tensors if t.role in ("gate_up", "down")]
    return out


def layer_expert_bytes(model_dir: Path) -> int:
    plan = map_checkpoint(model_dir)
    infos = read_checkpoint(model_dir)
    layer = plan.experts[0]
    return sum(infos[n].nbytes for t in layer.tensors if t.role in ("gate_up", "down") for n in t.source_names)


# -- 1. throughput ---------------------------------------------------------------------------------------


def usaf_arm(model_dir: Path, out: Path, method: str) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds of this process, manifest summary) of one end-to-end stage run."""
    config = QuantizeConfig(model=str(model_dir), out=out, method=method, group_size=GROUP)
    start, cpu = time.perf_counter(), time.process_time()
    manifest, _ = run(config)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    shutil.rmtree(out)
    return elapsed, cpu, manifest.summary


def bare_arm(slices: list[torch.Tensor]) -> tuple[float, float, None]:
    """(wall seconds, CPU seconds, None) of hqq's own quantizer over every [O, I] slice, nothing else."""
    from hqq.core.quantize import Quantizer

    start, cpu = time.perf_counter(), time.process_time()
    for w in slices:
        Quantizer.quantize(w, nbits=4, group_size=GROUP, axis=1, optimize=True, bitpack=False, device="cpu")
    return time.perf_counter() - start, time.process_time() - cpu, None


def throughput(work: Path, repeats: int, quick: bool, profile: bool) -> dict:
    widths = SPEED_MODEL_QUICK if quick else SPEED_MODEL
    t0 = time.perf_counter()
    model_dir = build(work / "speed-model", widths["num_layers"], widths)
    print(f"[throughput] built {widths} in {time.perf_counter() - t0:.1f}s", flush=True)
    tensors = expert_tensors(model_dir)  # outside the timed part: bf16 (E, O, I), as the stage loads them
    slices = [w[e] for _, w in tensors for e in range(w.shape[0])]  # every [O, I] slice, bf16 views
    source_bytes = sum(w.numel() * w.element_size() for _, w in tensors)
    arms = {
        "usaf_hqq": lambda: usaf_arm(model_dir, work / "q-hqq", "hqq"),
        "bare_hqq": lambda: bare_arm(slices),
        "usaf_rtn": lambda: usaf_arm(model_dir, work / "q-rtn", "rtn"),
    }
    # Warm-up, untimed: imports hqq (seconds) and everything the stage imports lazily.
    bare_arm(slices[:1])
    usaf_arm(model_dir, work / "warm", "rtn")
    times: dict[str, list[float]] = {k: [] for k in arms}
    cpu_times: dict[str, list[float]] = {k: [] for k in arms}
    load: list[float] = []
    summaries = {}
    for i in range(repeats):
        # A B C, then C B A: a slow drift in machine load hits every arm alike.
        for name in list(arms) if i % 2 == 0 else list(arms)[::-1]:
            wall, cpu, summary = arms[name]()
            times[name].append(wall)
            cpu_times[name].append(cpu)
            if summary is not None:
                summaries[name.removeprefix("usaf_")] = summary
        load.append(os.getloadavg()[0])
        print(
            f"[throughput] repeat {i}: "
            + "  ".join(f"{k} {times[k][-1]:.2f}s (cpu {cpu_times[k][-1]:.1f}s)" for k in arms)
            + f"  load {load[-1]:.1f}",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_times.items()}
    pair = [a / b for a, b in zip(times["usaf_hqq"], times["bare_hqq"])]
    mb = source_bytes / 1e6
    assert summaries["hqq"].experts_source_bytes == source_bytes
    result = {
        "model": {"family": "qwen3_moe", "dtype": "bfloat16", "top_k": 4, **widths},
        "expert_tensors": len(tensors),
        "expert_slices": len(slices),
        "source_expert_mb": mb,
        "repeats": repeats,
        "seconds": times,
        "cpu_seconds": cpu_times,
        "load_average_1min": load,
        "median_seconds": med,
        "median_cpu_seconds": cpu_med,
        "mb_per_s": {k: mb / v for k, v in med.items()},
        "ratio_usaf_hqq_over_bare_time": med["usaf_hqq"] / med["bare_hqq"],
        "ratio_usaf_hqq_over_bare_time_pairs": pair,
        "ratio_usaf_hqq_over_bare_time_median_of_pairs": statistics.median(pair),
        "ratio_usaf_hqq_over_bare_cpu_time": cpu_med["usaf_hqq"] / cpu_med["bare_hqq"],
        "ratio_usaf_hqq_over_usaf_rtn_time": med["usaf_hqq"] / med["usaf_rtn"],
        "manifest_mean_rel_error": {m: s.mean_rel_error for m, s in summaries.items()},
        "compression_ratio": {m: s.compression_ratio for m, s in summaries.items()},
    }
    if profile:
        result["profile"] = profile_stage(model_dir, work / "q-prof")
    return result


def profile_stage(model_dir: Path, out: Path) -> dict:
    """cProfile of one usaf hqq run: the top functions by own time and by cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    usaf_arm(model_dir, out, "hqq")
    prof.disable()
    rows: dict = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(25)
        rows[key] = [line for line in buf.getvalue().splitlines() if line.strip()]
    # Cumulative seconds of the parts of the stage that matter, by (file suffix, function name).
    wanted = {
        "total (stage run)": ("usaf/stages/quantize.py", "run"),
        "hqq Quantizer.quantize": ("hqq/core/quantize.py", "quantize"),
        "usaf quantize_experts (incl. hqq)": ("usaf/quant/quantize.py", "quantize_experts"),
        "usaf _round_codes": ("usaf/quant/quantize.py", "_round_codes"),
        "usaf pack_codes": ("usaf/quant/packing.py", "pack_codes"),
        "usaf _relative_error (dequantize per expert)": ("usaf/stages/quantize.py", "_relative_error"),
        "usaf _estimate_note (one extra slice)": ("usaf/stages/quantize.py", "_estimate_note"),
        "usaf load_expert_layer": ("usaf/families/mapping.py", "load_expert_layer"),
        "usaf map_checkpoint": ("usaf/families/mapping.py", "map_checkpoint"),
        "usaf _save_layer": ("usaf/stages/quantize.py", "_save_layer"),
        "usaf _assemble_experts": ("usaf/stages/quantize.py", "_assemble_experts"),
        "usaf write_base_shards": ("usaf/stages/quantize_parts.py", "write_base_shards"),
        "usaf ArtifactWriter.commit": ("usaf/artifacts/writer.py", "commit"),
        "torch.isfinite": ("~", "<built-in method torch.isfinite>"),
    }
    stats = pstats.Stats(prof).stats  # (file, line, function) -> (cc, nc, tottime, cumtime, callers)
    breakdown = {}
    for label, (suffix, func) in wanted.items():
        hits = [v[3] for (f, _, fn), v in stats.items() if fn == func and f.endswith(suffix)]
        if hits:
            breakdown[label] = max(hits)
    rows["breakdown_cumulative_seconds"] = breakdown
    return rows


# -- 2. memory -------------------------------------------------------------------------------------------


def peak_rss(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS of ``cmd``'s process tree's largest process in MiB, wall seconds), in a fresh wrapper."""
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    kib, rc = p.stdout.split()
    if int(rc) != 0 or p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({rc}):\n{p.stderr}")
    return int(kib) / 1024, elapsed


def memory(work: Path, repeats: int, quick: bool) -> dict:
    widths = MEMORY_MODEL_QUICK if quick else MEMORY_MODEL
    counts = MEMORY_LAYERS_QUICK if quick else MEMORY_LAYERS
    dirs = {}
    for n in counts:
        t0 = time.perf_counter()
        dirs[n] = build(work / f"mem-{n}", n, widths)
        print(f"[memory] built {n} layers {widths} in {time.perf_counter() - t0:.1f}s", flush=True)
    # The CLI's fixed cost: the same command on a 1-layer model whose experts are negligible (1.5 MiB).
    dirs["floor"] = build(work / "mem-floor", 1, MEMORY_MODEL_QUICK)
    floor_mib = layer_expert_bytes(dirs["floor"]) / 2**20
    one_layer = layer_expert_bytes(dirs[counts[0]])
    assert one_layer == layer_expert_bytes(dirs[counts[-1]])
    baseline_cmd = [sys.executable, "-c", "import usaf.stages.quantize"]
    runs = ["floor", *(str(n) for n in counts)]
    rss: dict[str, list[float]] = {"baseline": [], **{k: [] for k in runs}}
    wall: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(repeats):
        rss["baseline"].append(peak_rss(baseline_cmd)[0])
        for key in runs:
            model_dir = dirs[key if key == "floor" else int(key)]
            out = work / f"mem-out-{key}"
            cmd = [sys.executable, "-m", "usaf", "quantize", str(model_dir), "--out", str(out), "--method", "rtn"]
            mib, secs = peak_rss(cmd)
            shutil.rmtree(out)
            rss[key].append(mib)
            wall[key].append(secs)
        print(f"[memory] repeat {i}: " + "  ".join(f"{k} {v[-1]:.0f} MiB" for k, v in rss.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rss.items()}
    layer_mib = one_layer / 2**20
    few, many = str(counts[0]), str(counts[-1])
    return {
        "model": {"family": "qwen3_moe", "dtype": "bfloat16", **widths},
        "floor_model": {"num_layers": 1, **MEMORY_MODEL_QUICK, "one_layer_expert_mib": floor_mib},
        "layer_counts": list(counts),
        "one_layer_expert_mib": layer_mib,
        "source_expert_mib": {str(n): n * layer_mib for n in counts},
        "repeats": repeats,
        "peak_rss_mib": rss,
        "median_peak_rss_mib": med,
        "cli_wall_seconds": wall,
        "ratio_peak_many_over_few": med[many] / med[few],
        "above_baseline_in_layers": {str(n): (med[str(n)] - med["baseline"]) / layer_mib for n in counts},
        "above_floor_in_layers": {str(n): (med[str(n)] - med["floor"]) / layer_mib for n in counts},
    }


# -- 3. reconstruction error -----------------------------------------------------------------------------


def error(work: Path, quick: bool) -> dict:
    model_dir = work / "speed-model"
    if not model_dir.exists():
        widths = SPEED_MODEL_QUICK if quick else SPEED_MODEL
        build(model_dir, widths["num_layers"], widths)
    tensors = expert_tensors(model_dir, layers=1 if quick else ERROR_LAYERS)
    rows = []
    for nbits, group in ERROR_SETTINGS:
        for method in ("hqq", "rtn"):
            start = time.perf_counter()
            num = den = 0.0
            per_tensor = []
            for _, w in tensors:
                q = quantize_experts(w, method=method, nbits=nbits, group_size=group)
                err = relative_error(w, q)
                per_tensor.append(err)
                sq = float(w.float().square().sum())
                num, den = num + err**2 * sq, den + sq
            rows.append(
                {
                    "method": method,
                    "nbits": nbits,
                    "group_size": group,
                    "mean_rel_error": statistics.mean(per_tensor),
                    "pooled_rel_error": (num / den) ** 0.5,
                    "per_tensor": per_tensor,
                    "seconds": time.perf_counter() - start,
                }
            )
            print(f"[error] {method} {nbits}-bit g{group}: {rows[-1]['mean_rel_error']:.4f}", flush=True)
    return {
        "weights": "random init (normal, std 0.02), not pretrained",
        "tensors": [f"{name} {tuple(w.shape)}" for name, w in tensors],
        "rows": rows,
    }


# -- 4. dequantization -----------------------------------------------------------------------------------


def dequant(repeats: int) -> dict:
    torch.manual_seed(0)
    picked = torch.randperm(DEQUANT_EXPERTS)[:TOP_K].sort().values.tolist()
    cases = []
    for name, (o, i) in QWEN3_30B_SHAPES.items():
        w = (torch.randn(DEQUANT_EXPERTS, o, i) * 0.02).to(torch.bfloat16)
        q = quantize_experts(w, method="rtn", nbits=4, group_size=GROUP)
        del w
        for label, experts in (("1 expert", [picked[0]]), (f"{TOP_K} experts", picked)):
            for dtype in (torch.float32, torch.bfloat16):
                out = dequantize(q, experts=experts, dtype=dtype)  # warm-up; gives the copy's size and dtype
                src = torch.randn(out.shape).to(dtype)
                cases.append({"tensor": name, "label": label, "experts": experts, "dtype": dtype, "q": q, "src": src})
    deq_t: list[list[float]] = [[] for _ in cases]
    blocks_t: list[list[float]] = [[] for _ in cases]
    copy_t: list[list[float]] = [[] for _ in cases]
    # Round robin over all cases, dequantize then copy, so a burst of load elsewhere hits every case alike.
    # The reference dequantize unpacks 4 bits with the general block loop (usaf.quant.packing.unpack_blocks,
    # what every 4-bit unpack ran before the nibble interleave), timed in the same rounds.
    for _ in range(repeats):
        for k, c in enumerate(cases):
            start = time.perf_counter()
            dequantize(c["q"], experts=c["experts"], dtype=c["dtype"])
            deq_t[k].append(time.perf_counter() - start)
            with mock.patch.object(quant_tensor, "unpack_codes", unpack_blocks):
                start = time.perf_counter()
                dequantize(c["q"], experts=c["experts"], dtype=c["dtype"])
                blocks_t[k].append(time.perf_counter() - start)
            start = time.perf_counter()
            torch.empty_like(c["src"]).copy_(c["src"])
            copy_t[k].append(time.perf_counter() - start)
    rows = []
    for k, c in enumerate(cases):
        d, cp, b = statistics.median(deq_t[k]), statistics.median(copy_t[k]), statistics.median(blocks_t[k])
        src, q = c["src"], c["q"]
        rows.append(
            {
                "tensor": c["tensor"],
                "shape": [len(c["experts"]), *q.shape[1:]],
                "experts": c["label"],
                "dtype": str(c["dtype"]).removeprefix("torch."),
                "output_mb": src.numel() * src.element_size() / 1e6,
                "dequantize_ms": d * 1e3,
                "copy_ms": cp * 1e3,
                "ratio_dequantize_over_copy": d / cp,
                "dequantize_block_unpack_ms": b * 1e3,
                "speedup_over_block_unpack": b / d,
                "ratio_median_of_pairs": statistics.median(a / b for a, b in zip(deq_t[k], copy_t[k])),
                "dequantize_ms_all": [t * 1e3 for t in deq_t[k]],
                "copy_ms_all": [t * 1e3 for t in copy_t[k]],
            }
        )
        print(
            f"[dequant] {c['tensor']} {c['label']} -> {rows[-1]['dtype']}: {d * 1e3:.2f} ms vs copy "
            f"{cp * 1e3:.3f} ms (x{d / cp:.1f}); with the block unpack {b * 1e3:.2f} ms",
            flush=True,
        )
    # A whole top-8 MoE step: gate_up and down of 8 experts.
    top = {}
    for dt in ("float32", "bfloat16"):
        sel = [r for r in rows if r["experts"] == f"{TOP_K} experts" and r["dtype"] == dt]
        top[dt] = {
            "dequantize_ms": sum(r["dequantize_ms"] for r in sel),
            "dequantize_block_unpack_ms": sum(r["dequantize_block_unpack_ms"] for r in sel),
            "copy_ms": sum(r["copy_ms"] for r in sel),
        }
    return {
        "shapes": "Qwen3-30B-A3B: gate_up (E, 1536, 2048), down (E, 2048, 768); 4-bit, group 128, rtn codes",
        "picked_experts": picked,
        "repeats": repeats,
        "rows": rows,
        "top8_gate_up_plus_down": top,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats [5; 2 with --quick]")
    parser.add_argument("--quick", action="store_true", help="small models, few repeats: a smoke run")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--profile", action="store_true", help="also cProfile one usaf hqq run")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads [torch's default]")
    parser.add_argument("--speed-layers", type=int, default=None, help="layers of the throughput model [8; 2 quick]")
    parser.add_argument("--out", type=Path, default=None, help="[benchmarks/results/quantize.json]")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.speed_layers:
        SPEED_MODEL["num_layers"] = SPEED_MODEL_QUICK["num_layers"] = args.speed_layers
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {PARTS}")
    repeats = args.repeats or (2 if args.quick else 5)
    out = args.out or RESULTS / ("quantize-quick.json" if args.quick else "quantize.json")
    result: dict = {"machine": machine(), "quick": args.quick, "command": " ".join(["python", *sys.argv])}
    result["load_average_at_start"] = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="usaf-bench-quantize-") as tmp:
        work = Path(tmp)
        if "throughput" in parts:
            result["throughput"] = throughput(work, repeats, args.quick, args.profile)
        if "memory" in parts:
            result["memory"] = memory(work, max(3, repeats // 2) if not args.quick else 1, args.quick)
        if "error" in parts:
            result["error"] = error(work, args.quick)
        if "dequant" in parts:
            result["dequant"] = dequant(5 if args.quick else 21)
    result["total_seconds"] = time.perf_counter() - started
    result["load_average_at_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"wrote {out}")


def print_summary(r: dict) -> None:
    print(f"\nmachine: {r['machine']['summary']}")
    if "throughput" in r:
        t = r["throughput"]
        med, mbs = t["median_seconds"], t["mb_per_s"]
        print(f"throughput ({t['source_expert_mb']:.1f} MB of bf16 experts, median of {t['repeats']}):")
        for k in ("usaf_hqq", "bare_hqq", "usaf_rtn"):
            print(f"  {k:9s} {med[k]:7.2f} s  {mbs[k]:7.2f} MB/s")
        print(f"  usaf hqq / bare hqq time: {t['ratio_usaf_hqq_over_bare_time']:.3f} (target <= 1.15)")
        print(f"  usaf hqq / usaf rtn time: {t['ratio_usaf_hqq_over_usaf_rtn_time']:.1f}")
    if "memory" in r:
        m = r["memory"]
        med = m["median_peak_rss_mib"]
        print(
            f"memory (one layer's experts {m['one_layer_expert_mib']:.1f} MiB; import baseline "
            f"{med['baseline']:.0f} MiB; CLI on a 1-layer {m['floor_model']['one_layer_expert_mib']:.1f} MiB model "
            f"{med['floor']:.0f} MiB):"
        )
        for n in m["layer_counts"]:
            base, floor = m["above_baseline_in_layers"][str(n)], m["above_floor_in_layers"][str(n)]
            print(f"  {n:3d} layers: peak {med[str(n)]:.0f} MiB = baseline + {base:.2f} layers = floor + {floor:.2f}")
        print(f"  peak({m['layer_counts'][-1]}) / peak({m['layer_counts'][0]}): {m['ratio_peak_many_over_few']:.3f}")
    if "error" in r:
        print("relative error (mean over tensors; random-init weights):")
        for row in r["error"]["rows"]:
            print(f"  {row['method']} {row['nbits']}-bit g{row['group_size']}: {row['mean_rel_error']:.4f}")
    if "dequant" in r:
        print("dequantize vs copy (median):")
        for row in r["dequant"]["rows"]:
            print(
                f"  {row['tensor']:7s} {row['experts']:9s} {row['dtype']:8s} {row['dequantize_ms']:8.2f} ms"
                f"  copy {row['copy_ms']:7.3f} ms  x{row['ratio_dequantize_over_copy']:.1f}"
                f"  block unpack {row['dequantize_block_unpack_ms']:8.2f} ms ({row['speedup_over_block_unpack']:.2f}x)"
            )


if __name__ == "__main__":
    main()
