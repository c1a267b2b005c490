"""`usaf train` through the CLI: learning, exact resume, Ctrl-C, reselection, NaN steps, routers, bad input."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import FAMILIES
from helpers import ctrl_c_at_step, explain, invoke
from usaf.artifacts import PlanManifest, RunManifest, load_verified
from usaf.artifacts.run import run_settings_text


def train(qdir, tokens, plan, out, *extra):
    return invoke(
        "train",
        "--model",
        qdir,
        "--data",
        tokens,
        "--plan",
        plan,
        "--out",
        out,
        "--lr",
        0.05,
        "--save-every",
        0,
        *extra,
    )


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_deltas(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "deltas.safetensors"))


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_decreases_for_every_family(family, prepared, tmp_path):
    """A memorisation task: two sequences, seen again and again, must get likelier."""
    qdir, tokens, plan = prepared(family)
    memory = tmp_path / "two.jsonl"
    memory.write_text("".join((tokens / "train.jsonl").read_text().splitlines(keepends=True)[:2]))
    run = tmp_path / "run"
    result = train(
        qdir, memory, plan, run, "--steps", 30, "--reselect-every", 10, "--eval-data", tokens, "--eval-every", 15
    )
    assert result.exit_code == 0, result.output
    manifest = load_verified(run, RunManifest)
    s = manifest.summary
    losses = [m["loss"] for m in metrics(run) if "loss" in m]
    assert len(losses) == 30 and s.skipped_steps == 0
    # the same two sequences every step and no dropout: a frozen model's loss would not move at all, so 0.05
    # nats is learning (gpt-oss, whose attention trains too by default, gains the least: ~0.08 at this lr)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05, losses
    assert [step for step, _ in s.eval_losses] == [0, 15, 30] and len(s.reselections) == 2  # 0: untrained
    flat = " ".join(result.stdout.split())
    assert f"held-out loss untrained → trained │ {s.eval_losses[0][1]:.4f} → {s.eval_losses[-1][1]:.4f}" in flat
    # the summary's ends: means of a quarter of the steps (7 of 30), from the metrics, shown on the console
    assert s.loss_window == 7 and s.first_losses_mean == pytest.approx(sum(losses[:7]) / 7)
    assert s.last_losses_mean == pytest.approx(sum(losses[-7:]) / 7) and s.last_losses_mean < s.first_losses_mean
    shown = f"train loss, mean of the first → last 7 steps │ {s.first_losses_mean:.4f} → {s.last_losses_mean:.4f}"
    assert shown in " ".join(result.stdout.split())


def test_the_progress_bar_shows_the_mean_loss_of_the_last_20_steps(prepared, tmp_path):
    """One step's loss is one microbatch's: the bar shows the mean of the last 20 steps, skipped ones left out."""
    from helpers import RecordingProgress
    from usaf.stages.train import TrainConfig
    from usaf.stages.train import run as train_run
    from usaf.stages.train.loop import SHOWN_LOSS

    qdir, tokens, plan = prepared("qwen3_moe")
    progress = RecordingProgress()
    train_run(TrainConfig(model=qdir, data=tokens, plan=plan, out=tmp_path / "run", steps=25, reselect_every=0,
                          device="cpu"), progress=progress)  # fmt: skip
    begin = progress.events.index(("training", 25, "steps"))
    end = progress.events.index("finish", begin)
    shown = [counters[SHOWN_LOSS] for amount, counters in progress.events[begin + 1 : end] if amount == 1]
    losses = [m["loss"] for m in metrics(tmp_path / "run") if "loss" in m]
    assert len(shown) == len(losses) == 25
    assert shown[2] == pytest.approx(sum(losses[:3]) / 3) and shown[-1] == pytest.approx(sum(losses[-20:]) / 20)
    assert shown[-1] != pytest.approx(losses[-1])  # the control: not the last step's own
    assert [counters["tokens"] for amount, counters in progress.events[begin + 1 : end] if amount == 1][:3] == [
        m["tokens"] for m in metrics(tmp_path / "run") if "loss" in m][:3]  # fmt: skip

    # Resumed at step 10, the bar starts there, and counts (for its tokens/s) the tokens of this start: it counted the
    # run's from step 0 in this start's seconds (a resumed run showed 137,624 tokens/s; found in review).
    resumed = RecordingProgress()
    config = TrainConfig(model=qdir, data=tokens, plan=plan, out=tmp_path / "resumed", steps=25, reselect_every=0,
                         device="cpu")  # fmt: skip
    with ctrl_c_at_step(10), pytest.raises(KeyboardInterrupt):
        train_run(config, progress=RecordingProgress())
    train_run(config, progress=resumed)
    begin = resumed.events.index(("training", 25, "steps", 10))
    end = resumed.events.index("finish", begin)
    # named as what they are (the run's steps beside this start's tokens read as the run's; found in review)
    counted = [counters["tokens since the resume"] for amount, counters in resumed.events[begin + 1 : end]
               if amount == 1]  # fmt: skip
    at = [m["tokens"] for m in metrics(tmp_path / "resumed") if "loss" in m]
    assert len(counted) == 15 and counted == [tokens - at[9] for tokens in at[10:]]


def test_the_held_out_loss_is_shown_as_it_runs(prepared, tmp_path):
    """Held-out evaluation ran in silence (minutes at a real model's size; found in review): before and after
    training a phase of its own, counting the held-out sequences; inside the training bar a note, then its result."""
    from helpers import RecordingProgress
    from usaf.stages.train import TrainConfig
    from usaf.stages.train import run as train_run

    qdir, tokens, plan = prepared("qwen3_moe")
    progress = RecordingProgress()
    train_run(TrainConfig(model=qdir, data=tokens, plan=plan, out=tmp_path / "run", steps=4, reselect_every=0,
                          eval_data=tokens, eval_every=3, device="cpu"), progress=progress)  # fmt: skip
    held = len((tokens / "heldout.jsonl").read_text().splitlines())
    losses = {m["step"]: m["eval_loss"] for m in metrics(tmp_path / "run") if "eval_loss" in m}
    assert sorted(losses) == [0, 3, 4]
    for step in (0, 4):  # a phase each, advanced by microbatch to every held-out sequence
        begin = progress.events.index((f"held-out loss at step {step}", held, "sequences"))
        end = progress.events.index("finish", begin)
        assert sum(amount for amount, _ in progress.events[begin + 1 : end]) == held
    assert f"step 3: held-out loss over {held:,} sequences" in progress.notes
    assert [f"step {s}: held-out loss {loss:.4f}" in progress.notes for s, loss in losses.items()] == [True] * 3


def test_loss_ends_average_a_quarter_of_the_steps_at_most_50():
    from usaf.stages.train.run import loss_ends

    assert loss_ends([]) == (None, None, None)
    assert loss_ends([3.0, 1.0, 2.0]) == (1, 3.0, 2.0)  # fewer than 4 steps: one at each end
    assert loss_ends([1.0] * 4 + [2.0] * 4) == (2, 1.0, 2.0)
    window, first, last = loss_ends([float(i) for i in range(400)])
    assert (window, first, last) == (50, 24.5, 374.5)


@pytest.mark.parametrize(
    "interrupt_at",
    [
        10,  # right after a reselection
        8,  # inside the scoring window (steps 7-10) of the reselection at step 10: the checkpoint carries its scores
    ],
)
def test_resume_is_exact(prepared, tmp_path, monkeypatch, interrupt_at):
    from helpers_trained import interrupt_at as ctrl_c_at

    qdir, tokens, plan = prepared("qwen3_moe")
    args = ["--steps", 20, "--reselect-every", 5, "--reselect-fraction", 0.3]
    straight = tmp_path / "straight"
    assert train(qdir, tokens, plan, straight, *args).exit_code == 0

    resumed = tmp_path / "resumed"
    result = ctrl_c_at(interrupt_at, lambda: train(qdir, tokens, plan, resumed, *args), monkeypatch)
    assert result.exit_code == 130 and "run the same command to resume" in result.stderr
    assert (resumed / "checkpoints" / f"step-{interrupt_at:07d}").is_dir() and not (resumed / "manifest.json").exists()
    result = train(qdir, tokens, plan, resumed, *args)
    assert result.exit_code == 0, result.output
    assert "resuming from" in result.stderr
    losses = lambda run: [m["loss"] for m in metrics(run) if "loss" in m]  # noqa: E731
    assert losses(resumed) == losses(straight), str([losses(straight), losses(resumed)])
    ends = [load_verified(run, RunManifest).summary for run in (straight, resumed)]
    assert [(e.loss_window, e.first_losses_mean, e.last_losses_mean) for e in ends] == [(5, *ends[0].model_dump(
        include={"first_losses_mean", "last_losses_mean"}).values())] * 2  # fmt: skip
    a, b = final_deltas(straight), final_deltas(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The summary's time and rate are of the resumed start: it divided every step's tokens by the resumed part's
    # seconds (found in review). The straight run's are the whole run's (the control).
    at = next(m["tokens"] for m in metrics(resumed) if m.get("step") == interrupt_at and "tokens" in m)
    assert (ends[0].resumed_at_step, ends[0].session_tokens) == (None, ends[0].tokens)
    assert (ends[1].resumed_at_step, ends[1].session_tokens) == (interrupt_at, ends[1].tokens - at)
    assert f"wall time since the resume at step {interrupt_at}" in " ".join(result.output.split())


def test_an_interrupted_run_resumes_with_what_it_started_with_and_a_refusal_says_what_differs(
    prepared, tmp_path, monkeypatch
):
    """Found in review: a run that took its plan (or tokens) from the workspace could not be resumed once a newer
    one appeared there, nor with its paths spelled otherwise or another --save-every, and the refusal ("holds
    another run") named nothing, offering --overwrite, which discards its checkpoints."""
    from helpers_trained import interrupt_at as ctrl_c_at

    qdir, tokens, plan = prepared("qwen3_moe")
    workspace = tmp_path / "ws"
    shutil.copytree(plan, workspace / "plan" / "first")
    shutil.copytree(tokens, workspace / "tokens" / "first")
    run = tmp_path / "run"
    args = ["train", "--model", qdir, "--workspace", workspace, "--steps", 4, "--lr", 0.05]
    ctrl_c_at(2, lambda: invoke(*args, "--save-every", 2, "--out", run), monkeypatch)
    newer = invoke("score", "--model", qdir, "--data", tokens, "--calib-samples", 4, "--no-stability",
                   "--no-lr-test", "--train-from", 2, "--out", workspace / "plan" / "newer")  # fmt: skip
    assert newer.exit_code == 0, newer.output
    monkeypatch.chdir(tmp_path)
    resumed = invoke(*args, "--save-every", 1, "--out", "run")  # relative now, and checkpoints more often
    assert resumed.exit_code == 0, resumed.output
    assert "the one this run started with" in resumed.stderr and "resuming from" in resumed.stderr
    assert load_verified(run, RunManifest).summary.steps == 4

    ctrl_c_at(2, lambda: invoke(*args, "--out", tmp_path / "other"), monkeypatch)
    refused = invoke(*args, "--lr", 0.01, "--out", tmp_path / "other")
    assert refused.exit_code == 2 and "--lr 0.05, not 0.01" in refused.stderr, refused.output


def test_a_run_resumes_only_in_the_compute_dtype_it_started_in(prepared, tmp_path, monkeypatch):
    """--dtype auto resolves per device: a bf16 GPU run resumed where only the CPU is seen went on in fp32, in silence
    (found in review). Here the record says bfloat16 (as a GPU start writes it). The controls: a record of an older
    usaf, without the key, resumes; the record written holds the dtype resolved."""
    from helpers_trained import interrupt_at as ctrl_c_at

    qdir, tokens, plan = prepared("qwen3_moe")
    run = tmp_path / "run"
    args = ["--steps", 4, "--save-every", 2]
    ctrl_c_at(2, lambda: train(qdir, tokens, plan, run, *args), monkeypatch)
    settings = json.loads((run / "run-settings.json").read_text())
    assert settings["compute_dtype"] == "float32"
    (run / "run-settings.json").write_text(run_settings_text({**settings, "compute_dtype": "bfloat16"}))
    refused = train(qdir, tokens, plan, run, *args)
    assert refused.exit_code == 2 and "the compute dtype bfloat16, not float32" in refused.stderr, refused.output
    del settings["compute_dtype"]
    (run / "run-settings.json").write_text(run_settings_text(settings))
    resumed = train(qdir, tokens, plan, run, *args)
    assert resumed.exit_code == 0 and "resuming from" in resumed.stderr, resumed.output


def test_the_untrained_held_out_loss_is_logged_once_whether_resumed_or_restarted(prepared, tmp_path, monkeypatch):
    """The held-out loss at step 0 (before training) is in the metrics once: after a resume from a checkpoint (the
    checkpoint carries it) and after a restart from nothing (a run killed before its first checkpoint logged it)."""
    from helpers_trained import interrupt_at as ctrl_c_at

    qdir, tokens, plan = prepared("qwen3_moe")
    args = ["--steps", 6, "--reselect-every", 0, "--eval-data", tokens]
    straight = tmp_path / "straight"
    assert train(qdir, tokens, plan, straight, *args).exit_code == 0
    evals = lambda run: [(m["step"], m["eval_loss"]) for m in metrics(run) if "eval_loss" in m]  # noqa: E731
    assert [step for step, _ in evals(straight)] == [0, 6]
    for restart in (False, True):
        run = tmp_path / f"run-{restart}"
        assert ctrl_c_at(3, lambda run=run: train(qdir, tokens, plan, run, *args), monkeypatch).exit_code == 130
        if restart:  # as if killed before any checkpoint: the same command starts from nothing
            shutil.rmtree(run / "checkpoints")
        result = train(qdir, tokens, plan, run, *args)
        assert result.exit_code == 0, result.output
        assert ("resuming from" in result.stderr) is not restart
        assert evals(run) == evals(straight), restart


def test_train_dequantizes_the_frozen_layers_once_and_trains_exactly_as_per_forward(prepared, tmp_path, monkeypatch):
    """usaf train computes prefixes (no store in the plan): the frozen layer is made resident, the run says so, and
    its losses and deltas equal a run that dequantizes per forward (the control, with the choice switched off)."""
    from usaf.stages import engine_setup  # lazy: the test patches its module attribute

    qdir, tokens, plan = prepared("qwen3_moe")  # layers 0-1 frozen, layer 2 trains
    args = ["--steps", 6, "--reselect-every", 3]
    made = []
    real = engine_setup.make_resident

    def recording(loaded, backend, wanted, layers=None, progress=None):
        resident, nbytes = real(loaded, backend, wanted, layers, progress)
        made.append((sorted(layers), resident))
        return resident, nbytes

    monkeypatch.setattr(engine_setup, "make_resident", recording)
    result = train(qdir, tokens, plan, tmp_path / "resident", *args)
    assert result.exit_code == 0, result.output
    assert made == [([0, 1], True)] and "2 frozen MoE layers' experts dequantized once" in result.stderr
    monkeypatch.setattr(engine_setup, "frozen_layers_resident", lambda *args, **kwargs: False)
    result = train(qdir, tokens, plan, tmp_path / "per-forward", *args)
    assert result.exit_code == 0, result.output
    assert "dequantized once" not in result.stderr
    losses = [[m["loss"] for m in metrics(tmp_path / run) if "loss" in m] for run in ("resident", "per-forward")]
    assert losses[0] == losses[1]
    a, b = final_deltas(tmp_path / "resident"), final_deltas(tmp_path / "per-forward")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _train_command(qdir, tokens, plan, run, steps: int) -> list[str]:
    args = ["--model", qdir, "--data", tokens, "--plan", plan, "--out", run, "--steps", steps, "--save-every", 0]
    return [sys.executable, "-m", "usaf", "train", *map(str, args)]


def _signal_after_two_steps(cmd: list[str], run, signum: int) -> tuple[int, str]:
    """Start ``cmd``, send ``signum`` as soon as two steps are logged; (exit code, stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    log = run / "metrics.jsonl"
    # An unloaded machine runs a step of this model in ~10 ms.
    while time.time() < deadline and not (log.is_file() and len(log.read_text().splitlines()) >= 2):
        time.sleep(0.05)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    return proc.returncode, stderr


def test_ctrl_c_in_a_subprocess_saves_and_the_rerun_resumes(prepared, tmp_path):
    qdir, tokens, plan = prepared("olmoe")
    run = tmp_path / "run"
    cmd = _train_command(qdir, tokens, plan, run, 600)
    returncode, stderr = _signal_after_two_steps(cmd, run, signal.SIGINT)
    assert returncode == 130, stderr
    checkpoints = sorted((run / "checkpoints").iterdir())
    assert len(checkpoints) == 1 and "interrupted" in stderr
    done = int(checkpoints[0].name.split("-")[1])
    assert 0 < done < 600
    resumed = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ}, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {done} of 600" in resumed.stderr
    assert load_verified(run, RunManifest).summary.steps == 600


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_save_like_ctrl_c_and_exit_with_the_signals_code(prepared, tmp_path, name):
    """What kill, schedulers, container stops (SIGTERM) and a closed terminal (SIGHUP) send: a checkpoint at the
    step boundary, exit 128 + the signal's number, and the rerun resumes from it."""
    signum = getattr(signal, name)
    qdir, tokens, plan = prepared("olmoe")
    run = tmp_path / "run"
    cmd = _train_command(qdir, tokens, plan, run, 150)
    returncode, stderr = _signal_after_two_steps(cmd, run, signum)
    assert returncode == 128 + signum, stderr
    assert f"stopped by {name}: the work above is kept" in stderr and "interrupted: saved" in stderr
    assert "nothing half-written" not in stderr  # after "saved", it read as contradicting it (found in review)
    checkpoints = sorted((run / "checkpoints").iterdir())
    assert len(checkpoints) == 1
    done = int(checkpoints[0].name.split("-")[1])
    assert 0 < done < 150
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert f"step {done} of 150" in resumed.stderr


def test_a_run_whose_output_reader_dies_goes_on_and_finishes(prepared, tmp_path):
    """``nohup usaf train ... 2>&1 | tee log &``: at logout tee died, and the next progress line's write raised
    BrokenPipeError out of the loop: exit 1, no checkpoint, every step lost (found in review). The streams now
    outlive their reader: the run finishes, its manifest written. The reader is closed after the first line here,
    while the run has most of its steps ahead (the control: they are logged after the close)."""
    qdir, tokens, plan = prepared("olmoe")
    run = tmp_path / "run"
    cmd = _train_command(qdir, tokens, plan, run, 150)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stderr.readline()  # the first note: the run has begun
    proc.stderr.close()  # what a dead tee leaves: no reader on either stream
    proc.stdout.close()
    assert proc.wait(timeout=600) == 0
    assert load_verified(run, RunManifest).summary.steps == 150
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= 150  # every step trained after the close


@pytest.mark.parametrize("name", ["SIGHUP", "SIGINT"])
def test_a_signal_ignored_when_train_starts_stays_ignored(prepared, tmp_path, name):
    """``nohup usaf train ... &`` ignores SIGHUP, and a job a script starts in the background ignores SIGINT; train
    took both over, so logging out stopped the run nohup was to keep (found in review). An ignored signal stays
    ignored: the run goes on to its end. The control (the test above): not ignored, the same signal stops it."""
    signum = getattr(signal, name)
    qdir, tokens, plan = prepared("olmoe")
    run = tmp_path / "run"
    cmd = _train_command(qdir, tokens, plan, run, 60)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signum, signal.SIG_IGN))  # fmt: skip
    log, deadline = run / "metrics.jsonl", time.time() + 120
    while time.time() < deadline and not (log.is_file() and len(log.read_text().splitlines()) >= 2):
        time.sleep(0.05)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "interrupted" not in stderr, stderr
    assert load_verified(run, RunManifest).summary.steps == 60


