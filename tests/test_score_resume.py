"""An interrupted ``usaf score`` resumes (usaf.stages.score_resume): a stop request saves the calibration pass or the
lr test's finished probes in the output's partial directory, and the same command goes on from there to the plan an
uninterrupted run writes, byte for byte. Other settings are refused, --overwrite discards, a failure with nothing
saved leaves nothing; a real SIGINT in a subprocess does the same."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from helpers import invoke, leftovers, same_plan, stop_at_check
from usaf.artifacts import PlanManifest, load_verified
from usaf.artifacts.checksums import seal
from usaf.artifacts.prefix_store import STATES_FILE
from usaf.stages import lr_test
from usaf.stages.score_resume import CALIBRATION, PROBES, SETTINGS, STORE
from usaf.testing import stdlib_dir

LAYERS = 4
STEPS = 3  # lr-test probe steps: what is saved and resumed is under test, not the lr chosen
BATCHES = 4  # --calib-samples 8 at --microbatch 2


@pytest.fixture(scope="module")
def setup(quantized, tmp_path_factory):
    qdir = quantized("qwen3_moe", num_layers=LAYERS, tokenizer=True)
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    result = invoke("tokenize", stdlib_dir() / "textwrap.py", "--model", qdir, "--seq-len", 64, "--out", tokens)
    assert result.exit_code == 0, result.output
    return qdir, tokens


def args(setup, out: Path, *extra) -> list:
    qdir, tokens = setup
    return ["score", "--model", qdir, "--data", tokens, "--out", out, "--frac", 0.02, "--calib-samples", 8,
            "--microbatch", 2, "--train-from", 2, "--lr-test", "--lr-test-steps", STEPS, *extra]  # fmt: skip


def workspace_command(setup, workspace: Path) -> list:
    """A score without --out, its default output in ``workspace`` (no lr test: the pass is what is resumed)."""
    qdir, tokens = setup
    return ["score", "--workspace", workspace, "--model", qdir, "--data", tokens, "--calib-samples", 8,
            "--microbatch", 2, "--train-from", 2, "--no-lr-test"]  # fmt: skip


def partial(out: Path) -> Path:
    return out.parent / f".{out.name}.usaf-partial"


@pytest.fixture
def stop_at(monkeypatch):
    """``stop_at(n)``: the n-th stop check of the run raises as Ctrl-C does (helpers.stop_at_check)."""
    yield lambda n: stop_at_check(monkeypatch, n)
    monkeypatch.undo()


@pytest.fixture(scope="module")
def straight(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "plan"
    result = invoke(*args(setup, out))
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("extra", [(), ("--no-stability", "--cache")], ids=["defaults", "no-stability-cache"])
def test_interrupted_in_the_calibration_pass_resumes_to_the_same_plan(setup, straight, tmp_path, stop_at, extra):
    """Without the halves the pass has one set of accumulators; with --cache the plan's store of every sequence's
    prefix states is written after the resumed pass."""
    if extra:
        straight = tmp_path / "straight"
        assert invoke(*args(setup, straight, *extra)).exit_code == 0
    out = tmp_path / "plan"
    stop_at(3)  # before the third batch: two done
    result = invoke(*args(setup, out, *extra))
    assert result.exit_code == 130, result.output
    assert f"saved the calibration pass (2 of {BATCHES} batches)" in result.stderr
    assert not out.exists() and leftovers(tmp_path) == []
    saved = torch.load(partial(out) / CALIBRATION, weights_only=True)
    assert saved["batches"] == 2 and len(saved["states"]) == 2
    assert not (partial(out) / PROBES).exists()

    stop_at(0)  # never
    result = invoke(*args(setup, out, *extra))
    assert result.exit_code == 0, result.output
    assert f"2 of {BATCHES} calibration batches done" in result.stderr
    assert not partial(out).exists()
    same_plan(out, straight)
    assert not {SETTINGS, CALIBRATION, PROBES, STORE} & {f.path for f in load_verified(out, PlanManifest).files}


@pytest.mark.parametrize("recorded_again", [True, False])
def test_the_saved_pass_is_what_the_rerun_continues_from(setup, straight, tmp_path, stop_at, recorded_again):
    """Control: the same saved accumulators resumed as if no batch were done (the first two scored twice), their
    checksum recorded again, give other importance scores, so the equality above is not that of two runs that both
    started over. Left as recorded (a byte changed on disk that still loads was taken; found in review), the rerun
    says so, starts the pass over and writes the straight run's plan."""
    out = tmp_path / "plan"
    stop_at(3)
    assert invoke(*args(setup, out)).exit_code == 130
    saved = torch.load(partial(out) / CALIBRATION, weights_only=True)
    saved["batches"] = 0
    torch.save(saved, partial(out) / CALIBRATION)
    if recorded_again:
        seal(partial(out) / CALIBRATION)
    stop_at(0)
    result = invoke(*args(setup, out))
    assert result.exit_code == 0, result.output
    if recorded_again:
        files = {f.path: f.sha256 for f in load_verified(out, PlanManifest).files}
        reference = {f.path: f.sha256 for f in load_verified(straight, PlanManifest).files}
        assert files["importance.safetensors"] != reference["importance.safetensors"]
    else:
        said = " ".join(result.stderr.split())
        assert f"{CALIBRATION}: not as usaf wrote it (its sha256 is not the one recorded): the calibration pass " \
               "starts over" in said, said
        same_plan(out, straight)


