"""usaf score's learning-rate test (usaf.stages.lr_test): the rule, the engine left untouched, determinism, the lr
recorded in the plan and used by usaf train unless --lr / USAF_LR is given, and tampered records refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import RecordingProgress, invoke
from helpers_engine import FAMILY_LAYERS, batch, random_selection
from usaf.artifacts import PlanManifest, RunManifest, load_verified
from usaf.data.tokens import TokenLine
from usaf.engine.engine import SparseEngine
from usaf.engine.loading import load_quantized_model
from usaf.stages.lr_test import (
    CANDIDATES,
    HeldOut,
    cannot_measure,
    choose_lr,
    choose_lr_within_noise,
    paired_gap,
    probes_run,
    run_lr_test,
    run_probes,
    split,
)

STEPS = 3  # per probe in the CLI tests: the recorded figures, not their quality, are under test


def lines(n: int = 8, length: int = 20, sources: int = 2) -> list[TokenLine]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 512, (n, length), generator=g).tolist()
    return [TokenLine(i, row, row, f"file{i % sources}.py") for i, row in enumerate(ids)]


def engine_of(quantized, *, all_layers: bool = False) -> SparseEngine:
    loaded = load_quantized_model(quantized("qwen3_moe", num_layers=FAMILY_LAYERS))
    layers = list(loaded.spec.moe_layers) if all_layers else [loaded.spec.moe_layers[-1]]
    return SparseEngine(loaded, trainable_layers=layers)


# -- the rule -------------------------------------------------------------------------------------------------


def held(per_token: list[float], tokens: list[float] | None = None) -> HeldOut:
    """A probe's held-back score from per-sequence losses (nats per token) and token counts (default 100 each)."""
    t = torch.tensor(tokens or [100.0] * len(per_token), dtype=torch.float64)
    return HeldOut(torch.tensor(per_token, dtype=torch.float64) * t, t)


def test_paired_gap_is_the_loss_difference_with_its_standard_error():
    a, b = held([5.0, 5.2, 4.9, 5.1], [100, 50, 200, 150]), held([4.9, 5.3, 4.8, 5.0], [100, 50, 200, 150])
    gap, se = paired_gap(a, b)
    assert gap == pytest.approx(a.loss - b.loss)
    d, w = torch.tensor([0.1, -0.1, 0.1, 0.1]), torch.tensor([100, 50, 200, 150]) / 500
    assert se == pytest.approx(float((4 / 3 * (w**2 * (d - gap) ** 2).sum()).sqrt()))
    assert paired_gap(held([5.0, 5.1]), held([4.9, 5.0]))[1] == pytest.approx(0.0, abs=1e-12), "the same gap on all"
    assert paired_gap(held([5.0]), held([4.9])) == (pytest.approx(0.1), 0.0), "one sequence: no estimate"


def test_a_smaller_lr_within_one_standard_error_of_the_lowest_is_chosen():
    """The second evidence model's torch-cpp seed 0: 3e-2 ended 0.002 nats below 1e-2, while the held-back sequences
    disagree by far more about which is better: 1e-2. The control: the same mean gap on every sequence (no noise)
    keeps 3e-2; a smaller lr beyond one standard error is not taken; without per-sequence scores, the lowest."""
    base, candidates = 5.6959, [1e-3, 3e-3, 1e-2, 3e-2]
    noise = [0.05, -0.05, 0.04, -0.04]
    lowest = [5.1002 + n for n in noise]
    tie = [held([5.4467] * 4), held([5.2667] * 4), held([5.1024 + 3 * n for n in noise]), held(lowest)]
    lr, gap_se = choose_lr_within_noise(base, candidates, tie)
    assert lr == 1e-2 and gap_se[2] > 0.0022 and gap_se[3] == 0.0
    consistent = [tie[0], tie[1], held([x + 0.0022 for x in lowest]), held(lowest)]
    assert choose_lr_within_noise(base, candidates, consistent)[0] == 3e-2
    assert choose_lr(base, candidates, [h.loss for h in tie]) == 3e-2


