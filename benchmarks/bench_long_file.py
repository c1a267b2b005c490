"""Benchmark: `usaf tokenize` of one long text file, in pieces (usaf.data.cuts) against encoded whole.

The file: the Python standard library's ``.py`` sources concatenated in sorted order up to ``--mb`` MB (one document,
one source). The tokenizer: the demo model's (Qwen-style byte-level BPE), as `usaf demo` uses. Each arm is a fresh
``python -m usaf tokenize`` process; the "whole" arm is the same code with ``usaf.data.cuts.PIECE_CHARS`` set past the
file's length (so no cut is made: the text goes to the tokenizer in one call, as before pieces existed). Measured:
the wall time and the process's peak resident memory (``ru_maxrss``); both arms' train.jsonl must be byte-identical.
The arms alternate; the figures are medians.

    python benchmarks/bench_long_file.py [--mb 5 20] [--rounds 2] [--out benchmarks/results/long-file.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from usaf.testing import stdlib_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import machine  # noqa: E402
from bench_train import git_commit  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "src" / "usaf" / "demo" / "model"

# Run in each arm's process: the CLI, then its peak memory on stderr's last line.
CHILD = """
import json, resource, runpy, sys
import usaf.data.cuts as cuts
if sys.argv[1] == "whole":
    cuts.PIECE_CHARS = 10**15
sys.argv = ["usaf", "tokenize", *sys.argv[2:]]
try:
    runpy.run_module("usaf", run_name="__main__")
except SystemExit as e:
    if e.code:
        raise
print(json.dumps({"maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), file=sys.stderr)
"""


def write_long_file(path: Path, megabytes: float) -> int:
    """Stdlib sources, whole files in sorted order, until ``megabytes`` (characters; ~ bytes, mostly ASCII)."""
    root, written = stdlib_dir(), 0
    with path.open("w", encoding="utf-8") as f:
        for source in sorted(root.rglob("*.py")):
            if "site-packages" in source.relative_to(root).parts:
                continue
            try:
                text = source.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            f.write(text)
            written += len(text)
            if written >= megabytes * 1e6:
                break
    return path.stat().st_size


def run_arm(arm: str, corpus: Path, out: Path) -> dict:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, arm, str(corpus), "--model", str(MODEL), "--out", str(out)],
                          capture_output=True, text=True)  # fmt: skip
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{arm} arm failed:\n{done.stderr}")
    rss = json.loads(done.stderr.strip().splitlines()[-1])["maxrss_kib"] / 1024
    digest = hashlib.sha256((out / "train.jsonl").read_bytes()).hexdigest()
    return {"seconds": seconds, "peak_rss_mib": rss, "train_sha256": digest}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, nargs="+", default=[5.0, 20.0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/long-file.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for mb in args.mb:
            corpus = work / f"corpus-{mb:g}"
            corpus.mkdir()
            size = write_long_file(corpus / "long.py", mb)
            runs: dict[str, list[dict]] = {"pieces": [], "whole": []}
            for r in range(args.rounds):
                for arm in ("pieces", "whole") if r % 2 == 0 else ("whole", "pieces"):
                    runs[arm].append(run_arm(arm, corpus, work / f"out-{mb:g}-{arm}-{r}"))
                    print(f"{mb:g} MB, round {r}, {arm}: {runs[arm][-1]['seconds']:.1f} s, "
                          f"{runs[arm][-1]['peak_rss_mib']:.0f} MiB", flush=True)  # fmt: skip
            digests = {run["train_sha256"] for arm in runs.values() for run in arm}
            median = {arm: {key: statistics.median(run[key] for run in arm_runs) for key in ("seconds", "peak_rss_mib")}
                      for arm, arm_runs in runs.items()}  # fmt: skip
            rows.append({
                "file_bytes": size,
                "runs": runs,
                "median": median,
                "same_train_jsonl": len(digests) == 1,
                "whole_over_pieces_memory": median["whole"]["peak_rss_mib"] / median["pieces"]["peak_rss_mib"],
                "whole_over_pieces_seconds": median["whole"]["seconds"] / median["pieces"]["seconds"],
            })  # fmt: skip
    result = {
        "machine": machine(),
        "commit": git_commit(),
        "command": " ".join(["python", *sys.argv]),
        "tokenizer": f"{MODEL} (the demo model's)",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}))


if __name__ == "__main__":
    main()