def test_interrupted_in_the_lr_test_resumes_from_its_finished_probes(setup, straight, tmp_path, stop_at, monkeypatch):
    out = tmp_path / "plan"
    stop_at(BATCHES + 1 + STEPS + 2)  # the pass, its closing check, the first probe, two steps of the second
    result = invoke(*args(setup, out))
    assert result.exit_code == 130, result.output
    assert "saved the calibration pass and 1 finished lr-test probe in" in result.stderr
    assert len(torch.load(partial(out) / PROBES, weights_only=True)["done"]) == 1

    stop_at(0)
    probed = []
    real = lr_test._probe
    monkeypatch.setattr(lr_test, "_probe", lambda *a: probed.append(a[4]) or real(*a))
    result = invoke(*args(setup, out))
    assert result.exit_code == 0, result.output
    assert f"{BATCHES} of {BATCHES} calibration batches done" in result.stderr
    assert "1 of 4 probes done by the interrupted run" in result.stderr
    assert probed == sorted(lr_test.CANDIDATES)[1:], "the finished probe is not run again"
    same_plan(out, straight)


def test_other_settings_are_refused_and_overwrite_discards_the_saved_work(setup, tmp_path, stop_at):
    out = tmp_path / "plan"
    stop_at(3)
    assert invoke(*args(setup, out)).exit_code == 130
    before = (partial(out) / CALIBRATION).read_bytes()
    stop_at(0)
    other = [a if a != 0.02 else 0.05 for a in args(setup, out)]
    result = invoke(*other)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--frac 0.02 there, 0.05 now" in result.stderr and "--overwrite" in result.stderr
    assert (partial(out) / CALIBRATION).read_bytes() == before and not out.exists()

    result = invoke(*other, "--overwrite")
    assert result.exit_code == 0, result.output
    assert "discarding the interrupted score's work" in result.stderr
    assert "calibration batches done" not in result.stderr
    assert load_verified(out, PlanManifest).summary.frac == 0.05 and not partial(out).exists()


def test_work_saved_under_another_torch_is_refused_and_a_record_without_versions_resumes(
    setup, straight, tmp_path, stop_at
):
    """The pass's sums depend on torch's kernels: work saved before an upgrade was continued in silence (found in
    review). A record from before the versions were kept (the control) resumes, to the straight run's plan."""
    out = tmp_path / "plan"
    stop_at(3)
    assert invoke(*args(setup, out)).exit_code == 130
    settings = partial(out) / SETTINGS
    record = json.loads(settings.read_text())
    assert record["versions"] == {"torch": torch.__version__, "transformers": transformers.__version__}
    settings.write_text(json.dumps({**record, "versions": {**record["versions"], "torch": "2.0.0"}}))
    stop_at(0)
    refused = invoke(*args(setup, out))
    assert refused.exit_code == 2, refused.output
    assert f"torch 2.0.0 there, {torch.__version__} now" in refused.stderr and not out.exists()

    settings.write_text(json.dumps({key: value for key, value in record.items() if key != "versions"}))
    resumed = invoke(*args(setup, out))
    assert resumed.exit_code == 0, resumed.output
    assert f"2 of {BATCHES} calibration batches done" in resumed.stderr
    same_plan(out, straight)


