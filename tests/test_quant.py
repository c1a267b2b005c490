"""usaf.quant: bit packing, hqq/rtn quantization of stacked experts, serialisation, dequantization."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from usaf.quant import (
    PACKING,
    QuantizedTensor,
    dequantize,
    dequantize_entries,
    effective_group_size,
    pack_codes,
    packed_width,
    packing,
    quantize_experts,
    relative_error,
    unpack_codes,
)
from usaf.quant.packing import codes_at, unpack_blocks, unpack_codes_as
from usaf.quant.tensor import _select

NE, NO, NI = 3, 24, 64  # experts, out and in features; NI < the default group size 128, so the group is 64
NBITS = (2, 3, 4, 8)
# Relative Frobenius error on N(0, 1) weights, group 64. Measured (seed 0): hqq 0.441 / 0.185 / 0.088 /
# 0.0051, rtn 0.456 / 0.193 / 0.093 / 0.0054 at 2 / 3 / 4 / 8 bits; theory for min-max 4-bit:
# range ~4.8 sigma / 15 steps / sqrt(12) = 0.092. Lower bounds catch a "quantizer" that stores floats.
ERROR_BOUNDS = {2: (0.35, 0.50), 3: (0.15, 0.21), 4: (0.07, 0.10), 8: (0.004, 0.006)}


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return randn(NE, NO, NI)  # (E, O, I)


@pytest.fixture(scope="module")
def quantized(weight) -> dict[tuple[str, int], QuantizedTensor]:
    return {(m, n): quantize_experts(weight, method=m, nbits=n) for m in ("hqq", "rtn") for n in NBITS}


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("nbits", NBITS)
@pytest.mark.parametrize("width", [1, 7, 8, 13, 64])
def test_pack_round_trip_including_extreme_codes(nbits, width):
    codes = torch.randint(0, 2**nbits, (2, 3, width), generator=torch.Generator().manual_seed(width))
    codes[0, 0] = 2**nbits - 1  # all bits set, including the ones that straddle bytes at 3 bits
    codes[0, 1] = 0
    packed = pack_codes(codes, nbits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (2, 3, packed_width(width, nbits))
    assert packed.shape[-1] == (width if nbits == 8 else -(-width // 8) * nbits)
    assert torch.equal(unpack_codes(packed, nbits, width), codes.to(torch.uint8))
    if nbits != 8:  # 4 bits has its own fast path: the general block loop must agree with it
        assert torch.equal(unpack_blocks(packed, nbits, width), codes.to(torch.uint8))


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.bfloat16))
def test_host_unpack_in_chunks_equals_the_nibble_by_nibble_form(dtype, monkeypatch):
    # Every byte value, in rows of 12 bytes (24 codes); a chunk of 7 bytes splits rows and leaves a partial
    # last chunk; [::2] makes the input a strided view.
    packed = torch.arange(256, dtype=torch.uint8).repeat(3)[: 64 * 12].view(4, 16, 12)[:, ::2]  # (4, 8, 12)
    expected = unpack_codes(packed, 4, 24).to(dtype)  # (4, 8, 24)
    calls, host = [], packing._unpack_nibbles_host
    monkeypatch.setattr(packing, "_HOST_UNPACK_CHUNK", 7)
    monkeypatch.setattr(packing, "_unpack_nibbles_host", lambda *a: calls.append(1) or host(*a))
    got = unpack_codes_as(packed, 4, 24, dtype)
    assert calls, "the host path did not run"
    assert got.dtype == dtype and got.shape == (4, 8, 24) and got.is_contiguous()
    assert torch.equal(got, expected)
    swapped = expected.view(4, 8, 12, 2).flip(-1).reshape(4, 8, 24)  # the codes of each byte in the wrong order
    assert not torch.equal(got, swapped)  # the negative control: the data tells the two orders apart
    monkeypatch.setattr(packing.sys, "byteorder", "big")  # the device form, which does not reinterpret bytes
    assert torch.equal(unpack_codes_as(packed, 4, 24, dtype), expected)
    assert len(calls) == 1


@pytest.mark.parametrize("nbits", (2, 3, 4))
def test_packing_is_the_documented_little_endian_layout(nbits):
    """usaf-lsb-v1: 8 codes -> nbits bytes with sum(c_k << k*nbits) == sum(B_j << 8j)."""
    codes = torch.randint(0, 2**nbits, (5, 24), generator=torch.Generator().manual_seed(nbits))
    packed = pack_codes(codes, nbits)
    for row in range(5):
        for block in range(3):
            cs = codes[row, 8 * block : 8 * block + 8].tolist()
            value = sum(c << (k * nbits) for k, c in enumerate(cs))
            expected = list(value.to_bytes(nbits, "little"))
            assert packed[row, nbits * block : nbits * block + nbits].tolist() == expected
    assert pack_codes(torch.tensor([[1, 2]]), 4).tolist() == [[0x21, 0, 0, 0]]  # low nibble first, zero padding


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="out of range"):
        pack_codes(torch.tensor([16]), 4)
    with pytest.raises(ValueError, match="out of range"):
        pack_codes(torch.tensor([-1]), 2)
    with pytest.raises(ValueError, match="integer"):
        pack_codes(torch.tensor([1.0]), 4)
    with pytest.raises(ValueError, match="nbits"):
        pack_codes(torch.tensor([1]), 5)
    with pytest.raises(ValueError, match="expected 8"):
        unpack_codes(torch.zeros(1, 9, dtype=torch.uint8), 4, 16)


# ---------------------------------------------------------------- group size


def test_effective_group_size():
    assert effective_group_size(2048, 128) == 128
    assert effective_group_size(96, 128) == 96
    assert effective_group_size(2880, 128) == 120  # gpt-oss: 2880 = 24 * 120
    assert effective_group_size(2880, 64) == 64
    assert effective_group_size(2880, 100) == 96
    assert effective_group_size(7, 4) == 1
    with pytest.raises(ValueError, match=">= 1"):
        effective_group_size(64, 0)


@pytest.mark.parametrize(("width", "expected"), [(96, 96), (2880, 120)])
def test_quantize_records_the_effective_group_size(width, expected):
    w = randn(1, 2, width)
    q = quantize_experts(w, method="rtn", group_size=128)
    assert q.group_size == expected
    assert q.scale.shape == q.zero.shape == (1, 2, width // expected)
    assert relative_error(w, q) < 0.12  # larger groups, larger ranges than the group of 64 above


# ---------------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("method", ("hqq", "rtn"))
@pytest.mark.parametrize("nbits", NBITS)
def test_error_within_bounds_for_bit_width(quantized, weight, method, nbits):
    q = quantized[method, nbits]
    assert (q.method, q.nbits, q.group_size, q.shape, q.transposed) == (method, nbits, 64, (NE, NO, NI), False)
    assert q.codes.shape == (NE, NO, NI * nbits // 8) and q.codes.dtype == torch.uint8
    assert q.scale.shape == q.zero.shape == (NE, NO, 1) and q.scale.dtype == q.zero.dtype == torch.float16
    assert q.nbytes == NE * NO * (NI * nbits // 8 + 2 * 2)
    deq = dequantize(q)
    assert deq.shape == (NE, NO, NI) and deq.dtype == torch.float32
    lo, hi = ERROR_BOUNDS[nbits]
    assert lo < relative_error(weight, q) < hi


@pytest.mark.parametrize("method", ("hqq", "rtn"))
def test_error_decreases_with_bits(quantized, weight, method):
    errors = [relative_error(weight, quantized[method, n]) for n in NBITS]
    assert errors == sorted(errors, reverse=True)
    assert all(a > 1.8 * b for a, b in zip(errors, errors[1:]))


def test_hqq_beats_rtn_at_4_bits(quantized, weight):
    hqq, rtn = relative_error(weight, quantized["hqq", 4]), relative_error(weight, quantized["rtn", 4])
    assert hqq < 0.98 * rtn, (hqq, rtn)  # measured 0.0884 vs 0.0927 (ratio 0.953; 0.95-0.97 over seeds)


def test_groups_run_along_the_input_axis():
    """Two distinct values per group of 16 along I: min-max RTN reproduces them up to fp16 rounding."""
    g = 16
    gen = torch.Generator().manual_seed(1)
    lo, hi = torch.randn(2, 8, 4, generator=gen), torch.randn(2, 8, 4, generator=gen) + 3  # (E, O, I/g)
    pick = torch.rand(2, 8, 4, g, generator=gen) < 0.5
    w = torch.where(pick, hi.unsqueeze(-1), lo.unsqueeze(-1)).reshape(2, 8, 4 * g)  # (E, O, I)
    assert relative_error(w, quantize_experts(w, method="rtn", group_size=g)) < 1e-3
    # the same values grouped along O instead would span many values per group
    wt = w.transpose(1, 2).contiguous()  # (E, I, O) read as out-major: groups now cross rows
    assert relative_error(wt, quantize_experts(wt, method="rtn", group_size=g // 2)) > 1e-2


@pytest.mark.parametrize("method", ("hqq", "rtn"))
def test_transposed_round_trip(method):
    w_mem = randn(NE, NI, NO, seed=3)  # gpt-oss style (E, I, O): input-major
    q = quantize_experts(w_mem, method=method, transposed=True)
    assert (q.shape, q.memory_shape, q.transposed) == ((NE, NO, NI), (NE, NI, NO), True)
    deq = dequantize(q)
    assert deq.shape == (NE, NI, NO) and deq.is_contiguous()
    assert torch.equal(dequantize(q, memory_layout=False), deq.transpose(1, 2))
    assert relative_error(w_mem, q) < ERROR_BOUNDS[4][1]
    assert relative_error(w_mem.transpose(1, 2), q) == pytest.approx(relative_error(w_mem, q))
    # identical to quantizing the out-major tensor: the groups run along I in both cases
    plain = quantize_experts(w_mem.transpose(1, 2).contiguous(), method=method)
    assert torch.equal(plain.codes, q.codes) and torch.equal(plain.scale, q.scale)


def test_expert_selection_equals_slicing(quantized):
    q = quantized["rtn", 3]
    full = dequantize(q)
    for sel, idx in [
        ([2, 0], [2, 0]),
        ((1,), [1]),
        ([-1], [2]),
        (slice(1, 3), [1, 2]),
        (torch.tensor([0, 2]), [0, 2]),
        (torch.tensor([True, False, True]), [0, 2]),
        ([], []),
    ]:
        assert torch.equal(dequantize(q, experts=sel), full[idx]), sel
    with pytest.raises(IndexError, match="out of range"):
        dequantize(q, experts=[3])
    with pytest.raises(IndexError):
        dequantize(q, experts=torch.tensor([[0]]))


def test_a_host_selection_is_checked_on_the_host(quantized):
    """The grouped forward dequantizes blocks of routed experts named on the host; over codes on a GPU, checking
    the selection there read its bounds back from the device, two syncs a block. Meta tensors stand in for a
    device here: any read of one raises."""
    meta = quantized["rtn", 4].to("meta")
    for sel in ([2, 0], torch.tensor([1]), torch.tensor([True, False, True]), [-1]):
        codes, scale, zero = _select(meta, sel)
        assert codes.device.type == "meta" and codes.shape[0] == len(dequantize(quantized["rtn", 4], experts=sel))
    with pytest.raises(IndexError, match="out of range"):
        _select(meta, [3])
    # negative control: a selection on the device is checked there, which reads it back
    with pytest.raises(RuntimeError, match="meta"):
        _select(meta, torch.tensor([0], device="meta"))


@pytest.mark.parametrize("nbits", NBITS)
@pytest.mark.parametrize("width", [7, 13, 64])
def test_codes_at_reads_single_codes_like_unpacking(nbits, width):
    g = torch.Generator().manual_seed(nbits * width)
    codes = torch.randint(0, 2**nbits, (5, width), generator=g)
    codes[0] = 2**nbits - 1  # every bit set: a spill that read the wrong byte would show here
    packed = pack_codes(codes, nbits)
    rows = torch.arange(5).repeat_interleave(width)
    cols = torch.arange(width).repeat(5)
    assert torch.equal(codes_at(packed, nbits, rows, cols), codes.reshape(-1).to(torch.uint8))


@pytest.mark.parametrize("method", ("hqq", "rtn"))
@pytest.mark.parametrize("nbits", NBITS)
def test_dequantize_entries_is_bit_identical_to_whole_experts(quantized, weight, method, nbits):
    q = quantized[method, nbits]
    indices = torch.randperm(NE * NO * NI, generator=torch.Generator().manual_seed(nbits))[:500]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        whole = dequantize(q, dtype=dtype, memory_layout=False).reshape(-1)[indices]
        assert torch.equal(dequantize_entries(q, indices, dtype=dtype), whole), dtype
    transposed = quantize_experts(weight.transpose(1, 2).contiguous(), method=method, nbits=nbits, transposed=True)
    stored = dequantize(transposed, memory_layout=False).reshape(-1)[indices]  # indices of the stored (E, O, I)
    assert torch.equal(dequantize_entries(transposed, indices), stored)
    # negative control: the in-memory (E, I, O) orientation is not what the indices address
    assert not torch.equal(dequantize_entries(transposed, indices), dequantize(transposed).reshape(-1)[indices])


def test_dtype_and_device_arguments(quantized, weight):
    q = quantized["hqq", 4]
    ref = dequantize(q)
    for dtype, tol in ((torch.float16, 1e-3), (torch.bfloat16, 8e-3), (torch.float64, 1e-6)):
        out = dequantize(q, dtype=dtype, device=torch.device("cpu"), experts=[1])
        assert out.dtype == dtype and out.device.type == "cpu"
        torch.testing.assert_close(out.float(), ref[1:2], rtol=tol, atol=tol)
    q16 = quantize_experts(weight.bfloat16(), method="rtn", device="cpu")
    assert q16.source_dtype == "bfloat16"
    assert relative_error(weight.bfloat16(), q16) < ERROR_BOUNDS[4][1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(quantized, weight):
    q = quantized["hqq", 4]
    out = dequantize(q.to("cuda"), experts=torch.tensor([2, 0], device="cuda"), dtype=torch.bfloat16)
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), dequantize(q, experts=[2, 0], dtype=torch.bfloat16))
    for method in ("hqq", "rtn"):
        qc = quantize_experts(weight, method=method, device="cuda")
        assert qc.codes.device.type == "cpu"
        assert relative_error(weight, qc) < ERROR_BOUNDS[4][1]


@pytest.mark.parametrize("method", ("hqq", "rtn"))
def test_degenerate_groups_stay_finite_and_close(method):
    w = torch.zeros(2, 4, 32)
    w[0] = 3.7  # constant groups: no range to scale
    w[1, :, :16] = torch.linspace(-1e-6, 1e-6, 16)  # a vanishing range
    q = quantize_experts(w, method=method, nbits=4, group_size=16)
    assert torch.isfinite(q.scale).all() and torch.isfinite(q.zero).all()
    assert (dequantize(q) - w).abs().max() < 3.7 * 2**-10


def test_odd_width_is_padded_inside_packing():
    w = randn(2, 5, 36)
    q = quantize_experts(w, method="rtn", nbits=3, group_size=12)
    assert q.codes.shape == (2, 5, 15)  # ceil(36 / 8) * 3
    assert dequantize(q).shape == (2, 5, 36)
    assert relative_error(w, q) < ERROR_BOUNDS[3][1]


def test_quantize_rejects_bad_input(weight):
    with pytest.raises(ValueError, match="method"):
        quantize_experts(weight, method="gptq")
    with pytest.raises(ValueError, match="nbits"):
        quantize_experts(weight, nbits=5)
    with pytest.raises(ValueError, match="3-D"):
        quantize_experts(weight[0])
    with pytest.raises(ValueError, match="3-D floating"):
        quantize_experts(weight.to(torch.int32))
    bad = weight.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="expert 1 has non-finite"):
        quantize_experts(bad, method="rtn")


# ---------------------------------------------------------------- serialisation


def test_to_dict_round_trip_through_weights_only_load(quantized, tmp_path):
    for (method, nbits), q in quantized.items():
        path = tmp_path / f"{method}{nbits}.pt"
        torch.save({"t": q.to_dict()}, path)
        back = QuantizedTensor.from_dict(torch.load(path, weights_only=True)["t"], name="t")
        assert back.packing == PACKING
        for f in dataclasses.fields(q):
            a, b = getattr(q, f.name), getattr(back, f.name)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f.name
        assert torch.equal(dequantize(back), dequantize(q))


NAME = "model.layers.3.mlp.experts.down_proj"


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda d: d.update(codes=d["codes"][..., :-1]), "codes has shape"),
        (lambda d: d.pop("scale"), "missing keys ['scale']"),
        (lambda d: d.update(scale=d["scale"].float()), "scale has dtype torch.float32"),
        (lambda d: d.update(zero=d["zero"][:2]), "zero has shape"),
        (lambda d: d.update(nbits=3), "codes has shape"),  # 4-bit codes read as 3-bit
        (lambda d: d.update(nbits=5), "nbits"),
        (lambda d: d.update(group_size=48), "group_size 48 does not divide"),
        (lambda d: d.update(packing="hqq-4bit_u8"), "packing"),
        (lambda d: d.update(extra=1), "unknown keys ['extra']"),
        (lambda d: d.update(shape=[NE, NO]), "shape must be"),
        (lambda d: d.update(source_dtype="float99"), "source_dtype"),
        (lambda d: d["scale"].__setitem__((0, 0, 0), float("inf")), "scale has non-finite"),
    ],
)
def test_from_dict_rejects_corruption_naming_the_tensor(quantized, corrupt, message):
    d = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in quantized["rtn", 4].to_dict().items()}
    corrupt(d)
    with pytest.raises(ValueError) as info:
        QuantizedTensor.from_dict(d, name=NAME)
    assert str(info.value).startswith(f"{NAME}: ") and message in str(info.value), str(info.value)


# ---------------------------------------------------------------- negative controls


def test_swapped_scale_and_zero_is_detected(quantized, weight):
    q = quantized["hqq", 4]
    swapped = dataclasses.replace(q, scale=q.zero, zero=q.scale)
    assert relative_error(weight, swapped) > 20 * relative_error(weight, q)


def test_swapped_gate_up_halves_are_detected():
    gate, up = randn(2, 16, 32, seed=5), randn(2, 16, 32, seed=6) * 0.5 + 0.2
    fused = torch.cat((gate, up), dim=1)  # (E, 2I, H): gate rows, then up rows
    q = quantize_experts(fused, method="rtn")
    deq = dequantize(q)
    swapped = torch.cat((deq[:, 16:], deq[:, :16]), dim=1)
    good = (deq - fused).norm() / fused.norm()
    bad = (swapped - fused).norm() / fused.norm()
    assert good < ERROR_BOUNDS[4][1] and bad > 10 * good
