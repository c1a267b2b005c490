"""Write a ``.safetensors`` file readable as the user's other files are.

safetensors >= 0.8 writes through its own temporary (Rust's tempfile crate), created with mode 0600
and renamed onto the target: every tensor file came out readable by its owner only, while the JSON
beside it followed the umask. A model exported for a team, or a run read by another account (a
container, a shared box), then failed with "permission denied" on exactly the weights. Every usaf
write of a tensor file goes through :func:`save_tensors`, which gives the file the mode a plain
``open()`` would have (0666 less the umask).
"""

from __future__ import annotations

import os
from pathlib import Path

import safetensors.torch
import torch


def _umask() -> int:
    """The process's umask now (read each time: a caller may change it between writes)."""
    try:  # Linux: read without changing it (setting it, even briefly, races other threads' file creation)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o077)  # elsewhere: set and put back; a file made in between is only more private
    os.umask(umask)
    return umask


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    # looked up at call time: the crash and fault harnesses replace safetensors.torch.save_file
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    if os.name == "posix":
        os.chmod(path, 0o666 & ~_umask())
