"""Bit packing of quantization codes along the last axis: layout ``usaf-lsb-v1``.

hqq packs its own way (4-bit: the two halves of the *row* axis share a byte), so one expert's codes
would not be a contiguous slice of a stacked tensor. This layout packs each row on its own:

- 8 bits: the codes themselves, one ``uint8`` per code; ``packed_I = I``.
- 2, 3 and 4 bits: the row is zero-padded to ``I_pad = ceil(I / 8) * 8`` codes; each block of 8
  consecutive codes ``c0..c7`` (columns ``8b .. 8b+7``) becomes ``nbits`` bytes ``B0..B(nbits-1)``
  (bytes ``nbits*b .. nbits*b + nbits-1``) such that, as little-endian integers,
  ``sum_k c_k << (k * nbits) == sum_j B_j << (8 * j)``; i.e. code ``k`` occupies bits
  ``[k*nbits, (k+1)*nbits)`` of the block's bit stream, least significant bit first. So
  ``packed_I = I_pad * nbits / 8``. Examples: 4 bits, ``B_j = c_{2j} | c_{2j+1} << 4``; 3 bits,
  ``B0 = c0 | c1 << 3 | (c2 & 3) << 6``, ``B1 = c2 >> 2 | c3 << 1 | c4 << 4 | (c5 & 1) << 7``,
  ``B2 = c5 >> 1 | c6 << 2 | c7 << 5``. The padding codes are 0 and are dropped on unpacking; the
  padding is implied by ``I`` (which the caller records), so it is not stored separately.

Only shifts, masks and ORs on integers are used, so unpacking runs on any torch device (the host's 4-bit
path also reads an int16 scratch as its bytes, little-endian: :func:`_unpack_nibbles_host`).
"""

from __future__ import annotations

import sys

import torch

from usaf.backends.transfer import device_capabilities

PACKING = "usaf-lsb-v1"
PACKED_NBITS = (2, 3, 4)  # bit widths that are packed 8 codes -> nbits bytes; 8 bits is stored as is