def test_the_noise_rule_keeps_the_divergence_safeguard():
    """A diverged probe (None) and every larger lr are out, even one within noise of nothing; nothing eligible: the
    smallest candidate."""
    candidates = [1e-3, 3e-3, 1e-2]
    lr, gap_se = choose_lr_within_noise(5.0, candidates, [held([4.9, 4.95]), None, held([4.0, 4.1])])
    assert lr == 1e-3 and gap_se == [0.0, None, None]
    assert choose_lr_within_noise(5.0, candidates, [None, held([4.0, 4.1]), held([3.0, 3.1])]) == (1e-3, [None] * 3)
    above_base = [held([5.1, 5.2]), held([4.0, 4.1]), held([3.0, 3.1])]
    assert choose_lr_within_noise(5.0, candidates, above_base)[0] == 1e-3


def test_rule_takes_the_lowest_heldout_loss():
    assert choose_lr(5.0, [1e-3, 3e-3, 1e-2, 3e-2], [4.9, 4.8, 4.85, 4.95]) == 3e-3
    assert choose_lr(5.0, [3e-2, 1e-3, 1e-2], [4.6, 4.9, 4.7]) == 3e-2, "in any order"
    assert choose_lr(5.0, [1e-3, 1e-2], [4.8, 4.8]) == 1e-3, "a tie: the smaller"
    assert choose_lr(5.0, [1e-3, 1e-2], [5.1, 5.2]) == 1e-3, "nothing gains: the smallest"


def test_rule_refuses_everything_from_the_first_divergence_up():
    """A lucky probe above a diverged one is not taken; the negative control: without the safeguard (the plain
    best held-back loss over the finite probes) it would be."""
    candidates, losses = [1e-3, 1e-2, 3e-2, 1e-1], [4.9, 4.8, None, 4.0]
    assert choose_lr(5.0, candidates, losses) == 1e-2
    finite = [(loss, lr) for lr, loss in zip(candidates, losses) if loss is not None]
    assert min(finite)[1] == 1e-1, "control: the unguarded rule picks the probe above the divergence"
    worse = [4.9, 4.8, 5.3, 4.0]  # above the untrained loss counts as diverged too
    assert choose_lr(5.0, candidates, worse) == 1e-2


def test_split_holds_back_whole_sources():
    train, held = split(lines(8, sources=4))
    assert {x.source for x in held} == {"file3.py"} and "file3.py" not in {x.source for x in train}
    train, held = split(lines(8, sources=1))  # one source: every 4th line
    assert [x.line for x in held] == [3, 7] and len(train) == 6
    train, held = split(lines(1, sources=1))
    assert train == held and len(train) == 1


# -- the test on a tiny model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("all_layers", [False, True], ids=["frozen-prefix", "train-from-0"])
def test_engine_is_left_as_it_was(quantized, all_layers):
    engine = engine_of(quantized, all_layers=all_layers)
    assert (engine.prefix is None) == all_layers
    ids, labels = batch()
    before = float(engine.loss(ids, labels).loss.detach())
    routers = {n: p.detach().clone() for n, p in engine.routers.items()}
    result = run_lr_test(engine, random_selection(engine), lines(), microbatch=2, pad_id=0, steps=2)
    assert result.steps == 2 * result.probes_run and result.seconds > 0
    assert any(loss is not None and loss != result.base_loss for loss in result.losses), "the probes trained"
    assert engine.deltas() == {}
    assert all(torch.equal(p, routers[n]) and p.grad is None for n, p in engine.routers.items())
    assert float(engine.loss(ids, labels).loss.detach()) == before


def test_deterministic(quantized):
    results = []
    for _ in range(2):
        engine = engine_of(quantized)
        results.append(run_lr_test(engine, random_selection(engine), lines(), microbatch=2, pad_id=0, steps=2))
    assert results[0].losses == results[1].losses and results[0].lr == results[1].lr