@pytest.mark.parametrize(
    "options",
    [
        ("--z-loss-coef", 0.01),
        ("--aux-loss-coef", 0.01),
        ("--aux-loss-coef", 0.01, "--z-loss-coef", 0.01, "--no-router"),
    ],
    ids=["z-loss", "aux-loss", "both-without-router"],
)
def test_every_router_loss_option_trains_end_to_end(prepared, tmp_path, options):
    """Through the CLI, from the default cached prefix (where --z-loss-coef once crashed): the run finishes and
    its first step's loss carries the router terms on top of the plain run's cross-entropy."""
    qdir, tokens, plan = prepared("qwen3_moe")
    runs = {"plain": (), "with": options}
    for name, extra in runs.items():
        result = train(qdir, tokens, plan, tmp_path / name, "--steps", 3, "--save-every", 0, *extra)
        assert result.exit_code == 0, result.output
    first = {name: [m["loss"] for m in metrics(tmp_path / name) if "loss" in m][0] for name in runs}
    assert first["with"] > first["plain"]  # the same weights and batch at step 0: only the router terms differ
    summary = load_verified(tmp_path / "with", RunManifest).summary
    assert summary.steps == 3 and summary.skipped_steps == 0


def test_reselection_keeps_the_set_size_and_every_trained_value(prepared, tmp_path):
    qdir, tokens, plan = prepared("mixtral")
    masks = load_file(str(plan / "masks.safetensors"))
    static = tmp_path / "static"
    assert train(qdir, tokens, plan, static, "--steps", 12, "--reselect-every", 0).exit_code == 0
    deltas = final_deltas(static)
    for name, mask in masks.items():
        assert torch.equal(deltas[f"{name}.indices"], mask)  # a static mask never changes
        assert deltas[f"{name}.frozen_indices"].numel() == 0
    dynamic = tmp_path / "dynamic"
    assert (
        train(qdir, tokens, plan, dynamic, "--steps", 12, "--reselect-every", 4, "--reselect-fraction", 0.5).exit_code
        == 0
    )
    s = load_verified(dynamic, RunManifest).summary
    deltas = final_deltas(dynamic)
    assert len(s.reselections) == 2
    for record in s.reselections:
        assert record.kept + record.dropped == sum(m.numel() for m in masks.values())
        assert record.grown == record.dropped and 0 < record.turnover <= 0.5
    for name, mask in masks.items():
        assert deltas[f"{name}.indices"].numel() == mask.numel()  # set size unchanged
        assert not torch.equal(deltas[f"{name}.indices"], mask)
        # Every value ever trained is in the cumulative delta: active and dropped-and-kept together.
        cumulative = set(deltas[f"{name}.cumulative_indices"].tolist())
        assert set(deltas[f"{name}.indices"].tolist()) | set(deltas[f"{name}.frozen_indices"].tolist()) == cumulative
    assert s.frozen_entries > 0


