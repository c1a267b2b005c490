"""Quantize stacked expert weights, one expert slice at a time.

Two methods, same storage (see :mod:`usaf.quant.tensor`):

- ``"hqq"``: Half-Quadratic Quantization via the ``hqq`` library's own code
  (``hqq.core.quantize.Quantizer.quantize`` with ``optimize=True``): min-max initialisation, then a
  proximal solver that moves the zero point to minimise an l_p (p=0.7) error with early stopping.
  Called with ``axis=1`` (groups of consecutive input features; its default ``axis=0`` would group
  along the output axis), ``bitpack=False`` (we pack ourselves) and an explicit ``device`` (its
  default is ``"cuda"``). On CUDA hqq runs its solver in fp16 (its choice); elsewhere in fp32.
- ``"rtn"``: plain min-max round-to-nearest in torch, fp32 (what the original prototype called
  "HQQ"). About 20x faster on CPU.

For both, the scale and zero are rounded to the stored float16 first and the codes are then rounded
against those stored values, so dequantization uses exactly the parameters the codes were chosen for
(at 8 bits, fp16 rounding of a zero point near 200 is a visible fraction of a code step).
"""

from __future__ import annotations

import torch

from usaf.backends.transfer import move
from usaf.quant.packing import pack_codes, packed_width
from usaf.quant.tensor import QUANT_METHODS, SUPPORTED_NBITS, QuantizedTensor


def effective_group_size(in_features: int, requested: int) -> int:
    """``requested`` if it divides ``in_features``, else the largest divisor of ``in_features`` below it.

    Examples: (2048, 128) -> 128; (96, 128) -> 96; (2880, 128) -> 120.

    Raises:
        ValueError: ``requested < 1`` or ``in_features < 1``.
    """
    if requested < 1:
        raise ValueError(f"group size must be >= 1, got {requested}")
    if in_features < 1:
        raise ValueError(f"in_features must be >= 1, got {in_features}")
    return next(g for g in range(min(requested, in_features), 0, -1) if in_features % g == 0)


def quantize_experts(
    weight: torch.Tensor,
    *,
    method: str = "hqq",
    nbits: int = 4,
    group_size: int = 128,
    transposed: bool = False,
    device: str | torch.device = "cpu",
) -> QuantizedTensor:
    """Quantize a stack of expert weights, grouping along the input axis.

    Memory: one fp32 expert slice (plus the method's workspace) on ``device`` at a time; the result
    (about ``nbits/8 + 4/group_size`` bytes per weight) is kept on the CPU.

    Args:
        weight: ``(E, O, I)`` (``nn.Linear`` out x in per expert), or ``(E, I, O)`` if ``transposed``
            (gpt-oss keeps experts input-major); any floating dtype, any device.
        method: ``"hqq"`` or ``"rtn"`` (see the module docstring).
        nbits: 2, 3, 4 or 8.
        group_size: requested weights per (scale, zero) along I; passed through
            :func:`effective_group_size`, and the result records the effective one.
        transposed: ``weight`` is ``(E, I, O)``; it is stored transposed to ``(E, O, I)``.
        device: where each slice is quantized.

    Returns:
        The :class:`QuantizedTensor`, tensors on the CPU.

    Raises:
        ValueError: bad method, nbits, rank or dtype, a non-finite weight, or a scale/zero that does
            not fit in float16.
    """
    if method not in QUANT_METHODS:
        raise ValueError(f"method must be one of {QUANT_METHODS}, got {method!r}")
    if nbits not in SUPPORTED_NBITS:
        raise ValueError(f"nbits must be one of {SUPPORTED_NBITS}, got {nbits!r}")
    if weight.dim() != 3 or not weight.is_floating_point():
        raise ValueError(f"expected a 3-D floating tensor of stacked experts, got {weight.dtype} {tuple(weight.shape)}")
    e, o, i = (weight.shape[0], weight.shape[2], weight.shape[1]) if transposed else tuple(weight.shape)
    g = effective_group_size(i, group_size)
    device = torch.device(device)
    codes = torch.empty((e, o, packed_width(i, nbits)), dtype=torch.uint8)
    scale = torch.empty((e, o, i // g), dtype=torch.float16)
    zero = torch.empty_like(scale)
    solve = _hqq_params if method == "hqq" else _rtn_params
    with torch.no_grad():
        for x in range(e):
            w = weight[x].T if transposed else weight[x]  # (O, I)
            w = move(w, device, torch.float32).contiguous()
            if not bool(torch.isfinite(w).all()):
                raise ValueError(f"expert {x} has non-finite weights")
            s, z = solve(w, nbits, g)  # (O, I/g) each, fp32
            s, z = s.to(torch.float16), z.to(torch.float16)
            if not (bool(torch.isfinite(s).all()) and bool(torch.isfinite(z).all())):
                raise ValueError(f"expert {x}: scale or zero overflows float16 (weights too large?)")
            q = _round_codes(w, s.float(), z.float(), nbits, g)  # (O, I)
            codes[x] = pack_codes(q, nbits).cpu()
            scale[x], zero[x] = s.cpu(), z.cpu()
    return QuantizedTensor(
        codes=codes,
        scale=scale,
        zero=zero,
        shape=(e, o, i),
        nbits=nbits,
        group_size=g,
        method=method,
        transposed=transposed,
        source_dtype=str(weight.dtype).removeprefix("torch."),
    )


def _round_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, nbits: int, g: int) -> torch.Tensor:
    """Nearest codes for ``w`` (O, I) given per-group ``scale``, ``zero`` (O, I/g) -> (O, I) uint8."""
    o, i = w.shape
    q = w.view(o, i // g, g) / scale.unsqueeze(-1) + zero.unsqueeze(-1)
    return q.round_().clamp_(0, 2**nbits - 1).to(torch.uint8).view(o, i)


def _rtn_params(w: torch.Tensor, nbits: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max scale and zero of each group: the group's range spans codes 0 .. 2**nbits - 1."""
    o, i = w.shape
    groups = w.view(o, i // g, g)
    lo, hi = groups.amin(-1), groups.amax(-1)  # (O, I/g)
    # A (near-)constant group would get a vanishing scale and a zero point too large for fp16; the floor
    # keeps |zero| <= 2**14 and costs at most |w| * 2**-15 of error, below bf16's own rounding.
    floor = torch.maximum(lo.abs(), hi.abs()).clamp_(min=1.0) * 2.0**-14
    scale = torch.maximum((hi - lo) / (2**nbits - 1), floor)
    return scale, -lo / scale


def _hqq_params(w: torch.Tensor, nbits: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """hqq's optimised scale and zero of each group (w = (q - zero) * scale)."""
    from hqq.core.quantize import Quantizer  # lazy: importing hqq takes seconds

    o, i = w.shape
    _, meta = Quantizer.quantize(
        w,
        nbits=nbits,
        channel_wise=True,
        group_size=g,
        optimize=True,
        round_zero=False,
        axis=1,  # groups of g consecutive elements of the row-major (O, I) slice: along I
        bitpack=False,
        view_as_float=False,
        device=str(w.device),
    )
    # meta["scale"] is already inverted back to weight units; both are (O * I/g, 1)
    return meta["scale"].reshape(o, i // g).float(), meta["zero"].reshape(o, i // g).float()
