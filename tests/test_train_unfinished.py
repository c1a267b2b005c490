"""An interrupted ``usaf train`` is found again by the same command (usaf.stages.train.inputs): without ``--out`` a
run directory is named by its start time, so the rerun looks in the workspace for an unfinished run whose recorded
settings equal its own (or, stopped while scoring its plan on the fly, whose score settings do) and resumes it.
Stopped while scoring on the fly, with or without ``--out``, the rerun resumes the score inside the run directory.
Controls: other settings start a new run and leave the unfinished one alone; a directory of that name usaf did not
write stays refused."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest

from helpers import ctrl_c_at_step, explain, invoke, stop_at_check
from usaf.artifacts import RunManifest, load_verified
from usaf.artifacts.lock import OutputLock

STEPS = 6


def runs(workspace) -> list:
    return sorted(p for p in (workspace / "run").iterdir() if not p.name.startswith("."))


def train(workspace, qdir, tokens, *extra) -> list:
    return ["train", "--workspace", workspace, "--model", qdir, "--data", tokens, "--steps", STEPS,
            "--save-every", 0, "--lr", 1e-3, *extra]  # fmt: skip


@pytest.fixture
def stop_scoring_at(monkeypatch):
    """``stop_scoring_at(n)``: score's n-th stop check raises as Ctrl-C does (one before each calibration batch)."""
    yield lambda n: stop_at_check(monkeypatch, n)
    monkeypatch.undo()


def stopped_at_step_2(command: list, workspace):
    """Run ``command`` interrupted before step 3; its run directory (the workspace's only one) and the result."""
    with ctrl_c_at_step(2):
        stopped = invoke(*command)
    assert stopped.exit_code == 130, explain(stopped)
    (run,) = runs(workspace)
    return run, stopped


def test_the_same_command_resumes_its_unfinished_run_without_out(prepared, tmp_path):
    """Stopped at step 2 with a plan given: the same command resumes that run directory at step 2 and finishes
    there. Controls: another lr (another run) starts a new directory and leaves the unfinished one as it was, and so
    does the same command while another process holds the unfinished run's lock."""
    qdir, tokens, plan = prepared("qwen3_moe")
    command = train(tmp_path, qdir, tokens, "--plan", plan)
    run, stopped = stopped_at_step_2(command, tmp_path)
    assert f"run the same command to resume (or pass --out {run})" in stopped.stderr
    before = sorted(p.name for p in run.iterdir())

    other = invoke(*train(tmp_path, qdir, tokens, "--plan", plan)[:-2], "--lr", 2e-3)
    assert other.exit_code == 0, explain(other)
    assert "resuming" not in other.stderr
    assert len(runs(tmp_path)) == 2 and sorted(p.name for p in run.iterdir()) == before

    with OutputLock(run):  # another process running it: the same command started twice at once runs twice
        busy = invoke(*command)
    assert busy.exit_code == 0, explain(busy)
    assert "resuming" not in busy.stderr and len(runs(tmp_path)) == 3

    resumed = invoke(*command)
    assert resumed.exit_code == 0, explain(resumed)
    assert f"resuming the unfinished run {run} (no --out given)" in resumed.stderr
    assert f"(step 2 of {STEPS})" in resumed.stderr
    assert load_verified(run, RunManifest).summary.steps == STEPS and len(runs(tmp_path)) == 3


def test_an_unfinished_run_whose_settings_were_edited_is_named_when_passed_over(prepared, tmp_path):
    """An unfinished run whose run-settings.json was edited (an lr changed by hand) is refused by --resume, but the same
    command without --out passed it over in silence and started a new run (found in review): a note names it. The
    control: put back as usaf wrote it, the same command resumes it."""
    qdir, tokens, plan = prepared("qwen3_moe")
    command = train(tmp_path, qdir, tokens, "--plan", plan)
    run, _ = stopped_at_step_2(command, tmp_path)
    saved = run / "run-settings.json"
    written = saved.read_text(encoding="utf-8")
    saved.write_text(written.replace('"seed": 0', '"seed": 7'), encoding="utf-8")
    assert saved.read_text(encoding="utf-8") != written
    with ctrl_c_at_step(0):  # the new run it starts: stopped at once
        passed = invoke(*command)
    said = " ".join(passed.stderr.split())
    assert f"not resuming the unfinished run {run}: its run-settings.json changed since usaf wrote it" in said, said
    assert "resuming the unfinished run" not in said.replace("not resuming the unfinished run", "")
    newer = [r for r in runs(tmp_path) if r != run]
    for r in newer:
        shutil.rmtree(r)
    saved.write_text(written, encoding="utf-8")
    resumed = invoke(*command)
    assert resumed.exit_code == 0, explain(resumed)
    assert f"resuming the unfinished run {run} (no --out given)" in resumed.stderr
    assert "not resuming" not in resumed.stderr


