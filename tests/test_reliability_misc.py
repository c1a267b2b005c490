"""Free-space checks, usaf inspect --verify, and resuming quantize/train after the awkward moments of a kill."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import invoke, leftovers
from usaf.artifacts.safety import check_free_space
from usaf.errors import UsafError


def _tiny_disk(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - free, free))


def test_free_space_check_names_the_bytes_needed(tmp_path, monkeypatch):
    _tiny_disk(monkeypatch, 1000)
    with pytest.raises(UsafError) as e:
        check_free_space(tmp_path / "not" / "yet" / "there", 5000, what="the thing")
    assert "needs 5,000 bytes" in e.value.message and "1,000 bytes" in e.value.message
    assert "4,000 bytes needed beyond that" in e.value.message
    check_free_space(tmp_path / "x", 999)  # negative control: enough room passes


def test_quantize_and_export_refuse_early_on_a_full_disk(tiny_model, quantized, tmp_path, monkeypatch):
    from usaf.testing import crash

    setup = crash.build_setup(tmp_path / "setup", num_layers=2)
    run = tmp_path / "run"
    result = invoke("train", "--model", setup.quantized, "--data", setup.tokens, "--plan", setup.plan, "--steps", 1,
                    "--out", run)  # fmt: skip
    assert result.exit_code == 0, result.output
    _tiny_disk(monkeypatch, 1000)
    for args, out in (
        (["quantize", setup.model, "--method", "rtn", "--group-size", 8], tmp_path / "q"),
        (["export", "--model", setup.quantized, "--checkpoint", run], tmp_path / "hf"),
    ):
        result = invoke(*args, "--out", out)
        assert result.exit_code == 2, result.output
        assert "bytes" in result.stderr and "1,000 bytes" in result.stderr and "needs" in result.stderr
        assert not out.exists() and leftovers(tmp_path) == []
        assert not (tmp_path / f".{out.name}.usaf-partial").exists()  # refused before any work


def test_inspect_verify_detects_a_modified_file(quantized, tmp_path):
    artifact = Path(shutil.copytree(quantized("qwen3_moe"), tmp_path / "q"))
    result = invoke("inspect", "--verify", artifact)
    assert result.exit_code == 0 and "artifact verified: 5 files match their sha256" in result.stdout, (
        result.output
    )  # negative control
    experts = artifact / "experts_q4.pt"
    raw = bytearray(experts.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit, same size: only the hash can tell
    experts.write_bytes(bytes(raw))
    result = invoke("inspect", "--verify", artifact)
    assert result.exit_code == 2
    assert "experts_q4.pt: sha256 differs from the manifest (modified)" in result.stderr
    assert invoke("inspect", "--verify", "--no-hash", artifact).exit_code == 2
    # where nothing is hashed (a model directory), --no-hash was accepted and unused (found in review)
    model = tmp_path / "model-dir"
    assert invoke("tiny-model", model).exit_code == 0
    unused = invoke("inspect", model, "--no-hash")
    assert unused.exit_code == 2 and "--no-hash: " in unused.stderr and "nothing is hashed" in unused.stderr
    assert invoke("inspect", model).exit_code == 0  # control
    (artifact / "extra.txt").write_text("x")
    result = invoke("inspect", "--verify", artifact, "--json")
    assert json.loads(result.stdout)["unlisted"] == ["extra.txt"]


def test_quantize_killed_after_writing_its_manifest_finishes_with_the_rename(tiny_model, tmp_path, monkeypatch):
    from usaf.artifacts.writer import ArtifactWriter

    source = tiny_model("qwen3_moe")
    straight = tmp_path / "straight"
    assert invoke("quantize", source, "--out", straight, "--method", "rtn").exit_code == 0
    real = ArtifactWriter._move_into_place
    monkeypatch.setattr(ArtifactWriter, "_move_into_place", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
    out = tmp_path / "q"
    assert invoke("quantize", source, "--out", out, "--method", "rtn").exit_code == 130
    partial = tmp_path / ".q.usaf-partial"
    assert (partial / "manifest.json").is_file() and not out.exists()
    # a temporary of a process that no longer runs, as a SIGKILL leaves it
    (partial / ".experts_q4.pt.usaf-tmp-999999999-deadbeef").write_bytes(b"half")
    monkeypatch.setattr(ArtifactWriter, "_move_into_place", real)
    result = invoke("quantize", source, "--out", out, "--method", "rtn")
    assert result.exit_code == 0, result.output
    assert not partial.exists() and sorted(p.name for p in out.iterdir()) == sorted(p.name for p in straight.iterdir())
    assert (
        json.loads((out / "manifest.json").read_text())["fingerprint"]
        == json.loads((straight / "manifest.json").read_text())["fingerprint"]
    )


def test_stale_temporaries_in_a_resumed_partial_never_enter_the_artifact(tiny_model, tmp_path):
    source = tiny_model("qwen3_moe")
    out = tmp_path / "q"
    partial = tmp_path / ".q.usaf-partial"
    partial.mkdir()
    settings = {"source": None, "method": "rtn", "nbits": 4, "group_size": 128}
    from usaf.families import load_model_config, read_checkpoint, resolve_family
    from usaf.stages.quantize_parts import source_record

    spec = resolve_family(load_model_config(source))
    settings["source"] = source_record(str(source), source, spec, read_checkpoint(source)).fingerprint
    (partial / "partial-settings.json").write_text(json.dumps(settings))
    (partial / ".experts_q4.pt.usaf-tmp-999999999-0badf00d").write_bytes(b"x" * 100)
    (partial / "manifest.json.tmp").write_text("{")
    (partial / ".tmpAQALQU").write_bytes(b"x" * 100)  # safetensors' own temporary, cut by a kill (CI found it)
    (partial / ".tmpnotours").write_bytes(b"kept")  # not the library's pattern: negative control
    result = invoke("quantize", source, "--out", out, "--method", "rtn")
    assert result.exit_code == 0, result.output
    assert "resuming" in result.stderr  # the partial was taken up, not discarded
    names = [f["path"] for f in json.loads((out / "manifest.json").read_text())["files"]]
    assert ".tmpnotours" in names and ".tmpAQALQU" not in names, names
    names.remove(".tmpnotours")
    assert not [n for n in names if "usaf-tmp" in n or n.endswith(".tmp")], names
    assert not [p.name for p in out.iterdir() if "usaf-tmp" in p.name or p.name.endswith(".tmp")]


def test_train_rerun_after_a_torn_run_settings_file_is_one_clear_line(tmp_path):
    from usaf.testing import crash

    setup = crash.build_setup(tmp_path / "setup", num_layers=2)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run-settings.json").write_text('{"model_fing')  # cut by a kill before the atomic write existed
    result = invoke("train", "--model", setup.quantized, "--data", setup.tokens, "--plan", setup.plan, "--steps", 1,
                    "--out", run)  # fmt: skip
    assert result.exit_code == 2 and "holds another run" in result.stderr, result.output


def test_quantize_killed_while_writing_its_settings_starts_over_without_force(tiny_model, tmp_path):
    """Found by scripts/crash_harness.py: a kill before the settings' rename left a partial the rerun refused."""
    source = tiny_model("qwen3_moe")
    partial = tmp_path / ".q.usaf-partial"
    partial.mkdir()
    (partial / ".partial-settings.json.usaf-tmp-999999999-0badf00d").write_text('{"source": "abc", "met')
    result = invoke("quantize", source, "--out", tmp_path / "q", "--method", "rtn")
    assert result.exit_code == 0, result.output
    assert not partial.exists() and (tmp_path / "q" / "manifest.json").is_file()


