"""``usaf inspect WORKSPACE`` (usaf.stages.survey): what usaf left in a workspace, finished or not, and how each
unfinished thing goes on; ``usaf inspect`` of an unfinished run or of an interrupted output's path."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import ctrl_c_at_step, invoke, stop_at_check


@pytest.fixture(scope="module")
def workspace(prepared, tmp_path_factory):
    """A workspace holding a finished plan, a run stopped at step 2, a score stopped in its calibration pass, an eval
    stopped in its base pass, a killed write's temporary, and a user's own directory."""
    qdir, tokens, plan = prepared("qwen3_moe")
    ws = tmp_path_factory.mktemp("survey")
    with pytest.MonkeyPatch.context() as mp:
        with ctrl_c_at_step(2):
            stopped = invoke("train", "--model", qdir, "--data", tokens, "--plan", plan, "--workspace", ws,
                             "--steps", 6, "--save-every", 1, "--lr", 0.05)  # fmt: skip
        assert stopped.exit_code == 130, stopped.output
        stop_at_check(mp, 2)
        stopped = invoke("score", "--model", qdir, "--data", tokens, "--workspace", ws, "--frac", 0.05,
                         "--calib-samples", 8, "--train-from", 2, "--no-stability")  # fmt: skip
        assert stopped.exit_code == 130, stopped.output
        stop_at_check(mp, 2)
        stopped = invoke("eval", "--model", qdir, "--data", tokens, "--workspace", ws, "--microbatch", 2,
                         "--no-plots")  # fmt: skip
        assert stopped.exit_code == 130, stopped.output
    finished = invoke("score", "--model", qdir, "--data", tokens, "--out", ws / "plan" / "mine", "--frac", 0.05,
                      "--calib-samples", 8, "--train-from", 2, "--no-stability")  # fmt: skip
    assert finished.exit_code == 0, finished.output
    (ws / "plan" / f".gone.usaf-tmp-{2**22 + 7}-abcd1234").mkdir()  # a killed writer's temporary
    (ws / "notes").mkdir()
    (ws / "notes" / "todo.txt").write_text("mine")
    return ws


def surveyed(path: Path) -> list[dict]:
    result = invoke("inspect", path, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["entries"]


def test_a_workspace_lists_what_usaf_left_and_how_each_goes_on(workspace):
    entries = surveyed(workspace)
    by_state = {}
    for entry in entries:
        by_state.setdefault(entry["state"], []).append(entry)
    (run,) = by_state["unfinished run"]
    assert "newest checkpoint: step 2 of 6" in run["detail"] and "usaf train --out" in run["next"]
    (score,) = by_state["interrupted"]
    assert score["kind"] == "plan" and "usaf score kept the calibration pass" in score["detail"]
    assert Path(score["path"]).name.endswith(".usaf-partial") and "with --overwrite it starts over" in score["next"]
    (kept,) = by_state["kept eval pass"]
    assert kept["detail"] == "the base pass after 1 microbatch" and "resumes it" in kept["next"]
    (leftover,) = by_state["leftover"]
    assert "a killed write of gone" in leftover["detail"]
    assert {e["kind"] for e in by_state["finished"]} == {"plan"}
    assert all(e["bytes"] > 0 for e in entries if e["state"] != "leftover")
    assert not any("notes" in e["path"] for e in entries)  # the user's directory is not usaf's: not listed
    assert all(e["in_use"] is None for e in entries)
    text = invoke("inspect", workspace)
    assert text.exit_code == 0 and "what usaf left in" in text.stdout and "unfinished run" in text.stdout


def test_a_run_outside_the_workspaces_run_folder_is_not_said_to_be_found_without_out(workspace, tmp_path):
    """inspect told a run of --out run2 that its command, rerun without --out, finds it: train looks among
    WORKSPACE/run/ only, and started a new run (found in review). The control: the run in run/ is said to be found."""
    (run,) = [p for p in (workspace / "run").iterdir()]
    (entry,) = surveyed(run)
    assert "without --out it finds this run" in entry["next"], entry
    elsewhere = tmp_path / "run2"
    shutil.copytree(run, elsewhere)
    (entry,) = surveyed(elsewhere)
    assert "without --out" not in entry["next"] and "(with its --out)" in entry["next"], entry


def test_one_unfinished_run_or_interrupted_output_is_described_alone(workspace):
    (run,) = [p for p in (workspace / "run").iterdir()]
    (entry,) = surveyed(run)
    assert entry["state"] == "unfinished run" and entry["path"] == str(run)
    (partial,) = [p for p in (workspace / "plan").iterdir() if p.name.endswith(".usaf-partial")]
    target = partial.parent / partial.name[1 : -len(".usaf-partial")]
    assert not target.exists()
    (entry,) = surveyed(target)  # the output it resumes into, which does not exist yet
    assert entry["state"] == "interrupted" and entry["path"] == str(partial)


def test_a_quantize_killed_between_its_manifest_and_its_rename_is_seen(prepared, tmp_path):
    """Killed after its manifest was written, before the rename, a quantize left a whole model in its partial
    directory that inspect did not see ("no such file or directory"; found in review), though the rerun finishes it
    (the crash harness kills there, docs/RELIABILITY.md). Listed in the workspace too, alone (nothing else there)."""
    import shutil

    qdir, _, _ = prepared("qwen3_moe")
    target = tmp_path / "quantized_model" / "q"
    partial = target.parent / ".q.usaf-partial"
    shutil.copytree(qdir, partial)
    (entry,) = surveyed(target)
    assert entry["state"] == "interrupted" and entry["kind"] == "quantized_model", entry
    assert "only the rename into place is missing" in entry["detail"] and f"--out {target}" in entry["next"]
    assert [e["path"] for e in surveyed(tmp_path)] == [str(partial)]


def test_a_score_killed_between_its_manifest_and_its_rename_is_seen(prepared, tmp_path):
    """The same for score: unseen by inspect, and a run directory holding only such a plan partial was "a directory
    usaf did not make", which train could neither use nor replace (found in review)."""
    import shutil

    from usaf.artifacts.outputs import found_at

    _, _, plan = prepared("qwen3_moe")
    target = tmp_path / "plan" / "p"
    partial = target.parent / ".p.usaf-partial"
    shutil.copytree(plan, partial)
    (entry,) = surveyed(target)
    assert entry["state"] == "interrupted" and entry["kind"] == "plan" and "a rerun scores again" in entry["detail"]
    run = tmp_path / "run"
    shutil.copytree(plan, run / ".plan.usaf-partial")
    assert found_at(run).state == "usaf", found_at(run)


