"""Crash safety: SIGKILL at random moments (and mid-checkpoint-write), rerun, compare with an uninterrupted run.

Three kills per stage here for quantize and train (two random, one placed), two for train scoring its own plan
(one placed, one random), one placed for export and two for score, and a full disk instead of a kill for eval;
the long version (15 kills per stage) is ``scripts/crash_harness.py``, whose output is in docs/RELIABILITY.md.
"""

from __future__ import annotations

import random
import shutil

import pytest

from usaf.testing import crash, crash_stages

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return crash.build_setup(tmp_path_factory.mktemp("crash-setup"), num_layers=3)


@pytest.fixture(scope="module")
def quantize_ref(setup, tmp_path_factory):
    stage = crash.QuantizeStage(setup.model)
    return stage, crash.run_reference(stage, tmp_path_factory.mktemp("crash-quantize"))


@pytest.fixture(scope="module")
def train_ref(setup, tmp_path_factory):
    stage = crash.TrainStage(setup.quantized, setup.tokens, setup.plan, steps=6, save_every=2)
    return stage, crash.run_reference(stage, tmp_path_factory.mktemp("crash-train"))


@pytest.fixture(scope="module")
def fly_ref(setup, tmp_path_factory):
    stage = crash_stages.FlyTrainStage(setup.quantized, setup.tokens, setup.plan, steps=6, save_every=2)
    return stage, crash.run_reference(stage, tmp_path_factory.mktemp("crash-train-fly"))

def _trials(stage, reference, root, modes, seed):
    rng = random.Random(seed)
    return [crash.run_trial(stage, reference, root, n, rng, mode) for n, mode in enumerate(modes)]


def test_quantize_survives_random_kills(quantize_ref, tmp_path):
    """Two random kills, and one right after the second layer file: the rerun must not quantize those again."""
    stage, reference = quantize_ref
    trials = _trials(stage, reference, tmp_path, ["event", "time"], seed=11)
    assert all(not t.problems for t in trials), [(t.event, t.problems) for t in trials]
    assert trials[0].killed  # an event kill always lands (a time kill may come after the last write)
    layer_two = next(n for n, kind, path in reference.log if kind == "replace" and path.endswith("layer-00001.pt"))
    trial = crash.run_trial(stage, reference, tmp_path, 9, random.Random(0), "event", kill_at=layer_two + 1)
    assert trial.killed and not trial.problems, trial.problems
    assert trial.complete_layers == ["layer-00000", "layer-00001"] and trial.redone == []


def test_quantize_killed_inside_safetensors_save_file_resumes_clean(quantize_ref, tmp_path):
    """Found by CI (a time kill): safetensors' own temporary, left by the kill, must not enter the artifact."""
    stage, reference = quantize_ref
    shard = next(n for n, kind, path in reference.log if kind == "save_file" and "base-00001" in path)
    trial = crash.run_trial(stage, reference, tmp_path, 0, random.Random(0), "event", kill_at=shard, fraction=0.5)
    partial = tmp_path / ".quantize-000.usaf-partial"
    assert trial.killed and trial.torn and "base-00001" in trial.event
    assert not partial.exists() and not trial.problems, trial.problems


def test_train_survives_random_kills(train_ref, tmp_path):
    stage, reference = train_ref
    trials = _trials(stage, reference, tmp_path, ["event", "time"], seed=5)
    assert all(not t.problems for t in trials), [(t.event, t.problems) for t in trials]
    assert trials[0].killed


def test_a_kill_mid_checkpoint_write_loses_nothing_before_the_last_checkpoint(train_ref, tmp_path):
    """The third train kill, inside a checkpoint write; negative control that it lands there: the file is cut."""
    stage, reference = train_ref
    target = next(n for n, kind, path in reference.log if kind == "save_file" and "step-0000004.tmp/deltas" in path)
    trial = crash.run_trial(stage, reference, tmp_path, 0, random.Random(0), "event", kill_at=target, fraction=0.5)
    full = (reference.path / "checkpoints" / "step-0000004" / "deltas.safetensors").stat().st_size
    assert trial.killed and trial.torn and "step-0000004.tmp/deltas.safetensors" in trial.event
    assert 0 <= trial.torn_bytes < full  # it really was half-written when the process died
    assert trial.last_checkpoint == 2 and trial.resumed_from == 2  # the previous checkpoint, nothing earlier
    assert not trial.problems and trial.equal_to_reference, trial.problems


