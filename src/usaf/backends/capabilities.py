"""What a backend can do, and the dtype policy that follows from it.

Code outside ``usaf.backends`` branches on these flags, never on backend names, so a new backend
(or a new card) only has to declare its flags correctly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Capabilities:
    """Flags a backend declares about itself.

    Attributes:
        bf16: bfloat16 math runs natively (not emulated): NVIDIA compute capability >= 8.0, ROCm,
            MPS on macOS 14+, CPUs (slow without AMX, but exact to spec).
        fp16: float16 math is supported.
        autocast: ``torch.autocast`` works for this device type. Without it, mixed precision means
            casting weights and activations to the compute dtype explicitly.
        prefers_half: half precision is the faster default here (GPUs). CPUs default to fp32 because
            half precision is rarely faster there and costs accuracy.
        pinned_memory: page-locked host buffers make host -> device copies faster and asynchronous,
            so streaming weights from host memory should use them.
        memory_stats: device total/free/allocated memory can be queried.
        unified_memory: device tensors live in host RAM (CPU, Apple silicon), so keeping a copy in
            host memory "to stream it" saves nothing.
        float64: float64 tensors are supported (MPS has none; some DirectML GPUs lack them).
        torch_compile: ``torch.compile`` (inductor) is expected to work: Triton on CUDA >= 7.0 / ROCm,
            a C++ compiler on CPU.
        grouped_mm: torch's grouped matmul kernel runs here (transformers' ``grouped_mm`` experts
            path): CPU with torch >= 2.9, CUDA >= 8.0 with torch >= 2.9 (Hopper only before). usaf's
            grouped forward of frozen layers (``usaf.engine.grouped``) uses it where set, else one GEMM
            per expert of a block, so torch 2.4 needs no fallback beyond that.
        index_ops: ``one_hot``, ``index_add_``, ``nonzero`` and scatter run on the device. DirectML
            rejects them ("partially modified dimensions"); without them the experts forward does its
            routing bookkeeping on the host and combines expert outputs by a gather (no scatter).
        max_allocation_bytes: the largest single tensor the device allocates (DirectML: about 800 MB),
            or None for no limit below the device's memory. Larger tensors stay in host memory.
        to_device_and_dtype: ``tensor.to(device, dtype)`` honours both in one call. torch-directml
            ignores the dtype then, so :func:`usaf.backends.move` makes two calls.
        direct_load: safetensors can read a file straight onto this device; else read on the host, then move.
        reproducible: equal runs give equal bytes with torch's default kernels (the CPU's, at a fixed thread
            count). A GPU's scatter-adds sum in the order their atomics land: there only ``usaf train
            --deterministic`` makes a resumed run equal the straight one bit for bit (measured on an H200).
        dense_delta_terms: a sparse delta's terms run faster as GEMMs over the delta formed dense, one expert's
            ``(O, I)`` at a time, than as gathers and scatters (``usaf.engine.sparse_linear``'s ``"dense"``): on
            CUDA, where the scatters are colliding atomics and a GEMM of the same tokens is cheap (an H200's
            training step: 3.3× less device time). Not on the CPU (its fp32 GEMMs cost more than the gathers),
            not measured on ROCm's or MPS's kernels (ROCm shares CUDA's backend, so it follows CUDA).
        unpack_via_int16: 4-bit codes unpack faster through an int16 scratch, 1 MiB of codes at a time, and one
            contiguous cast than by writing each nibble into the output, a strided write
            (``usaf.quant.packing``): on the CPU, 1.6x on a frozen block of experts (docs/BENCHMARKS.md, "The 4-bit
            codes unpacked through an int16 scratch"). Devices keep the nibble form, four operators where the
            int16 form takes six per chunk; not measured there.
    """

    bf16: bool
    fp16: bool
    autocast: bool
    prefers_half: bool
    pinned_memory: bool
    memory_stats: bool
    unified_memory: bool
    float64: bool
    torch_compile: bool
    grouped_mm: bool
    index_ops: bool = True
    max_allocation_bytes: int | None = None
    to_device_and_dtype: bool = True
    direct_load: bool = True
    reproducible: bool = False
    dense_delta_terms: bool = False
    unpack_via_int16: bool = False

    def as_dict(self) -> dict[str, bool | int | None]:
        return asdict(self)


@dataclass(frozen=True)
class DTypePolicy:
    """The dtypes a run uses on one backend (see method.md §6: one loss-scaling policy).

    Attributes:
        compute: dtype of frozen weights (dequantized expert bases, attention) and of activations.
        master: dtype of trainable parameters and optimizer state; always float32, so small
            updates to sparse deltas are not rounded away.
        autocast: dtype for ``torch.autocast``, or ``None`` when the backend has no autocast or the
            run is fp32; then the engine casts explicitly to ``compute``.
        loss_scaling: fp16 gradients underflow without dynamic loss scaling; bf16 and fp32 need none.
    """

    compute: torch.dtype
    master: torch.dtype
    autocast: torch.dtype | None
    loss_scaling: bool

    @property
    def mixed(self) -> bool:
        """Whether this is a mixed-precision run (compute dtype narrower than the fp32 master)."""
        return self.compute != self.master

    def as_dict(self) -> dict[str, Any]:
        return {
            "compute": dtype_name(self.compute),
            "master": dtype_name(self.master),
            "autocast": None if self.autocast is None else dtype_name(self.autocast),
            "loss_scaling": self.loss_scaling,
        }


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (for manifests and tables)."""
    return str(dtype).removeprefix("torch.")


def dtype_policy(caps: Capabilities, amp: bool | None = None) -> DTypePolicy:
    """Derive the dtype policy from capabilities.

    Args:
        caps: the backend's capabilities.
        amp: ``True``/``False`` forces mixed precision on/off (``USE_AMP``); ``None`` takes the
            backend's default (half precision on GPUs, fp32 on CPU).

    Returns:
        bf16 where the backend has it; fp16 with dynamic loss scaling where it has only fp16; fp32
        when mixed precision is off or impossible.
    """
    fp32 = torch.float32
    use_half = caps.prefers_half if amp is None else amp
    if use_half and caps.bf16:
        half, scaling = torch.bfloat16, False
    elif use_half and caps.fp16:
        half, scaling = torch.float16, True
    else:
        return DTypePolicy(compute=fp32, master=fp32, autocast=None, loss_scaling=False)
    return DTypePolicy(compute=half, master=fp32, autocast=half if caps.autocast else None, loss_scaling=scaling)