def test_a_directory_usaf_did_not_make_is_still_refused(workspace):
    """The control: nothing of usaf's in it, so inspect says what it always said."""
    result = invoke("inspect", workspace / "notes")
    assert result.exit_code == 2 and "not a usaf artifact" in result.output
    assert invoke("inspect", workspace / "nothing-here").exit_code == 2


def test_an_output_being_written_is_said_to_be_in_use(workspace, tmp_path):
    """A live process's lock (its PID in the lock file) marks the output in use; a dead one's is ignored."""
    from usaf.artifacts.lock import lock_path

    run = next((workspace / "run").iterdir())
    lock = lock_path(run)
    parent = os.getppid()  # alive, and not this process
    lock.write_text(json.dumps({"pid": parent, "command": "usaf train --steps 6"}))
    try:
        (entry,) = surveyed(run)
        assert entry["in_use"] == f"PID {parent}: usaf train --steps 6"
        # being trained: not "rerun the command that started it", which its lock refuses (found in review)
        assert entry["next"].startswith("being trained now") and "rerun the command that" not in entry["next"]
        lock.write_text(json.dumps({"pid": 2**22 + 7, "command": "usaf train"}))  # no such process
        (entry,) = surveyed(run)
        assert entry["in_use"] is None and entry["next"].startswith(f"usaf train --out {run} --resume")
    finally:
        lock.unlink()


def test_a_damaged_manifest_is_listed_and_named_where_a_stage_looks_for_its_kind(prepared, tmp_path):
    """A quantized model whose manifest.json was cut was left out of ``usaf inspect WORKSPACE``, and a stage that took
    the workspace's newest said there was none and to run quantize first (found in review). Listed as damaged, and
    named by the stage. Control: a web app's own manifest.json (no usaf fields) is still no usaf entry."""
    import shutil

    qdir, _, _ = prepared("qwen3_moe")
    model = tmp_path / "quantized_model" / "q"
    shutil.copytree(qdir, model)
    (model / "manifest.json").write_text('{"kind":')
    (tmp_path / "webapp").mkdir()
    (tmp_path / "webapp" / "manifest.json").write_text('{"name": "my app", "start_url": "/"}')
    (entry,) = surveyed(tmp_path)
    assert (entry["state"], entry["kind"], entry["path"]) == ("damaged", "quantized_model", str(model)), entry
    assert f"usaf inspect {model} says what is wrong" in entry["next"]
    # one directly in the workspace: its kind was the workspace's name (found in review); its place names none
    loose = tmp_path / "loose" / "qbad"
    shutil.copytree(model, loose)
    entries = {Path(e["path"]).name: e for e in surveyed(tmp_path / "loose")}
    assert (entries["qbad"]["state"], entries["qbad"]["kind"]) == ("damaged", "unknown"), entries
    shutil.rmtree(tmp_path / "loose")
    result = invoke("generate", "--workspace", tmp_path, "hello")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and f"{model} is one with a damaged manifest.json" in said, said
    assert f"usaf inspect {model} says what is wrong with it" in said


