"""Peak resident memory of a command, measured in a fresh process (Linux).

The command is started by a small wrapper process, which reports ``getrusage(RUSAGE_CHILDREN).ru_maxrss``
once it has finished. Starting it straight from a test or benchmark would be wrong: Linux carries the
high-water RSS of the address space a process replaces at exec into its ``ru_maxrss``, so a child forked
from a large Python process reports at least that process's RSS (``benchmarks/bench_engine.py`` found
this the hard way).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

WRAPPER = (
    "import resource, subprocess, sys\n"
    "p = subprocess.run(sys.argv[1:])\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(p.returncode)\n"
)


def peak_rss(command: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None) -> int:
    """Peak RSS in bytes of ``command`` run to completion in a fresh process.

    Raises:
        RuntimeError: the command failed (its stderr is in the message).
    """
    if not sys.platform.startswith("linux"):
        raise RuntimeError("peak_rss reads ru_maxrss in KiB, as Linux reports it")
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, *command],
        capture_output=True,
        text=True,
        env=None if env is None else {**os.environ, **env},
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return int(proc.stdout.strip().splitlines()[-1]) * 1024


def import_baseline(*, env: Mapping[str, str] | None = None) -> int:
    """Peak RSS of a fresh Python that imports torch, transformers and usaf's engine, and nothing more."""
    code = "import torch, transformers, usaf.engine.engine, usaf.engine.loading, usaf.stages.train"
    return peak_rss([sys.executable, "-c", code], env=env)
