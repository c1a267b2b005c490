"""Bit-reproducible kernels (``usaf train --deterministic``).

On a GPU, scatter-adds (``index_add_``: the experts' combine, the sparse gradient's accumulation) sum in the
order their atomics land, so two equal runs differ in the last bits and the difference grows with training:
a resumed run matches the straight one only within that noise. torch's deterministic algorithms replace
them by ordered kernels (slower), and cuBLAS reduces reproducibly only with a fixed workspace configuration.
The CPU's kernels are deterministic at a fixed thread count already.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from usaf.errors import UsafError

# cuBLAS reads it when its handle is created, i.e. before the process's first matmul on the GPU; a value set
# later is still checked by torch at every cuBLAS call under deterministic algorithms (an error, not a wrong result).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


@contextlib.contextmanager
def deterministic_kernels(enabled: bool) -> Iterator[None]:
    """Within the block, torch's deterministic algorithms, strict: an op without a deterministic kernel raises
    (one usaf error naming it) instead of running nondeterministically. The process's setting is restored after,
    so an in-process caller (tests, the demo) is left as it was."""
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    except RuntimeError as e:
        if "deterministic" not in str(e):
            raise
        first_line = str(e).strip().splitlines()[0]
        raise UsafError(
            f"--deterministic: {first_line}",
            "run without --deterministic: the run is then reproducible only within the device's run-to-run noise",
        ) from e
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
