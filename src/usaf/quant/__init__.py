"""Quantized (2/3/4/8-bit, 4 by default) storage of frozen expert weights: quantize, store, dequantize.

Modules: :mod:`~usaf.quant.quantize` (the hqq and rtn methods), :mod:`~usaf.quant.tensor` (the
stored form and dequantization), :mod:`~usaf.quant.packing` (the bit layout) and
:mod:`~usaf.quant.ptfile` (a streaming writer of the ``torch.load``-able experts file, imported on
its own: ``from usaf.quant.ptfile import StreamingTorchSave``).
"""

from usaf.quant.packing import PACKING, pack_codes, packed_width, unpack_codes
from usaf.quant.quantize import effective_group_size, quantize_experts
from usaf.quant.tensor import (
    QUANT_METHODS,
    SUPPORTED_NBITS,
    QuantizedTensor,
    dequantize,
    dequantize_entries,
    relative_error,
)

__all__ = [
    "PACKING",
    "QUANT_METHODS",
    "SUPPORTED_NBITS",
    "QuantizedTensor",
    "dequantize",
    "dequantize_entries",
    "effective_group_size",
    "pack_codes",
    "packed_width",
    "quantize_experts",
    "relative_error",
    "unpack_codes",
]
