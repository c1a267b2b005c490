"""The machine a plan is for: the device kind, its compute dtype, the budgets and the fixed costs.

A plan is made for a device kind, not for the device present here (``usaf plan`` answers "would it fit
on a 12 GB card?" on any machine), so nothing here touches a device; the dtype follows the rules of
``usaf.backends.dtype_policy`` for a card of that kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from usaf.errors import UsafError

MIB = 2**20
GIB = 2**30

# The fixed cost of a usaf command on the host, whatever the model: the peak RSS of `usaf train` on the
# 4-layer tiny model (its tensors and activations come to under 3 MiB) was 419.8 MiB, and 414.6 MiB above
# the predicted model part on a 4-layer hidden-256 model (torch 2.13 CPU build, transformers 5.24, Linux,
# tests/test_memory_plan.py). Importing torch and transformers alone measures 247 MiB; transformers'
# modelling stack, tokenizers, safetensors and the CLI make up the rest. A CUDA build of torch maps more.
FRAMEWORK_HOST = 418 * MIB
# What a CUDA context costs on the device (driver, kernels, cuBLAS workspace): about 500 MiB on current
# NVIDIA cards. Measured once, on an H200 (132 SMs; torch 2.11, CUDA 13.0, with a cuBLAS handle): 685 MiB,
# above this figure; consumer cards' contexts are smaller (fewer SMs), none measured yet, so it stays, and the
# 5 % reserve (600 MiB of a 12 GiB card) covers the difference (docs/BENCHMARKS.md, "On a GPU").
CUDA_CONTEXT = 500 * MIB
# Host memory the CUDA runtime maps once initialised (its libraries, cuBLAS/cuDNN handles): 1 GiB, assumed;
# the H200 run measured 262 MiB more RSS after CUDA and cuBLAS initialised (cuDNN and NCCL were not loaded).
CUDA_HOST_RUNTIME = 1 * GIB
# A plan must leave this share of each budget free: allocator fragmentation and caching (PyTorch's CUDA
# allocator reserves more than it allocates), and what the prediction does not see.
RESERVE = 0.05

KINDS = ("cpu", "cuda", "directml")
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Target:
    """Where a plan runs.

    Attributes:
        kind: ``cpu``, ``cuda`` (also ROCm) or ``directml``.
        dtype: compute dtype name (frozen weights and activations; masters and optimizer stay fp32).
        device_budget: bytes of device memory (``None`` on CPU: tensors live in host memory).
        host_budget: bytes of host RAM.
    """

    kind: str
    dtype: str
    device_budget: int | None
    host_budget: int
    index: int | None = None  # the device of --device cuda:N (None: the default one), carried into the commands

    @property
    def device(self) -> str:
        """The --device the plan's commands pass."""
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def c(self) -> int:
        return DTYPES[self.dtype]

    @property
    def separate_device(self) -> bool:
        return self.kind != "cpu"

    @property
    def context(self) -> int:
        """Device bytes taken before any tensor: the CUDA (or DirectML) context."""
        return CUDA_CONTEXT if self.separate_device else 0

    @property
    def host_baseline(self) -> int:
        return FRAMEWORK_HOST + (CUDA_HOST_RUNTIME if self.separate_device else 0)

    def usable(self, budget: int) -> int:
        return int(budget * (1 - RESERVE))


def default_dtype(kind: str) -> str:
    """bf16 on CUDA (assumes compute capability >= 8.0: pass --dtype float16 for older cards), fp16 on
    DirectML (no bf16), fp32 on CPU (half precision is rarely faster there)."""
    return {"cpu": "float32", "cuda": "bfloat16", "directml": "float16"}[kind]


def make_target(kind: str, dtype: str | None, vram: int | None, ram: int, index: int | None = None) -> Target:
    if kind not in KINDS:
        raise UsafError(f"--device {kind}: the planner models {', '.join(KINDS)}", f"pass one of {', '.join(KINDS)}")
    if dtype in (None, "auto"):
        dtype = default_dtype(kind)
    if dtype not in DTYPES:
        raise UsafError(f"--dtype {dtype}: not a compute dtype", f"pass auto or one of {', '.join(DTYPES)}")
    if kind == "directml" and dtype == "bfloat16":
        raise UsafError("--dtype bfloat16: DirectML has no bf16", "pass --dtype float16 or float32")
    if kind == "cpu" and vram is not None:
        raise UsafError(
            "--vram: a CPU plan has no device memory (tensors live in RAM)", "drop --vram, or pass --device cuda"
        )
    if kind != "cpu" and vram is None:
        raise UsafError(f"--device {kind}: how much device memory?", "pass --vram, e.g. --vram 12GiB")
    return Target(kind=kind, dtype=dtype, device_budget=vram, host_budget=ram, index=index)
