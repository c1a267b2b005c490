"""Crash safety: SIGKILL at random moments (and mid-checkpoint-write), rerun, compare with an uninterrupted run.

Three kills per stage here (two random, one placed); the long version (30 per stage) is
``scripts/crash_harness.py``, whose output is in docs/RELIABILITY.md.
"""

from __future__ import annotations

import random
import shutil

import pytest

from usaf.testing import crash

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
