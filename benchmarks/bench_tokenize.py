"""Benchmark: `usaf tokenize` throughput versus a bare `tokenizers` encode_batch loop, same text, same run.

Corpus: the Python standard library's ``.py`` sources (site-packages excluded), read at run time.
Arm A is the real stage (`usaf.stages.tokenize.run`: discovery, decoding, tokenizing, packing into
sequences, JSONL writing, hashing, manifest). Arm B is the floor: read the same files and call
``Tokenizer.encode_batch`` on ~1 MiB batches, discarding the result. The arms alternate A B A B and
the figure is the ratio of medians (B time / A time = A's share of the bare loop's speed).

    python benchmarks/bench_tokenize.py [--repeats 5] [--out benchmarks/results/tokenize.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from usaf.stages.tokenize import BATCH_BYTES, TokenizeConfig, run
from usaf.testing import build_tiny_tokenizer, stdlib_dir

EXCLUDE = ["site-packages/*"]


def corpus_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)


def bare_loop(files: list[Path], tokenizer) -> tuple[float, int]:
    start = time.perf_counter()
    batch, size, tokens = [], 0, 0
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        batch.append(text)
        size += len(text)
        if size >= BATCH_BYTES:
            tokens += sum(len(e.ids) for e in tokenizer.encode_batch(batch, add_special_tokens=True))
            batch, size = [], 0
    if batch:
        tokens += sum(len(e.ids) for e in tokenizer.encode_batch(batch, add_special_tokens=True))
    return time.perf_counter() - start, tokens


def usaf_stage(root: Path, tok_dir: Path, work: Path, i: int) -> tuple[float, int]:
    config = TokenizeConfig(
        inputs=[root],
        model=str(tok_dir),
        out=work / f"run{i}",
        include=["*.py"],
        exclude=EXCLUDE,
        decode_errors="replace",
        held_out=["json", "email"],
    )
    start = time.perf_counter()
    manifest, _ = run(config)
    elapsed = time.perf_counter() - start
    return elapsed, manifest.summary.train_tokens + manifest.summary.heldout_tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tokenize.json"))
    args = parser.parse_args()
    root = stdlib_dir()
    files = corpus_files(root)
    total_bytes = sum(p.stat().st_size for p in files)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tokenizer = build_tiny_tokenizer(work / "tok")
        fast = tokenizer.backend_tokenizer
        usaf_times, bare_times = [], []
        for i in range(args.repeats):
            t, usaf_tokens = usaf_stage(root, work / "tok", work, i)
            usaf_times.append(t)
            t, bare_tokens = bare_loop(files, fast)
            bare_times.append(t)
            print(f"repeat {i}: usaf {usaf_times[-1]:.2f}s  bare {bare_times[-1]:.2f}s", flush=True)
    usaf_median, bare_median = statistics.median(usaf_times), statistics.median(bare_times)
    result = {
        "corpus": f"stdlib *.py ({len(files)} files, {total_bytes / 1e6:.1f} MB) at {root}",
        "tokenizer": "usaf.testing.build_tiny_tokenizer (byte-level BPE, vocab 512)",
        "repeats": args.repeats,
        "usaf_seconds": usaf_times,
        "bare_seconds": bare_times,
        "usaf_tokens": usaf_tokens,
        "bare_tokens": bare_tokens,
        "usaf_mb_per_s": total_bytes / 1e6 / usaf_median,
        "usaf_tokens_per_s": usaf_tokens / usaf_median,
        "bare_tokens_per_s": bare_tokens / bare_median,
        "ratio_usaf_over_bare_speed": bare_median / usaf_median,
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        "peak_rss_mib": psutil.Process().memory_info().rss / 2**20,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_seconds")}, indent=2))


if __name__ == "__main__":
    main()