def test_given_prefix_states_replace_the_capture(quantized):
    """States given by line number (score's calibration pass records them) are what the probes start from: no
    capture runs, and the losses are those of the test's own capture up to rounding (its states come from other
    microbatches). The controls: other states give other losses; a microbatch with a line missing captures its own."""
    engine = engine_of(quantized)
    sample, selection = lines(), random_selection(engine)
    own = run_lr_test(engine, selection, sample, microbatch=2, pad_id=0, steps=2)
    states = {line.line: engine.prefix_states(torch.tensor([line.input_ids]))[0] for line in sample}  # (t, H) each
    captures = []
    capture = engine.prefix_states
    engine.prefix_states = lambda *args, **kwargs: captures.append(1) or capture(*args, **kwargs)
    given = run_lr_test(engine, selection, sample, microbatch=2, pad_id=0, steps=2, states=states)
    assert captures == [] and given.lr == own.lr
    torch.testing.assert_close(given.losses, own.losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(given.base_loss, own.base_loss, rtol=1e-5, atol=0)
    g = torch.Generator().manual_seed(1)
    other = {k: torch.randn(v.shape, generator=g) for k, v in states.items()}  # a scale alone the next norm undoes
    moved = run_lr_test(engine, selection, sample, microbatch=2, pad_id=0, steps=2, states=other)
    assert moved.base_loss != pytest.approx(own.base_loss, rel=1e-3), "control: the given states are used"
    del states[sample[0].line]
    run_lr_test(engine, selection, sample, microbatch=2, pad_id=0, steps=2, states=states)
    assert captures == [1], "control: only the microbatch with a missing line captures"


@pytest.mark.parametrize("all_layers", [False, True], ids=["frozen-prefix", "train-from-0"])
def test_the_probes_share_their_first_step_bit_for_bit(quantized, all_layers):
    """Every probe's first forward and backward is the same, so only the first probe runs it (``FirstStep``): the
    held-back scores equal, bit for bit, those of probes that each ran it, and the test runs one loss fewer per
    later probe. The controls: a first step shared from other gradients changes the scores; a shared non-finite
    first loss ends the probe without a forward."""
    from usaf.stages import lr_test

    engine = engine_of(quantized, all_layers=all_layers)
    masks, (train_lines, held_lines) = random_selection(engine), split(lines())
    train = lr_test._with_prefix(engine, train_lines, 2, 0, None)
    held_back = lr_test._with_prefix(engine, held_lines, 1, 0, None)
    calls = []
    loss = engine.loss
    engine.loss = lambda *args, **kwargs: calls.append(torch.is_grad_enabled()) or loss(*args, **kwargs)
    alone = [lr_test._probe(engine, masks, train, held_back, lr, 3) for lr in lr_test.CANDIDATES]
    trained_alone = calls.count(True)
    calls.clear()
    first = lr_test.FirstStep()
    shared = [lr_test._probe(engine, masks, train, held_back, lr, 3, first) for lr in lr_test.CANDIDATES]
    lr_test._restore(engine)
    assert trained_alone == 3 * len(lr_test.CANDIDATES) and calls.count(True) == trained_alone - 3
    assert len({float(h.loss) for h in alone}) == len(alone), "the probes differ: each lr is trained"
    for a, b in zip(alone, shared, strict=True):
        assert torch.equal(a.nll, b.nll) and torch.equal(a.tokens, b.tokens)
    # moved one place (a scale would not do: Adam's first step and the clipping undo it)
    first.grads = [None if g is None else g.roll(1) for g in first.grads]
    changed = lr_test._probe(engine, masks, train, held_back, lr_test.CANDIDATES[0], 3, first)
    assert not torch.equal(changed.nll, alone[0].nll), "control: the shared gradients are what the probe steps on"
    calls.clear()
    assert lr_test._probe(engine, masks, train, held_back, 1e-3, 3, lr_test.FirstStep(taken=True, finite=False)) is None
    assert calls == [], "control: a non-finite first step is not run again"
    lr_test._restore(engine)


def test_a_diverging_lr_is_not_chosen(quantized):
    """lr 1e20 overflows the trained experts' outputs (non-finite loss); the test chooses below it. The control: its
    probe really diverged (a large finite lr does not show it here: on a random tiny model the final norm bounds the
    logits, and lr 100 still lowered the held-back loss of random tokens)."""
    engine = engine_of(quantized)
    result = run_lr_test(engine, random_selection(engine), lines(), microbatch=2, pad_id=0, steps=2,
                         candidates=(1e-3, 1e-2, 1e20))  # fmt: skip
    assert result.losses[-1] is None, "control: the probe at 1e20 diverged"
    assert result.lr < 1e20


def test_the_probes_stop_at_the_first_divergence():
    """Past a divergence nothing is eligible, so those probes are not run: the same choice, fewer steps. Candidates
    given out of order still run by ascending lr; the control: with no divergence every probe runs."""
    base = 5.0
    outcome = {1e-3: 4.9, 3e-3: 4.8, 1e-2: 5.1, 3e-2: 4.0}  # 1e-2 ends above the untrained loss: a divergence
    probed = []

    def probe(lr):
        probed.append(lr)
        return held([outcome[lr]])

    heldout = run_probes(base, (3e-2, 1e-3, 1e-2, 3e-3), probe)
    assert probed == [1e-3, 3e-3, 1e-2], "ascending, and 3e-2 is not run"
    assert heldout[0] is None and [h.loss for h in heldout[1:]] == pytest.approx([4.9, 5.1, 4.8])
    everything = [held([outcome[lr]]) for lr in (3e-2, 1e-3, 1e-2, 3e-3)]  # what running every probe gave
    assert choose_lr_within_noise(base, [3e-2, 1e-3, 1e-2, 3e-3], heldout)[0] == 3e-3
    assert choose_lr_within_noise(base, [3e-2, 1e-3, 1e-2, 3e-3], everything)[0] == 3e-3, "the same choice"
    probed.clear()
    outcome[1e-2] = 4.7
    assert None not in run_probes(base, (3e-2, 1e-3, 1e-2, 3e-3), probe) and len(probed) == 4, "control: all run"
    probed.clear()
    assert run_probes(base, (1e-3, 3e-3), lambda lr: probed.append(lr)) == [None, None] and probed == [1e-3]


def test_a_run_records_the_probes_it_ran(quantized, monkeypatch):
    """On the engine: the probes not run are not called, their losses are None, and the steps count the rest."""
    from usaf.stages import lr_test

    probed = []
    probe = lr_test._probe
    monkeypatch.setattr(lr_test, "_probe", lambda *args: probed.append(args[4]) or probe(*args))
    engine = engine_of(quantized)
    result = run_lr_test(engine, random_selection(engine), lines(), microbatch=2, pad_id=0, steps=2,
                         candidates=(1e20, 1e-3, 1e19, 1e-2))  # fmt: skip
    assert probed == sorted(probed) and result.probes_run == len(probed) and result.steps == 2 * len(probed)
    assert 1e20 not in probed, "1e19 or a smaller lr diverged first"
    assert all(loss is None for lr, loss in zip(result.candidates, result.losses) if lr not in probed)


def test_every_probe_step_is_reported_in_order(quantized):
    """``on_step(lr)`` once per optimizer step of every probe that runs, by ascending lr: what score's progress bar
    counts. Control: the probes past a divergence report nothing."""
    engine = engine_of(quantized)
    seen = []
    result = run_lr_test(engine, random_selection(engine), lines(), microbatch=2, pad_id=0, steps=2,
                         on_step=seen.append)  # fmt: skip
    assert len(seen) == result.steps == 2 * result.probes_run
    assert seen == sorted(seen) and set(seen) == set(result.candidates[: result.probes_run])
    seen.clear()
    diverged = run_lr_test(engine, random_selection(engine), lines(), microbatch=2, pad_id=0, steps=2,
                           candidates=(1e20, 1e19), on_step=seen.append)  # fmt: skip
    assert diverged.probes_run == 1 and seen and set(seen) == {1e19}, "1e19 diverges: 1e20 is not run"


def test_score_shows_the_test_as_a_phase_of_steps(inputs, tmp_path):
    """The stage's progress: an "lr test" phase of up to 4 probes' steps, advanced once per step with the probe's lr,
    and finished; the steps advanced are the steps the plan records."""
    from usaf.stages.score import ScoreConfig
    from usaf.stages.score import run as score_run

    progress = RecordingProgress()
    manifest, _ = score_run(ScoreConfig(model=inputs[0], data=inputs[1], out=tmp_path / "plan", frac=0.05,
                                        calib_samples=8, train_from=2, stability=False, lr_test=True,
                                        lr_test_steps=STEPS), progress=progress)  # fmt: skip
    begin = progress.events.index(("lr test", 4 * STEPS, "steps"))
    end = progress.events.index("finish", begin)
    steps = progress.events[begin + 1 : end]
    assert all(amount == 1 for amount, _ in steps)
    assert len(steps) == manifest.summary.lr_test.steps
    assert [c["lr"] for _, c in steps][::STEPS] == manifest.summary.lr_test.candidates[: len(steps) // STEPS]


def test_a_sweep_with_nothing_held_back_to_measure_is_not_run(inputs, tmp_path):
    """Found in review: one source of 3 lines (the held-back lines were the probes' own) or held-back lines without
    a target gave an lr chosen by memorization or among equal zero losses, recorded as measured and used by train.
    Now the test is skipped, said, and the plan records none. The control: 8 lines of 2 sources are measured."""
    assert cannot_measure(lines(3, sources=1)) and "none to hold back" in cannot_measure(lines(3, sources=1))
    unscored = [TokenLine(x.line, x.input_ids, [-100] * len(x.labels), x.source) if x.source == "file3.py" else x
                for x in lines(8, sources=4)]  # fmt: skip
    assert "no token to score" in cannot_measure(unscored)
    assert cannot_measure(lines(8, sources=2)) is None
    from usaf.stages.score import ScoreConfig
    from usaf.stages.score import run as score_run

    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"input_ids": x.input_ids, "labels": x.labels}) + "\n" for x in lines(3)))
    progress = RecordingProgress()
    manifest, _ = score_run(ScoreConfig(model=inputs[0], data=few, out=tmp_path / "plan", frac=0.05, calib_samples=8,
                                        train_from=2, stability=False, lr_test=True, lr_test_steps=STEPS),
                            progress=progress)  # fmt: skip
    assert manifest.summary.lr_test is None
    assert any("lr test skipped" in note for note in progress.notes), progress.notes