def test_negative_control_the_checks_catch_corruption(train_ref, tmp_path):
    stage, reference = train_ref
    copy = shutil.copytree(reference.path, tmp_path / "copy")
    assert stage.check_visible(copy)[1] == [] and stage.compare(copy, reference.path) == []
    deltas = copy / "checkpoints" / "step-0000002" / "deltas.safetensors"
    deltas.write_bytes(deltas.read_bytes()[:100])
    assert any("step-0000002" in p for p in stage.check_visible(copy)[1])
    final = copy / "final" / "routers.safetensors"
    raw = bytearray(final.read_bytes())
    raw[-1] ^= 1
    final.write_bytes(bytes(raw))
    assert any("routers" in p for p in stage.compare(copy, reference.path))


# -- export and eval, and a full disk instead of a kill ---------------------------------------------------


@pytest.fixture(scope="module")
def run(setup, tmp_path_factory):
    return crash_stages.build_run(setup, tmp_path_factory.mktemp("crash-run"))


@pytest.fixture(scope="module")
def export_ref(setup, run, tmp_path_factory):
    stage = crash_stages.ExportStage(setup.quantized, run)
    return stage, crash.run_reference(stage, tmp_path_factory.mktemp("crash-export"))


@pytest.fixture(scope="module")
def eval_ref(setup, run, tmp_path_factory):
    stage = crash_stages.EvalStage(setup.quantized, run, setup.tokens)
    return stage, crash.run_reference(stage, tmp_path_factory.mktemp("crash-eval"))


def _event_of(reference, kind: str, path_part: str) -> int:
    return next(n for n, k, path in reference.log if k == kind and path_part in path)


@pytest.fixture(scope="module")
def score_ref(setup, tmp_path_factory):
    stage = crash_stages.ScoreStage(setup.quantized, setup.tokens)
    return stage, crash.run_reference(stage, tmp_path_factory.mktemp("crash-score"))


def test_score_killed_in_its_lr_test_resumes_the_saved_pass_to_the_same_plan(score_ref, tmp_path):
    """Killed while saving the second probe (the file cut short), then in the plan's files: each rerun resumes the
    pass saved before the kill (the stage's check) and writes the uninterrupted run's plan byte for byte."""
    stage, reference = score_ref
    probe = [n for n, kind, path in reference.log if kind == "ptfile.add" and path.endswith("score-probes.pt")][2]
    trial = crash.run_trial(stage, reference, tmp_path, 0, random.Random(0), "event", kill_at=probe, fraction=0.5)
    assert trial.killed and trial.torn and "score-probes.pt" in trial.event
    assert trial.visible_after_kill.startswith("nothing (saved work to resume: score-calibration.pt")
    assert not trial.problems and trial.equal_to_reference, trial.problems
    masks = _event_of(reference, "save_file", "masks.safetensors")
    trial = crash.run_trial(stage, reference, tmp_path, 1, random.Random(0), "event", kill_at=masks, fraction=0.5)
    assert trial.killed and not trial.problems and trial.equal_to_reference, trial.problems


def test_negative_control_the_score_check_catches_a_pass_scored_again(score_ref):
    stage, reference = score_ref
    saved = next(n for n, kind, path in reference.log if kind == "replace" and path.endswith("score-calibration.pt"))
    trial = crash.Trial("score", "event")
    before = [(n, kind, path) for n, kind, path in reference.log if n <= saved + 1]
    assert stage.check_rerun(trial, reference.path, before, [], "lr test: up to 4 probes") != []
    assert stage.check_rerun(trial, reference.path, before, [], "8 of 8 calibration batches done") == []


