"""Benchmark: the chunked next-token loss against cross-entropy on the whole logits, side by side.

Workload: Qwen3-30B-A3B's output projection (hidden 2048, vocabulary 151,936; random weights, frozen), a
microbatch of ``B × T`` random hidden states and targets (the first 8 positions of each sequence unscored),
fp32 and bf16 on the CPU. Two arms, each the loss forward + backward to the hidden states (what a training step does
above the last layer):

- **whole**: what the engine did before: ``head(hidden)[:, :-1].float()`` and ``F.cross_entropy(..., "sum")``
  on the ``(B, T-1, V)`` logits.
- **chunked**: ``usaf.engine.head_loss.next_token_loss`` (64 MiB of fp32 logits per chunk, its default).

Memory: each arm runs once in a fresh process with glibc's mmap threshold lowered
(``MALLOC_MMAP_THRESHOLD_=65536``) so that freed large tensors leave the RSS; reported is the peak RSS
during the step above the RSS just before it (Linux's high-water mark reset through
``/proc/self/clear_refs``), and the bytes autograd saved for backward (the engine's ``SavedTensorMeter``).
Time: both arms interleaved in one process, medians of ``--repeats``.

    python benchmarks/bench_head_loss.py [--tokens 512 1024] [--dtypes float32 bfloat16] [--repeats 3] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import RESULTS, machine  # noqa: E402

from usaf.engine.activations import SavedTensorMeter  # noqa: E402
from usaf.engine.head_loss import CHUNK_LOGIT_BYTES, next_token_loss  # noqa: E402

HIDDEN, VOCAB = 2048, 151_936  # Qwen3-30B-A3B


def inputs(batch: int, seq: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.normal_(0, 0.02, generator=g)
    head = head.to(dtype)
    hidden = torch.randn(batch, seq, HIDDEN, generator=g).to(dtype).requires_grad_(True)
    labels = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels[:, :8] = -100
    return head, hidden, labels


def whole(head, hidden, labels) -> torch.Tensor:
    logits = head(hidden)[:, :-1].float()  # (B, T-1, V)
    targets = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum")


def chunked(head, hidden, labels) -> torch.Tensor:
    return next_token_loss(hidden, labels, head)[0]


ARMS = {"whole": whole, "chunked": chunked}


def step(arm: str, head, hidden, labels) -> tuple[float, int]:
    """One forward + backward; returns (loss, bytes saved for backward)."""
    meter = SavedTensorMeter(lambda: {head.weight.untyped_storage().data_ptr()})
    hidden.grad = None
    with meter.measure():
        loss = ARMS[arm](head, hidden, labels)
    loss.backward()
    return float(loss.detach()), meter.last


def _status_bytes(field: str) -> int:
    """``VmRSS``/``VmHWM`` of this process, in bytes (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(arm: str, batch: int, seq: int, dtype: str) -> None:
    """In a fresh process: peak RSS during one step of ``arm`` above the RSS just before it."""
    head, hidden, labels = inputs(batch, seq, getattr(torch, dtype))
    torch.zeros(1).sum()  # torch's lazy init before the baseline
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark (VmHWM) to the current RSS
    base = _status_bytes("VmRSS")
    loss, saved = step(arm, head, hidden, labels)
    print(json.dumps({"extra": _status_bytes("VmHWM") - base, "saved": saved, "loss": loss}))


def memory(arm: str, batch: int, seq: int, dtype: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    code = [sys.executable, __file__, "--child", arm, str(batch), str(seq), dtype]
    out = subprocess.run(code, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def timing(batch: int, seq: int, dtype: str, repeats: int) -> dict:
    head, hidden, labels = inputs(batch, seq, getattr(torch, dtype))
    times = {arm: [] for arm in ARMS}
    losses = {}
    for arm in ARMS:  # warm-up
        losses[arm] = step(arm, head, hidden, labels)[0]
    for r in range(repeats):
        for arm in ARMS if r % 2 == 0 else reversed(list(ARMS)):
            start = time.perf_counter()
            step(arm, head, hidden, labels)
            times[arm].append(time.perf_counter() - start)
    medians = {arm: statistics.median(t) for arm, t in times.items()}
    return {"seconds": medians, "chunked_over_whole": medians["chunked"] / medians["whole"], "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024], help="tokens per microbatch (B=1)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "head_loss.json")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]), args.child[3])
        return
    rows = []
    for dtype in args.dtypes:
        for tokens in args.tokens:
            row = {"dtype": dtype, "batch": 1, "seq": tokens}
            row["memory"] = {arm: memory(arm, 1, tokens, dtype) for arm in ARMS}
            row["timing"] = timing(1, tokens, dtype, args.repeats)
            row["whole_logits_fp32_bytes"] = (tokens - 1) * VOCAB * 4
            rows.append(row)
            m = row["memory"]
            print(
                f"{dtype} T={tokens}: extra RSS whole {m['whole']['extra'] / 2**20:.0f} MiB, chunked "
                f"{m['chunked']['extra'] / 2**20:.0f} MiB; saved whole {m['whole']['saved'] / 2**20:.0f} MiB, "
                f"chunked {m['chunked']['saved'] / 2**20:.1f} MiB; time chunked/whole "
                f"{row['timing']['chunked_over_whole']:.2f}; losses {row['timing']['losses']}",
                flush=True,
            )
    result = {
        "machine": machine(),
        "workload": {"hidden": HIDDEN, "vocab": VOCAB, "chunk_logit_bytes": CHUNK_LOGIT_BYTES},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
