"""Facts about the installed torch that several backends need (kept here so each is decided once)."""

from __future__ import annotations

import importlib.util
import shutil

import torch
from torch.torch_version import TorchVersion


def torch_at_least(version: str) -> bool:
    return TorchVersion(torch.__version__) >= version


def has_grouped_mm_op() -> bool:
    """torch ships a grouped matmul op (public since 2.10, private ``_grouped_mm`` since 2.8)."""
    return hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")


def has_triton() -> bool:
    # find_spec, not import: importing triton costs seconds and we only need to know it is there.
    return importlib.util.find_spec("triton") is not None


def has_cxx_compiler() -> bool:
    """Inductor on CPU compiles generated C++; without a compiler torch.compile fails at first call."""
    return any(shutil.which(cc) for cc in ("c++", "g++", "clang++", "cl"))