def test_export_killed_mid_shard_leaves_nothing_and_the_rerun_is_byte_identical(export_ref, tmp_path):
    stage, reference = export_ref
    shard = _event_of(reference, "save_file", "model-00001")
    trial = crash.run_trial(stage, reference, tmp_path, 0, random.Random(0), "event", kill_at=shard, fraction=0.5)
    assert trial.killed and trial.torn and trial.visible_after_kill == "nothing"
    assert not trial.problems and trial.equal_to_reference, trial.problems


def test_eval_on_a_full_disk_is_one_line_and_the_rerun_reports_the_same(eval_ref, tmp_path):
    """disk-full mode at eval's report (OSError ENOSPC): one error line naming --out, nothing torn left, the
    rerun's numbers equal to the uninterrupted run's. (train's checkpoint and the other stages' writes:
    tests/test_disk_full.py, in-process; ``scripts/crash_harness.py --disk-full N`` at random writes.)"""
    stage, reference = eval_ref
    trial = crash.run_trial(stage, reference, tmp_path, 0, random.Random(0), crash.DISK_FULL,
                            kill_at=_event_of(reference, "write_text", "report.json"), fraction=0.5)  # fmt: skip
    assert trial.killed and not trial.problems and trial.equal_to_reference, (trial.event, trial.problems)


def test_negative_control_the_export_and_eval_checks_catch_a_difference(export_ref, eval_ref, tmp_path):
    for stage, reference in (export_ref, eval_ref):
        copy = shutil.copytree(reference.path, tmp_path / stage.name)
        assert stage.check_visible(copy)[1] == [] and stage.compare(copy, reference.path) == []
    shard = next((tmp_path / "export").glob("model-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    assert any("model-" in p for p in export_ref[0].compare(tmp_path / "export", export_ref[1].path))
    report = tmp_path / "eval" / "report.json"
    report.write_text(report.read_text().replace('"rows": [', '"rows": [{"bogus": 1},', 1))
    assert eval_ref[0].compare(tmp_path / "eval", eval_ref[1].path)  # the manifest no longer verifies


def test_negative_control_a_full_disk_answered_badly_is_caught(eval_ref, tmp_path):
    """The disk-full judge flags a traceback, a second error line and a temporary left behind."""
    stage, _ = eval_ref
    out = tmp_path / "out"
    (tmp_path / ".out.usaf-tmp-1-x").mkdir()
    assert crash._disk_full_answer(stage, out, 2, f"error: --out {out}: no space left on the disk\n") == [
        "left after the full disk: .out.usaf-tmp-1-x"
    ]
    assert crash._disk_full_answer(stage, out, 1, "Traceback (most recent call last):\nRuntimeError: x\n")
    assert crash._disk_full_answer(stage, out, 2, "error: a\nerror: b\n")


def test_train_scoring_its_own_plan_survives_kills_in_the_score_and_after(fly_ref, tmp_path):
    """No plan anywhere: train scores one into RUN/plan. A kill right after the score saved its pass leaves
    RUN/.plan.usaf-partial, which the rerun resumes whole (refused as a directory usaf did not make before
    2026-12-06); a random kill anywhere; both reruns equal the uninterrupted run, plan included."""
    stage, reference = fly_ref
    saved = next(n for n, kind, path in reference.log if kind == "replace" and path.endswith("score-calibration.pt"))
    trial = crash.run_trial(stage, reference, tmp_path, 0, random.Random(0), "event", kill_at=saved + 1)
    assert trial.killed and "its plan's scoring pass saved to resume" in trial.visible_after_kill
    assert not trial.problems and trial.equal_to_reference, trial.problems
    (tmp_path / "random").mkdir()
    (random_kill,) = _trials(stage, reference, tmp_path / "random", ["event"], seed=7)
    assert random_kill.killed and not random_kill.problems, random_kill.problems