# For code k of a block of 8: (byte index, shift within that byte, spills into the next byte)
_POSITIONS = {n: tuple(((k * n) // 8, (k * n) % 8, (k * n) % 8 + n > 8) for k in range(8)) for n in PACKED_NBITS}


def packed_width(in_features: int, nbits: int) -> int:
    """Bytes per row of ``in_features`` codes of ``nbits`` bits in this layout."""
    if nbits == 8:
        return in_features
    _check_nbits(nbits)
    return -(-in_features // 8) * nbits


def pack_codes(codes: torch.Tensor, nbits: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2**nbits)`` along the last axis.

    Args:
        codes: ``(..., I)`` integer tensor (any integer dtype; values checked).
        nbits: 2, 3, 4 or 8.

    Returns:
        ``(..., packed_width(I, nbits))`` uint8 tensor on the device of ``codes``.

    Raises:
        ValueError: unsupported ``nbits``, a non-integer tensor, or a code out of range.
    """
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 2**nbits):
        raise ValueError(f"codes out of range for {nbits} bits: [{int(codes.min())}, {int(codes.max())}]")
    codes = codes.to(torch.uint8)
    if nbits == 8:
        return codes.contiguous()
    _check_nbits(nbits)
    *lead, i = codes.shape
    pad = packed_width(i, nbits) // nbits * 8 - i
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    blocks = codes.reshape(*lead, (i + pad) // 8, 8)  # (..., I_pad/8, 8)
    out = torch.zeros((*lead, blocks.shape[-2], nbits), dtype=torch.uint8, device=codes.device)
    for k, (j, shift, spills) in enumerate(_POSITIONS[nbits]):
        c = blocks[..., k]
        out[..., j] |= c << shift  # uint8 arithmetic drops the bits that spill over the byte
        if spills:
            out[..., j + 1] |= c >> (8 - shift)
    return out.reshape(*lead, out.shape[-2] * nbits)


def unpack_codes(packed: torch.Tensor, nbits: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`.

    Args:
        packed: ``(..., packed_width(in_features, nbits))`` uint8.
        nbits: 2, 3, 4 or 8.
        in_features: ``I``, the number of codes per row before padding.

    Returns:
        ``(..., I)`` uint8 codes, on the device of ``packed``.

    Raises:
        ValueError: wrong dtype or last dimension.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    width = packed_width(in_features, nbits)
    if packed.shape[-1] != width:
        raise ValueError(f"packed rows have {packed.shape[-1]} bytes, expected {width} for I={in_features}")
    if nbits == 8:
        return packed
    if nbits == 4:  # B_j = c_2j | c_2j+1 << 4: one interleave of the nibbles (docs/BENCHMARKS.md, dequantization)
        *lead, _ = packed.shape
        pairs = torch.stack((packed & 15, packed >> 4), dim=-1)  # (..., width, 2)
        return pairs.reshape(*lead, width * 2)[..., :in_features]
    return unpack_blocks(packed, nbits, in_features)


def unpack_codes_as(packed: torch.Tensor, nbits: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`unpack_codes` cast to ``dtype``: ``(..., I)``, a new tensor (callers edit it in place).

    4-bit codes: on a device, written straight into the ``dtype`` buffer, nibble by nibble (no uint8
    intermediate and no separate cast, two passes over the output fewer, four operators); where the backend
    declares ``Capabilities.unpack_via_int16`` (the CPU), a chunk at a time through an int16 scratch and one
    contiguous cast (:func:`_unpack_nibbles_host`, 1.6x faster on a frozen block there; dequantization is most
    of a frozen layer's per-forward cost on CPU, docs/BENCHMARKS.md). The values are the same integers either
    way, so the result is identical.
    """
    if nbits != 4 or packed.shape[-1] * 2 != in_features:  # other widths, and rows with a padding nibble
        return unpack_codes(packed, nbits, in_features).to(dtype, copy=True)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed codes must be uint8, got {packed.dtype}")
    if sys.byteorder == "little" and device_capabilities(packed.device).unpack_via_int16:
        return _unpack_nibbles_host(packed, dtype)
    out = torch.empty((*packed.shape, 2), dtype=dtype, device=packed.device)  # (..., I/2, 2)
    out[..., 0] = packed & 15  # B_j = c_2j | c_2j+1 << 4
    out[..., 1] = packed >> 4
    return out.view(*packed.shape[:-1], in_features)


# Packed bytes unpacked at a time on the host: the chunk's int16 scratch (2 MiB) stays in cache. 1 MiB was the
# fastest, or within 4 % of it, of 64 KiB to one chunk for the whole tensor, at every shape of bench_unpack.py.
_HOST_UNPACK_CHUNK = 2**20


def _unpack_nibbles_host(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`unpack_codes_as` for 4-bit codes on a little-endian host: ``(..., I/2)`` uint8 -> ``(..., I)``.

    Byte ``B = c0 | c1 << 4`` becomes the int16 ``c0 | c1 << 8``, whose two bytes in memory are ``c0, c1``: the
    codes in order, so one contiguous cast writes them. The strided writes of the nibble-by-nibble form run at
    about half the speed on a block that fits in cache (the per-forward frozen path's case); the result is the
    same integers.
    """
    flat = packed.reshape(-1)  # (P,)
    out = torch.empty(flat.numel() * 2, dtype=dtype)  # (2P,)
    for start in range(0, flat.numel(), _HOST_UNPACK_CHUNK):
        chunk = flat[start : start + _HOST_UNPACK_CHUNK]  # (c,)
        pairs = chunk.to(torch.int16)  # (c,) B
        high = pairs >> 4  # (c,) c1
        pairs.bitwise_and_(15).bitwise_or_(high.bitwise_left_shift_(8))  # c0 | c1 << 8
        out[2 * start : 2 * (start + chunk.numel())].copy_(pairs.view(torch.uint8))  # (2c,) c0, c1, ...
    return out.view(*packed.shape[:-1], packed.shape[-1] * 2)


def codes_at(packed: torch.Tensor, nbits: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The codes at ``(rows, cols)`` of a packed ``(R, packed_I)`` tensor, without unpacking whole rows.

    Args:
        packed: ``(R, packed_width(I, nbits))`` uint8.
        nbits: 2, 3, 4 or 8.
        rows, cols: ``(n,)`` int64 row and code (column) indices, on the device of ``packed``.

    Returns:
        ``(n,)`` uint8 codes, equal to ``unpack_codes(packed, nbits, I)[rows, cols]``.
    """
    if nbits == 8:
        return packed[rows, cols]
    _check_nbits(nbits)
    # Code k of block b occupies bits [k*nbits, (k+1)*nbits) of the block's bytes b*nbits .. (little-endian).
    bit = (cols % 8) * nbits  # (n,) bit offset within the block
    byte = (cols // 8) * nbits + bit // 8  # (n,) the byte holding the code's lowest bit
    low = packed[rows, byte].to(torch.int32)
    # A code that spills into the next byte also reads it (never past the row: the spill stays in its block).
    spills = bit % 8 + nbits > 8
    high = packed[rows, torch.where(spills, byte + 1, byte)].to(torch.int32) * spills
    return (((low | high << 8) >> (bit % 8)) & (2**nbits - 1)).to(torch.uint8)


def unpack_blocks(packed: torch.Tensor, nbits: int, in_features: int) -> torch.Tensor:
    """:func:`unpack_codes` for any packed width, block by block: 8 strided writes per block of 8 codes.

    The only way for 2 and 3 bits; 4 bits has a faster path, and the benchmark times this as its reference.
    """
    *lead, width = packed.shape
    blocks = packed.reshape(*lead, width // nbits, nbits)  # (..., I_pad/8, nbits)
    out = torch.empty((*lead, blocks.shape[-2], 8), dtype=torch.uint8, device=packed.device)
    mask = 2**nbits - 1
    for k, (j, shift, spills) in enumerate(_POSITIONS[nbits]):
        c = blocks[..., j] >> shift
        if spills:
            c = c | (blocks[..., j + 1] << (8 - shift))  # high bits fall off uint8; the mask drops the rest
        out[..., k] = c & mask
    return out.reshape(*lead, width // nbits * 8)[..., :in_features]


def _check_nbits(nbits: int) -> None:
    if nbits not in PACKED_NBITS:
        raise ValueError(f"nbits must be one of 2, 3, 4, 8; got {nbits}")