def test_probes_run_counts_up_to_the_first_divergence():
    assert probes_run(5.0, [1e-3, 1e-2, 3e-2], [4.9, 5.1, None]) == 2  # above the base: a divergence
    assert probes_run(5.0, [1e-3, 1e-2, 3e-2], [None, None, None]) == 1
    assert probes_run(5.0, [1e-3, 1e-2, 3e-2], [4.9, 4.8, 4.7]) == 3
    assert probes_run(5.0, [3e-2, 1e-3], [None, 4.9]) == 2  # by ascending lr, whatever the order given


# -- through the CLI: score records it, train uses it -----------------------------------------------------------


@pytest.fixture(scope="module")
def inputs(prepared):
    qdir, tokens, _ = prepared("qwen3_moe")
    return qdir, tokens


def score(qdir: Path, tokens: Path, out: Path, *extra):
    on = () if "--no-lr-test" in extra else ("--lr-test",)  # tests/conftest.py turns it off by default
    result = invoke("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--calib-samples", 8,
                    "--train-from", 2, "--no-stability", "--out", out, *extra, *on)  # fmt: skip
    assert result.exit_code == 0, result.output
    return load_verified(out, PlanManifest), result.output


def train(qdir: Path, tokens: Path, plan: Path, out: Path, *extra, env=None):
    return invoke("train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 1, "--out", out, *extra,
                  env=env)  # fmt: skip