def test_a_non_finite_step_is_skipped_and_counted(prepared, tmp_path, monkeypatch):
    from usaf.engine import engine as engine_module

    qdir, tokens, plan = prepared("qwen3_moe")
    real_loss = engine_module.SparseEngine.loss
    calls = []

    def poisoned(self, *args, **kwargs):
        parts = real_loss(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # the third step's loss is NaN
            parts.loss = parts.loss * float("nan")
        return parts

    monkeypatch.setattr(engine_module.SparseEngine, "loss", poisoned)
    run = tmp_path / "run"
    result = train(qdir, tokens, plan, run, "--steps", 5, "--reselect-every", 0)
    assert result.exit_code == 0
    # said, not only counted in the table (a run of skipped steps read as trained; found in review)
    assert "1 of the run's 5 steps were skipped (a non-finite loss" in " ".join(result.stderr.split())
    records = [m for m in metrics(run) if "loss" in m]
    assert [m["skipped"] for m in records] == [False, False, True, False, False]
    summary = load_verified(run, RunManifest).summary
    assert summary.skipped_steps == 1
    finite = [m["loss"] for m in records if not m["skipped"]]  # the skipped step's NaN is left out of the means
    assert (summary.loss_window, summary.first_losses_mean, summary.last_losses_mean) == (1, finite[0], finite[-1])
    deltas = final_deltas(run)
    assert all(torch.isfinite(v).all() for k, v in deltas.items() if k.endswith("values"))


def test_router_on_and_off(prepared, tmp_path):
    qdir, tokens, plan = prepared("qwen3_moe")
    off, on = tmp_path / "off", tmp_path / "on"
    assert train(qdir, tokens, plan, off, "--steps", 4, "--no-router", "--reselect-every", 0).exit_code == 0
    assert train(qdir, tokens, plan, on, "--steps", 4, "--router-lr", 0.01, "--reselect-every", 0).exit_code == 0
    assert load_verified(off, RunManifest).summary.router_params == 0
    assert set(load_file(str(off / "final" / "routers.safetensors"))) == {"_none"}
    routers = load_file(str(on / "final" / "routers.safetensors"))
    base = {}
    for shard in qdir.glob("base-*.safetensors"):
        base.update(load_file(str(shard)))
    assert routers and all(not torch.equal(routers[n], base[n].float()) for n in routers)


# ---- bad input -----------------------------------------------------------------------------------------


def test_bad_inputs(prepared, tmp_path):
    qdir, tokens, plan = prepared("qwen3_moe")
    other_q, _, other_plan = prepared("olmoe")
    out = tmp_path / "run"
    result = train(qdir, tokens, other_plan, out, "--steps", 2, "--reselect-every", 0)
    assert result.exit_code == 2 and "made for another quantized model" in result.stderr and not out.exists()
    result = train(qdir, tokens, plan, out, "--steps", 5, "--reselect-every", 10)
    assert result.exit_code == 2 and "--reselect-every 10 exceeds --steps 5" in result.stderr and not out.exists()
    # A corrupt checkpoint is refused on resume, and nothing is overwritten.
    assert train(qdir, tokens, plan, out, "--steps", 4, "--save-every", 2, "--reselect-every", 0).exit_code == 0
    (out / "manifest.json").unlink()
    newest = sorted((out / "checkpoints").iterdir())[-1]
    (newest / "deltas.safetensors").write_bytes(b"garbage")
    result = train(qdir, tokens, plan, out, "--steps", 4, "--save-every", 2, "--reselect-every", 0)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and f"resuming from {newest}: unreadable checkpoint" in said, said
    assert (newest / "deltas.safetensors").read_bytes() == b"garbage"
    # its hint works (it named --resume, not given, and an earlier checkpoint no option picks; found in review)
    assert "move it out of the run directory (the rerun resumes from the newest one left)" in said
    shutil.move(newest, tmp_path / "damaged")
    result = train(qdir, tokens, plan, out, "--steps", 4, "--save-every", 2, "--reselect-every", 0)
    assert result.exit_code == 0 and "resuming from" in result.stderr, explain(result)


def test_short_runs_default_to_a_static_mask_and_seq_len_cuts_sequences(prepared, tmp_path):
    qdir, tokens, plan = prepared("qwen3_moe")
    run = tmp_path / "run"
    result = invoke("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", run, "--steps", 3,
                    "--seq-len", 8, "--save-every", 0)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "too short for a reselection every 50: static mask" in result.output
    s = load_verified(run, RunManifest).summary
    assert s.reselections == [] and s.tokens == 3 * 2 * 8  # 3 steps × microbatch 2 × 8 tokens (sequences are 32)
    record = metrics(run)[0]
    assert record["memory"]["rss"] > 0 and set(record["routing"]) == {"2"}  # the trainable layer
    assert 0 < record["routing"]["2"]["max_share"] <= 1 and record["routing"]["2"]["entropy"] >= 0
    result = invoke("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", tmp_path / "long",
                    "--steps", 2, "--seq-len", 10**6)  # fmt: skip
    assert result.exit_code == 2 and "--seq-len 1000000 exceeds the model's context" in result.stderr
    assert not (tmp_path / "long").exists()
    # --seq-len above every line cuts nothing: said (it was silent), and the run is the one without it
    result = train(qdir, tokens, plan, tmp_path / "above", "--steps", 2, "--seq-len", 48)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0 and "--seq-len 48 cuts nothing: the longest sequence of --data" in said, said
    assert "has 32 tokens (tokenize with --seq-len 48 to train on longer ones)" in said
    assert load_verified(tmp_path / "above", RunManifest).summary.tokens == 2 * 2 * 32
    assert "cuts nothing" not in " ".join(train(qdir, tokens, plan, tmp_path / "cut", "--steps", 1, "--seq-len", 8)
                                          .stderr.split())  # fmt: skip


def test_an_interval_that_would_replace_nothing_is_a_static_mask_not_a_silent_one(prepared, tmp_path, monkeypatch):
    """The share replaced is 0 from 75 % of the run: --reselect-every 10 of 12 steps (or the default 50 of 51-66)
    reselected nothing, in silence, and paid each cycle's score collection (found in review). The control: 4 of 12
    reselects twice."""
    from usaf.stages.train import loop

    qdir, tokens, plan = prepared("qwen3_moe")
    refused = train(qdir, tokens, plan, tmp_path / "ten", "--steps", 12, "--reselect-every", 10)
    assert refused.exit_code == 2 and "no reselection of this 12-step run would replace anything" in refused.stderr, (
        refused.output)  # fmt: skip
    monkeypatch.setenv("USAF_RESELECT_EVERY", "10")
    noted = train(qdir, tokens, plan, tmp_path / "env", "--steps", 12)
    assert noted.exit_code == 0 and "USAF_RESELECT_EVERY 10: no reselection" in noted.stderr, noted.output
    monkeypatch.delenv("USAF_RESELECT_EVERY")
    collected = []
    real = loop.collect_scores
    monkeypatch.setattr(loop, "collect_scores", lambda engine: collected.append(1) or real(engine))
    control = train(qdir, tokens, plan, tmp_path / "four", "--steps", 12, "--reselect-every", 4)
    assert control.exit_code == 0, control.output
    assert len(load_verified(tmp_path / "four", RunManifest).summary.reselections) == 2 and len(collected) == 2
    assert loop.collecting(7, 4, 12, 0.2) and not loop.collecting(11, 4, 12, 0.2)  # the cycle ending at 12: none
    assert loop.collecting(29, 10, 50, 0.2) and not loop.collecting(39, 10, 50, 0.2)  # 40 is past 75 % of 50


def test_a_reselection_that_would_replace_under_one_weight_or_a_zero_share_is_refused(prepared, tmp_path):
    """--steps 100 --reselect-every 74: one reselection at a share of 8.8e-05, which replaced no weight of the plan's
    tensors, accepted; --reselect-fraction 0 was refused naming --reselect-every, whose lowering cannot help (found in
    review). The control: --reselect-every 10 of 100 reselects."""
    qdir, tokens, plan = prepared("qwen3_moe")
    late = train(qdir, tokens, plan, tmp_path / "late", "--steps", 100, "--reselect-every", 74)
    said = " ".join(late.stderr.split())
    assert late.exit_code == 2 and "--reselect-every 74: no reselection of this 100-step run would replace one " \
        "weight (the plan's largest tensor trains" in said, late.output  # fmt: skip
    zero = train(qdir, tokens, plan, tmp_path / "zero", "--steps", 12, "--reselect-every", 4, "--reselect-fraction", 0)
    said = " ".join(zero.stderr.split())
    assert zero.exit_code == 2 and "--reselect-fraction 0: no reselection replaces anything" in said, zero.output
    assert "pass a fraction above 0, or --reselect-every 0 for a static mask" in said
    assert not (tmp_path / "late").exists() and not (tmp_path / "zero").exists()
    tiny = train(qdir, tokens, plan, tmp_path / "tiny", "--steps", 100, "--reselect-every", 1, "--reselect-fraction",
                 1e-6)  # fmt: skip  (--reselect-every 1 was blamed, which cannot go lower; found in review)
    said = " ".join(tiny.stderr.split())
    assert tiny.exit_code == 2 and "--reselect-fraction 1e-06: no reselection would replace one weight" in said, said
    assert "hint: raise it above" in said
    control = train(qdir, tokens, plan, tmp_path / "ten", "--steps", 30, "--reselect-every", 10)
    assert control.exit_code == 0, control.output
    assert len(load_verified(tmp_path / "ten", RunManifest).summary.reselections) == 2
    # the default interval, not given, where its one reselection would replace no weight (steps 67-69): it was
    # refused as if given, after a plan scored on the fly (found in review); said, and the mask static
    default = train(qdir, tokens, plan, tmp_path / "default", "--steps", 67)
    said = " ".join(default.stderr.split())
    assert default.exit_code == 0 and "the default --reselect-every 50: no reselection of this 67-step run would " \
        "replace one weight" in said and ": static mask" in said, said  # fmt: skip
    assert load_verified(tmp_path / "default", RunManifest).summary.reselections == []


@pytest.mark.parametrize(("model_type", "ways"), [
    ("qwen3_moe", "--aux-loss-coef 0.01 or --no-router"),
    ("deepseek_v3", "--no-router"),  # no load-balancing loss: --aux-loss-coef is refused for it
])  # fmt: skip
def test_routing_collapse_is_warned_once_per_layer(model_type, ways):
    from types import SimpleNamespace

    from usaf.engine.engine import LayerLoad
    from usaf.stages.train.trainer import Trainer, TrainState

    loads = iter(
        [
            LayerLoad([10, 10, 10, 10], 1.38, 0.25, 0),  # baseline window
            LayerLoad([12, 9, 10, 9], 1.38, 0.30, 0),  # healthy
            LayerLoad([34, 2, 2, 2], 0.7, 0.85, 0),  # one expert takes over
            LayerLoad([40, 0, 0, 0], 0.0, 1.0, 3),  # still collapsed: no second warning
        ]
    )

    class Engine:
        trainable_layers = (2,)
        spec = SimpleNamespace(model_type=model_type)

        def load_stats(self, reset=True):
            return {1: LayerLoad([0] * 4, 0.0, 0.0, 4), 2: next(loads)}  # layer 1: frozen, skipped by the cache

    from usaf.distributed import World

    trainer = Trainer.__new__(Trainer)
    trainer.engine, trainer.state, trainer.world = Engine(), TrainState(), World()
    assert trainer._check_routing() == [] and trainer._check_routing() == []
    warned = trainer._check_routing()
    assert len(warned) == 1 and warned[0].startswith("layer 2: routing collapsing, one expert takes 85%")
    assert warned[0].endswith(f"(was 25%); try a lower --router-lr, {ways}"), warned
    assert trainer._check_routing() == [] and trainer.state.routing_warnings == warned


def test_without_a_plan_it_scores_on_the_fly_like_usaf_score(prepared, tmp_path, monkeypatch):
    from usaf.stages.train import trainer

    qdir, tokens, _ = prepared("qwen3_moe")
    workspace = tmp_path / "empty-workspace"  # no plan to find
    args = ["--model", qdir, "--data", tokens, "--workspace", workspace, "--steps", 6, "--frac", 0.05,
            "--train-from", 2, "--calib-samples", 8, "--save-every", 2]  # fmt: skip
    real_step = trainer.Trainer.step

    def interrupt(self):
        if self.state.step == 3:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(trainer.Trainer, "step", interrupt)
    run = tmp_path / "run"
    result = invoke("train", *args, "--out", run)
    assert result.exit_code == 130 and "scoring now into" in result.stderr, result.output
    monkeypatch.setattr(trainer.Trainer, "step", real_step)
    result = invoke("train", *args, "--out", run)
    assert result.exit_code == 0, result.output
    assert "scoring now" not in result.stderr and "resuming from" in result.stderr  # the same plan, reused
    plan = tmp_path / "plan"
    result = invoke("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--train-from", 2,
                    "--calib-samples", 8, "--microbatch", 2, "--no-stability", "--out", plan)  # fmt: skip
    assert result.exit_code == 0, result.output
    on_the_fly, scored = load_file(str(run / "plan" / "masks.safetensors")), load_file(str(plan / "masks.safetensors"))
    assert on_the_fly.keys() == scored.keys() and all(torch.equal(on_the_fly[k], scored[k]) for k in scored)
    manifest = load_verified(run, RunManifest)
    assert [i.path for i in manifest.inputs if i.role == "plan"] == [str(run / "plan")]



def test_a_workspace_plan_is_taken_when_the_settings_given_are_what_its_defaults_chose(prepared, tmp_path):
    """A plan scored without --frac/--targets was passed over for "--frac the default, not 0.1 (given)" when 0.1 was
    the share its default chose, and a plan scored again (found in review). The control: another --frac scores."""
    qdir, tokens, _ = prepared("qwen3_moe")
    ws = tmp_path / "ws"
    scored = invoke("score", "--model", qdir, "--data", tokens, "--out", ws / "plan" / "default", "--train-from", 2,
                    "--calib-samples", 8, "--no-lr-test", "--no-stability")  # fmt: skip
    assert scored.exit_code == 0, scored.output
    summary = load_verified(ws / "plan" / "default", PlanManifest).summary
    args = ["--model", qdir, "--data", tokens, "--workspace", ws, "--steps", 2, "--calib-samples", 8, "--train-from", 2]
    same = invoke("train", *args, "--frac", summary.frac, "--targets", ",".join(reversed(summary.targets)),
                  "--out", tmp_path / "same")  # fmt: skip
    assert same.exit_code == 0 and "not using the plan" not in same.stderr and "scoring now" not in same.stderr, (
        same.output)  # fmt: skip
    other = invoke("train", *args, "--frac", summary.frac / 2, "--out", tmp_path / "other")
    assert other.exit_code == 0 and "not using the plan" in other.stderr and "scoring now" in other.stderr

def test_a_workspace_plan_scored_with_other_selection_settings_is_not_taken(prepared, tmp_path, monkeypatch):
    """Without --plan, train takes the workspace's newest plan for the model; the plan decides the masks, so with a
    --frac it was not scored with the --frac would be ignored. Such a plan is passed over (saying so) and one is
    scored with the settings given; the same settings take it (the control); a run directory whose own plan was
    scored with others is refused."""
    from usaf.artifacts import PlanManifest

    qdir, tokens, plan = prepared("qwen3_moe")
    ws = tmp_path / "ws"
    shutil.copytree(plan, ws / "plan" / "scored")  # frac 0.05, layers from 2, 8 calibration sequences
    args = ["--model", qdir, "--data", tokens, "--workspace", ws, "--steps", 2, "--calib-samples", 8]

    same = invoke("train", *args, "--frac", 0.05, "--train-from", 2, "--out", tmp_path / "same")
    assert same.exit_code == 0 and "using the plan" in same.stderr and "scoring now" not in same.stderr, same.output
    assert [i.path for i in load_verified(tmp_path / "same", RunManifest).inputs if i.role == "plan"] == [
        str(ws / "plan" / "scored")
    ]

    other = invoke("train", *args, "--frac", 0.1, "--train-from", 2, "--out", tmp_path / "other")
    assert other.exit_code == 0, other.output
    assert "not using the plan" in other.stderr and "--frac 0.05, not 0.1 (given)" in other.stderr
    assert "scoring now into" in other.stderr
    assert load_verified(tmp_path / "other" / "plan", PlanManifest).summary.frac == 0.1
    assert load_verified(tmp_path / "other", RunManifest).config["frac"] == 0.1

    # a start that scored its plan on the fly and stopped before training: rerun with another --frac
    shutil.copytree(tmp_path / "other" / "plan", tmp_path / "stopped" / "plan")
    refused = invoke("train", *args, "--frac", 0.2, "--train-from", 2, "--out", tmp_path / "stopped")
    assert refused.exit_code == 2 and "--frac 0.1, not 0.2 (given)" in refused.stderr, refused.output
    resumed = invoke("train", *args, "--frac", 0.1, "--train-from", 2, "--out", tmp_path / "stopped")
    assert resumed.exit_code == 0 and "scoring now" not in resumed.stderr, resumed.output

    # from USAF_* as from a flag: scoring on the fly would honour it, so the plan must have been scored with it
    monkeypatch.setenv("USAF_FRAC", "0.1")
    env = invoke("train", *args, "--train-from", 2, "--out", tmp_path / "env")
    assert env.exit_code == 0 and "--frac 0.05, not 0.1 (given)" in env.stderr, env.output


def test_eval_data_named_as_a_file_is_read_as_named_and_its_errors_name_the_flag(prepared, tmp_path):
    """--eval-data X/train.jsonl was silently replaced by X/heldout.jsonl, and --eval-data errors named --data (found
    in review). The control: a tokens directory gives its held-out split."""
    qdir, tokens, plan = prepared("qwen3_moe")
    named = train(qdir, tokens, plan, tmp_path / "file", "--steps", 1, "--eval-data", tokens / "train.jsonl")
    assert named.exit_code == 0, named.output
    trained_lines = len((tokens / "train.jsonl").read_text().splitlines())
    held_lines = len((tokens / "heldout.jsonl").read_text().splitlines())
    assert trained_lines != held_lines  # else the check below could not tell them apart
    first = [m for m in metrics(tmp_path / "file") if "eval_loss" in m]
    directory = train(qdir, tokens, plan, tmp_path / "dir", "--steps", 1, "--eval-data", tokens)
    assert directory.exit_code == 0, directory.output
    second = [m for m in metrics(tmp_path / "dir") if "eval_loss" in m]
    assert first and second and first[0]["eval_loss"] != second[0]["eval_loss"]
    # the training file as held-out data was reported as held-out (found in review); the split is not (the control)
    said = " ".join(named.stderr.split())
    assert f"{trained_lines:,} of its {trained_lines:,} sequences are training sequences of --data" in said, said
    assert "the same text in several sources, a shared header or licence, is on both sides of any split" in said
    assert "are training sequences" not in directory.stderr
    missing = train(qdir, tokens, plan, tmp_path / "missing", "--steps", 1, "--eval-data", tmp_path / "nope")
    assert missing.exit_code == 2 and f"--eval-data {tmp_path / 'nope'}: no such file" in missing.stderr, (
        missing.output)  # fmt: skip


def test_a_seq_len_that_cuts_away_every_target_is_refused(prepared, tmp_path):
    """--seq-len cut every line before its first target: the run trained at loss 0 and exited 0 (found in review).
    The control: a cut past the targets' start trains."""
    qdir, tokens, plan = prepared("qwen3_moe")
    masked = tmp_path / "masked.jsonl"
    lines = [json.loads(line) for line in (tokens / "train.jsonl").read_text().splitlines()]
    masked.write_text("".join(json.dumps({**r, "labels": [-100] * min(10, len(r["labels"])) + r["labels"][10:]}) + "\n"
                              for r in lines))  # fmt: skip
    refused = train(qdir, masked, plan, tmp_path / "cut", "--steps", 2, "--seq-len", 8)
    assert refused.exit_code == 2 and "in the first 8 tokens of any sequence" in refused.stderr, refused.output
    assert not (tmp_path / "cut").exists()
    assert train(qdir, masked, plan, tmp_path / "fits", "--steps", 2, "--seq-len", 16).exit_code == 0


def test_the_prefix_spill_file_neither_grows_across_starts_nor_outlives_the_run(prepared, tmp_path, monkeypatch):
    """Appended to at every start and never deleted, it grew by a copy each resume and stayed in the finished run
    (GBs at a real model's size; found in review). The control: it is written while the run spills."""
    from helpers_trained import interrupt_at as ctrl_c_at
    from usaf.engine.prefix import PrefixCache

    qdir, tokens, plan = prepared("qwen3_moe")
    run, spill = tmp_path / "run", tmp_path / "run" / "prefix-cache.bin"
    args = ["--steps", 6, "--save-every", 2, "--prefix-cache-gib", 0, "--reselect-every", 0]
    sizes = []
    real_put = PrefixCache.put

    def put(self, key, state):
        real_put(self, key, state)
        sizes.append(self.spill_path.stat().st_size if self.spill_path and self.spill_path.exists() else 0)

    monkeypatch.setattr(PrefixCache, "put", put)
    ctrl_c_at(4, lambda: train(qdir, tokens, plan, run, *args), monkeypatch)
    first = max(sizes)
    assert first > 0  # it spilled
    sizes.clear()
    assert train(qdir, tokens, plan, run, *args).exit_code == 0
    assert 0 < max(sizes) <= first and not spill.exists()


def test_eval_every_without_eval_data_is_refused_not_ignored(prepared, tmp_path, monkeypatch):
    """--eval-every with nothing to evaluate on would train without a held-out loss, silently; from USAF_* (which may
    be meant for other runs) it is a note."""
    qdir, tokens, plan = prepared("qwen3_moe")
    args = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 2]
    refused = invoke(*args, "--eval-every", 1, "--out", tmp_path / "flag")
    assert refused.exit_code == 2 and "--eval-every 1: no --eval-data" in refused.stderr, refused.output
    assert not (tmp_path / "flag").exists()
    monkeypatch.setenv("USAF_EVAL_EVERY", "1")
    noted = invoke(*args, "--out", tmp_path / "env")
    assert noted.exit_code == 0 and "USAF_EVAL_EVERY 1: no --eval-data" in noted.stderr, noted.output