def test_a_failure_with_nothing_saved_leaves_no_partial_directory(setup, tmp_path):
    out = tmp_path / "plan"
    result = invoke(*args(setup, out, "--targets", "shared"))  # qwen3_moe has no shared experts
    assert result.exit_code == 2, result.output
    assert not out.exists() and not partial(out).exists() and leftovers(tmp_path) == []


def test_ctrl_c_in_a_subprocess_saves_and_the_rerun_resumes(setup, tmp_path):
    """A real SIGINT, sent once the pass is saved (the lr test made long so the signal lands in it): exit 130, the
    work kept; the same command finishes from it."""
    out = tmp_path / "plan"
    cmd = [sys.executable, "-m", "usaf", *map(str, args(setup, out))]
    cmd[cmd.index("--lr-test-steps") + 1] = "400"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (partial(out) / CALIBRATION).is_file():
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    assert "saved the calibration pass and" in stderr and not out.exists()
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{BATCHES} of {BATCHES} calibration batches done" in resumed.stderr
    assert load_verified(out, PlanManifest).summary.lr_test.steps > 0 and not partial(out).exists()


def test_interrupted_while_storing_every_prefix_state_resumes_the_store(setup, tmp_path, stop_at):
    """--cache's store of every training sequence's states is the longest part of a large score: a stop there saves
    how far it got (the index so far, the bytes to keep), and the rerun appends the rest. Control: the saved
    progress is that of a part of the store, not all of it."""
    straight = tmp_path / "straight"
    assert invoke(*args(setup, straight, "--cache")).exit_code == 0
    out = tmp_path / "plan"
    before_store = BATCHES + 1 + 4 * STEPS + 1  # the pass, its closing check, the probes' steps, the test's end
    stop_at(before_store + 3)  # the store's third boundary
    result = invoke(*args(setup, out, "--cache"))
    assert result.exit_code == 130, result.output
    assert "its prefix store's first" in result.stderr, result.stderr
    saved = json.loads((partial(out) / STORE).read_text())
    total = load_verified(straight, PlanManifest).summary.prefix_cache
    assert saved["lines"] > 0 and 0 < saved["store"]["bytes"] < total.bytes

    stop_at(0)
    result = invoke(*args(setup, out, "--cache"))
    assert result.exit_code == 0, result.output
    assert f"prefix cache: {saved['lines']:,} sequences stored by the interrupted run" in result.stderr
    same_plan(out, straight)


@pytest.mark.parametrize("damage", ["byte", "no checksum"])
def test_a_changed_byte_in_the_kept_prefix_states_starts_the_store_over(setup, tmp_path, stop_at, damage):
    """The --cache store a stop kept was appended to as it stood: a byte changed on disk in its states file (still a
    number) entered the plan, and its manifest hashed it as the plan's own (found in review). The kept bytes' sha256
    is recorded with the progress; a rerun whose kept bytes differ, or whose progress has no sha256 (an older usaf's),
    starts the store over, with a note, and the plan is the straight run's. The control: the same stop resumed as it
    is appends (test_interrupted_while_storing_every_prefix_state_resumes_the_store)."""
    straight = tmp_path / "straight"
    assert invoke(*args(setup, straight, "--cache")).exit_code == 0
    out = tmp_path / "plan"
    stop_at(BATCHES + 1 + 4 * STEPS + 1 + 3)  # the store's third boundary, as in the test above
    assert invoke(*args(setup, out, "--cache")).exit_code == 130
    saved = json.loads((partial(out) / STORE).read_text())
    states = partial(out) / STATES_FILE
    if damage == "byte":
        raw = bytearray(states.read_bytes())
        raw[5] ^= 0x01  # a low mantissa bit: the state still reads as a finite number
        states.write_bytes(bytes(raw))
    else:
        del saved["store"]["sha256"]
        (partial(out) / STORE).write_text(json.dumps(saved))

    stop_at(0)
    result = invoke(*args(setup, out, "--cache"))
    assert result.exit_code == 0, result.output
    same_plan(out, straight)
    why = "its sha256 is not the one recorded" if damage == "byte" else "no checksum"
    assert f"{STATES_FILE}: not as usaf wrote it ({why}): the prefix store starts over" in result.stderr