@pytest.fixture(scope="module")
def plan(inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("lr") / "plan"
    manifest, output = score(*inputs, out, "--lr-test-steps", STEPS)
    return out, manifest, output


def test_score_records_and_prints_the_test(plan):
    _, manifest, output = plan
    t = manifest.summary.lr_test
    assert t is not None and t.lr in t.candidates and t.probes_run is not None and t.steps == STEPS * t.probes_run
    assert len(t.heldout_losses) == len(t.candidates) and math.isfinite(t.base_loss)
    assert t.heldout_gap_se is not None and len(t.heldout_gap_se) == len(t.candidates)
    lowest = t.candidates.index(choose_lr(t.base_loss, t.candidates, t.heldout_losses))
    chosen = t.candidates.index(t.lr)
    assert t.heldout_losses[chosen] - t.heldout_losses[lowest] <= t.heldout_gap_se[chosen] + 1e-12
    for i in range(chosen):  # every smaller lr was further from the lowest than its standard error
        assert t.heldout_losses[i] - t.heldout_losses[lowest] > t.heldout_gap_se[i]
    assert f"lr test: lr {t.lr:.1e}" in output
    assert ("within one standard error" in output) == (chosen != lowest)


def test_score_takes_and_names_a_smaller_lr_within_noise(inputs, tmp_path, monkeypatch):
    """The probes at the two largest lrs end 0.001 nats apart, while the two held-back sequences disagree by 0.06
    about which is better: the plan records the smaller and score says why (the lowest is named for --lr)."""
    import dataclasses

    from usaf.stages import score as score_stage

    real = score_stage.run_lr_test

    def tied(*args, **kwargs):
        r = real(*args, **kwargs)
        ends = [r.base_loss - 0.1, r.base_loss - 0.2, r.base_loss - 0.3, r.base_loss - 0.301]
        heldout = [held([e + 0.03, e - 0.03]) for e in ends[:-1]] + [held([ends[-1] - 0.03, ends[-1] + 0.03])]
        lr, gap_se = choose_lr_within_noise(r.base_loss, r.candidates, heldout)
        return dataclasses.replace(r, losses=[h.loss for h in heldout], gap_se=gap_se, lr=lr)

    monkeypatch.setattr(score_stage, "run_lr_test", tied)
    manifest, output = score(*inputs, tmp_path / "plan", "--lr-test-steps", 1)
    assert manifest.summary.lr_test.lr == CANDIDATES[-2]
    assert f"lr test: {CANDIDATES[-1]:g} ended lowest, {CANDIDATES[-2]:g} within one standard error" in output
    assert f"train --lr {CANDIDATES[-1]:g}" in output


@pytest.mark.parametrize("second", ["nan", "above"])
def test_score_names_the_probes_not_run(inputs, tmp_path, monkeypatch, second):
    """The second probe diverged, so the test stopped: the plan records two probes run and score prints the others
    as not run, not as diverged, and why it stopped in the test's terms (a loss a little above the untrained one
    counts: "diverged" alone read as a blow-up next to a loss 0.008 above it). The control: the one that did
    diverge is printed with its loss, or as diverged where it had none."""
    import dataclasses

    from usaf.stages import score as score_stage

    real = score_stage.run_lr_test

    def stopped(*args, **kwargs):
        r = real(*args, **kwargs)
        losses = [r.base_loss - 0.1, None if second == "nan" else r.base_loss + 0.01, None, None]
        return dataclasses.replace(r, losses=losses, gap_se=[0.0, None, None, None], lr=CANDIDATES[0], probes_run=2)

    monkeypatch.setattr(score_stage, "run_lr_test", stopped)
    manifest, output = score(*inputs, tmp_path / "plan", "--lr-test-steps", 1)
    t = manifest.summary.lr_test
    assert t.probes_run == 2
    flat = " ".join(output.split())  # the console wraps long lines
    how = "its loss was not finite" if second == "nan" else "it ended above the untrained held-back loss"
    shown = "diverged" if second == "nan" else f"{t.base_loss + 0.01:.4f}"
    assert f"{CANDIDATES[1]:g}: {shown}," in flat
    assert all(f"{lr:g}: not run" in flat for lr in CANDIDATES[2:])
    assert f"(the larger lrs not run, past {CANDIDATES[1]:g}: {how})" in flat  # the summary
    note = f"2 of {len(CANDIDATES)} probes, {t.steps} steps; the larger lrs not run, past {CANDIDATES[1]:g}: {how})"
    assert note in flat


def test_train_uses_the_plans_lr(inputs, plan, tmp_path):
    path, manifest, _ = plan
    result = train(*inputs, path, tmp_path / "run")
    assert result.exit_code == 0, result.output
    lr = manifest.summary.lr_test.lr
    s = load_verified(tmp_path / "run", RunManifest).summary
    assert (s.lr, s.lr_source) == (lr, "the plan's lr test")
    assert json.loads((tmp_path / "run" / "run-settings.json").read_text())["lr"] == lr  # resume uses it too
    assert f"lr {lr:.1e} (from the plan's lr test)" in result.output


@pytest.mark.parametrize("how", ["flag", "env"])
def test_lr_given_wins_over_the_plan(inputs, plan, tmp_path, how):
    path, manifest, _ = plan
    given = 0.0123
    assert given != manifest.summary.lr_test.lr
    extra, env = (("--lr", given), None) if how == "flag" else ((), {"USAF_LR": str(given)})
    result = train(*inputs, path, tmp_path / "run", *extra, env=env)
    assert result.exit_code == 0, result.output
    s = load_verified(tmp_path / "run", RunManifest).summary
    assert (s.lr, s.lr_source) == (given, "--lr" if how == "flag" else "USAF_LR")


def test_no_lr_test_means_the_default(inputs, tmp_path):
    manifest, output = score(*inputs, tmp_path / "plan", "--no-lr-test")
    assert manifest.summary.lr_test is None and "lr test: off" in output
    result = train(*inputs, tmp_path / "plan", tmp_path / "run")
    assert result.exit_code == 0, result.output
    s = load_verified(tmp_path / "run", RunManifest).summary
    assert s.lr == 3e-3 and "no lr test" in s.lr_source


def test_steps_without_the_test_are_refused(inputs, tmp_path):
    result = invoke("score", "--model", inputs[0], "--data", inputs[1], "--no-lr-test", "--lr-test-steps", 4,
                    "--out", tmp_path / "plan")  # fmt: skip
    assert result.exit_code == 2 and "--lr-test-steps" in result.output and "--no-lr-test" in result.output


def test_score_computes_the_samples_prefix_states_once(inputs, tmp_path, monkeypatch):
    """The lr test starts from the states the calibration pass recorded: no prefix capture in the whole stage. The
    control: without the recorded states the test captures its own (the counter counts)."""
    from usaf.stages import score as score_stage

    captures = []
    capture = SparseEngine.prefix_states
    monkeypatch.setattr(
        SparseEngine, "prefix_states", lambda self, *a, **k: captures.append(1) or capture(self, *a, **k)
    )
    score(*inputs, tmp_path / "a", "--lr-test-steps", 1)
    assert captures == []
    monkeypatch.setattr(score_stage, "_states_by_line", lambda tap, items: None)
    score(*inputs, tmp_path / "b", "--lr-test-steps", 1)
    assert captures, "control: the lr test captures when it is given no states"


def test_the_cache_is_captured_from_an_untouched_engine(inputs, tmp_path):
    """--cache runs after the lr test: its stored states equal those of a plan scored without the test (the
    sample's 8 come from the scoring pass, before the test; the others are computed after it)."""
    with_test, _ = score(*inputs, tmp_path / "a", "--cache", "--lr-test-steps", STEPS)
    without, _ = score(*inputs, tmp_path / "b", "--cache", "--no-lr-test")
    assert with_test.summary.lr_test is not None and with_test.summary.prefix_cache.samples > 8
    states = [(tmp_path / p / "prefix_states.bin").read_bytes() for p in ("a", "b")]
    assert states[0] == states[1]


def test_train_scoring_on_the_fly_runs_the_test_unless_lr_is_given(inputs, tmp_path):
    for name, extra in (("plain", ()), ("given", ("--lr", 0.01))):
        out = tmp_path / name
        result = invoke("train", "--model", inputs[0], "--data", inputs[1], "--steps", 1, "--calib-samples", 4,
                        "--train-from", 2, "--workspace", tmp_path / f"ws-{name}", "--out", out, *extra)  # fmt: skip
        assert result.exit_code == 0, result.output
        plan = load_verified(out / "plan", PlanManifest).summary
        s = load_verified(out, RunManifest).summary
        if extra:
            assert plan.lr_test is None and (s.lr, s.lr_source) == (0.01, "--lr")
        else:
            assert plan.lr_test is not None and (s.lr, s.lr_source) == (plan.lr_test.lr, "the plan's lr test")


def tampered(plan_dir: Path, tmp_path: Path, key: str, value) -> Path:
    """A copy of the plan with ``summary.lr_test[key]`` replaced, re-signed (sizes, hashes, fingerprint) so that only
    the summary's own checks can catch it."""
    import shutil

    from usaf.testing.hostile import _resign as resign  # the hostile-input catalogue's re-signing

    copy = Path(shutil.copytree(plan_dir, tmp_path / "plan"))
    data = json.loads((copy / "manifest.json").read_text())
    data["summary"]["lr_test"][key] = value
    (copy / "manifest.json").write_text(json.dumps(data))
    resign(copy)
    return copy


@pytest.mark.parametrize("value", [float("nan"), -0.01, "fast", 7e-3], ids=["nan", "negative", "string", "foreign"])
def test_a_tampered_lr_is_refused(inputs, plan, tmp_path, value):
    """One line naming the plan's manifest."""
    copy = tampered(plan[0], tmp_path, "lr", value)
    result = train(*inputs, copy, tmp_path / "run")
    assert result.exit_code == 2, result.output
    assert str(copy / "manifest.json") in result.output and "lr_test" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("value", [[0.01], [-0.01, 0.0, None, None], [float("nan"), 0.0, None, None]],
                         ids=["length", "negative", "nan"])  # fmt: skip
def test_a_tampered_standard_error_is_refused(inputs, plan, tmp_path, value):
    """The recorded errors must match the candidates and be finite and >= 0; the control: the untouched plan trains."""
    assert train(*inputs, plan[0], tmp_path / "control").exit_code == 0
    result = train(*inputs, tampered(plan[0], tmp_path, "heldout_gap_se", value), tmp_path / "run")
    assert result.exit_code == 2 and "heldout_gap_se" in result.output, result.output


@pytest.mark.parametrize("value", [5, 0, "two"], ids=["more than the candidates", "zero", "string"])
def test_a_tampered_probes_run_is_refused(inputs, plan, tmp_path, value):
    """At least one probe ran, and no more than there are candidates: anything else is one line naming the field."""
    result = train(*inputs, tampered(plan[0], tmp_path, "probes_run", value), tmp_path / "run")
    assert result.exit_code == 2 and "probes_run" in result.output, result.output
    assert "Traceback" not in result.output


def test_the_samples_prefix_states_are_padded_at_each_use_not_copied_for_the_whole_test():
    """The test held a padded copy of every microbatch's states beside the sample's (about twice the sample's states in
    host memory, which score's memory plan counts once; found in review). It holds references and pads at each use,
    to the same values as the copy (the control: lines without given states are computed once, as before)."""
    from types import SimpleNamespace

    from usaf.data.tokens import TokenLine
    from usaf.engine.prefix import padded_states
    from usaf.stages.lr_test import _on_device, _with_prefix

    lines = [TokenLine(i, list(range(1, 4 + i)), list(range(1, 4 + i)), "s") for i in range(4)]
    states = {line.line: torch.randn(len(line.input_ids), 8) for line in lines}
    computed = []
    compute = lambda ids, mask: computed.append(ids) or torch.zeros(*ids.shape, 8)  # noqa: E731
    engine = SimpleNamespace(prefix=object(), device=torch.device("cpu"), prefix_states=compute)
    groups = _with_prefix(engine, lines, 2, 0, states)
    for microbatch, prefix in groups:
        assert isinstance(prefix, list) and all(any(p is s for s in states.values()) for p in prefix)
        expected = padded_states(prefix, microbatch.input_ids.shape[1])
        assert torch.equal(_on_device(prefix, microbatch), expected)
    assert computed == []
    groups = _with_prefix(engine, lines, 2, 0, {0: states[0]})  # a microbatch without every line's states
    assert len(computed) == 2 and all(isinstance(prefix, torch.Tensor) for _, prefix in groups)