def test_inspect_of_a_manifest_file_names_its_directory(workspace):
    """``usaf inspect ARTIFACT/manifest.json`` answered "not a usaf artifact (no manifest.json)" (found in review)."""
    plan = workspace / "plan" / "mine"
    result = invoke("inspect", plan / "manifest.json")
    assert result.exit_code == 2 and f"hint: pass its directory, {plan}" in " ".join(result.stderr.split())
    assert invoke("inspect", plan).exit_code == 0  # the control


def test_an_output_whose_write_was_killed_is_described_by_its_path_and_its_temporary(tmp_path, tiny_model):
    """inspect OUT of a killed export said "no such file or directory" (inspect of the workspace listed its temporary),
    and inspect of the temporary described a model as if it were one (found in review). Both describe a killed write.
    The control: a path with nothing beside it is still "no such file"."""
    temporary = tmp_path / ".xk.usaf-tmp-999999999-deadbeef"
    shutil.copytree(tiny_model("qwen3_moe"), temporary)  # half an export: config.json and some shards
    for path in (tmp_path / "xk", temporary):
        (entry,) = surveyed(path)
        assert entry["state"] == "leftover" and "a killed write of xk" in entry["detail"], entry
    missing = invoke("inspect", tmp_path / "other")
    assert missing.exit_code == 2 and "no such file or directory" in missing.stderr


def test_a_tiny_model_usaf_wrote_is_listed_and_a_copy_of_a_model_is_not(tmp_path):
    """README: inspect lists every output usaf made in a workspace; a tiny-model's (the .usaf-made marker, which
    --overwrite takes as usaf's) was left out (found in review). The control: a model directory without the marker
    (someone else's) is not listed."""
    assert invoke("tiny-model", tmp_path / "t8").exit_code == 0
    shutil.copytree(tmp_path / "t8", tmp_path / "theirs")
    (tmp_path / "theirs" / ".usaf-made").unlink()
    (entry,) = surveyed(tmp_path)
    assert (Path(entry["path"]).name, entry["kind"], entry["state"]) == ("t8", "tiny model", "finished"), entry


def test_inspect_of_a_checkpoint_says_it_is_one_and_what_takes_it(workspace, tmp_path):
    """inspect RUN/checkpoints/step-N said "not a usaf artifact ... an interrupted run leaves none", misleading for a
    checkpoint eval --checkpoint takes (found in review); then refused it with exit 2, where eval, export and generate
    take it (review, 2026-12-07). It is described (step, losses) and checked against its checksums. The control: an
    empty directory keeps the general hint."""
    (run,) = [p for p in (workspace / "run").iterdir()]
    (step,) = sorted((run / "checkpoints").iterdir())[-1:]
    result = invoke("inspect", step)
    said = " ".join(result.stdout.split())
    assert result.exit_code == 0 and f"{step}: a checkpoint of the run {run}, at step " in said, result.output
    assert "take it as --checkpoint" in said and "1 checkpoint matches its checksums" in said
    assert ", the loss of step 1 " in said and "→" not in said  # single steps, not the run's trend (review)
    (step / "optimizer.pt").unlink()
    result = invoke("inspect", step)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and f"1 checkpoint file missing: checkpoints/{step.name}/optimizer.pt" in said, said
    (tmp_path / "empty").mkdir()
    control = invoke("inspect", tmp_path / "empty")
    assert control.exit_code == 2 and "a checkpoint of" not in control.stderr


def test_a_run_stopped_while_scoring_its_plan_is_not_told_to_resume_with_resume_alone(tmp_path):
    """``inspect`` advised ``usaf train --out RUN --resume (the settings it recorded)`` of a run stopped while scoring
    its own plan, which records no settings yet: that command was refused (found in review). The control: a run
    with its settings recorded is advised --resume."""
    run = tmp_path / "run" / "r1"
    (run / ".plan.usaf-partial").mkdir(parents=True)
    (run / ".plan.usaf-partial" / "score-settings.json").write_text("{}")
    said = " ".join(invoke("inspect", run).output.split())
    assert "rerun the command that started it" in said and "--resume alone has none to take" in said, said
    assert f"usaf train --out {run} --resume" not in said
    (run / "run-settings.json").write_text("{}")
    said = " ".join(invoke("inspect", run).output.split())
    assert f"usaf train --out {run} --resume (the settings it recorded)" in said, said
