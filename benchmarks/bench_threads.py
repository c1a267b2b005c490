"""Benchmark: `usaf demo --quick` on an idle machine and with other processes busy on some cores (issue 21, item 4).

Arms, each a fresh ``usaf demo --quick`` (wall time of the whole command, a new workspace every time):

- idle, usaf's thread choice (``usaf.backends.cpu.choose_threads``: torch's default on an idle machine);
- loaded, usaf's thread choice (it sees the busy cores and runs that many threads fewer, at least one);
- loaded, ``OMP_NUM_THREADS`` = torch's default: what every command did before the choice;
- loaded, ``OMP_NUM_THREADS=1``.

"Loaded" is ``--busy`` processes ``python -c 'while True: pass'`` (default 1; the issue's goal: one per core)
started before the arm and killed after it. For the
issue's yardstick, a plain transformers forward of the demo model (batch 2 x 256, 20 forwards, torch's default
threads, ``OMP_NUM_THREADS`` fixed so nothing adapts) is timed idle and loaded in a child process the same way.

    python benchmarks/bench_threads.py [--busy 1] [--out benchmarks/results/threads.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BUSY = [sys.executable, "-c", "while True: pass"]
FORWARD = """
import time, torch
from transformers import AutoModelForCausalLM
from usaf.demo import demo_model_dir
model = AutoModelForCausalLM.from_pretrained(demo_model_dir(), dtype=torch.float32).eval()
ids = torch.randint(1, 4000, (2, 256), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    model(input_ids=ids)
    start = time.perf_counter()
    for _ in range(20):
        model(input_ids=ids)
print(time.perf_counter() - start)
"""


def default_threads() -> int:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         capture_output=True, text=True, check=True, env={k: v for k, v in os.environ.items()
                                                                          if k != "OMP_NUM_THREADS"})  # fmt: skip
    return int(out.stdout.strip())


def timed(cmd: list[str], env: dict, busy: int) -> tuple[float, str]:
    """Wall seconds and stdout of ``cmd`` with ``busy`` busy processes running beside it."""
    spinners = [subprocess.Popen(BUSY) for _ in range(busy)]
    try:
        time.sleep(1.0 if busy else 0.0)  # the busy processes run before the command samples the load
        start = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        return time.perf_counter() - start, done.stdout
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=1, help="busy processes in the loaded arms (goal: one per core)")
    parser.add_argument("--out", type=Path, default=RESULTS / "threads.json")
    args = parser.parse_args()
    if args.busy < 1:
        parser.error("--busy must be at least 1")
    busy = args.busy
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    default = default_threads()
    arms = {
        "idle, usaf's choice": (base, 0),
        "loaded, usaf's choice": (base, busy),
        f"loaded, OMP_NUM_THREADS={default} (before the choice)": ({**base, "OMP_NUM_THREADS": str(default)}, busy),
        "loaded, OMP_NUM_THREADS=1": ({**base, "OMP_NUM_THREADS": "1"}, busy),
    }
    result: dict = {"cpus": os.cpu_count(), "busy_processes": busy, "torch_default_threads": default,
                    "demo_quick_seconds": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="usaf-bench-threads-") as tmp:
        for i, (name, (env, loaded)) in enumerate(arms.items()):
            cmd = [sys.executable, "-m", "usaf", "demo", "--quick", "--workspace", str(Path(tmp) / f"ws{i}")]
            seconds, _ = timed(cmd, env, loaded)
            result["demo_quick_seconds"][name] = seconds
            print(f"[demo --quick] {name}: {seconds:.1f} s", flush=True)
    fixed = {**base, "OMP_NUM_THREADS": str(default)}
    forward = {}
    for name, loaded in (("idle", 0), ("loaded", busy)):
        _, out = timed([sys.executable, "-c", FORWARD], fixed, loaded)
        forward[name] = float(out.strip().splitlines()[-1])
        print(f"[transformers forward x20] {name}: {forward[name]:.2f} s", flush=True)
    demo = result["demo_quick_seconds"]
    idle = demo["idle, usaf's choice"]
    result["transformers_forward_seconds"] = forward
    result["slowdown"] = {
        "usaf demo, usaf's choice": demo["loaded, usaf's choice"] / idle,
        "usaf demo, before": demo[f"loaded, OMP_NUM_THREADS={default} (before the choice)"] / idle,
        "transformers forward": forward["loaded"] / forward["idle"],
    }
    print(json.dumps(result["slowdown"], indent=1))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
