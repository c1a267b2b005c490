"""A quantized stack of expert weights, its serialisable form, and dequantization.

E = experts, O = output features, I = input features. Codes are stored out-major ``(E, O, I)``,
grouped along I, whatever the model's in-memory orientation; ``transposed`` records that the model
holds ``(E, I, O)`` (gpt-oss), so :func:`dequantize` can hand back the in-memory orientation.
The weight of code ``q`` in group ``g`` is ``(q - zero[g]) * scale[g]`` (hqq's convention: the
zero point is in code units and need not be an integer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

import torch

from usaf.backends.transfer import move, upload
from usaf.quant.packing import PACKING, codes_at, packed_width, unpack_codes_as

QUANT_METHODS = ("hqq", "rtn")
SUPPORTED_NBITS = (2, 3, 4, 8)

_TENSOR_FIELDS = {"codes": torch.uint8, "scale": torch.float16, "zero": torch.float16}


@dataclass(frozen=True)
class QuantizedTensor:
    """One fused expert tensor (all experts of one layer), quantized.

    Construction validates dtypes and shapes (metadata only, no pass over the data).
    """

    codes: torch.Tensor = field(repr=False)  # (E, O, packed_I) uint8, layout ``packing`` (usaf.quant.packing)
    scale: torch.Tensor = field(repr=False)  # (E, O, I // group_size) float16
    zero: torch.Tensor = field(repr=False)  # (E, O, I // group_size) float16, in code units
    shape: tuple[int, int, int]  # (E, O, I): the stored, out-major orientation
    nbits: int
    group_size: int  # the effective one: it divides I
    method: str  # "hqq" | "rtn"
    transposed: bool  # the model's tensor is (E, I, O)
    source_dtype: str  # dtype of the weights that were quantized, e.g. "bfloat16"
    packing: str = PACKING

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        problem = _problem(self.__dict__)
        if problem:
            raise ValueError(f"QuantizedTensor: {problem}")

    @property
    def nbytes(self) -> int:
        """Bytes of codes + scale + zero."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    @property
    def memory_shape(self) -> tuple[int, int, int]:
        """The model's in-memory orientation: ``(E, I, O)`` if transposed, else ``(E, O, I)``."""
        e, o, i = self.shape
        return (e, i, o) if self.transposed else (e, o, i)

    def to(self, device: str | torch.device, *, non_blocking: bool = False, copy: bool = False) -> QuantizedTensor:
        """The same tensor with codes, scale and zero on ``device`` (e.g. resident on the GPU).

        ``non_blocking`` from pinned memory overlaps the copy with compute; ``copy`` forces new storage
        even on the same device."""
        moved = {k: getattr(self, k).to(device, non_blocking=non_blocking, copy=copy) for k in _TENSOR_FIELDS}
        return QuantizedTensor(**{**self._fields(), **moved})

    def pin_memory(self) -> QuantizedTensor:
        """A copy in page-locked host memory (so host-to-device copies can run asynchronously)."""
        pinned = {k: getattr(self, k).pin_memory() for k in _TENSOR_FIELDS}
        return QuantizedTensor(**{**self._fields(), **pinned})

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.zero

    def to_dict(self) -> dict:
        """Plain dict (tensors, ints, strs, bools, a list): ``torch.save``-able, ``weights_only``-loadable."""
        d = self._fields()
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: Mapping, *, name: str = "") -> QuantizedTensor:
        """Inverse of :meth:`to_dict`, validating everything a corrupted or foreign file could get wrong.

        Raises:
            ValueError: naming ``name`` and the problem (missing/unknown key, wrong type, dtype or
                shape, codes length inconsistent with shape and nbits, non-finite scale or zero).
        """
        label = name or "quantized tensor"
        if not isinstance(d, Mapping):
            raise ValueError(f"{label}: expected a dict, got {type(d).__name__}")
        keys = {f.name for f in fields(cls)}
        missing, unknown = sorted(keys - set(d)), sorted(set(d) - keys)
        if missing or unknown:
            raise ValueError(f"{label}: missing keys {missing}, unknown keys {unknown}")
        problem = _problem(d)
        if not problem:
            bad = [k for k in ("scale", "zero") if not bool(torch.isfinite(d[k]).all())]
            problem = f"{bad[0]} has non-finite values" if bad else None
        if problem:
            raise ValueError(f"{label}: {problem}")
        return cls(**{**d, "shape": tuple(d["shape"])})

    def _fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _problem(d: Mapping) -> str | None:
    """The first thing wrong with the fields in ``d`` (metadata only), or None."""

    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    shape = d["shape"]
    if not (isinstance(shape, (list, tuple)) and len(shape) == 3 and all(is_int(s) and s > 0 for s in shape)):
        return f"shape must be 3 positive ints (E, O, I), got {shape!r}"
    e, o, i = shape
    if not (is_int(d["nbits"]) and d["nbits"] in SUPPORTED_NBITS):
        return f"nbits must be one of {SUPPORTED_NBITS}, got {d['nbits']!r}"
    g = d["group_size"]
    if not (is_int(g) and g > 0 and i % g == 0):
        return f"group_size {g!r} does not divide I={i}"
    if not (isinstance(d["method"], str) and d["method"] in QUANT_METHODS):
        return f"method must be one of {QUANT_METHODS}, got {d['method']!r}"
    if not isinstance(d["transposed"], bool):
        return f"transposed must be a bool, got {d['transposed']!r}"
    src = d["source_dtype"]
    source = getattr(torch, src, None) if isinstance(src, str) else None
    if not (isinstance(source, torch.dtype) and source.is_floating_point):  # what was quantized: float weights
        return f"source_dtype must name a floating-point torch dtype, got {src!r}"
    if not (isinstance(d["packing"], str) and d["packing"] == PACKING):
        return f"packing {d['packing']!r} is not supported (expected {PACKING!r})"
    expected = {"codes": (e, o, packed_width(i, d["nbits"])), "scale": (e, o, i // g), "zero": (e, o, i // g)}
    for key, dtype in _TENSOR_FIELDS.items():
        t = d[key]
        if not isinstance(t, torch.Tensor):
            return f"{key} must be a tensor, got {type(t).__name__}"
        if t.dtype != dtype:
            return f"{key} has dtype {t.dtype}, expected {dtype}"
        if tuple(t.shape) != expected[key]:
            return f"{key} has shape {tuple(t.shape)}, expected {expected[key]} for shape {tuple(shape)}, " + (
                f"{d['nbits']} bits, group size {g}"
            )
    return None


def dequantize(
    q: QuantizedTensor,
    *,
    experts: Sequence[int] | slice | torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    memory_layout: bool = True,
) -> torch.Tensor:
    """Unpack and rescale the selected experts.

    Only the selected experts' codes are moved to ``device`` and unpacked; the arithmetic runs there
    in fp32 (fp64 if ``dtype`` is fp64) and the result is cast to ``dtype`` at the end, because an
    fp16/bf16 ``code - zero`` would round away part of the zero point.

    Args:
        q: the quantized tensor.
        experts: expert indices (a sequence or 1-D integer/bool tensor; negative counts from the
            end), a slice, or None for all.
        dtype: result dtype.
        device: where to compute and return; default the device of ``q.codes``.
        memory_layout: return the model's orientation (``(E', I, O)`` if ``q.transposed``); if False,
            the stored ``(E', O, I)``.

    Returns:
        Contiguous ``(E', O, I)`` or ``(E', I, O)`` tensor.
    """
    codes, scale, zero = _select(q, experts)
    device = torch.device(device) if device is not None else codes.device
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    e = codes.shape[0]
    _, o, i = q.shape
    g = q.group_size
    w = unpack_codes_as(codes.to(device), q.nbits, i, compute)  # (E', O, I), a new tensor: edited in place
    groups = w.view(e, o, i // g, g)
    groups.sub_(move(zero, device, compute).unsqueeze(-1)).mul_(move(scale, device, compute).unsqueeze(-1))
    if q.transposed and memory_layout:
        w = w.transpose(1, 2)  # (E', I, O)
    if w.dtype == dtype and w.is_contiguous():
        return w
    return torch.empty(w.shape, dtype=dtype, device=device).copy_(w)  # one copy: cast and lay out at once


def dequantize_entries(
    q: QuantizedTensor, indices: torch.Tensor, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weights at some flat indices of the stored ``(E, O, I)`` orientation, without whole experts.

    Bit-identical to ``dequantize(q, dtype=dtype, memory_layout=False).view(-1)[indices]`` (the same fp32
    arithmetic, element by element), in time and memory O(n): what a fold needs when it touches a few
    entries of many experts (:meth:`usaf.engine.experts.ExpertWeight._write_frozen`).

    Args:
        q: the quantized tensor.
        indices: ``(n,)`` int64 flat indices into ``(E, O, I)``, on the device of ``q.codes``.
        dtype: result dtype.

    Returns:
        ``(n,)`` on the device of ``q.codes``.
    """
    _, o, i = q.shape
    rows, cols = indices // i, indices % i  # rows index (E*O): codes, scale and zero viewed as 2-D
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    codes = codes_at(q.codes.view(-1, q.codes.shape[-1]), q.nbits, rows, cols).to(compute)  # (n,)
    group = cols // q.group_size
    zero = q.zero.view(-1, q.zero.shape[-1])[rows, group].to(compute)
    scale = q.scale.view(-1, q.scale.shape[-1])[rows, group].to(compute)
    return ((codes - zero) * scale).to(dtype)


def _select(q: QuantizedTensor, experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, zero) of the selected experts; a slice or None gives views, no copy."""
    if experts is None:
        return q.codes, q.scale, q.zero
    if isinstance(experts, slice):
        return q.codes[experts], q.scale[experts], q.zero[experts]
    n = q.shape[0]
    # Checked where the selection lives and moved after: a host selection (the grouped forward's blocks) over
    # codes on a GPU would otherwise read its min and max back from the device, two syncs per block.
    idx = torch.as_tensor(experts)
    if idx.dtype == torch.bool:
        if idx.shape != (n,):
            raise IndexError(f"boolean expert mask has shape {tuple(idx.shape)}, expected ({n},)")
        idx = idx.nonzero().squeeze(1)
    if idx.dim() != 1 or (idx.numel() and (idx.is_floating_point() or idx.is_complex())):
        raise IndexError(f"experts must be a 1-D sequence of ints, a slice or None, got {experts!r}")
    idx = idx.long()
    idx = torch.where(idx < 0, idx + n, idx)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise IndexError(f"expert index out of range for {n} experts: {experts!r}")
    idx = upload(idx, q.codes.device)
    return q.codes.index_select(0, idx), q.scale.index_select(0, idx), q.zero.index_select(0, idx)


def relative_error(reference: torch.Tensor, q: QuantizedTensor) -> float:
    """``||W - dequantize(q)||_F / ||W||_F`` in fp32, one expert at a time.

    ``reference`` may be in the in-memory (:attr:`QuantizedTensor.memory_shape`) or the stored
    orientation; the in-memory one is assumed when both match (square, transposed). Returns 0.0 for
    an all-zero reference that is reproduced exactly, ``inf`` if it is not.
    """
    if tuple(reference.shape) == q.memory_shape:
        memory_layout = True
    elif tuple(reference.shape) == q.shape:
        memory_layout = False
    else:
        raise ValueError(f"reference shape {tuple(reference.shape)} matches neither {q.memory_shape} nor {q.shape}")
    num = den = 0.0  # python floats (fp64) so that thousands of slices add up without fp32 loss
    for e in range(q.shape[0]):
        ref = reference[e].to(torch.float32)
        deq = dequantize(q, experts=slice(e, e + 1), device=ref.device, memory_layout=memory_layout)[0]
        num += float((ref - deq).square().sum())
        den += float(ref.square().sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)
