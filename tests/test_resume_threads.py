"""A resumed CPU run computes at the thread count its run started with (usaf.backends.cpu.same_threads_as).

The CPU's sums are bit-identical only at one intra-op thread count, and usaf lowers the count on a busy machine, so
a run resumed under another load than it started in would continue with other last bits (found by the crash
harness: two of its full-disk trials resumed on a busier machine and ended with other deltas). The count is kept
in every checkpoint's state.json and the resume takes it; where the user set OMP_NUM_THREADS their count stays and
the run says what that costs.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import ctrl_c_at_step, explain, invoke, stop_at_check
from usaf.artifacts import PlanManifest, load_verified
from usaf.backends.cpu import same_threads_as
from usaf.demo import demo_model_dir
from usaf.testing import stdlib_dir
from usaf.testing.hostile import resign_checkpoint

STEPS = 12


@pytest.fixture
def threads():
    """Sets torch's intra-op threads for the test (as choose_threads would on a busy machine); restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo_inputs(tmp_path_factory):
    """The built-in demo model (wide enough that 1 and 2 threads sum differently; the tiny test models are not),
    quantized, with tokens and a plan."""
    root = tmp_path_factory.mktemp("threads")
    model, tokens, qdir, plan = demo_model_dir(), root / "tokens", root / "quantized", root / "plan"
    for command in (["tokenize", stdlib_dir() / "email", "--model", model, "--seq-len", 128, "--out", tokens],
                    ["quantize", model, "--out", qdir],
                    ["score", "--model", qdir, "--data", tokens, "--calib-samples", 8, "--no-lr-test",
                     "--no-stability", "--out", plan]):  # fmt: skip
        result = invoke(*command)
        assert result.exit_code == 0, explain(result)
    return qdir, tokens, plan


def train(inputs, out) -> list:
    qdir, tokens, plan = inputs
    return ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", out, "--steps", STEPS,
            "--save-every", 4, "--reselect-every", 6, "--lr", 1e-3]  # fmt: skip


def deltas(run) -> dict:
    return load_file(run / "final" / "deltas.safetensors")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_on_a_busier_machine_computes_at_the_runs_thread_count(demo_inputs, tmp_path, threads, monkeypatch):
    """Stopped at step 8 of a 2-thread run, resumed where the load chose 1 thread: it runs at 2 and ends with the
    straight run's deltas. Control: the same resume held at 1 thread by OMP_NUM_THREADS ends with other deltas."""
    threads(2)
    straight = invoke(*train(demo_inputs, tmp_path / "straight"))
    assert straight.exit_code == 0, explain(straight)
    for name in ("run", "control"):
        with ctrl_c_at_step(8):
            stopped = invoke(*train(demo_inputs, tmp_path / name))
        assert stopped.exit_code == 130, explain(stopped)
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-0000008" / "state.json").read_text())
    assert state["threads"] == 2

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads(1)  # what a busy machine makes choose_threads pick
    resumed = invoke(*train(demo_inputs, tmp_path / "run"))
    assert resumed.exit_code == 0, explain(resumed)
    assert "resuming at the 2 torch threads the run ran at, not the 1 this machine's load chose" in resumed.stderr
    assert same(deltas(tmp_path / "straight"), deltas(tmp_path / "run"))

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads(1)
    control = invoke(*train(demo_inputs, tmp_path / "control"))
    assert control.exit_code == 0, explain(control)
    assert "the run ran at 2 torch threads, this process runs at 1 (OMP_NUM_THREADS)" in control.stderr
    assert not same(deltas(tmp_path / "straight"), deltas(tmp_path / "control"))


def test_the_users_omp_num_threads_stays_and_the_note_says_what_it_costs(threads):
    threads(1)
    note = same_threads_as(2, "the run", env={"OMP_NUM_THREADS": "1"})
    assert torch.get_num_threads() == 1
    assert note == ("the run ran at 2 torch threads, this process runs at 1 (OMP_NUM_THREADS): the result equals an "
                    "uninterrupted run's only within float rounding; OMP_NUM_THREADS=2 gives its bits")  # fmt: skip
    assert same_threads_as(1, "the run", env={}) is None  # the same count: nothing to say
    assert same_threads_as(None, "the run", env={}) is None and torch.get_num_threads() == 1  # an older usaf's state


def test_a_state_with_a_bad_thread_count_is_refused(demo_inputs, tmp_path):
    with ctrl_c_at_step(4):
        assert invoke(*train(demo_inputs, tmp_path / "run")).exit_code == 130
    path = tmp_path / "run" / "checkpoints" / "step-0000004" / "state.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "threads": 0}))
    result = invoke(*train(demo_inputs, tmp_path / "run"))
    assert result.exit_code == 2 and "state.json: changed since usaf wrote it" in result.stderr  # the checksums
    resign_checkpoint(path.parent)  # a consistent forgery: what the state's own check sees
    result = invoke(*train(demo_inputs, tmp_path / "run"))
    assert result.exit_code == 2
    assert "threads 0 is not a thread count (a whole number from 1)" in result.stderr


def test_a_resumed_score_computes_at_the_thread_count_it_started_with(demo_inputs, tmp_path, threads, monkeypatch):
    """The same for score: stopped in its calibration pass at 2 threads, resumed where the load chose 1, its plan is
    the straight run's, file for file. Control: held at 1 thread by OMP_NUM_THREADS, the plan's files differ."""
    qdir, tokens, _ = demo_inputs

    def score(out) -> list:
        return ["score", "--model", qdir, "--data", tokens, "--calib-samples", 16, "--microbatch", 2, "--no-lr-test",
                "--no-stability", "--out", out]  # fmt: skip

    def files(plan) -> dict:
        return {f.path: f.sha256 for f in load_verified(plan, PlanManifest).files}

    threads(2)
    assert invoke(*score(tmp_path / "straight")).exit_code == 0
    for name in ("plan", "control"):
        stop_at_check(monkeypatch, 4)
        assert invoke(*score(tmp_path / name)).exit_code == 130
    stop_at_check(monkeypatch, 0)

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads(1)
    resumed = invoke(*score(tmp_path / "plan"))
    assert resumed.exit_code == 0, explain(resumed)
    assert "3 of 8 calibration batches done" in resumed.stderr
    assert "resuming at the 2 torch threads the interrupted score ran at, not the 1" in resumed.stderr
    assert files(tmp_path / "plan") == files(tmp_path / "straight")

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads(1)
    control = invoke(*score(tmp_path / "control"))
    assert control.exit_code == 0, explain(control)
    assert "the interrupted score ran at 2 torch threads, this process runs at 1" in control.stderr
    assert files(tmp_path / "control") != files(tmp_path / "straight")
