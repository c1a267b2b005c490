"""Run every hostile input of usaf.testing.hostile through the real CLI; write the answers as JSON.

    PYTHONPATH=src python scripts/fuzz_readers.py --out benchmarks/results/fuzz_readers.json

Each case is one distinct malformed input (a broken tokens line, a tampered manifest, a pickle that
runs code, a safetensors header that lies, a bad TOML file, ...). The JSON feeds the tables of
docs/RELIABILITY.md (scripts/reliability_report.py). Exit status 1 if any case was answered badly.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fuzz_readers.json"))
    parser.add_argument("--reader", action="append", help="only these readers (repeatable)")
    args = parser.parse_args()

    from usaf.testing import hostile

    cases = [c for c in hostile.all_cases() if not args.reader or c.reader in args.reader]

    def report(outcome) -> None:
        mark = "ok " if outcome.ok else "BAD"
        print(
            f"{mark} [{outcome.reader}] {outcome.case}: {outcome.answer} | {outcome.message[:150]}"
            + (f" | PROBLEMS: {outcome.problems}" if outcome.problems else ""),
            flush=True,
        )

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="usaf-fuzz-") as root:
        outcomes = hostile.run_all(Path(root), cases, progress=report)
    record = {
        "command": "PYTHONPATH=src python scripts/fuzz_readers.py" + (f" --out {args.out}"),
        "seconds": round(time.perf_counter() - start, 1),
        "cases": outcomes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    bad = [o for o in outcomes if not o["ok"]]
    print(f"{len(outcomes)} cases, {len(bad)} answered badly; written to {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