def test_without_out_the_same_command_finds_the_interrupted_output_in_the_workspace(setup, tmp_path, stop_at):
    """A default output is named by its start time, so a rerun would get a new one and start over: the same command
    finds the workspace's interrupted score of the same settings and resumes it. Control: other settings start a new
    output and leave that saved work alone."""
    command = workspace_command(setup, tmp_path)
    stop_at(3)
    assert invoke(*command).exit_code == 130
    (interrupted,) = (tmp_path / "plan").glob(".*.usaf-partial")
    other = invoke(*command, "--frac", 0.05)
    assert other.exit_code == 0, other.output
    assert "resuming" not in other.stderr and interrupted.is_dir()

    stop_at(0)
    result = invoke(*command)
    assert result.exit_code == 0, result.output
    target = interrupted.parent / interrupted.name.removeprefix(".").removesuffix(".usaf-partial")
    assert f"resuming the interrupted score that was writing {target}" in result.stderr
    assert f"2 of {BATCHES} calibration batches done" in result.stderr
    assert load_verified(target, PlanManifest).summary.frac == 0.1 and not interrupted.exists()
    assert len([p for p in (tmp_path / "plan").iterdir() if not p.name.startswith(".")]) == 2


def test_overwrite_starts_over_an_interrupted_score_of_the_same_settings(setup, tmp_path, stop_at):
    """--overwrite discarded saved work only where the settings differed; with the same ones it resumed, while inspect
    said "--overwrite discards it", and no flag started over (found in review). The control: without it, the same
    command resumes."""
    out = tmp_path / "plan"
    stop_at(3)
    assert invoke(*args(setup, out)).exit_code == 130
    stop_at(0)
    over = invoke(*args(setup, out), "--overwrite")
    assert over.exit_code == 0, over.output
    assert "discarding the interrupted score's work" in over.stderr and "(--overwrite; its settings)" in over.stderr
    assert "calibration batches done" not in over.stderr and not partial(out).exists()

    again = tmp_path / "again"
    stop_at(3)
    assert invoke(*args(setup, again)).exit_code == 130
    stop_at(0)
    resumed = invoke(*args(setup, again))
    assert resumed.exit_code == 0 and "calibration batches done" in resumed.stderr, resumed.output