def test_prefix_cache_gib_for_a_plan_without_a_frozen_prefix_is_refused_not_ignored(prepared, tmp_path, monkeypatch):
    """A plan trained from layer 0 runs no frozen layer first: --prefix-cache-gib was accepted and unused (found in
    review). From USAF_* a note. Control: the prepared plan (from layer 2) takes it."""
    qdir, tokens, plan = prepared("qwen3_moe")
    whole = tmp_path / "plan-from-0"
    scored = invoke("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--calib-samples", 4,
                    "--train-from", 0, "--no-stability", "--no-lr-test", "--device", "cpu", "--out", whole)  # fmt: skip
    assert scored.exit_code == 0, explain(scored)
    args = ["train", "--model", qdir, "--data", tokens, "--steps", 2, "--lr", 1e-3, "--reselect-every", 0]
    refused = invoke(*args, "--plan", whole, "--prefix-cache-gib", 1, "--out", tmp_path / "flag")
    assert refused.exit_code == 2, explain(refused)
    assert "--prefix-cache-gib 1.0: the plan trains from layer 0" in refused.stderr and not (tmp_path / "flag").exists()
    monkeypatch.setenv("USAF_PREFIX_CACHE_GIB", "1")
    noted = invoke(*args, "--plan", whole, "--out", tmp_path / "env")
    assert noted.exit_code == 0 and "USAF_PREFIX_CACHE_GIB 1.0: the plan trains from layer 0" in noted.stderr
    taken = invoke(*args, "--plan", plan, "--out", tmp_path / "control")
    assert taken.exit_code == 0 and "the plan trains from layer 0" not in taken.stderr, explain(taken)


def test_eval_every_reaching_the_runs_end_is_refused_not_ignored(prepared, tmp_path, monkeypatch):
    """--eval-every 2 of a 2-step run measured the held-out loss at the start and the end, as 0 does: accepted and
    without effect (found in review). From USAF_* a note. Control: an interval inside the run measures between."""
    qdir, tokens, plan = prepared("qwen3_moe")
    args = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 2, "--eval-data", tokens]
    for every in (2, 5):
        refused = invoke(*args, "--eval-every", every, "--out", tmp_path / "flag")
        assert refused.exit_code == 2, explain(refused)
        assert f"--eval-every {every}: the run has 2 steps" in refused.stderr and "lower it below 2" in refused.stderr
    assert not (tmp_path / "flag").exists()
    monkeypatch.setenv("USAF_EVAL_EVERY", "2")
    noted = invoke(*args, "--out", tmp_path / "env")
    assert noted.exit_code == 0 and "USAF_EVAL_EVERY 2: the run has 2 steps" in noted.stderr, explain(noted)
    monkeypatch.delenv("USAF_EVAL_EVERY")
    inside = invoke(*args, "--eval-every", 1, "--out", tmp_path / "inside")
    assert inside.exit_code == 0, explain(inside)
    measured = load_verified(tmp_path / "inside", RunManifest).summary.eval_losses
    assert [step for step, _ in measured] == [0, 1, 2]


STATIC = "0.3: this run's mask is static"


@pytest.mark.parametrize(
    ("given", "unused_by", "env", "message"),
    [
        (("--router-lr", 0.01), ("--no-router",), "USAF_ROUTER_LR", "0.01: no router is trained"),
        (("--reselect-fraction", 0.3), ("--reselect-every", 0), "USAF_RESELECT_FRACTION", STATIC),
        (("--reselect-fraction", 0.3), (), "USAF_RESELECT_FRACTION", STATIC),  # a 2-step run's default: static
    ],
)
def test_a_setting_the_run_would_not_use_is_refused_not_dropped(prepared, tmp_path, monkeypatch, given, unused_by, env,
                                                                message):  # fmt: skip
    """--router-lr with --no-router, --reselect-fraction with a static mask (asked for, or the default for a short
    run) were accepted and did nothing. From USAF_* (which may be meant for other runs) a note."""
    qdir, tokens, plan = prepared("qwen3_moe")
    args = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 2, *unused_by]
    refused = invoke(*args, *given, "--out", tmp_path / "flag")
    assert refused.exit_code == 2 and f"{given[0]} {message}" in refused.stderr, refused.output
    assert not (tmp_path / "flag").exists()
    alone = invoke(*args, "--out", tmp_path / "alone")  # the control: without the setting the same run trains
    assert alone.exit_code == 0 and message not in alone.stderr, alone.output
    monkeypatch.setenv(env, str(given[1]))
    noted = invoke(*args, "--out", tmp_path / "env")
    assert noted.exit_code == 0 and f"{env} {message}" in noted.stderr, noted.output