def test_score_overwrite_of_the_plan_an_unfinished_run_trains_with_is_refused(prepared, tmp_path):
    """``usaf score --out PLAN --overwrite`` replaced the plan of an interrupted run in silence, and that run could
    never resume again (found in review). Refused while the run is unfinished; the control: once it finished, the
    plan is replaced."""
    qdir, tokens, plan = prepared("qwen3_moe")
    mine = tmp_path / "plan"
    shutil.copytree(plan, mine)
    command = train(tmp_path, qdir, tokens, "--plan", mine)
    run, _ = stopped_at_step_2(command, tmp_path)
    before = sorted((p.name, p.stat().st_size) for p in mine.iterdir())
    rescore = ["score", "--model", qdir, "--data", tokens, "--out", mine, "--overwrite", "--workspace", tmp_path,
               "--calib-samples", 2, "--no-stability", "--no-lr-test", "--frac", 0.1]  # fmt: skip
    refused = invoke(*rescore)
    said = " ".join(refused.stderr.split())
    assert refused.exit_code == 2 and f"--out {mine}: the plan of the unfinished run {run}" in said, refused.output
    assert f"usaf train --out {run} --resume" in said
    assert sorted((p.name, p.stat().st_size) for p in mine.iterdir()) == before
    assert invoke(*command).exit_code == 0  # resumed and finished
    done = invoke(*rescore)
    assert done.exit_code == 0, explain(done)


def test_the_out_the_interrupt_note_names_resumes_too(prepared, tmp_path):
    """The note names the run directory as well: --out RUN resumes it whatever else changed in the workspace."""
    qdir, tokens, plan = prepared("qwen3_moe")
    command = train(tmp_path, qdir, tokens, "--plan", plan)
    run, stopped = stopped_at_step_2(command, tmp_path)
    resumed = invoke(*command, "--out", run)
    assert resumed.exit_code == 0, explain(resumed)
    assert "resuming the unfinished run" not in resumed.stderr and f"(step 2 of {STEPS})" in resumed.stderr
    assert "the run trained at" not in resumed.stderr  # the same split: the control of the test below
    assert "run the same command to resume" in " ".join(stopped.stderr.split())


def test_stopped_with_overwrite_the_note_says_to_resume_without_it(prepared, tmp_path):
    """"run the same command to resume", and the same command, with --overwrite, deleted the run it said was saved
    (found in review). The test above is the control."""
    qdir, tokens, plan = prepared("qwen3_moe")
    _, stopped = stopped_at_step_2([*train(tmp_path, qdir, tokens, "--plan", plan), "--overwrite"], tmp_path)
    said = " ".join(stopped.stderr.split())
    assert "run the same command without --overwrite to resume (with it, it starts over)" in said, said


def test_a_resume_at_another_microbatch_says_it_is_not_the_uninterrupted_run(prepared, tmp_path):
    """The same global batch split otherwise resumes (README), but was said to be exact: each step's sums and RigL's
    grow scores depend on the microbatch, and a resumed run reselected other weights (found in review)."""
    qdir, tokens, plan = prepared("qwen3_moe")
    command = train(tmp_path, qdir, tokens, "--plan", plan)
    run, _ = stopped_at_step_2(command, tmp_path)
    resumed = invoke(*command, "--out", run, "--microbatch", 1, "--grad-accum", 2)
    assert resumed.exit_code == 0, explain(resumed)
    said = " ".join(resumed.stderr.split())
    assert f"(step 2 of {STEPS})" in said and "--microbatch 1: the run trained at 2 until now" in said, said
    assert "(--microbatch 2 continues it exactly)" in said


