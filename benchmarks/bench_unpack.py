"""Benchmark: unpacking 4-bit codes on the host, nibble by nibble (the device form) against an int16 scratch a
chunk at a time (``usaf.quant.packing._unpack_nibbles_host``), and the chunk size.

The per-forward frozen path dequantizes a block of experts right before its GEMM (8 MiB of fp32 on the host), and
unpacking the codes was most of that dequantization. Shapes: one host block of ``bench_frozen.py``'s 128-expert model
(10 experts of ``gate_up`` 384 x 512 and of ``down`` 512 x 192), a 2-expert block, and a whole 128-expert ``gate_up``
tensor (what "dequantized once" unpacks). Arms alternate within each round; every arm's result is checked equal to
:func:`usaf.quant.packing.unpack_codes` cast to fp32.

``--steps``: a first-visit training step with the frozen layers dequantized per forward (``bench_train.py``'s
model, 2 x 256 tokens, a fresh prefix cache each step: since 2026-12-05 the step computes its whole first-epoch
company's states, 4 sequences), the host unpack against the nibble form (``Capabilities.unpack_via_int16``
switched off), alternating in one process, each timed step after an untimed one of the same arm.

    python benchmarks/bench_unpack.py [--threads 1] [--rounds 7] [--steps] [--experts 128]
        [--out benchmarks/results/unpack.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import RESULTS, machine  # noqa: E402
from bench_train import CALIB, MODEL, PACKAGES, SEQ, build, git_commit, stage_trainer, trainer_step  # noqa: E402

SHAPES = {  # packed (E, O, I / 2)
    "block of 10, gate_up 384 x 512": (10, 384, 256),
    "block of 10, down 512 x 192": (10, 512, 96),
    "block of 2, gate_up 384 x 512": (2, 384, 256),
    "whole tensor, 128 x gate_up 384 x 512": (128, 384, 256),
}
CHUNKS_KIB = (64, 256, 1024, 4096, 2**20)  # packed bytes a chunk; 2**20 KiB: one chunk for every shape here


def nibble_form(packed: torch.Tensor) -> torch.Tensor:
    """The device form of ``unpack_codes_as``: each nibble written straight into the fp32 buffer."""
    out = torch.empty((*packed.shape, 2), dtype=torch.float32)  # (..., I/2, 2)
    out[..., 0] = packed & 15
    out[..., 1] = packed >> 4
    return out.view(*packed.shape[:-1], packed.shape[-1] * 2)


def int16_form(chunk_kib: int):
    from usaf.quant import packing

    def run(packed: torch.Tensor) -> torch.Tensor:
        saved = packing._HOST_UNPACK_CHUNK
        packing._HOST_UNPACK_CHUNK = chunk_kib * 1024
        try:
            return packing._unpack_nibbles_host(packed, torch.float32)
        finally:
            packing._HOST_UNPACK_CHUNK = saved

    return run


def seconds(fn, packed: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(packed)
    return (time.perf_counter() - start) / calls


def first_visit_steps(experts: int, rounds: int) -> dict:
    """Median first-visit step (frozen layers per forward) with the host unpack and with the nibble form."""
    from usaf.engine.prefix import PrefixCache
    from usaf.quant import packing

    widths = MODEL if experts == 32 else {**MODEL, "num_experts": experts, "num_experts_per_tok": 8,
                                          "moe_intermediate_size": 3 * MODEL["hidden_size"] // 8}  # fmt: skip
    host = packing.device_capabilities

    def nibble(device):
        return dataclasses.replace(host(device), unpack_via_int16=False)

    with tempfile.TemporaryDirectory(prefix="usaf-bench-unpack-") as tmp:
        work = Path(tmp)
        _, qdir, tdir, plan, _ = build(work, widths, SEQ, CALIB, PACKAGES)
        trainer, _ = stage_trainer(qdir, tdir, plan, work / "run")
        fingerprint = trainer.prefix[1]

        def step(index: int) -> float:
            trainer.prefix = (PrefixCache(2**31, None), fingerprint)  # no store: both sequences are first visits
            return trainer_step(trainer, index)

        times = {"int16": [], "nibble_by_nibble": []}
        try:
            for r in range(rounds):
                for arm in list(times) if r % 2 == 0 else list(times)[::-1]:
                    packing.device_capabilities = host if arm == "int16" else nibble
                    step(r)  # untimed: the same arm's settle step
                    times[arm].append(step(r))
        finally:
            packing.device_capabilities = host
    medians = {arm: statistics.median(t) for arm, t in times.items()}
    per_round = [n / i for i, n in zip(times["int16"], times["nibble_by_nibble"])]
    print(f"[first visit, {experts} experts] int16 {medians['int16']:.3f} s, nibble by nibble "
          f"{medians['nibble_by_nibble']:.3f} s", flush=True)  # fmt: skip
    return {
        "experts": experts,
        "median_seconds": medians,
        "speed_int16_over_nibble": medians["nibble_by_nibble"] / medians["int16"],
        "per_round_speed": per_round,
        "rounds": times,
    }


def main() -> None:
    from usaf.quant import unpack_codes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", action="store_true", help="also time first-visit steps, host unpack vs nibbles")
    parser.add_argument("--experts", type=int, choices=(32, 64, 128), default=128, help="--steps' model [128]")
    parser.add_argument("--out", type=Path, default=RESULTS / "unpack.json")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    arms = {"nibble_by_nibble": nibble_form} | {f"int16_chunk_{k}KiB": int16_form(k) for k in CHUNKS_KIB}
    result = {"machine": machine(), "commit": git_commit(), "command": " ".join(["python", *sys.argv]), "shapes": {}}
    gen = torch.Generator().manual_seed(0)
    for name, shape in SHAPES.items():
        packed = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        expected = unpack_codes(packed, 4, shape[-1] * 2).to(torch.float32)
        for arm, fn in arms.items():
            if not torch.equal(fn(packed), expected):
                raise SystemExit(f"{arm} unpacks {name} wrongly")
        calls = max(3, int(2e7 // packed.numel()))  # about 20 M packed bytes a timing
        times = {arm: [] for arm in arms}
        for r in range(args.rounds):
            order = list(arms)[r % len(arms) :] + list(arms)[: r % len(arms)]  # rotate which arm goes first
            for arm in order:
                times[arm].append(seconds(arms[arm], packed, calls))
        medians = {arm: statistics.median(t) for arm, t in times.items()}
        base = medians["nibble_by_nibble"]
        result["shapes"][name] = {
            "packed_shape": list(shape),
            "median_ms": {arm: round(m * 1e3, 4) for arm, m in medians.items()},
            "speed_vs_nibble_by_nibble": {arm: round(base / m, 3) for arm, m in medians.items()},
            "per_round_ms": {arm: [round(t * 1e3, 4) for t in ts] for arm, ts in times.items()},
        }
        print(f"[{name}] " + "  ".join(f"{arm} {m * 1e3:.3f} ms" for arm, m in medians.items()), flush=True)
    if args.steps:
        result["first_visit_steps"] = first_visit_steps(args.experts, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
