"""The device of one data-parallel rank (``torchrun`` starts one process per GPU).

:mod:`usaf.distributed` joins the process group; which GPU a rank computes on, and making it the process's
current device (so NCCL's collectives and the allocator use it), is device knowledge and lives here.
"""

from __future__ import annotations

import torch

from usaf.backends.spec import CUDA


def rank_device(local_rank: int) -> str | None:
    """``cuda:LOCAL_RANK`` where CUDA (or ROCm) is usable, else ``None`` (the rank keeps its ``--device``)."""
    return f"{CUDA}:{local_rank}" if torch.cuda.is_available() else None


def bind_device(device: torch.device) -> None:
    """Make ``device`` the process's current CUDA device; other devices have no such notion."""
    if device.type == CUDA:
        torch.cuda.set_device(device)