def test_the_split_note_compares_what_the_run_computed_with_what_this_start_computes():
    """An out-of-memory retry's microbatch, kept in the checkpoint, overrides --microbatch on resume: the note compared
    the flag with the first start's flag, both untrue then (found in review)."""
    from usaf.stages.train.inputs import other_split

    assert other_split(2, 2, 2) is None and other_split(None, 1, 1) is None  # the same; a run from before the record
    assert "the run trained at 2 until now" in other_split(2, 1, 1)
    overridden = "--microbatch 4: the run goes on at its checkpoint's 2 (an out-of-memory retry chose it)"
    assert other_split(2, 2, 4) == overridden


def test_resume_at_an_out_holding_no_run_is_refused_and_at_the_stopped_run_resumes(prepared, tmp_path):
    """--resume --out at an empty directory (or one holding only a kill's temporary) started a new run there in
    silence (found in review), where the user meant another directory. Control: at the stopped run it resumes."""
    qdir, tokens, plan = prepared("qwen3_moe")
    command = train(tmp_path, qdir, tokens, "--plan", plan)
    empty, leftover = tmp_path / "empty", tmp_path / "leftover"
    empty.mkdir()
    leftover.mkdir()
    (leftover / ".run-settings.json.usaf-tmp-1-abcd").write_text("{")
    for out in (empty, leftover):
        refused = invoke(*command, "--out", out, "--resume")
        assert refused.exit_code == 2, explain(refused)
        assert f"--out {out}: nothing to resume there" in refused.stderr and "drop --resume" in refused.stderr
    assert list(empty.iterdir()) == [] and not (leftover / "manifest.json").exists()
    # before the inputs are looked for: with none given in a workspace of no model (or of several), the answer was
    # "--model: not given ..." of a mistyped --out, or of another artifact's (found in review)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    for out, said in ((workspace / "typo", "nothing to resume there (--resume)"),
                      (tokens, "a usaf tokens artifact, no run to resume (--resume)")):  # fmt: skip
        refused = invoke("train", "--out", out, "--resume", "--workspace", workspace)
        assert refused.exit_code == 2 and f"--out {out}: {said}" in " ".join(refused.stderr.split()), explain(refused)
        assert "--model" not in refused.stderr

    run, _ = stopped_at_step_2(command, tmp_path)
    resumed = invoke(*command, "--out", run, "--resume")
    assert resumed.exit_code == 0, explain(resumed)
    assert f"(step 2 of {STEPS})" in resumed.stderr and (run / "manifest.json").is_file()

def test_a_run_that_scored_its_plan_is_found_after_its_first_steps_and_before(prepared, tmp_path, monkeypatch):
    """No plan anywhere: the run scores one into RUN/plan. Its settings are recorded right after, so a stop before
    the first step (here: while the engine is built) is found again, and so is a stop at step 2; neither scores
    again."""
    train_run = importlib.import_module("usaf.stages.train.run")  # the package binds run to the function

    qdir, tokens, _ = prepared("qwen3_moe")
    command = train(tmp_path, qdir, tokens, "--calib-samples", 4, "--train-from", 2, "--frac", 0.05)
    real_engine = train_run._engine

    def stopped_while_loading(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_run, "_engine", stopped_while_loading)
    first = invoke(*command)
    assert first.exit_code == 130, explain(first)
    assert "scoring now into" in first.stderr
    (run,) = runs(tmp_path)
    assert sorted(p.name for p in run.iterdir()) == ["plan", "run-settings.json"]

    monkeypatch.setattr(train_run, "_engine", real_engine)
    with ctrl_c_at_step(2):
        second = invoke(*command)
    assert second.exit_code == 130, explain(second)
    assert f"resuming the unfinished run {run}" in second.stderr and "scoring now" not in second.stderr

    third = invoke(*command)
    assert third.exit_code == 0, explain(third)
    assert f"resuming the unfinished run {run}" in third.stderr and "scoring now" not in third.stderr
    assert f"(step 2 of {STEPS})" in third.stderr
    assert runs(tmp_path) == [run] and (run / "manifest.json").is_file()


