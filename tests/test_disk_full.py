"""A full, read-only or forbidden disk at any stage's write: one error line naming the output, exit 2.

The faults are injected (``usaf.testing.faults``: we run as root, and fill no real disk): the Nth write
of a stage raises ``ENOSPC`` (or torch.save's / safetensors' own forms of it, ``EROFS``, ``EACCES``)
after leaving the torn prefix a full disk leaves. Each test checks the error line (the path, the
cause, the bytes when known), that nothing half-written or temporary is left, that a train run's
previous checkpoint is intact, and that the same command, rerun, finishes (resuming where it can).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from helpers import invoke, leftovers
from usaf.artifacts import PlanManifest, QuantizedModelManifest, RunManifest, load_manifest, load_verified
from usaf.artifacts.disk import NO_PERMISSION, NO_SPACE, READ_ONLY, cause_of, disk_error
from usaf.errors import UsafError
from usaf.testing import crash, faults
from usaf.testing.faults import failing_write

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return crash.build_setup(tmp_path_factory.mktemp("disk-setup"), num_layers=2)


@pytest.fixture(scope="module")
def trained(setup, tmp_path_factory):
    run = tmp_path_factory.mktemp("disk-run") / "run"
    result = invoke(*_train(setup, run))
    assert result.exit_code == 0, result.output
    return run


def _train(setup, out: Path) -> list:
    return ["train", "--model", setup.quantized, "--data", setup.tokens, "--plan", setup.plan, "--out", out,
            "--steps", 4, "--save-every", 2, "--seed", 3]  # fmt: skip


def _quantize(setup, out: Path) -> list:
    return ["quantize", setup.model, "--out", out, "--method", "rtn", "--group-size", 8]


def _error_line(result) -> str:
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def _no_space_answer(result, out: Path) -> str:
    line = _error_line(result)
    assert f"--out {out}: {NO_SPACE}" in line and "free on that disk" in line, line
    assert not out.exists() and leftovers(out.parent) == []
    return line


# -- every stage, the disk full at one of its writes ------------------------------------------------


def _corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 200, encoding="utf-8")
    return corpus


STAGES = {
    # name: (args(setup, trained, tmp, out), the failing write's path contains, form)
    "tokenize: train.jsonl": (
        lambda s, r, t, o: ["tokenize", _corpus(t), "--model", s.model, "--out", o, "--seq-len", 32],
        "train.jsonl",
        "enospc",
    ),
    "score: masks (safetensors' form)": (
        lambda s, r, t, o: [
            "score",
            "--model",
            s.quantized,
            "--data",
            s.tokens,
            "--out",
            o,
            "--frac",
            "0.05",
            "--calib-samples",
            4,
            "--no-stability",
        ],
        "masks.safetensors",
        "safetensors",
    ),  # fmt: skip
    "eval: report.json": (
        lambda s, r, t, o: [
            "eval",
            "--model",
            s.quantized,
            "--checkpoint",
            r,
            "--data",
            s.tokens,
            "--out",
            o,
            "--workspace",
            t / "ws",
        ],
        "report.json",
        "enospc",
    ),  # fmt: skip
    "export hf: a shard (safetensors' form)": (
        lambda s, r, t, o: ["export", "--model", s.quantized, "--checkpoint", r, "--out", o],
        "model-0000",
        "safetensors",
    ),
    "export delta: deltas": (
        lambda s, r, t, o: ["export", "--model", s.quantized, "--checkpoint", r, "--out", o, "--format", "delta"],
        "deltas.safetensors",
        "enospc",
    ),
    "export hf: config.json": (
        lambda s, r, t, o: ["export", "--model", s.quantized, "--checkpoint", r, "--out", o],
        "config.json",
        "enospc",
    ),
}


@pytest.mark.parametrize("name", list(STAGES))
def test_a_full_disk_in_a_stage_is_one_line_and_leaves_nothing(setup, trained, tmp_path, name):
    make_args, path_part, form = STAGES[name]
    out = tmp_path / "out"
    args = make_args(setup, trained, tmp_path, out)
    with failing_write(1, form, only=lambda p: path_part in p) as log:
        result = invoke(*args)
    assert log.failed is not None and path_part in log.failed[1]  # the fault did land on that write
    line = _no_space_answer(result, out)
    if name.startswith("export hf: a shard"):
        assert "needs 1." in line  # the export's size, known from its preflight
    assert invoke(*args).exit_code == 0 and (out / "manifest.json").is_file()  # negative control: room again


@pytest.mark.parametrize(
    ("form", "path_part", "kinds"),
    [
        ("enospc", "layer-00001", None),
        ("torch", "layer-00000", None),
        ("safetensors", "base-0000", None),
        ("edquot", "experts_q4.pt", ("ptfile.add",)),  # the streaming writer, its second layer
        ("enospc", "experts_q4.pt", ("open",)),
    ],
)
def test_quantize_on_a_full_disk_keeps_the_finished_layers_and_resumes(setup, tmp_path, form, path_part, kinds):
    out = tmp_path / "q"
    with failing_write(2 if kinds == ("ptfile.add",) else 1, form, kinds=kinds, only=lambda p: path_part in p) as log:
        result = invoke(*_quantize(setup, out))
    assert log.failed is not None
    line = _no_space_answer(result, out)
    assert "needs " in line and "rerun to resume" in result.stderr
    partial = tmp_path / ".q.usaf-partial"
    assert [p.name for p in partial.rglob("*") if p.name.endswith(".tmp") or ".usaf-tmp-" in p.name] == []
    with failing_write(0) as rerun_log:
        assert invoke(*_quantize(setup, out)).exit_code == 0
    if path_part == "layer-00001":  # the first layer's file was complete: not quantized again
        assert not any(kind == "torch.save" and "layer-00000" in p for kind, p in rerun_log.events)
    mine, ref = load_manifest(out, QuantizedModelManifest), load_manifest(setup.quantized, QuantizedModelManifest)
    assert mine.fingerprint == ref.fingerprint and not partial.exists()


def test_train_full_at_a_checkpoint_keeps_the_previous_one_and_the_rerun_resumes(setup, trained, tmp_path):
    """torch.save's RuntimeError (basic_ios / PytorchStreamWriter) mid-checkpoint: step 2 stays, the rerun
    resumes from it and ends byte-identical to the uninterrupted run."""
    out = tmp_path / "run"
    with failing_write(1, "torch", only=lambda p: "step-0000004.tmp/optimizer.pt" in p) as log:
        result = invoke(*_train(setup, out))
    assert log.failed is not None
    line = _error_line(result)
    assert f"--out {out}: {NO_SPACE} (at run/checkpoints/step-0000004.tmp)" in line, line
    assert "needs " in line and "free on that disk" in line and "rerun to resume" in result.stderr
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step-0000002"] and not (out / "manifest.json").exists()
    for file in (out / "checkpoints" / "step-0000002").iterdir():  # the previous checkpoint, intact
        assert file.read_bytes() == (trained / "checkpoints" / "step-0000002" / file.name).read_bytes(), file.name
    rerun = invoke(*_train(setup, out))
    assert rerun.exit_code == 0 and "resuming from" in rerun.stderr and "(step 2 of 4)" in rerun.stderr
    assert load_manifest(out, RunManifest).fingerprint == load_manifest(trained, RunManifest).fingerprint


@pytest.mark.parametrize("path_part", ["run-settings.json", "metrics.jsonl", "final.tmp/deltas", "manifest.json"])
def test_train_full_at_any_other_write_is_one_line_too(setup, tmp_path, path_part):
    out = tmp_path / "run"
    with failing_write(1, "enospc", only=lambda p: path_part in p) as log:
        result = invoke(*_train(setup, out))
    assert log.failed is not None
    assert f"--out {out}: {NO_SPACE}" in _error_line(result)
    assert [p.name for p in out.rglob("*") if ".tmp" in p.name or ".usaf-tmp-" in p.name] == []
    assert invoke(*_train(setup, out)).exit_code == 0


def test_a_checkpoint_without_room_is_refused_before_it_is_written(setup, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real = shutil.disk_usage

    def tiny(path):  # room for everything but a checkpoint: the run directory's disk has 10 KiB
        usage = real(path)
        return shutil._ntuple_diskusage(usage.total, usage.total - 10_000, 10_000) if str(out) in str(path) else usage

    monkeypatch.setattr(shutil, "disk_usage", tiny)
    line = _error_line(invoke(*_train(setup, out)))
    assert f"{out}/checkpoints/step-0000002: the checkpoint needs" in line and "10,000 bytes" in line, line
    assert not (out / "checkpoints").exists() or list((out / "checkpoints").iterdir()) == []


def test_a_prefix_cache_without_room_is_refused_before_it_is_written(setup, tmp_path, monkeypatch):
    out = tmp_path / "plan"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    args = ["score", "--model", setup.quantized, "--data", setup.tokens, "--out", out, "--frac", "0.05",
            "--calib-samples", 4, "--no-stability", "--cache", "--train-from", 1]  # fmt: skip
    line = _error_line(invoke(*args))
    assert "the prefix states of --cache needs" in line and "1,000 bytes" in line, line
    assert not out.exists() and leftovers(tmp_path) == []
    monkeypatch.undo()  # negative control: with room, the same command writes its store
    assert invoke(*args).exit_code == 0 and (out / "prefix_states.bin").is_file()


def test_without_room_for_the_samples_prefix_states_score_still_writes_its_plan(setup, tmp_path, monkeypatch):
    """The calibration sample's states are kept by default, unasked: no room for them is a note, not a failure."""
    out = tmp_path / "plan"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    args = ["score", "--model", setup.quantized, "--data", setup.tokens, "--out", out, "--frac", "0.05",
            "--calib-samples", 4, "--no-stability", "--train-from", 1]  # fmt: skip
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "prefix states not kept in the plan" in result.output and "1,000 bytes" in result.output
    assert load_verified(out, PlanManifest).summary.prefix_cache is None and not (out / "prefix_states.bin").exists()
    monkeypatch.undo()  # negative control: with room, the same command keeps them
    assert invoke(*args, "--overwrite").exit_code == 0
    assert load_verified(out, PlanManifest).summary.prefix_cache.samples > 0