def test_the_settings_a_run_uses_are_not_refused(prepared, tmp_path):
    """The negative control: the same settings where the run uses them (routers trained, RigL reselection on)."""
    qdir, tokens, plan = prepared("qwen3_moe")
    args = ["--steps", 4, "--reselect-every", 2, "--reselect-fraction", 0.3, "--router-lr", 0.01]
    result = train(qdir, tokens, plan, tmp_path / "run", *args)
    assert result.exit_code == 0, result.output
    assert "would not" not in result.stderr and "mask is static" not in result.stderr


def test_a_refused_overwrite_leaves_the_run_it_was_to_replace(prepared, tmp_path):
    """--overwrite deleted the run in --out before the settings were checked: a command then refused for its length
    or reselection destroyed it (found in review). The control: a valid --overwrite replaces it."""
    qdir, tokens, plan = prepared("qwen3_moe")
    run = tmp_path / "run"
    assert train(qdir, tokens, plan, run, "--steps", 2).exit_code == 0
    for refused_args, needle in [
        (("--steps", 2, "--reselect-fraction", 0.3), "mask is static"),
        (("--epochs", 1, "--reselect-every", 100000), "exceeds the run's"),
        (("--steps", 2, "--resume"), "either --resume"),
    ]:
        refused = train(qdir, tokens, plan, run, *refused_args, "--overwrite")
        assert refused.exit_code == 2 and needle in refused.stderr, (refused_args, refused.output)
        assert (run / "manifest.json").is_file(), refused_args
    assert train(qdir, tokens, plan, run, "--steps", 3, "--overwrite").exit_code == 0
    assert load_verified(run, RunManifest).summary.steps == 3


def test_vram_on_the_cpu_is_refused_not_dropped(prepared, tmp_path):
    """On the CPU the planner sizes the run by RAM alone: a --vram given there used to be read and dropped while the
    run said it followed usaf plan's choice (usaf plan refuses the same)."""
    qdir, tokens, plan = prepared("qwen3_moe")
    args = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 1, "--device", "cpu"]
    refused = invoke(*args, "--vram", "12GiB", "--ram", "8GiB", "--out", tmp_path / "vram")
    assert refused.exit_code == 2 and "--vram 12GiB: this run computes on the CPU" in refused.stderr, refused.output
    assert not (tmp_path / "vram").exists()
    ram = invoke(*args, "--ram", "8GiB", "--out", tmp_path / "ram")  # the control: --ram alone plans the run
    assert ram.exit_code == 0 and "usaf plan's choice" in ram.stderr, ram.output