def test_stopped_while_scoring_on_the_fly_the_same_command_resumes_the_score(prepared, tmp_path, stop_scoring_at):
    """Stopped in the calibration pass of a plan scored on the fly (no --out): the same command finds the run by
    score's recorded settings and resumes the score there. Control: another --frac would score another plan, so
    it starts a new run and leaves the stopped score's work alone."""
    qdir, tokens, _ = prepared("qwen3_moe")
    command = train(tmp_path, qdir, tokens, "--calib-samples", 8, "--microbatch", 2, "--train-from", 2)
    stop_scoring_at(2)
    stopped = invoke(*command)
    assert stopped.exit_code == 130, explain(stopped)
    (run,) = runs(tmp_path)
    assert [p.name for p in run.iterdir()] == [".plan.usaf-partial"]

    stop_scoring_at(0)
    other = invoke(*command, "--frac", 0.05)
    assert other.exit_code == 0, explain(other)
    assert "resuming" not in other.stderr and (run / ".plan.usaf-partial").is_dir()

    resumed = invoke(*command)
    assert resumed.exit_code == 0, explain(resumed)
    assert f"resuming the unfinished run {run} (no --out given)" in resumed.stderr
    assert "1 of 4 calibration batches done" in resumed.stderr
    assert "scoring now into" not in resumed.stderr  # it said so before saying it resumed (found in review)
    assert "scoring now into" in stopped.stderr  # the control: the first start scores anew, and says so
    assert load_verified(run, RunManifest).summary.steps == STEPS and len(runs(tmp_path)) == 2


def test_stopped_after_scoring_on_the_fly_before_the_plan_s_rename_the_same_command_takes_the_plan(
    prepared, tmp_path, monkeypatch
):
    """Stopped between the plan's manifest and its rename (its bookkeeping gone): the same command without --out
    found no unfinished run there and started a new one, scoring again (found in review). It finds the run and moves
    the finished plan into place without scoring."""
    from usaf.artifacts.writer import ArtifactWriter
    from usaf.stages import score

    qdir, tokens, _ = prepared("qwen3_moe")
    command = train(tmp_path, qdir, tokens, "--calib-samples", 8, "--microbatch", 2, "--train-from", 2)
    with monkeypatch.context() as patched:
        patched.setattr(ArtifactWriter, "_move_into_place", lambda self: (_ for _ in ()).throw(KeyboardInterrupt))
        stopped = invoke(*command)
    assert stopped.exit_code == 130, explain(stopped)
    (run,) = runs(tmp_path)
    partial = run / ".plan.usaf-partial"
    assert [p.name for p in run.iterdir()] == [partial.name] and (partial / "manifest.json").is_file()

    monkeypatch.setattr(score, "_score", lambda *a, **k: pytest.fail("scored again"))
    resumed = invoke(*command)
    assert resumed.exit_code == 0, explain(resumed)
    said = " ".join(resumed.stderr.split())
    assert f"resuming the unfinished run {run} (no --out given)" in said and "had finished its plan" in said
    assert load_verified(run, RunManifest).summary.steps == STEPS and runs(tmp_path) == [run]


def test_stopped_while_scoring_on_the_fly_with_out_resumes_and_overwrite_replaces(prepared, tmp_path, stop_scoring_at):
    """With --out: the rerun resumes the stopped score inside RUN (it was refused as a directory usaf did not make
    before), and --overwrite may replace such a directory; killed before score's settings file was in place (only its
    temporary and a stale lock there), the rerun starts the score over in it. Control: a .plan.usaf-partial holding a
    file usaf does not write is not usaf's for sure, so that directory stays refused, with or without --overwrite."""
    qdir, tokens, _ = prepared("qwen3_moe")
    out = tmp_path / "out"
    command = [*train(tmp_path, qdir, tokens, "--calib-samples", 8, "--microbatch", 2, "--train-from", 2), "--out", out]
    stop_scoring_at(2)
    assert invoke(*command).exit_code == 130
    stop_scoring_at(0)
    resumed = invoke(*command)
    assert resumed.exit_code == 0, explain(resumed)
    assert "1 of 4 calibration batches done" in resumed.stderr and (out / "manifest.json").is_file()

    stop_scoring_at(2)
    again = tmp_path / "again"
    assert invoke(*command[:-1], again).exit_code == 130
    stop_scoring_at(0)
    replaced = invoke(*command[:-1], again, "--overwrite")
    assert replaced.exit_code == 0, explain(replaced)
    assert "calibration batches done" not in replaced.stderr and (again / "manifest.json").is_file()

    killed = tmp_path / "killed"  # before score's settings file was in place: only its temporary, and the lock
    (killed / ".plan.usaf-partial").mkdir(parents=True)
    (killed / ".plan.usaf-partial" / ".score-settings.json.usaf-tmp-999999999-0a1b2c3d").write_text("{")
    (killed / ".plan.usaf-lock").write_text("")
    alone = train(tmp_path / "empty", qdir, tokens, "--calib-samples", 8, "--microbatch", 2, "--train-from", 2)
    started = invoke(*alone, "--out", killed)  # a workspace without the plans above: it scores its own
    assert started.exit_code == 0, explain(started)
    assert (killed / "manifest.json").is_file()

    foreign = tmp_path / "foreign"
    (foreign / ".plan.usaf-partial").mkdir(parents=True)
    (foreign / ".plan.usaf-partial" / "notes.json").write_text(json.dumps({}))
    for extra in ((), ("--overwrite",)):
        refused = invoke(*command[:-1], foreign, *extra)
        assert refused.exit_code == 2 and "a directory usaf did not make" in refused.stderr
    assert (foreign / ".plan.usaf-partial" / "notes.json").is_file()