HOLD_THE_LOCK = """
import pathlib, sys, time
from usaf.artifacts.lock import OutputLock
lock = OutputLock(pathlib.Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_score_still_running_is_not_taken_for_an_interrupted_one(setup, tmp_path, stop_at):
    """A second identical `usaf score` (no --out) said it was resuming the first, still running, then was refused,
    naming an --out never given (found in review). A default output another process holds is passed over. The
    control: free, the same command resumes it (test_without_out_the_same_command_finds_...)."""
    import subprocess
    import sys

    command = workspace_command(setup, tmp_path)
    stop_at(3)
    assert invoke(*command).exit_code == 130
    (interrupted,) = (tmp_path / "plan").glob(".*.usaf-partial")
    target = interrupted.parent / interrupted.name.removeprefix(".").removesuffix(".usaf-partial")
    stop_at(0)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = invoke(*command)
        assert result.exit_code == 0, result.output
        assert "resuming" not in result.stderr and interrupted.is_dir()  # a new output; the running one's left alone
    finally:
        holder.kill()
        holder.wait()


def test_stopped_while_writing_the_plan_it_says_what_is_kept_and_resumes(setup, tmp_path, monkeypatch):
    """Ctrl-C after the lr test, while the plan's files were written, said "nothing half-written was left behind"
    of a kept, resumable partial directory (found in review). It says what is kept; the rerun resumes."""
    from usaf.stages import score

    out = tmp_path / "plan"
    real = score._write_files

    def stopped(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(score, "_write_files", stopped)
    result = invoke(*args(setup, out))
    assert result.exit_code == 130 and partial(out).is_dir()
    said = " ".join(result.stderr.split())
    assert f"interrupted while writing the plan: its work is saved in {partial(out)}" in said
    monkeypatch.setattr(score, "_write_files", real)
    resumed = invoke(*args(setup, out))
    assert resumed.exit_code == 0 and "calibration batches done" in resumed.stderr, resumed.output


@pytest.fixture
def stopped_before_the_rename(monkeypatch):
    """``stop(command)``: run ``command`` with Ctrl-C (as a kill would) after the plan's manifest was written and its
    bookkeeping dropped, before the rename: the partial directory holds a finished plan and nothing else."""
    from usaf.artifacts.writer import ArtifactWriter

    def stop(command: list) -> None:
        with monkeypatch.context() as patched:
            patched.setattr(ArtifactWriter, "_move_into_place",
                            lambda self: (_ for _ in ()).throw(KeyboardInterrupt))  # fmt: skip
            result = invoke(*command)
        assert result.exit_code == 130, result.output

    return stop


def finished_in(directory: Path) -> bool:
    """A partial directory holding a plan's manifest and none of score's bookkeeping."""
    names = {p.name for p in directory.iterdir()}
    return "manifest.json" in names and not names & {SETTINGS, CALIBRATION, PROBES, STORE}


def test_killed_between_the_manifest_and_the_rename_the_finished_plan_is_moved_into_place(
    setup, straight, tmp_path, stopped_before_the_rename, monkeypatch
):
    """It was scored again from nothing (its bookkeeping was gone; found in review). The rerun verifies the finished
    plan and moves it into place without scoring."""
    from usaf.stages import score

    out = tmp_path / "plan"
    stopped_before_the_rename(args(setup, out))
    assert not out.exists() and finished_in(partial(out))
    monkeypatch.setattr(score, "_score", lambda *a, **k: pytest.fail("scored again"))
    result = invoke(*args(setup, out))
    assert result.exit_code == 0, result.output
    assert "the interrupted score had finished its plan" in " ".join(result.stderr.split())
    assert not partial(out).exists() and leftovers(tmp_path) == []
    same_plan(out, straight)
    load_verified(out, PlanManifest)


def test_a_finished_plan_of_other_settings_is_refused_and_a_damaged_one_scored_again(
    setup, straight, tmp_path, stopped_before_the_rename
):
    """Controls: other settings are refused as their saved work is (naming the setting); --overwrite discards it;
    a plan whose files no longer match its manifest is not taken for finished, and is scored again."""
    out = tmp_path / "plan"
    stopped_before_the_rename(args(setup, out))
    other = [*args(setup, out), "--no-stability"]
    result = invoke(*other)
    assert result.exit_code == 2 and "finished its plan" in result.stderr, result.output
    assert "--stability there, --no-stability now" in " ".join(result.stderr.split())  # a switch as its flag
    assert finished_in(partial(out)) and not out.exists()  # nothing taken or deleted

    result = invoke(*other, "--overwrite")
    assert result.exit_code == 0, result.output
    assert "discarding the finished plan" in " ".join(result.stderr.split())
    assert load_verified(out, PlanManifest).config["stability"] is False

    out = tmp_path / "damaged"
    stopped_before_the_rename(args(setup, out))
    mask = next(p for p in partial(out).iterdir() if p.suffix == ".safetensors")
    mask.write_bytes(mask.read_bytes()[:-8])  # truncated: the manifest's sha256 no longer matches
    result = invoke(*args(setup, out))
    assert result.exit_code == 0, result.output
    assert "had finished its plan" not in result.stderr and "calibration" in result.stderr
    same_plan(out, straight)


def test_without_out_a_finished_plan_left_in_the_workspace_is_found(setup, tmp_path, stopped_before_the_rename):
    """Without --out every run gets a new name: the rerun would have scored into another one, leaving the finished
    plan where nothing finds it."""
    workspace = tmp_path / "ws"
    stopped_before_the_rename(workspace_command(setup, workspace))
    (left,) = (workspace / "plan").iterdir()
    assert left.name.endswith(".usaf-partial") and finished_in(left)
    result = invoke(*workspace_command(setup, workspace))
    assert result.exit_code == 0, result.output
    assert "had finished its plan" in " ".join(result.stderr.split())
    assert [p.name for p in (workspace / "plan").iterdir()] == [left.name[1:].removesuffix(".usaf-partial")]


def test_a_finished_plan_discarded_by_overwrite_is_gone_when_that_run_stops(
    setup, tmp_path, stopped_before_the_rename, stop_at
):
    """--overwrite said it discarded the finished plan, and left its manifest: stopped in its calibration pass, the
    rerun without the flag (as the stop note says) took that old plan for finished work (found in review). The
    rerun resumes the new pass instead."""
    out = tmp_path / "plan"
    stopped_before_the_rename(args(setup, out))
    stop_at(3)
    result = invoke(*args(setup, out), "--overwrite")
    assert result.exit_code == 130 and "discarding the finished plan" in " ".join(result.stderr.split())
    assert not (partial(out) / "manifest.json").exists()
    stop_at(0)
    resumed = invoke(*args(setup, out))
    assert resumed.exit_code == 0, resumed.output
    assert "had finished its plan" not in resumed.stderr and "2 of 4 calibration batches done" in resumed.stderr
