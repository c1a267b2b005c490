"""Determinism on CPU: the same inputs and seed give byte-identical masks, deltas and reports, across processes.

Each run is a fresh ``python -m usaf`` process: an unseeded RNG differs between processes, not within one, so
in-process repeats could pass where users would see two runs differ.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import invoke
from usaf.artifacts import PlanManifest, RunManifest, load_verified
from usaf.testing import crash

pytestmark = pytest.mark.slow


def _usaf(*args) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "usaf", *map(str, args)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]


def _report(manifest) -> dict:
    """The summary without wall-clock fields (the only things allowed to differ)."""
    return {k: v for k, v in manifest.summary.model_dump(mode="json").items() if "seconds" not in k}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("determinism")
    setup = crash.build_setup(root / "setup", num_layers=3)
    score = ["score", "--model", setup.quantized, "--data", setup.tokens, "--frac", 0.05, "--calib-samples", 8,
             "--train-from", 1, "--seed", 7]  # fmt: skip
    for name in ("plan-a", "plan-b"):
        _usaf(*score, "--out", root / name)
    train = ["train", "--model", setup.quantized, "--data", setup.tokens, "--plan", root / "plan-a", "--steps", 6,
             "--reselect-every", 3, "--save-every", 3, "--lr", 0.01]  # fmt: skip
    for name in ("run-a", "run-b"):
        _usaf(*train, "--seed", 3, "--out", root / name)
    result = invoke(*train, "--seed", 4, "--out", root / "run-other-seed")  # in-process: the control needs no fresh one
    assert result.exit_code == 0, result.output
    return root


def test_score_twice_gives_byte_identical_masks_and_report(runs):
    a, b = (load_verified(runs / name, PlanManifest) for name in ("plan-a", "plan-b"))
    assert (runs / "plan-a" / "masks.safetensors").read_bytes() == (runs / "plan-b" / "masks.safetensors").read_bytes()
    assert [f.sha256 for f in a.files] == [f.sha256 for f in b.files] and a.fingerprint == b.fingerprint
    assert _report(a) == _report(b)


def test_train_twice_gives_byte_identical_deltas_checkpoints_and_report(runs):
    a, b = (load_verified(runs / name, RunManifest) for name in ("run-a", "run-b"))
    assert [(f.path, f.sha256) for f in a.files] == [(f.path, f.sha256) for f in b.files]  # final/: deltas, routers,
    assert a.fingerprint == b.fingerprint  # optimizer state with torch's RNG, state.json
    for checkpoint in ("step-0000003", "step-0000006"):
        for file in ("deltas.safetensors", "optimizer.pt"):
            one, two = (runs / r / "checkpoints" / checkpoint / file for r in ("run-a", "run-b"))
            assert one.read_bytes() == two.read_bytes(), (checkpoint, file)
    assert _report(a) == _report(b)
    assert _metrics(runs / "run-a") == _metrics(runs / "run-b")


def _metrics(run) -> list[dict]:
    """metrics.jsonl without its wall-clock and memory fields."""
    timing = {"seconds", "tokens_per_s", "memory"}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in timing} for r in records]


def test_negative_control_another_seed_gives_other_bytes(runs):
    a, other = (load_verified(runs / name, RunManifest) for name in ("run-a", "run-other-seed"))
    assert a.fingerprint != other.fingerprint and _report(a) != _report(other)