def test_fp16_training_scales_the_loss_learns_and_resumes_exactly(prepared, tmp_path, monkeypatch):
    from usaf.stages.train import trainer

    qdir, tokens, plan = prepared("qwen3_moe")
    memory = tmp_path / "two.jsonl"
    memory.write_text("".join((tokens / "train.jsonl").read_text().splitlines(keepends=True)[:2]))
    args = ["--steps", 16, "--reselect-every", 8, "--dtype", "float16"]
    straight = tmp_path / "straight"
    assert train(qdir, memory, plan, straight, *args).exit_code == 0
    records = [m for m in metrics(straight) if "loss" in m]
    assert all(m["loss_scale"] > 1 for m in records)
    losses = [m["loss"] for m in records]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.1, losses
    assert load_verified(straight, RunManifest).environment.dtype == "float16"

    real_step = trainer.Trainer.step

    def interrupt(self):
        if self.state.step == 6:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(trainer.Trainer, "step", interrupt)
    resumed = tmp_path / "resumed"
    assert train(qdir, memory, plan, resumed, *args).exit_code == 130
    monkeypatch.setattr(trainer.Trainer, "step", real_step)
    assert train(qdir, memory, plan, resumed, *args).exit_code == 0
    assert [m["loss"] for m in metrics(resumed) if "loss" in m] == losses
    a, b = final_deltas(straight), final_deltas(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_out_of_memory_retries_with_a_smaller_microbatch(prepared, tmp_path, monkeypatch):
    from usaf.engine.engine import SparseEngine

    qdir, tokens, plan = prepared("qwen3_moe")
    args = ["--steps", 6, "--reselect-every", 0, "--microbatch", 4]
    real_loss = SparseEngine.loss
    calls = {"oom": 0}

    def tight_memory(self, input_ids, *a, **k):
        if input_ids.shape[0] > 1 and calls["oom"] < 3:  # a 4-sequence microbatch, then a 2-sequence one, fail
            calls["oom"] += 1
            raise torch.OutOfMemoryError("simulated")
        return real_loss(self, input_ids, *a, **k)

    monkeypatch.setattr(SparseEngine, "loss", tight_memory)
    run = tmp_path / "run"
    result = train(qdir, tokens, plan, run, *args)
    assert result.exit_code == 0, result.output
    assert "out of memory at microbatch 4 × 1: retrying step 1 with microbatch 2 × grad-accum 2" in result.stderr
    assert "microbatch 1 × grad-accum 4 (kept from now on)" in result.stderr
    retries = [m["oom_retry"] for m in metrics(run) if "oom_retry" in m]
    assert retries == [{"microbatch": 2, "grad_accum": 2}, {"microbatch": 1, "grad_accum": 4}]
    monkeypatch.setattr(SparseEngine, "loss", real_loss)
    # The same sequences and the same token-weighted loss as asking for microbatch 1 × 4 from the start:
    reference = tmp_path / "reference"
    assert train(qdir, tokens, plan, reference, "--steps", 6, "--reselect-every", 0, "--microbatch", 1,
                 "--grad-accum", 4).exit_code == 0  # fmt: skip
    got, want = [m["loss"] for m in metrics(run) if "loss" in m], [m["loss"] for m in metrics(reference) if "loss" in m]
    assert got == pytest.approx(want, abs=1e-6)

    def always(self, input_ids, *a, **k):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(SparseEngine, "loss", always)
    result = train(qdir, tokens, plan, tmp_path / "hopeless", *args)
    assert result.exit_code == 2 and "out of device memory at microbatch 1" in result.stderr


def test_a_signal_during_the_stop_checkpoint_does_not_cut_it_short():
    """Under torchrun a Ctrl-C reaches every rank and torchrun forwards another: one arriving while the ranks write
    their stop checkpoint (a collective) must only set the flag again, or that rank dies and the others' gather
    fails. Simulated in one process with an active world: the save signals its own process midway."""
    import types

    from usaf.stages.progress import NullProgress
    from usaf.stages.train.loop import run_loop as _loop

    events = []

    def save_checkpoint(where):
        events.append("save started")
        os.kill(os.getpid(), signal.SIGINT)  # torchrun's forwarded signal, in the middle of the save
        time.sleep(0.05)  # Python runs the handler here
        events.append("save finished")
        return where

    world = types.SimpleNamespace(active=True, any=lambda flag: True)  # every rank asked to stop
    trainer = types.SimpleNamespace(
        world=world, state=types.SimpleNamespace(step=5, tokens=0), s=None, collector=None,
        checkpoint_dir=lambda: "checkpoints/step-0000005", save_checkpoint=save_checkpoint, run_dir=None,
        config=types.SimpleNamespace(out="run", overwrite=False, keep_checkpoints=None),
    )  # fmt: skip
    progress = NullProgress()
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a job started in the background
    with pytest.raises(KeyboardInterrupt):
        _loop(trainer, 10, progress)
    assert events == ["save started", "save finished"]
    assert any(n.startswith("interrupted: saved checkpoints/step-0000005") for n in progress.notes)
    assert signal.getsignal(signal.SIGINT) is before  # restored afterwards


def test_a_memory_budget_with_a_plan_sizes_the_plans_frac_not_the_default(monkeypatch):
    """``usaf train --plan P --vram/--ram``: the planner is asked about P's masks (its frac and first trainable
    layer), not about --frac's default, which the plan overrides."""
    import types

    import usaf.memory_plan as memory_plan
    from usaf.stages.progress import NullProgress
    from usaf.stages.train import TrainConfig
    from usaf.stages.train.budget import apply_budget

    asked = []

    class Asked(Exception):
        pass

    def plan_memory(facts, quant, target, request):
        asked.append(request)
        raise Asked

    monkeypatch.setattr(memory_plan, "read_model", lambda *a, **k: types.SimpleNamespace(config={}, quant=None))
    monkeypatch.setattr(memory_plan, "model_facts", lambda config: None)
    monkeypatch.setattr(memory_plan, "plan_memory", plan_memory)
    memory = types.SimpleNamespace(host_total=2**34, device_total=None)
    backend = types.SimpleNamespace(device=torch.device("cpu"), memory=lambda: memory)
    class Data:  # 4 sequences of 32 tokens
        longest = 32

        def __len__(self) -> int:
            return 4

    data = Data()
    config = TrainConfig(plan=Path("plan"), ram="8GiB")  # --frac not given: its default is not the plan's
    plan = types.SimpleNamespace(frac=0.05, trainable_layers=[3, 4], targets=["experts"])
    with pytest.raises(Asked):
        apply_budget(config, Path("model"), backend, data, plan, NullProgress())
    assert asked[0].frac == 0.05 and asked[0].train_from == 3 and config.frac != 0.05
    # the plan's targets, not the --targets default (experts + attention), size the run
    assert asked[0].targets == ("experts",) and config.targets != "experts"


@pytest.mark.parametrize("failure", ["peer lost", "another error"])
def test_a_lost_peer_keeps_the_flag_handlers_so_torchruns_sigterm_cannot_cut_the_message(failure):
    """When a rank dies, torchrun sends SIGTERM to the others while they turn the failed collective into their message
    (the newest checkpoint): with the default handler back that signal killed rank 0 first (exit -15, no message; seen
    once under load). So under torchrun a PeerLost leaves the flag-only handlers in place; the control, any other
    error, restores the previous handlers."""
    import types

    from usaf.distributed import PeerLost
    from usaf.stages.stop import STOP_SIGNALS, StopRequest

    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    error = PeerLost("rank 0: all-reduce failed") if failure == "peer lost" else RuntimeError("a bug")
    stop = StopRequest(types.SimpleNamespace(active=True, any=lambda flag: flag))
    try:
        with pytest.raises(type(error)), stop:
            raise error
        for sig in STOP_SIGNALS:
            kept = signal.getsignal(sig)
            assert (kept == stop._handle) if failure == "peer lost" else (kept is before[sig]), sig
    finally:  # every handler back, not SIGTERM's alone: the rest of the session keeps its Ctrl-C
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_workspace_plan_scored_on_other_data_is_not_taken_and_a_given_one_is_said(prepared, tmp_path):
    """A plan's masks and lr are chosen on its data: `train --data B` took the workspace's plan scored on A in
    silence, and said its prefix store held every training sequence (found in review). Passed over now (saying so)
    and one scored on B; --plan A with --data B is the user's choice, said. The control: --data A takes it."""
    from usaf.testing import stdlib_dir

    qdir, tokens, plan = prepared("qwen3_moe")
    ws = tmp_path / "ws"
    shutil.copytree(plan, ws / "plan" / "scored")
    other = tmp_path / "other-tokens"
    made = invoke("tokenize", stdlib_dir() / "glob.py", "--model", qdir, "--seq-len", 32, "--out", other)
    assert made.exit_code == 0, made.output
    args = ["--model", qdir, "--workspace", ws, "--steps", 2, "--calib-samples", 8, "--train-from", 2]

    same = invoke("train", *args, "--data", tokens, "--out", tmp_path / "same")
    assert same.exit_code == 0 and "scoring now" not in same.stderr, same.output
    passed = invoke("train", *args, "--data", other, "--out", tmp_path / "passed")
    said = " ".join(passed.stderr.split())
    assert passed.exit_code == 0 and "not using the plan" in said and "scored with other tokens" in said, said
    assert "scoring now into" in said
    # without the selection given: "none in the workspace for this model" read as no plan at all, after the one
    # named above (found in review)
    plain = invoke("train", "--model", qdir, "--workspace", ws, "--steps", 2, "--data", other, "--out", tmp_path / "p")
    said = " ".join(plain.stderr.split())
    assert plain.exit_code == 0 and "scored with other tokens" in said, said
    assert "no --plan and none in the workspace for this model and these tokens: scoring now" in said, said
    given = invoke("train", *args[:-4], "--data", other, "--plan", plan, "--out", tmp_path / "given")
    said = " ".join(given.stderr.split())
    assert given.exit_code == 0 and f"--plan {plan}: scored with other tokens" in said, said


def test_a_prefix_store_of_other_data_does_not_spare_the_frozen_layers():
    """A --cache store of another --data, as large as this one, was taken for this data's: the frozen layers were left
    unprepared and then run at every miss (found in review)."""
    from types import SimpleNamespace

    from usaf.stages.train.run import _computes_prefixes

    def inputs(scored_on: str):
        summary = SimpleNamespace(prefix_cache=SimpleNamespace(scope="data"), tokens_fingerprint=scored_on)
        plan = SimpleNamespace(summary=summary)
        return SimpleNamespace(plan=plan, data_fingerprint="A", data=[0] * 4, eval_data=None)

    cache = SimpleNamespace(store=[0] * 4)
    assert _computes_prefixes(cache, inputs("B"), True) and not _computes_prefixes(cache, inputs("A"), True)  # control
    assert _computes_prefixes(cache, inputs("A"), False)  # keyed otherwise (--seq-len, --dtype): _store_probe


def test_the_lr_taken_from_the_plan_says_a_fallback_and_another_router_setting():
    """Train reported "lr 1.0e-03 (from the plan's lr test)" for a test whose every probe diverged (score had said
    "not a measured choice"), and for a test run without the routers training before a run that trains them (found
    in review). The control: a measured test of the same router setting is said as before."""
    from types import SimpleNamespace

    from usaf.artifacts.plan import LrTestRecord
    from usaf.stages.train.config import TrainConfig
    from usaf.stages.train.inputs import with_lr

    def plan(losses, router=True):
        test = LrTestRecord(lr=1e-3, candidates=[1e-3, 3e-3], heldout_losses=losses, base_loss=4.0, rule="r",
                            steps=16, seconds=1.0)  # fmt: skip
        return SimpleNamespace(summary=SimpleNamespace(lr_test=test), config={"router": router})

    config = TrainConfig()
    assert with_lr(config, plan([3.5, 3.6]))[1] == "the plan's lr test"
    assert "a fallback: every probe diverged" in with_lr(config, plan([4.5, None]))[1]
    assert "which ran without the routers training, and this run trains them" in with_lr(config, plan([3.5, 3.6],
                                                                                                  router=False))[1]
    lr, source = with_lr(config.model_copy(update={"router": False}), plan([3.5, 3.6]))
    assert lr.lr == 1e-3 and "which ran with the routers training, and this run trains none" in source


def test_a_stop_during_the_final_held_out_loss_saves_every_step_and_the_rerun_finishes_as_a_straight_run(
    prepared, tmp_path, monkeypatch
):
    """Ctrl-C while the final weights' held-out loss ran (minutes at a real model's size) was outside the loop's stop
    handling: every step since the last checkpoint was lost and the note said nothing was (found in review). Now
    it saves a checkpoint at the last step and the rerun resumes there, evaluates and ends as a straight run."""
    from helpers import stop_at_check

    qdir, tokens, plan = prepared("qwen3_moe")
    args = ["--steps", 4, "--eval-data", tokens, "--microbatch", 1]
    straight = tmp_path / "straight"
    assert train(qdir, tokens, plan, straight, *args).exit_code == 0
    run = tmp_path / "run"
    stop_at_check(monkeypatch, 4 + 2)  # before each of the 4 steps, then after the final pass's 2nd microbatch
    result = train(qdir, tokens, plan, run, *args)
    assert result.exit_code == 130, explain(result)
    said = " ".join(result.stderr.split())
    assert "held-out loss at step 4" in said and f"interrupted: saved {run / 'checkpoints' / 'step-0000004'}" in said
    assert not (run / "final").exists() and not (run / "manifest.json").exists()
    monkeypatch.undo()
    result = train(qdir, tokens, plan, run, *args)
    assert result.exit_code == 0, explain(result)
    assert "resuming from" in result.stderr
    ends = [load_verified(r, RunManifest).summary for r in (straight, run)]
    assert ends[0].eval_losses == ends[1].eval_losses and ends[1].steps == 4
    a, b = final_deltas(straight), final_deltas(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("damage", ["step-of-another-type", "loss-of-another-type", "removed", "a-directory", None])
def test_a_damaged_training_log_is_no_traceback_and_missing_steps_are_said(prepared, tmp_path, monkeypatch, damage):
    """``metrics.jsonl`` of an interrupted run edited (a step or a loss of another type: tracebacks, one after the
    whole run), removed (the summary's loss means were of fewer steps, unsaid) or a directory (a traceback): found in
    review. Damaged lines are skipped and the summary says how many steps its loss means cover; a directory is one
    error line. Control (None): an undamaged log, no such note."""
    from helpers_trained import interrupt_at

    qdir, tokens, plan = prepared("qwen3_moe")
    args = ["--steps", 8, "--save-every", 2]
    run = tmp_path / "run"
    assert interrupt_at(5, lambda: train(qdir, tokens, plan, run, *args), monkeypatch).exit_code == 130
    log = run / "metrics.jsonl"
    lines = log.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if '"loss"' in line)
    if damage == "step-of-another-type":
        lines[first] = json.dumps({"step": "x", "loss": 1.0})
    elif damage == "loss-of-another-type":
        lines[first] = json.dumps({"step": 1, "loss": "abc"})
    if damage in ("step-of-another-type", "loss-of-another-type"):
        log.write_text("\n".join(lines) + "\n")
    elif damage == "removed":
        log.unlink()
    elif damage == "a-directory":
        log.unlink()
        log.mkdir()
    result = train(qdir, tokens, plan, run, *args)
    said = " ".join(result.stderr.split())
    if damage == "a-directory":
        assert result.exit_code == 2 and f"--out {run}: its training log metrics.jsonl is not a file" in said, said
        assert result.exception is None or isinstance(result.exception, SystemExit)
        return
    assert result.exit_code == 0, explain(result)
    assert "steps were skipped" not in said  # a run without any (the note's control)
    kept = {None: 8, "step-of-another-type": 7, "loss-of-another-type": 7, "removed": 3}[damage]
    note = f"metrics.jsonl holds the loss of {kept} of the run's 8 trained steps"
    assert (note in said) == (damage is not None), said


def test_a_run_resumes_from_another_directory_and_with_the_device_and_dtype_spelled_as_resolved(
    prepared, tmp_path, monkeypatch
):
    """A relative --eval-data was recorded as typed, so the run did not resume from another working directory; and
    ``--device cpu`` or ``--dtype float32`` on a run started with auto (the same device and dtype here) was "another
    run" (found in review). Control: another --dtype that computes otherwise is still refused."""
    from helpers_trained import interrupt_at as ctrl_c_at

    qdir, tokens, plan = prepared("qwen3_moe")
    (tmp_path / "a").mkdir()
    shutil.copytree(tokens, tmp_path / "a" / "held")
    run = tmp_path / "run"
    args = ["--steps", 4, "--save-every", 2, "--eval-data", "held"]
    monkeypatch.chdir(tmp_path / "a")
    ctrl_c_at(2, lambda: train(qdir, tokens, plan, run, *args), monkeypatch)
    monkeypatch.chdir(tmp_path)
    refused = train(qdir, tokens, plan, run, "--steps", 4, "--save-every", 2, "--eval-data", tmp_path / "a" / "held",
                    "--dtype", "bfloat16")  # fmt: skip
    assert refused.exit_code == 2 and "the compute dtype float32, not bfloat16" in refused.stderr, refused.output
    resumed = train(qdir, tokens, plan, run, "--steps", 4, "--save-every", 2, "--eval-data", tmp_path / "a" / "held",
                    "--device", "cpu", "--dtype", "float32")  # fmt: skip
    assert resumed.exit_code == 0, explain(resumed)
    assert "resuming from" in resumed.stderr and load_verified(run, RunManifest).summary.steps == 4


def test_the_run_records_the_selection_its_plan_was_scored_with(prepared, tmp_path, monkeypatch):
    """With --plan the run's manifest and settings record said calib_samples 64, statistic grad (the defaults) for a
    plan scored with 8 (found in review). They hold the plan's now. A run whose record holds the defaults (started
    before) still resumes with the same plan: the plan decides the selection. The control: another plan is refused."""
    from helpers_trained import interrupt_at as ctrl_c_at

    qdir, tokens, plan = prepared("qwen3_moe")
    scored = load_verified(plan, PlanManifest).config
    run = tmp_path / "run"
    ctrl_c_at(2, lambda: train(qdir, tokens, plan, run, "--steps", 4, "--save-every", 2), monkeypatch)
    record = json.loads((run / "run-settings.json").read_text())
    assert (record["calib_samples"], record["frac"], record["train_from"]) == (8, 0.05, 2) == (
        scored["calib_samples"], scored["frac"], scored["train_from"])
    (run / "run-settings.json").write_text(run_settings_text({**record, "calib_samples": 64, "statistic": "grad"}))
    result = train(qdir, tokens, plan, run, "--steps", 4, "--save-every", 2)
    assert result.exit_code == 0 and "resuming from" in result.stderr, result.output
    assert load_verified(run, RunManifest).config["calib_samples"] == 8
    other = tmp_path / "other"
    ctrl_c_at(2, lambda: train(qdir, tokens, plan, other, "--steps", 4, "--save-every", 2), monkeypatch)
    record = json.loads((other / "run-settings.json").read_text())
    edited = {**record, "calib_samples": 64, "plan_fingerprint": "0" * 64}
    (other / "run-settings.json").write_text(run_settings_text(edited))
    refused = train(qdir, tokens, plan, other, "--steps", 4, "--save-every", 2)
    said = " ".join(refused.stderr.split())
    assert refused.exit_code == 2 and "the plan 0000000000000000, not" in said and "--calib-samples 64, not 8" in said


def test_text_given_as_data_says_to_tokenize_it_first(prepared, tmp_path):
    """A directory of text as --data was "not a usaf artifact ... an interrupted run leaves none", a text file a JSON
    error without the flag (found in review). The controls: a broken tokens JSONL line is still the reader's, with its
    line; a tokens file trains."""
    from usaf.testing import stdlib_dir

    qdir, tokens, plan = prepared("qwen3_moe")
    for text in (stdlib_dir() / "json", stdlib_dir() / "json" / "decoder.py"):
        result = train(qdir, text, plan, tmp_path / "run", "--steps", 2)
        said = " ".join(result.stderr.split())
        assert result.exit_code == 2 and f"--data {text}: not a tokens" in said and "text to tokenize?" in said, said
        assert f"tokenize it first: usaf tokenize {text} --model MODEL --out TOKENS, then pass --data TOKENS" in said
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"input_ids": [1, 2\n')
    result = train(qdir, broken, plan, tmp_path / "run", "--steps", 2)
    assert result.exit_code == 2 and f"{broken}:1: not valid JSON" in result.stderr, result.output
    broken.write_text("[1, 2]\n")  # JSON, not an object: the reader's line too (this check took it for text once)
    result = train(qdir, broken, plan, tmp_path / "run", "--steps", 2)
    assert result.exit_code == 2 and f"{broken}:1: a JSON list, not an object" in result.stderr, result.output
    marked = tmp_path / "bom.jsonl"  # tokens behind a UTF-8 byte-order mark: tokens (refused as text once)
    marked.write_bytes(b"\xef\xbb\xbf" + (tokens / "train.jsonl").read_bytes())
    assert train(qdir, marked, plan, tmp_path / "bom", "--steps", 2).exit_code == 0
    assert train(qdir, tokens / "train.jsonl", plan, tmp_path / "run", "--steps", 2).exit_code == 0


def test_the_summary_counts_scoring_in_the_wall_time_only_where_the_run_scored(prepared, tmp_path):
    """"wall time (with loading and scoring)" was said of a run given its plan (found in review). The control: a run
    that scored its plan on the fly says it."""
    qdir, tokens, plan = prepared("qwen3_moe")
    given = train(qdir, tokens, plan, tmp_path / "given", "--steps", 2)
    assert given.exit_code == 0 and "wall time (with loading)" in given.stdout, given.output
    fly = invoke("train", "--model", qdir, "--data", tokens, "--workspace", tmp_path / "empty", "--steps", 2,
                 "--frac", 0.05, "--train-from", 2, "--calib-samples", 8, "--out", tmp_path / "fly")  # fmt: skip
    assert fly.exit_code == 0 and "wall time (with loading and scoring)" in fly.stdout, fly.output


def test_prefix_states_no_sequence_of_the_run_matches_are_not_read(prepared, tmp_path):
    """--seq-len shorter than the tokenized sequences: the plan's calibration states (of the uncut ones) were read
    and held, and said read, for no hit (found in review). The control: uncut, they are read."""
    qdir, tokens, plan = prepared("qwen3_moe")
    cut = train(qdir, tokens, plan, tmp_path / "cut", "--steps", 2, "--seq-len", 16)
    said = " ".join(cut.stderr.split())
    assert cut.exit_code == 0 and "are of none of this run's sequences as it keys them" in said, cut.output
    assert "read from the plan" not in said
    whole = train(qdir, tokens, plan, tmp_path / "whole", "--steps", 2)
    said = " ".join(whole.stderr.split())
    assert whole.exit_code == 0 and "read from the plan (the calibration sample)" in said and "none of" not in said


def test_resume_alone_continues_a_run_with_the_settings_it_recorded(prepared, tmp_path, monkeypatch):
    """``usaf train --out RUN --resume`` with nothing else was refused ("--model: not given ...", or "holds another
    run" naming every setting not given again; found in review): the help says it continues the run. It takes what
    the run recorded for each setting not given, from any directory, and ends where a straight run ends, bit for
    bit. The control: the same command without --resume is refused. A setting given is still compared."""
    from helpers_trained import interrupt_at as ctrl_c_at

    qdir, tokens, plan = prepared("qwen3_moe")
    args = ["--steps", 6, "--reselect-every", 3, "--reselect-fraction", 0.3, "--grad-accum", 2, "--seed", 3]
    straight = tmp_path / "straight"
    assert train(qdir, tokens, plan, straight, *args).exit_code == 0
    run = tmp_path / "run"
    ctrl_c_at(4, lambda: train(qdir, tokens, plan, run, *args, "--save-every", 2), monkeypatch)
    monkeypatch.chdir(tmp_path / "run" / "checkpoints")  # elsewhere: the recorded paths are absolute
    assert invoke("train", "--out", run).exit_code == 2  # the control: nothing taken without --resume
    assert invoke("train", "--out", run, "--resume", "--seed", 4).exit_code == 2  # given: compared, not replaced
    resumed = invoke("train", "--out", run, "--resume")
    assert resumed.exit_code == 0, resumed.output
    said = " ".join(resumed.stderr.split())
    assert "settings not given are those recorded in" in said and "resuming from" in said, said
    a, b = final_deltas(straight), final_deltas(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the lr it took is said to be the record's: it was "from --lr", given to no resume (found in review); the
    # control: the straight run, given --lr, names it
    sources = [load_verified(r, RunManifest).summary.lr_source for r in (run, straight)]
    assert sources == ["the interrupted run's run-settings.json", "--lr"], sources


def test_an_edited_run_settings_is_refused_and_resume_alone_takes_the_plans_lr_as_the_plans(
    prepared, tmp_path, monkeypatch
):
    """An lr edited in run-settings.json was trained with by ``--resume`` and recorded as the whole run's, the steps
    before it trained at the other; the same edit given as --lr is refused (found in review). The record carries the
    sha256 of what it holds: an edit is refused by the resume, by the rerun command and by eval of the unfinished
    run. And an lr the plan chose was recorded by ``--resume`` as "the interrupted run's run-settings.json"; it is
    the plan's again. The control: the record put back resumes, to the straight run's lr and its source."""
    from helpers_trained import interrupt_at as ctrl_c_at

    qdir, tokens, plan = prepared("qwen3_moe")
    command = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 4]
    straight = invoke(*command, "--out", tmp_path / "straight")
    assert straight.exit_code == 0, straight.output
    run = tmp_path / "run"
    ctrl_c_at(2, lambda: invoke(*command, "--out", run, "--save-every", 2), monkeypatch)
    path = run / "run-settings.json"
    kept = path.read_text()
    edited = json.loads(kept)
    edited["lr"] /= 3
    path.write_text(json.dumps(edited, indent=1))
    for again in (["train", "--out", run, "--resume"], [*command, "--out", run, "--save-every", 2],
                  ["eval", "--checkpoint", run, "--model", qdir, "--data", tokens, "--out", tmp_path / "r"]):
        refused = invoke(*again)
        said = " ".join(refused.stderr.split())
        assert refused.exit_code == 2 and f"{path}: changed since usaf wrote it" in said, (again[0], said)
    assert not (run / "manifest.json").exists() and not (tmp_path / "r").exists()
    path.write_text(kept)
    resumed = invoke("train", "--out", run, "--resume")
    assert resumed.exit_code == 0, resumed.output
    (a, b) = (load_verified(r, RunManifest).summary for r in (tmp_path / "straight", run))
    assert (b.lr, b.lr_source) == (a.lr, a.lr_source) and not a.lr_source.startswith("the interrupted"), (a, b)


def test_a_shared_setting_a_given_plan_decides_is_said_not_used(prepared, tmp_path, monkeypatch):
    """USAF_FRAC with --plan: dropped in silence (found in review); now a note. The control: without it, no note."""
    qdir, tokens, plan = prepared("qwen3_moe")
    quiet = train(qdir, tokens, plan, tmp_path / "quiet", "--steps", 2)
    assert quiet.exit_code == 0 and "not used" not in quiet.stderr
    monkeypatch.setenv("USAF_FRAC", "0.1")
    said = train(qdir, tokens, plan, tmp_path / "said", "--steps", 2)
    assert said.exit_code == 0 and f"USAF_FRAC 0.1: not used, --plan {plan} decides it" in " ".join(
        said.stderr.split()), said.output  # fmt: skip


def test_a_run_whose_held_out_loss_is_nan_is_read_back(prepared, tmp_path):
    """A held-out loss of NaN (a diverged run: --lr 1e30) is JSON's null in the manifest, which the reader refused as
    "edited or truncated": the run could not be exported or used (found in review). Read back, said as nan."""
    qdir, tokens, plan = prepared("qwen3_moe")
    run = tmp_path / "run"
    result = train(qdir, tokens, plan, run, "--steps", 2, "--reselect-every", 0, "--eval-data", tokens, "--lr", 1e30)
    assert result.exit_code == 0, result.output
    losses = load_verified(run, RunManifest).summary.eval_losses
    assert any(loss is None for _, loss in losses), losses  # the control of this test: the loss did go NaN
    assert "→ nan" in result.stdout, result.stdout
    assert invoke("inspect", "--verify", run).exit_code == 0


def test_an_epoch_a_step_does_not_divide_says_the_sequences_trained_once_more(prepared, tmp_path):
    """One epoch of an odd count of sequences at 2 a step trains ceil(N/2) steps: the last step took one sequence of
    the next epoch's order, trained twice, in silence (a known gap, noted since). The control: at 1 a step, nothing."""
    qdir, tokens, plan = prepared("qwen3_moe")
    lines = (tokens / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    lines = lines[: len(lines) - (len(lines) % 2 == 0)][:9]  # an odd count
    data = tmp_path / "odd.jsonl"
    data.write_text("".join(lines), encoding="utf-8")
    common = ["train", "--model", qdir, "--data", data, "--plan", plan, "--epochs", 1, "--save-every", 0, "--lr", 1e-3,
              "--reselect-every", 0]  # fmt: skip
    result = invoke(*common, "--microbatch", 2, "--out", tmp_path / "two")
    said = " ".join(result.stderr.split())
    n = len(lines)
    assert result.exit_code == 0, result.output
    assert f"--epochs 1 of {n} sequences at 2 a step: {(n + 1) // 2} steps, the last one filled with 1 sequence of " \
        "the next epoch's order (trained once more)" in said, said  # fmt: skip
    control = invoke(*common, "--microbatch", 1, "--out", tmp_path / "one")
    assert control.exit_code == 0 and "trained once more" not in control.stderr, control.output


def test_a_held_out_loss_that_rose_is_said_with_the_checkpoint_of_its_lowest(tmp_path):
    """A run whose held-out loss rose at every evaluation, to above the untrained model's, was summarised as any other
    with its last (worst) weights in final/ (found in review). Said, naming the step of the lowest and the checkpoint
    holding it. Controls: a loss that fell, or rose within 1 %, says nothing."""
    from usaf.stages.train.run import held_out_rise

    run = tmp_path / "run"
    (run / "checkpoints" / "step-0000010").mkdir(parents=True)
    (run / "checkpoints" / "step-0000010" / "state.json").write_text("{}")
    said = held_out_rise([[0, 4.45], [10, 4.30], [20, 4.60], [30, 4.90]], run)
    assert said is not None and said.startswith("warning: the held-out loss rose from 4.3000 at step 10 to 4.9000 "
                                                "at step 30, above the untrained model's 4.4500: the run overfit")
    assert f"{run / 'checkpoints' / 'step-0000010'} holds the weights of step 10" in said
    at_start = held_out_rise([[0, 4.45], [10, 4.60]], run)
    assert "the untrained weights were the best: train fewer steps, or with a smaller --lr" in at_start
    assert "above the untrained" not in at_start
    unkept = held_out_rise([[0, 4.45], [20, 4.20], [30, 4.50]], run)
    assert "no checkpoint holds step 20: train --steps 20" in unkept
    assert held_out_rise([[0, 4.45], [10, 4.30], [20, 4.20]], run) is None
    assert held_out_rise([[0, 4.45], [10, 4.30], [20, 4.34]], run) is None  # within 1 %
    assert held_out_rise([[0, 4.45]], run) is None and held_out_rise([[0, float("nan")], [5, 4.0]], run) is None


def test_train_says_a_held_out_loss_that_rose(prepared, tmp_path, monkeypatch):
    """Through the CLI: held-out losses that rise after step 2 (the measurements replaced: a tiny random model's loss
    falls on any text) make the run say so, naming its checkpoint of step 2 (the unit test above has the cases);
    the control: the real, falling losses say nothing."""
    from usaf.stages.train import loop

    qdir, tokens, plan = prepared("qwen3_moe")
    common = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--eval-data", tokens, "--steps", 6,
              "--eval-every", 2, "--save-every", 2, "--reselect-every", 0, "--lr", 1e-3]  # fmt: skip
    calm = invoke(*common, "--out", tmp_path / "low")
    assert calm.exit_code == 0 and "held-out loss rose" not in calm.stderr, calm.output
    rising = iter([6.3, 4.0, 4.5, 5.0])  # steps 0 (untrained), 2, 4, 6
    monkeypatch.setattr(loop, "held_out_loss", lambda *a, **k: next(rising))
    monkeypatch.setattr(loop, "final_held_out_loss", lambda *a, **k: 5.0)
    rose = invoke(*common, "--out", tmp_path / "high")
    said = " ".join(rose.stderr.split())
    assert rose.exit_code == 0, rose.output
    assert "warning: the held-out loss rose from 4.0000 at step 2 to 5.0000 at step 6" in said, said
    assert f"{tmp_path / 'high' / 'checkpoints' / 'step-0000002'} holds the weights of step 2" in said


def test_a_seq_len_that_cuts_the_data_says_how_much_it_drops(prepared, tmp_path):
    """``--seq-len 128`` on 512-token sequences trained on a quarter of the data without a word (found in review): the
    tokens it cuts are said, counted. The control: without --seq-len nothing is cut or said."""
    from usaf.data.tokens import iter_token_file

    qdir, tokens, plan = prepared("qwen3_moe")
    lengths = [len(line.input_ids) for line in iter_token_file(tokens / "train.jsonl", vocab_size=512)]
    cut = sum(max(0, n - 16) for n in lengths)
    common = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 1, "--save-every", 0,
              "--lr", 1e-3, "--reselect-every", 0]  # fmt: skip
    result = invoke(*common, "--seq-len", 16, "--out", tmp_path / "cut")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0, result.output
    assert f"--seq-len 16 cuts {cut:,} of the {sum(lengths):,} tokens of --data" in said, said
    assert "each sequence trains on its first 16" in said
    control = invoke(*common, "--out", tmp_path / "whole")
    assert control.exit_code == 0 and " cuts " not in control.stderr, control.output


def test_a_ram_budget_places_the_frozen_experts_as_its_plan_predicted(prepared, tmp_path, monkeypatch):
    """Under --ram the planner predicts the peak with the frozen layers' experts dequantized per forward where they do
    not fit, but train dequantized them once whenever the machine's free memory allowed: a 1 GiB --ram run peaked at
    1.27 GiB (found in review). The planner's choice is taken (forced here: the tiny model fits any budget). The
    control: without a budget, the free memory decides."""
    from dataclasses import replace

    from usaf.memory_plan import choose

    monkeypatch.setattr(choose, "_with_frozen_resident", lambda m, q, t, s: replace(s, frozen_resident=False))
    qdir, tokens, plan = prepared("qwen3_moe")
    common = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 1, "--save-every", 0,
              "--lr", 1e-3, "--reselect-every", 0]  # fmt: skip
    budget = invoke(*common, "--ram", "8GiB", "--out", tmp_path / "budget")
    said = " ".join(budget.stderr.split())
    assert budget.exit_code == 0, budget.output
    assert "the frozen layers' experts dequantized per forward (train's predicted peak" in said, said
    assert "frozen MoE layers' experts dequantized per forward" in said and "the --vram/--ram budget's plan" in said
    free = invoke(*common, "--out", tmp_path / "free")
    assert free.exit_code == 0 and "frozen MoE layers' experts dequantized once" in free.stderr, free.output


