"""usaf.quant.ptfile: a streamed archive loads exactly like torch.save's, and never half-exists."""

from __future__ import annotations

import gc
import weakref
import zipfile

import pytest
import torch

from usaf.quant import QuantizedTensor, dequantize, quantize_experts
from usaf.quant.ptfile import StreamingTorchSave


def entries() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.experts.gate_up_proj": {
            "codes": torch.randint(0, 256, (2, 6, 8), dtype=torch.uint8, generator=gen),
            "scale": torch.randn(2, 6, 1, generator=gen).half(),
            "bf16": torch.randn(3, 5, generator=gen).bfloat16(),
            "shape": [2, 6, 16],
            "nbits": 4,
            "ratio": 0.125,
            "method": "hqq",
            "transposed": False,
            "nothing": None,
            "pair": (1, torch.arange(3)),
        },
        "errors": {"fp32": torch.randn(4, 4, generator=gen), "int64": torch.arange(7), "empty": torch.empty(0, 3)},
        "scalar_tensor": torch.tensor(2.5),
        "plain": [1, 2.0, "three", True, None, [4, (5,)]],
    }


def assert_same(a, b, where="") -> None:
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad), where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def stream(path, data: dict) -> None:
    with StreamingTorchSave(path) as archive:
        for name, entry in data.items():
            archive.add(name, entry)


@pytest.mark.parametrize("mmap", [False, True])
def test_loads_like_torch_save(tmp_path, mmap):
    data = entries()
    stream(tmp_path / "ours.pt", data)
    torch.save(data, tmp_path / "ref.pt")
    ours = torch.load(tmp_path / "ours.pt", weights_only=True, mmap=mmap)
    assert_same(ours, torch.load(tmp_path / "ref.pt", weights_only=True, mmap=mmap))
    assert_same(ours, data)


def test_records_are_byte_identical_to_torch_save(tmp_path):
    """Pins the torch internals the writer relies on (record names, pickle of tensors, storage keys)."""
    data = entries()
    stream(tmp_path / "ours.pt", data)
    torch.save(data, tmp_path / "ref.pt")

    def records(path) -> dict[str, bytes]:
        with zipfile.ZipFile(path) as z:
            return {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}

    ours, ref = records(tmp_path / "ours.pt"), records(tmp_path / "ref.pt")
    assert set(ours) == set(ref)
    for name in ref:
        if name != ".data/serialization_id":  # a hash of the archive's folder name and its record order
            assert ours[name] == ref[name], name


def test_output_is_deterministic(tmp_path):
    """Same entries, same bytes: a resumed run can be compared byte for byte with a straight one."""
    stream(tmp_path / "a.pt", entries())
    stream(tmp_path / "b.pt", entries())
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()


def test_quantized_tensors_round_trip(tmp_path):
    w = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    qs = {f"t{n}": quantize_experts(w, method="rtn", nbits=n, group_size=16) for n in (3, 4)}
    stream(tmp_path / "q.pt", {k: q.to_dict() for k, q in qs.items()})
    loaded = torch.load(tmp_path / "q.pt", weights_only=True, mmap=True)
    for k, q in qs.items():
        assert torch.equal(dequantize(QuantizedTensor.from_dict(loaded[k], name=k)), dequantize(q))


def test_tensors_are_written_at_once_and_not_kept(tmp_path):
    big = torch.ones(1 << 18)  # 1 MiB
    ref = weakref.ref(big)
    with StreamingTorchSave(tmp_path / "x.pt") as archive:
        archive.add("a", {"w": big})
        del big
        gc.collect()
        assert ref() is None  # the writer holds no reference: peak memory is one entry's tensors
        (tmp,) = tmp_path.iterdir()
        assert tmp.name.startswith(".x.pt.usaf-tmp-") and tmp.stat().st_size >= 1 << 20
    assert [p.name for p in tmp_path.iterdir()] == ["x.pt"]
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["a"]["w"], torch.ones(1 << 18))


def test_views_and_non_contiguous_tensors_store_their_own_values(tmp_path):
    base = torch.arange(1 << 16, dtype=torch.float32)
    data = {"view": {"slice": base[10:20], "t": base[:12].view(3, 4).T, "grad": torch.ones(2, requires_grad=True)}}
    stream(tmp_path / "v.pt", data)
    assert (tmp_path / "v.pt").stat().st_size < 8192  # not the 256 KiB base storage
    back = torch.load(tmp_path / "v.pt", weights_only=True)["view"]
    assert torch.equal(back["slice"], base[10:20]) and torch.equal(back["t"], base[:12].view(3, 4).T)
    assert back["t"].is_contiguous() and back["grad"].requires_grad