# -- read-only and forbidden outputs ------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["tokenize", "quantize", "train", "export"])
def test_a_read_only_out_says_read_only(setup, trained, tmp_path, stage):
    out = tmp_path / "ro" / "out"
    args = {
        "tokenize": lambda: ["tokenize", _corpus(tmp_path), "--model", setup.model, "--out", out],
        "quantize": lambda: _quantize(setup, out),
        "train": lambda: _train(setup, out),
        "export": lambda: ["export", "--model", setup.quantized, "--checkpoint", trained, "--out", out],
    }[stage]()
    with failing_write(1, "erofs", kinds=("mkdir",), only=lambda p: str(tmp_path / "ro") in p) as log:
        result = invoke(*args)
    assert log.failed is not None
    line = _error_line(result)
    assert f"--out {out}: {READ_ONLY}" in line and "space" not in line, line
    assert "writable disk" in result.stderr and not out.exists()


def test_a_read_only_image_reporting_no_free_space_says_read_only(setup, tmp_path, monkeypatch):
    """A squashfs or ISO mount reports 0 bytes free: the preflight must not call that a full disk."""
    import os

    real = os.statvfs
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))
    monkeypatch.setattr(os, "statvfs", lambda path: _Flags(real(path), os.ST_RDONLY))
    out = tmp_path / "q"
    line = _error_line(invoke(*_quantize(setup, out)))
    assert f"--out {out}: {READ_ONLY}" in line and "needs" not in line, line
    monkeypatch.setattr(os, "statvfs", real)  # negative control: a writable disk with 0 free is full
    assert "needs" in _error_line(invoke(*_quantize(setup, out)))