def test_resume_without_out_and_nothing_unfinished_is_one_clear_error(prepared, tmp_path):
    qdir, tokens, plan = prepared("qwen3_moe")
    result = invoke(*train(tmp_path, qdir, tokens, "--plan", plan), "--resume")
    assert result.exit_code == 2
    assert f"--resume: no interrupted run of this command in {tmp_path / 'run'}" in result.stderr
    assert not (tmp_path / "run").exists() or runs(tmp_path) == []


def test_refusals_name_the_setting_where_it_was_given(prepared, tmp_path):
    """``USAF_RESUME=1`` on a new --out was told to "drop --resume", and ``[train] frac`` of a --config file beside
    --plan to "drop --frac": flags never given (found in review). The setting is named where it came from; the flag
    itself is the control."""
    qdir, tokens, plan = prepared("qwen3_moe")
    base = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 2]
    result = invoke(*base, "--out", tmp_path / "new", env={"USAF_RESUME": "1"})
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "nothing to resume there (USAF_RESUME)" in said and "drop USAF_RESUME" in said
    result = invoke(*base, "--out", tmp_path / "new", "--resume")
    assert result.exit_code == 2 and "drop --resume to start a new run" in " ".join(result.stderr.split())
    config = tmp_path / "c.toml"
    config.write_text("[train]\nfrac = 0.01\n")
    result = invoke(*base, "--out", tmp_path / "new", "--config", config)
    assert result.exit_code == 2 and f"drop --config {config} [train] frac" in " ".join(result.stderr.split())
    result = invoke(*base, "--out", tmp_path / "new", "--frac", 0.01)
    assert result.exit_code == 2 and "hint: drop --frac," in result.stderr
    result = invoke(*base, "--out", tmp_path / "new", "--ram", "1KiB")  # a plan's --frac is refused: not offered
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "nothing fits" in said and "or a plan with a smaller --frac" in said, said


def test_stopped_while_scoring_on_the_fly_other_settings_are_refused_in_trains_words(prepared, tmp_path,
                                                                                      stop_scoring_at):
    """A rerun with other settings was refused as "--out RUN/plan: ... (--lr-test False there, True now)": a path and
    a flag the user never gave, whose --overwrite would discard the whole run (found in review). The control: the
    same command resumes (the test above)."""
    qdir, tokens, _ = prepared("qwen3_moe")
    out = tmp_path / "out"
    command = [*train(tmp_path, qdir, tokens, "--calib-samples", 8, "--microbatch", 2, "--train-from", 2), "--out", out]
    stop_scoring_at(2)
    assert invoke(*command).exit_code == 130
    stop_scoring_at(0)
    without_lr = [arg for i, arg in enumerate(command) if arg != "--lr" and command[i - 1] != "--lr"]
    refused = invoke(*without_lr)
    said = " ".join(refused.stderr.split())
    assert refused.exit_code == 2 and f"--out {out}: the run was stopped while scoring its plan" in said, said
    assert "--lr given there, none now" in said and "--lr-test" not in said and "True" not in said, said
    assert "--overwrite to start the run over" in said
