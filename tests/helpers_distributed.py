"""Running usaf under torchrun in tests: 2 CPU processes on gloo, and comparing what the runs wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def torchrun(*args, nproc: int = 2, entry: tuple = ("-m", "usaf"), **popen) -> subprocess.Popen:
    """``usaf ARGS`` on ``nproc`` ranks (``entry``: what each rank runs, ``-m usaf`` or a script and its arguments)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               *map(str, entry), *map(str, args)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen)


def finished(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    stdout, stderr = proc.communicate(timeout=timeout)
    return proc.returncode, stdout, stderr


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def deltas(run: Path, name: str = "final") -> dict[str, torch.Tensor]:
    return load_file(str(run / name / "deltas.safetensors"))


def assert_same_deltas(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if a[key].dtype == torch.int64:
            assert torch.equal(a[key], b[key]), key
        else:
            assert torch.allclose(a[key], b[key], rtol=0, atol=atol), (key, (a[key] - b[key]).abs().max())