def test_a_ram_budget_with_a_workspace_plan_does_not_count_scoring(prepared, tmp_path, monkeypatch):
    """Under --ram, a run that takes its plan from the workspace was budgeted as if it scored on the fly: refused where
    scoring would not fit though it scores nothing, and told a --train-from the plan decides (found in review). Here
    the planner finds score short (forced: the tiny model fits any budget). The control: with no plan to find, the
    run scores, and the same budget refuses it, naming score."""
    from dataclasses import replace

    import usaf.memory_plan as memory_plan

    real = memory_plan.plan_memory
    monkeypatch.setattr(memory_plan, "plan_memory", lambda *a: replace(
        real(*a), shortfalls=("score needs 9 GiB of host memory, 8 GiB given",)))  # fmt: skip
    qdir, tokens, plan = prepared("qwen3_moe")
    ws = tmp_path / "ws"
    shutil.copytree(plan, ws / "plan" / "scored")
    args = ["train", "--model", qdir, "--data", tokens, "--steps", 1, "--save-every", 0, "--lr", 1e-3,
            "--reselect-every", 0, "--ram", "8GiB"]  # fmt: skip
    found = invoke(*args, "--workspace", ws, "--out", tmp_path / "found")
    said = " ".join(found.stderr.split())
    assert found.exit_code == 0, found.output
    assert "using the plan" in said and "usaf plan's choice" in said and "--train-from" not in said, said
    scoring = invoke(*args, "--workspace", tmp_path / "empty", "--out", tmp_path / "scoring")
    assert scoring.exit_code == 2 and "nothing fits: score needs 9 GiB" in scoring.stderr, scoring.output