def test_train_killed_while_writing_its_settings_or_first_checkpoint_restarts_cleanly(tmp_path):
    """Found by scripts/crash_harness.py: a start killed before run-settings.json's rename was 'another run';
    one killed before its first checkpoint left metrics of steps the rerun logged again."""
    from usaf.testing import crash

    setup = crash.build_setup(tmp_path / "setup", num_layers=2)
    args = ["train", "--model", setup.quantized, "--data", setup.tokens, "--plan", setup.plan, "--steps", 2]
    straight = tmp_path / "straight"
    assert invoke(*args, "--out", straight).exit_code == 0
    run = tmp_path / "run"
    run.mkdir()
    (run / ".run-settings.json.usaf-tmp-999999999-0badf00d").write_text('{"mod')
    result = invoke(*args, "--out", run)
    assert result.exit_code == 0, result.output
    assert not [p for p in run.iterdir() if ".usaf-tmp-" in p.name]
    # killed before its first checkpoint: settings and the metrics of steps no checkpoint holds
    again = Path(shutil.copytree(straight, tmp_path / "again"))
    for name in ("checkpoints", "final"):
        shutil.rmtree(again / name, ignore_errors=True)
    (again / "manifest.json").unlink()
    with (again / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "lo')  # a line cut by the kill
    result = invoke(*args, "--out", again)
    assert result.exit_code == 0, result.output
    assert "resuming" not in result.stderr  # no checkpoint: started over
    steps = lambda r: [json.loads(line)["step"] for line in (r / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert steps(again) == steps(straight) == [1, 2]


def test_a_stop_signal_while_an_error_is_printed_does_not_cut_it():
    """torchrun's SIGTERM, sent as a peer died, reached rank 0 while it turned the failed collective into its message:
    the CLI's signal handling had ended and the default handler killed it first (exit -15, no message; a flaky
    test_distributed test, 2026-12-06). The error is printed with stop signals ignored; the control: the same
    signal before the error still stops the command as Ctrl-C does (exit 143)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import os, signal, sys
        import typer
        import usaf.cli.console as console
        from usaf.errors import UsafError

        real = console._print_error
        def print_after_sigterm(e, verbose):
            os.kill(os.getpid(), signal.SIGTERM)
            real(e, verbose)
        console._print_error = print_after_sigterm
        try:
            with console.handle_errors():
                if sys.argv[1] == "before":
                    os.kill(os.getpid(), signal.SIGTERM)
                raise UsafError("another process of the run stopped", "rerun to resume")
        except typer.Exit as e:
            sys.exit(e.exit_code)
        """
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    during = subprocess.run([sys.executable, "-c", script, "during"], capture_output=True, text=True, env=env)
    assert during.returncode == 2 and "another process of the run stopped" in during.stderr, during
    before = subprocess.run([sys.executable, "-c", script, "before"], capture_output=True, text=True, env=env)
    assert before.returncode == 143 and "stopped by SIGTERM" in before.stderr, before


def test_a_stage_that_said_what_its_interrupt_kept_is_not_followed_by_nothing_half_written(capsys):
    """After "interrupted: saved ... (step 78); run the same command to resume" the command added "interrupted:
    nothing half-written was left behind", which read as contradicting it (found in review). Said by the stage, the
    generic line is left out; the control: an interrupt no stage spoke of still ends with it, and the next command
    starts afresh."""
    import typer

    from usaf.cli import console
    from usaf.stages.progress import NullProgress
    from usaf.stages.stop import note_at_stop

    def interrupted(*, said: bool) -> str:
        with pytest.raises(typer.Exit) as e, console.handle_errors():
            if said:
                note_at_stop(NullProgress(), "interrupted: saved checkpoints/step-0000078 (step 78)")
            raise KeyboardInterrupt
        assert e.value.exit_code == 130
        return capsys.readouterr().err

    assert "interrupted" not in interrupted(said=True)  # the stage's note said it
    assert "interrupted: nothing half-written was left behind" in interrupted(said=False)


def test_a_second_stop_signal_leaves_at_once_and_says_so(capsys):
    """A second Ctrl-C during training ended the command with exit 130 and no line at all (found in review). The
    control: the first only asks the run to stop at its next boundary, silently."""
    import signal as signals

    from usaf.distributed import World
    from usaf.stages.stop import SECOND_STOP, StopRequest

    stop = StopRequest(World())
    stop._handle(signals.SIGINT, None)
    assert stop.requested and capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as e:
        stop._handle(signals.SIGINT, None)
    assert e.value.code == 130 and SECOND_STOP in capsys.readouterr().err