def test_exception_inside_the_block_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), StreamingTorchSave(tmp_path / "x.pt") as archive:
        archive.add("a", entries()["errors"])
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("entry", "error", "message"),
    [
        ({"x": object()}, TypeError, "a.x: cannot store a object"),
        ({"x": b"bytes"}, TypeError, "cannot store a bytes"),
        ({"x": torch.zeros(2, dtype=torch.uint16)}, TypeError, "dtype torch.uint16"),
        ({"x": torch.zeros(2, 2).to_sparse()}, TypeError, "dense"),
    ],
)
def test_unsupported_values_fail_and_leave_no_file(tmp_path, entry, error, message):
    with pytest.raises(error, match=message), StreamingTorchSave(tmp_path / "x.pt") as archive:
        archive.add("a", entry)
    assert list(tmp_path.iterdir()) == []


def test_misuse_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="added twice"), StreamingTorchSave(tmp_path / "x.pt") as archive:
        archive.add("a", 1)
        archive.add("a", 2)
    assert list(tmp_path.iterdir()) == []
    archive = StreamingTorchSave(tmp_path / "y.pt")
    archive.add("a", 1)
    archive.close()
    with pytest.raises(ValueError, match="closed"):
        archive.add("b", 2)
    with pytest.raises(ValueError, match="closed"):
        archive.close()
    assert torch.load(tmp_path / "y.pt", weights_only=True) == {"a": 1}


def test_truncated_file_fails_to_load(tmp_path):
    path = tmp_path / "x.pt"
    stream(path, entries())
    torch.load(path, weights_only=True)  # intact: loads
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(RuntimeError):
        torch.load(path, weights_only=True)


_SIGNAL_INSIDE_A_RECORD = """
import os, signal, sys
from pathlib import Path
import torch
import usaf.quant.ptfile as ptfile

real_open, writes = open, [0]

class Signalled:  # a file whose 3rd write is interrupted by the signal, as Ctrl-C lands inside a record
    def __init__(self, path, mode):
        self.file = real_open(path, mode)
    def write(self, data):
        writes[0] += 1
        if writes[0] == 3:
            os.kill(os.getpid(), getattr(signal, sys.argv[2]))
        return self.file.write(data)
    def __getattr__(self, name):
        return getattr(self.file, name)

ptfile.open = Signalled
out = Path(sys.argv[1])
try:
    with ptfile.StreamingTorchSave(out / "x.pt") as archive:
        for i in range(4):
            archive.add(f"t{i}", torch.arange(1 << 16, dtype=torch.float32))
except KeyboardInterrupt:
    print("stopped between records", flush=True)
    sys.exit(130)
"""


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_inside_a_record_stops_between_records_not_in_a_cpp_abort(tmp_path, name):
    """Ctrl-C (SIGTERM) landing inside the writer's call into the file tore the archive; the writer's destructor then
    threw and the process aborted with a C++ stack dump (``usaf quantize`` assembling experts_q4.pt; found in review).
    The signal is delivered after the record: Ctrl-C stops between records, SIGTERM ends the process as its default
    handler does (exit by the signal, no abort), and no file is left but a kill's temporary."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "signalled.py"
    script.write_text(_SIGNAL_INSIDE_A_RECORD)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), name], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert "terminate called" not in done.stderr and "c10::Error" not in done.stderr, done.stderr
    if name == "SIGINT":
        assert done.returncode == 130 and "stopped between records" in done.stdout, done.stderr
        assert [p.name for p in tmp_path.iterdir()] == ["signalled.py"]  # aborted cleanly: its temporary removed
    else:
        assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr)
    assert not (tmp_path / "x.pt").exists()


_FULL_DISK = """
import errno, io, sys
from pathlib import Path
import torch
from usaf.quant import ptfile

class Full(io.FileIO):  # a disk with 5,000 bytes free
    room = 5000
    def write(self, b):
        if len(b) > Full.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        Full.room -= len(b)
        return super().write(b)

ptfile.open = lambda path, mode: Full(path, mode)
out = Path(sys.argv[1])
try:
    with ptfile.StreamingTorchSave(out / "x.pt") as archive:
        archive.add("a", torch.zeros(10_000))
except OSError as e:
    print("refused:", e.errno)
print("left:", sorted(p.name for p in out.iterdir()))
"""


def test_a_full_disk_while_saving_is_an_oserror_not_a_process_abort(tmp_path):
    """On a full disk the writer's destructor wrote the zip's end over the failed record and threw in C++: SIGABRT and
    a stack dump (usaf score on a full disk; found in review). In a child process, since the bug kills its process.
    The control: with room, the same save is whole and readable."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.splitlines() == ["refused: 28", "left: []"], child.stdout
    with StreamingTorchSave(tmp_path / "x.pt") as archive:
        archive.add("a", torch.zeros(10_000))
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["a"], torch.zeros(10_000))
