"""Settings a command would not use in the combination given are refused from their flag and noted from USAF_*
(usaf.config.refuse_unused), and values past any machine are one range error, not a traceback (found in review,
2026-12-06). Each case has its control: the same setting where it does act is taken."""

from __future__ import annotations

import pytest

from helpers import explain, invoke


def one_error(result, needle: str) -> None:
    assert result.exit_code == 2, explain(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0] and "Traceback" not in result.output, result.output


def test_greedy_generation_refuses_top_p_and_seed(prepared, monkeypatch):
    qdir, _, _ = prepared("qwen3_moe")
    base = ["generate", "def f", "--model", qdir, "--no-checkpoint", "--max-new-tokens", 2]
    for flag, value in (("--top-p", 0.5), ("--seed", 7)):
        one_error(invoke(*base, "--temperature", 0, flag, value), f"{flag} {value}: --temperature 0 decodes greedily")
    monkeypatch.setenv("USAF_SEED", "7")
    noted = invoke(*base, "--temperature", 0)
    assert noted.exit_code == 0 and "USAF_SEED 7: --temperature 0 decodes greedily" in noted.stderr, explain(noted)
    monkeypatch.delenv("USAF_SEED")
    sampled = invoke(*base, "--temperature", 0.7, "--top-p", 0.5, "--seed", 7)  # control: sampling uses both
    assert sampled.exit_code == 0 and "decodes greedily" not in sampled.stderr, explain(sampled)


def test_dist_backend_in_one_process_is_refused(prepared, tmp_path):
    qdir, tokens, plan = prepared("qwen3_moe")
    train = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 1, "--lr", 1e-3,
             "--reselect-every", 0, "--out", tmp_path / "run"]  # fmt: skip
    one_error(invoke(*train, "--dist-backend", "gloo"), "--dist-backend gloo: this is one process")
    score = ["score", "--model", qdir, "--data", tokens, "--calib-samples", 4, "--no-lr-test", "--no-stability",
             "--train-from", 2, "--out", tmp_path / "plan"]  # fmt: skip
    one_error(invoke(*score, "--dist-backend", "gloo"), "--dist-backend gloo: this is one process")
    assert not (tmp_path / "run").exists() and not (tmp_path / "plan").exists()
    # control: torchrun's ranks take it (tests/test_distributed.py runs both commands under torchrun)


@pytest.mark.parametrize(
    ("given", "needle", "control"),
    [
        (("--full-maps", "--candidates-factor", 8), "--candidates-factor 8: --full-maps scores every weight",
         ("--candidates-factor", 8)),
        (("--targets", "attention", "--budget", "per-expert"), "--budget per-expert: --targets attention has no",
         ("--targets", "experts,attention", "--budget", "per-expert")),
    ],
)  # fmt: skip
def test_score_refuses_selection_settings_that_change_nothing(prepared, tmp_path, given, needle, control):
    qdir, tokens, _ = prepared("qwen3_moe")
    score = ["score", "--model", qdir, "--data", tokens, "--calib-samples", 4, "--no-lr-test", "--no-stability",
             "--train-from", 2, "--frac", 0.05]  # fmt: skip
    one_error(invoke(*score, *given, "--out", tmp_path / "refused"), needle)
    assert not (tmp_path / "refused").exists()
    taken = invoke(*score, *control, "--out", tmp_path / "taken")
    assert taken.exit_code == 0, explain(taken)


def test_values_past_any_machine_and_an_empty_device_are_one_range_error(prepared, tmp_path):
    qdir, tokens, plan = prepared("qwen3_moe")
    train = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 1, "--out", tmp_path / "run"]
    one_error(invoke(*train, "--prefix-cache-gib", "1e300"), "--prefix-cache-gib")
    one_error(invoke(*train, "--device", ""), "--device")
    assert not (tmp_path / "run").exists()


def test_a_step_larger_than_the_data_is_refused(prepared, tmp_path):
    """--microbatch 10**12 hung building its first step, and a step larger than the data trained some sequences twice
    in it (found in review). Control: a step the data holds trains."""
    qdir, tokens, plan = prepared("qwen3_moe")
    train = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 1, "--lr", 1e-3,
             "--reselect-every", 0]  # fmt: skip
    one_error(invoke(*train, "--microbatch", 10**12, "--out", tmp_path / "huge"), "is more than the data's")
    one_error(invoke(*train, "--microbatch", 200, "--grad-accum", 2, "--out", tmp_path / "big"),
              "a step of 400 sequences (--microbatch 200 × --grad-accum 2) is more than the data's")  # fmt: skip
    assert not (tmp_path / "huge").exists() and not (tmp_path / "big").exists()
    fits = invoke(*train, "--microbatch", 4, "--out", tmp_path / "fits")
    assert fits.exit_code == 0, explain(fits)