class _Flags:
    def __init__(self, result, flag: int) -> None:
        self._result, self.f_flag = result, flag

    def __getattr__(self, name):
        return getattr(self._result, name)


def test_permission_denied_says_so(setup, tmp_path):
    out = tmp_path / "q"
    with failing_write(1, "eacces", only=lambda p: "layer-00000" in p):
        line = _error_line(invoke(*_quantize(setup, out)))
    assert f"--out {out}: {NO_PERMISSION}" in line and "space" not in line, line


def test_eval_without_room_for_its_base_cache_still_reports(setup, trained, tmp_path):
    """The base pass's cache only saves time: a full disk skips it with a note, the report is written."""
    out, ws = tmp_path / "ev", tmp_path / "ws"
    with failing_write(1, "safetensors", only=lambda p: "eval-base" in p):
        result = invoke("eval", "--model", setup.quantized, "--checkpoint", trained, "--data", setup.tokens,
                        "--out", out, "--workspace", ws)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "base pass: not cached" in result.stderr and NO_SPACE in result.stderr, result.stderr.replace("━", "")
    assert (out / "manifest.json").is_file()
    assert not any(p.name.startswith(".") for p in (ws / "cache" / "eval-base").iterdir())  # no torn entry


# -- the translation itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), NO_SPACE),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), NO_SPACE),
        (OSError(errno.EROFS, "Read-only file system"), READ_ONLY),
        (OSError(errno.EACCES, "Permission denied"), NO_PERMISSION),
        (OSError(errno.EPERM, "Operation not permitted"), NO_PERMISSION),
        (RuntimeError("basic_ios::clear: iostream error"), NO_SPACE),
        (RuntimeError(faults.TORCH_NO_SPACE), NO_SPACE),
        (faults.make_error("safetensors", "x"), NO_SPACE),
        (RuntimeError("I/O error: Read-only file system (os error 30)"), READ_ONLY),
        # negative controls: other errors are not the disk's answer, and keep their own message or traceback
        (OSError(errno.ENOENT, "No such file or directory"), None),
        (OSError(errno.EIO, "Input/output error"), None),
        (RuntimeError("shape mismatch"), None),
        (UsafError("--out x: no space left on the disk"), None),
    ],
)
def test_the_forms_of_a_refused_write_are_recognised(exc, cause):
    assert cause_of(exc) == cause
    translated = disk_error(exc, Path("/somewhere/out"), needed=3 * 2**30)
    assert (translated is None) == (cause is None)
    if cause == NO_SPACE:
        assert (
            translated.message.startswith(f"--out /somewhere/out: {NO_SPACE}") and "needs 3.0 GiB" in translated.message
        )


def test_a_stray_full_disk_error_is_one_line_at_the_cli(tmp_path, monkeypatch):
    """The last resort (a write no stage guards): the path the OS named; any other OSError stays a bug."""
    import usaf.stages.tokenize as stage

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "somefile"))

    monkeypatch.setattr(stage, "run", full)
    line = _error_line(invoke("tokenize", tmp_path, "--model", tmp_path, "--out", tmp_path / "o"))
    assert f"{tmp_path / 'somefile'}: {NO_SPACE}" in line, line

    def missing(*args, **kwargs):
        raise OSError(errno.ENOENT, "No such file or directory", "x")

    monkeypatch.setattr(stage, "run", missing)
    result = invoke("tokenize", tmp_path, "--model", tmp_path, "--out", tmp_path / "o")
    assert result.exit_code == 1 and isinstance(result.exception, OSError)  # negative control: a bug keeps its trace