def test_a_run_that_measures_no_held_out_loss_of_a_split_it_has_says_so(prepared, tmp_path):
    """Train at its defaults measured no held-out loss of the tokens' own held-out split, in silence: the summary's
    only figure was the training loss, and the warning of a rising held-out loss was off (found in review). Said,
    with the flags. The control: given --eval-data, nothing of it."""
    qdir, tokens, plan = prepared("qwen3_moe")
    common = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 1, "--save-every", 0,
              "--lr", 1e-3, "--reselect-every", 0]  # fmt: skip
    silent = invoke(*common, "--out", tmp_path / "none")
    said = " ".join(silent.stderr.split())
    assert silent.exit_code == 0, silent.output
    assert "no held-out loss is measured while training" in said and f"--eval-data {tokens} --eval-every N" in said
    measured = invoke(*common, "--eval-data", tokens, "--eval-every", 1, "--steps", 2, "--out", tmp_path / "held")
    assert measured.exit_code == 0 and "no held-out loss" not in measured.stderr, measured.output


def test_keep_checkpoints_keeps_the_newest_and_the_lowest_held_out_ones(prepared, tmp_path, monkeypatch):
    """Every checkpoint was kept: 33 of them were 168 of a run's 174 MB, and nothing said so (found in review).
    --keep-checkpoints N deletes older ones as each is written, but for the one at the lowest held-out loss, which the
    overfit warning names; the summary says what is kept. The control: without it, all are kept, and said."""
    from usaf.stages.train import trainer as trainer_module

    losses = iter([5.0, 4.0, 4.5, 4.6, 4.7, 4.8])  # steps 0..5: lowest at step 1, then rising
    monkeypatch.setattr(trainer_module.Trainer, "evaluate", lambda self, **kw: next(losses))
    qdir, tokens, plan = prepared("qwen3_moe")
    common = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 5, "--save-every", 1,
              "--eval-data", tokens, "--eval-every", 1, "--lr", 1e-3, "--reselect-every", 0, "--json"]  # fmt: skip
    pruned = invoke(*common, "--keep-checkpoints", 2, "--out", tmp_path / "pruned")
    assert pruned.exit_code == 0, pruned.output
    kept = sorted(p.name for p in (tmp_path / "pruned" / "checkpoints").iterdir())
    assert kept == ["step-0000001", "step-0000004", "step-0000005"], kept
    said = " ".join(pruned.stderr.split())
    assert f"{tmp_path / 'pruned' / 'checkpoints' / 'step-0000001'} holds the weights of step 1" in said, said
    summary = json.loads(pruned.stdout)["summary"]
    assert summary["checkpoints"] == 3 and summary["checkpoint_bytes"] > 0
    losses = iter([5.0, 4.0, 4.5, 4.6, 4.7, 4.8])
    every = invoke(*common[:-1], "--out", tmp_path / "every")
    assert every.exit_code == 0, every.output
    assert len(list((tmp_path / "every" / "checkpoints").iterdir())) == 5
    assert "checkpoints kept (all: --keep-checkpoints N) │ 5 (" in " ".join(every.stdout.split()), every.stdout


def test_pruning_keeps_the_lowest_measured_checkpoint_where_the_lowest_loss_has_none(tmp_path):
    """The untrained model (step 0, no checkpoint) measured lowest: the checkpoint of the lowest loss at a checkpoint
    was deleted with the others, for it was not the lowest of all (found in review). It is kept. The control: no
    loss measured, the newest alone are kept; an incomplete directory is never touched."""
    from usaf.artifacts.run import STATE_FILE
    from usaf.stages.train.resume import prune_checkpoints

    def run_with(steps):
        run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        for step in steps:
            (run / "checkpoints" / f"step-{step:07d}").mkdir(parents=True)
            (run / "checkpoints" / f"step-{step:07d}" / STATE_FILE).write_text("{}")
        return run

    def left(run):
        return sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").iterdir())

    run = run_with([20, 40, 60, 80])
    (run / "checkpoints" / "step-0000010").mkdir()  # incomplete (no state file): not one of the run's checkpoints
    prune_checkpoints(run, 2, [[0, 3.0], [20, 4.2], [40, 4.0], [60, 4.5], [80, 4.6]])
    assert left(run) == [10, 40, 60, 80]
    control = run_with([20, 40, 60, 80])
    prune_checkpoints(control, 2, [])
    assert left(control) == [60, 80]
    # a checkpoint linked in by hand, to a folder of the user's: left, and its target untouched
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / STATE_FILE).write_text("{}")
    linked = run_with([60, 80])
    (linked / "checkpoints" / "step-0000040").symlink_to(theirs)
    prune_checkpoints(linked, 1, [])
    assert left(linked) == [40, 80] and (theirs / STATE_FILE).is_file()


def test_a_vram_from_the_environment_on_the_cpu_is_said_unused_and_plans_nothing(prepared, tmp_path, monkeypatch):
    """USAF_VRAM (set for a GPU machine) on a CPU run was taken as a budget: the planner shrank the prefix cache with
    no RAM budget given, where --vram itself is refused (found in review). Said not used; nothing planned. The
    control: the flag is still refused."""
    qdir, tokens, plan = prepared("qwen3_moe")
    common = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 1, "--save-every", 0,
              "--lr", 1e-3, "--reselect-every", 0]  # fmt: skip
    monkeypatch.setenv("USAF_VRAM", "12GiB")
    result = invoke(*common, "--out", tmp_path / "env")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0, result.output
    assert "USAF_VRAM 12GiB: not used, this run computes on the CPU" in said and "usaf plan's choice" not in said
    monkeypatch.delenv("USAF_VRAM")
    flag = invoke(*common, "--vram", "12GiB", "--out", tmp_path / "flag")
    assert flag.exit_code == 2 and "--vram 12GiB: this run computes on the CPU" in flag.stderr, flag.output


def test_a_save_interval_past_the_run_and_a_fraction_of_a_step_are_said(prepared, tmp_path):
    """``--save-every 100`` on a 5-step run saved no checkpoint, and ``--epochs 0.0001`` trained a whole step, both in
    silence where --eval-every and --reselect-every past the run are said (found in review). The controls: the
    default --save-every past a short run, and an --epochs of whole steps, say nothing."""
    qdir, tokens, plan = prepared("qwen3_moe")
    common = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--lr", 1e-3, "--reselect-every", 0]
    past = invoke(*common, "--steps", 2, "--save-every", 100, "--out", tmp_path / "past")
    said = " ".join(past.stderr.split())
    assert past.exit_code == 0 and "--save-every 100: past the run's 2 steps, so no checkpoint before final/" in said
    assert "for 2 steps of 2 sequences" in said, said
    tiny = invoke(*common, "--epochs", 0.0001, "--out", tmp_path / "tiny")
    said = " ".join(tiny.stderr.split())
    assert tiny.exit_code == 0 and "--epochs 0.0001 is " in said and "1 step is trained" in said, tiny.output
    assert "for 1 step of 2 sequences" in said  # "1 steps" (review)
    quiet = invoke(*common, "--steps", 2, "--out", tmp_path / "quiet")
    assert quiet.exit_code == 0 and "--save-every" not in quiet.stderr and "step is trained" not in quiet.stderr


def test_the_first_steps_memory_line_says_what_the_whole_process_holds(prepared, tmp_path):
    """The parts usaf accounts for (0.60 GiB) were read as the total where the process held 1.05 GiB (found in
    review): the line ends with the process's RSS, at least the parts' sum."""
    import re

    qdir, tokens, plan = prepared("qwen3_moe")
    result = invoke("train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 1, "--lr", 1e-3,
                    "--reselect-every", 0, "--out", tmp_path / "run")  # fmt: skip
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0, result.output
    line = re.search(r"memory after the first step: .*?; the whole process holds ([0-9.]+) (KiB|MiB|GiB) of host "
                     r"memory \(RSS\)", said)  # fmt: skip
    assert line is not None, said
    held = float(line.group(1)) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[line.group(2)]
    assert held > 50 * 2**20  # torch alone holds more: a real process's figure, not one of the parts


def test_a_default_epoch_of_few_steps_says_how_to_train_longer(prepared, tmp_path):
    """A 4 KB corpus trained one step at the defaults, its held-out loss barely moved, and nothing said so (found in
    review). The control: an --epochs given is the user's choice, not said."""
    qdir, tokens, plan = prepared("qwen3_moe")
    lines = (tokens / "train.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:6]
    data = tmp_path / "small.jsonl"
    data.write_text("".join(lines), encoding="utf-8")
    common = ["train", "--model", qdir, "--data", data, "--plan", plan, "--lr", 1e-3, "--reselect-every", 0]
    small = invoke(*common, "--out", tmp_path / "small")
    said = " ".join(small.stderr.split())
    assert small.exit_code == 0, small.output
    assert "one epoch (the default) of 6 sequences is 3 steps: little training; --epochs N or --steps N" in said, said
    given = invoke(*common, "--epochs", 1, "--out", tmp_path / "given")
    assert given.exit_code == 0 and "little training" not in given.stderr, given.output


def test_the_held_out_rise_warning_survives_a_checkpoint_renamed_by_hand(tmp_path):
    """A ``checkpoints/step-N`` renamed by hand (``step-best``) made the warning's lookup raise at a finished run's
    end. The rise is still said, without a checkpoint to name."""
    from usaf.stages.train.run import held_out_rise

    run = tmp_path / "run"
    (run / "checkpoints" / "step-best").mkdir(parents=True)
    (run / "checkpoints" / "step-best" / "state.json").write_text("{}")
    said = held_out_rise([[0, 4.45], [10, 4.30], [20, 4.60]], run)
    assert said is not None and "no checkpoint holds step 10" in said