def test_weights_an_update_made_non_finite_are_not_saved(prepared, tmp_path):
    """--lr 1e300: the first update overflowed, the later steps were skipped (non-finite gradients) and the run
    ended with exit 0 and a change eval, export and generate refused (found in review). Control: a sane lr saves."""
    from usaf.artifacts import RunManifest, load_verified

    qdir, tokens, plan = prepared("qwen3_moe")
    train = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 3, "--reselect-every", 0]
    diverged = invoke(*train, "--lr", 1e300, "--out", tmp_path / "diverged")
    one_error(diverged, "the trained weights are no longer finite")
    assert "lower --lr (this run's: 1e+300" in diverged.stderr
    assert not (tmp_path / "diverged" / "manifest.json").exists() and not (tmp_path / "diverged" / "final").exists()
    sane = invoke(*train, "--lr", 1e-3, "--out", tmp_path / "sane")
    assert sane.exit_code == 0, explain(sane)
    assert load_verified(tmp_path / "sane", RunManifest).summary.steps == 3


def test_lr_test_steps_where_the_test_will_not_run_are_refused(prepared, tmp_path):
    """--lr-test-steps where the sample has nothing to hold back was accepted and unused, and the summary of a
    skipped test said "off (--no-lr-test)", a flag not given (found in review); with --no-lr-test it was refused
    already. Control: a skipped test without the flag is said as skipped."""
    qdir, tokens, _ = prepared("qwen3_moe")
    score = ["score", "--model", qdir, "--data", tokens, "--no-stability", "--train-from", 2, "--frac", 0.05]
    one_error(invoke(*score, "--no-lr-test", "--lr-test-steps", 5, "--out", tmp_path / "off"),
              "--lr-test-steps sizes the lr test, which --no-lr-test turns off")  # fmt: skip
    one_error(invoke(*score, "--calib-samples", 1, "--lr-test", "--lr-test-steps", 5, "--out", tmp_path / "one"),
              "--lr-test-steps 5: the lr test will not run (1 calibration line of one source")  # fmt: skip
    skipped = invoke(*score, "--calib-samples", 1, "--lr-test", "--out", tmp_path / "skipped")
    assert skipped.exit_code == 0, explain(skipped)
    assert "lr test: skipped (see the note above)" in skipped.output and "--no-lr-test" not in skipped.output


def test_router_losses_where_nothing_trained_feeds_a_router_are_refused(prepared, tmp_path, monkeypatch):
    """--no-router over one trained layer's experts: the router losses reach no trained weight, and --aux-loss-coef
    5 gave the same deltas byte for byte (found in review). From USAF_* a note. Control: with the attention trained
    (before the router), they act."""
    qdir, tokens, plan = prepared("qwen3_moe")
    experts = tmp_path / "experts-plan"
    scored = invoke("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--calib-samples", 4, "--train-from",
                    2, "--targets", "experts", "--no-stability", "--no-lr-test", "--out", experts)  # fmt: skip
    assert scored.exit_code == 0, explain(scored)
    train = ["train", "--model", qdir, "--data", tokens, "--steps", 1, "--lr", 1e-3, "--reselect-every", 0,
             "--no-router"]  # fmt: skip
    one_error(invoke(*train, "--plan", experts, "--aux-loss-coef", 5, "--out", tmp_path / "refused"),
              "--aux-loss-coef 5.0: no router trains (--no-router)")  # fmt: skip
    assert not (tmp_path / "refused").exists()
    monkeypatch.setenv("USAF_Z_LOSS_COEF", "0.1")
    noted = invoke(*train, "--plan", experts, "--out", tmp_path / "noted")
    assert noted.exit_code == 0 and "USAF_Z_LOSS_COEF 0.1: no router trains" in noted.stderr, explain(noted)
    monkeypatch.delenv("USAF_Z_LOSS_COEF")
    acting = invoke(*train, "--plan", plan, "--aux-loss-coef", 5, "--out", tmp_path / "acting")  # experts+attention
    assert acting.exit_code == 0 and "no router trains" not in acting.stderr, explain(acting)
