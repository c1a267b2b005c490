"""Reading what a run trained (`load_trained_change`) and applying it to a fresh engine (`apply_change`):
the applied engine reproduces the held-out loss the run itself reported."""

from __future__ import annotations

import shutil

import pytest
import torch

from helpers import invoke
from usaf.artifacts.run import load_trained_change
from usaf.errors import UsafError
from usaf.testing import stdlib_dir


@pytest.fixture(scope="module")
def finished_run(quantized, tmp_path_factory):
    root = tmp_path_factory.mktemp("change")
    qdir = quantized("qwen3_moe", num_layers=3, tokenizer=True)
    tokens, plan, run = root / "tokens", root / "plan", root / "run"
    steps = [
        ("tokenize", stdlib_dir() / "textwrap.py", stdlib_dir() / "shlex.py", "--model", qdir, "--seq-len", 32,
         "--held-out", "shlex.py", "--out", tokens),
        ("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--calib-samples", 8, "--train-from", 2,
         "--no-stability", "--out", plan),
        ("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", run, "--lr", 0.05, "--steps", 8,
         "--reselect-every", 4, "--save-every", 4, "--eval-data", tokens),
    ]  # fmt: skip
    for args in steps:
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    return qdir, tokens, run


def heldout_loss(qdir, tokens, change=None, *, layers=(2,), router=True) -> float:
    from usaf.data.batches import collate
    from usaf.data.dataset import TokenDataset
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model
    from usaf.families.targets import targets_of

    loaded = load_quantized_model(qdir, device=torch.device("cpu"), compute_dtype=torch.float32)
    targets = targets_of(change.deltas, loaded.spec) if change is not None else ("experts",)
    engine = SparseEngine(loaded, trainable_layers=list(layers), train_router=router, targets=targets)
    if change is not None:
        engine.apply_change(change)
    data = TokenDataset(tokens / "heldout.jsonl", vocab_size=512)
    total = count = 0.0
    with torch.no_grad():
        for start in range(0, len(data), 2):  # the run's microbatch (2), so padding matches
            batch = collate([data[i] for i in range(start, min(start + 2, len(data)))], 0)
            parts = engine.loss(batch.input_ids, batch.labels, batch.attention_mask)
            total += float(parts.ce) * parts.tokens
            count += parts.tokens
    return total / count


def test_applied_change_reproduces_the_runs_heldout_loss(finished_run):
    from usaf.artifacts import RunManifest, load_verified

    qdir, tokens, run = finished_run
    change = load_trained_change(run)
    reported = load_verified(run, RunManifest).summary.eval_losses[-1][1]
    assert change.trainable_layers == [2] and change.expert_entries > 0 and change.routers
    assert any(".self_attn." in name for name in change.deltas)  # the default targets: experts and attention
    assert heldout_loss(qdir, tokens, change) == pytest.approx(reported, abs=1e-5)
    # negative control: the untouched model does not reproduce it
    assert abs(heldout_loss(qdir, tokens) - reported) > 1e-3


def test_unfinished_run_and_single_checkpoint(finished_run, tmp_path):
    _, _, run = finished_run
    partial = tmp_path / "partial"
    shutil.copytree(run, partial)
    (partial / "manifest.json").unlink()
    change = load_trained_change(partial)  # the newest checkpoint: step 8
    assert change.source.name == "step-0000008"
    early = load_trained_change(partial / "checkpoints" / "step-0000004")
    assert early.source.name == "step-0000004"
    name = next(iter(change.deltas))
    assert not torch.equal(change.deltas[name][1], early.deltas[name][1])


def test_bad_run_directories(finished_run, tmp_path):
    _, tokens, run = finished_run
    with pytest.raises(UsafError, match="no such directory"):
        load_trained_change(tmp_path / "missing")
    with pytest.raises(UsafError, match="is a 'tokens' artifact"):
        load_trained_change(tokens)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsafError, match="not a usaf run"):
        load_trained_change(tmp_path / "empty")
    final = load_trained_change(run / "final")  # a finished run's final/: the run (a false error before)
    assert final.fingerprint == load_trained_change(run).fingerprint and final.source == run
    started = tmp_path / "started"  # a run that wrote its settings, no checkpoint yet: not "not a usaf run"
    started.mkdir()
    shutil.copy(run / "run-settings.json", started / "run-settings.json")
    with pytest.raises(UsafError, match="an unfinished usaf run with no checkpoint yet"):
        load_trained_change(started)
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged)
    (damaged / "manifest.json").unlink()
    newest = damaged / "checkpoints" / "step-0000008" / "deltas.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.raises(UsafError, match="unreadable checkpoint"):
        load_trained_change(damaged)


def _set_first_value(checkpoint, value: float) -> None:
    """Change one trained value of a checkpoint in place to a finite number: an edit every content check passes."""
    from safetensors.torch import load_file, save_file

    path = checkpoint / "deltas.safetensors"
    tensors = load_file(str(path))
    name = next(n for n in sorted(tensors) if n.endswith(".cumulative_values"))
    tensors[name][0] = value
    save_file(tensors, str(path))


def test_a_checkpoint_edited_in_place_is_refused_by_its_checksums(finished_run, tmp_path):
    """A byte changed in a checkpoint that still reads as finite numbers was taken by resume, eval and export (found
    in review). Each checkpoint records its files' sha256 (checksums.json), checked when it is read. Control: the
    same edit re-signed is read, with the edited value in it (so the checksums are what refused it)."""
    from usaf.testing.hostile import resign_checkpoint

    _, _, run = finished_run
    partial = tmp_path / "partial"
    shutil.copytree(run, partial)
    (partial / "manifest.json").unlink()
    newest = partial / "checkpoints" / "step-0000008"
    assert (newest / "checksums.json").is_file()
    _set_first_value(newest, 1.25)
    with pytest.raises(UsafError, match=r"step-0000008/deltas.safetensors: changed since usaf wrote it: its sha256"):
        load_trained_change(partial)
    resign_checkpoint(newest)
    change = load_trained_change(partial)
    assert any(float(values[0]) == 1.25 for _, values in change.deltas.values())


def _as_from_before_checksums(run):
    """A run as a usaf before checkpoint checksums left it: no checksums.json anywhere, no mark in state.json."""
    import json

    from usaf.artifacts.run import CHECKSUMMED

    for state in run.glob("**/state.json"):
        record = json.loads(state.read_text())
        del record[CHECKSUMMED]
        state.write_text(json.dumps(record))
    for sums in run.glob("**/checksums.json"):
        sums.unlink()


def test_a_checkpoint_of_a_usaf_from_before_checksums_is_read_without(finished_run, tmp_path):
    _, _, run = finished_run
    partial = tmp_path / "partial"
    shutil.copytree(run, partial)
    (partial / "manifest.json").unlink()
    _as_from_before_checksums(partial)
    assert load_trained_change(partial).source.name == "step-0000008"
    said = " ".join(invoke("inspect", partial / "checkpoints" / "step-0000008").output.split())
    assert "1 checkpoint of a usaf from before checksums, not checked" in said, said


def test_a_checkpoint_that_lost_its_checksums_is_refused_not_read_unchecked(finished_run, tmp_path):
    """A checkpoint without its checksums.json was read unchecked by resume, eval and export, as one from a usaf
    before the records (found in review). Its state.json says it had one, and so do its run's other checkpoints:
    either refuses it, from the CLI too. The control: the same run as a usaf before checksums left it is read."""
    import json

    from usaf.artifacts.run import CHECKSUMMED

    _, _, run = finished_run
    for alone in (False, True):  # beside checkpoints with theirs; alone, by its state.json's mark
        partial = tmp_path / f"partial-{alone}"
        shutil.copytree(run, partial)
        (partial / "manifest.json").unlink()
        if alone:
            shutil.rmtree(partial / "final")
            shutil.rmtree(partial / "checkpoints" / "step-0000004")
        else:  # the mark gone: the others' records alone say it lost its own
            state = partial / "checkpoints" / "step-0000008" / "state.json"
            state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items() if k != CHECKSUMMED}))
        newest = partial / "checkpoints" / "step-0000008"
        (newest / "checksums.json").unlink()
        with pytest.raises(UsafError, match=r"step-0000008/checksums.json: missing, so its files cannot be checked"):
            load_trained_change(partial)
        said = invoke("export", "--checkpoint", partial, "--out", tmp_path / f"x-{alone}")
        assert said.exit_code == 2 and "checksums.json: missing" in said.stderr, said.output
        said = invoke("inspect", newest)
        assert said.exit_code == 2 and "1 checkpoint file missing: checkpoints/step-0000008/checksums.json" in " ".join(
            said.stderr.split()
        ), said.output
        assert not (tmp_path / f"x-{alone}").exists()
    control = tmp_path / "older"
    shutil.copytree(run, control)
    (control / "manifest.json").unlink()
    _as_from_before_checksums(control)
    assert load_trained_change(control).source.name == "step-0000008"


def test_a_finished_runs_final_is_checked_by_its_checksums_too(finished_run, tmp_path):
    """final/ is listed in the run's manifest, whose hashes a read checks; with the manifest re-signed over an edit
    there, final/'s own checksums still refuse it."""
    from usaf.testing.hostile import _resign

    _, _, run = finished_run
    edited = tmp_path / "run"
    shutil.copytree(run, edited)
    _set_first_value(edited / "final", 1.25)
    _resign(edited)
    with pytest.raises(UsafError, match=r"final/deltas.safetensors: changed since usaf wrote it"):
        load_trained_change(edited)


def test_an_edited_checkpoint_is_refused_from_the_cli_and_a_resume_goes_on_from_an_intact_one(finished_run, tmp_path):
    """export names the file and the fix; moved out of the run (the hint), the run's next checkpoint is read."""
    qdir, _, run = finished_run
    partial = tmp_path / "partial"
    shutil.copytree(run, partial)
    (partial / "manifest.json").unlink()
    newest = partial / "checkpoints" / "step-0000008"
    _set_first_value(newest, -3.0)
    export = ("export", "--checkpoint", partial, "--model", qdir, "--format", "delta", "--out", tmp_path / "delta")
    result = invoke(*export)
    assert result.exit_code == 2, result.output
    assert "deltas.safetensors: changed since usaf wrote it" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "delta").exists()
    shutil.move(newest, tmp_path / "edited")
    result = invoke(*export)
    assert result.exit_code == 0, result.output


def test_inspect_verify_checks_a_runs_checkpoints_finished_or_not(finished_run, tmp_path):
    """A run's checkpoints are not in its manifest, and an unfinished run has none: ``inspect --verify`` said "not a
    usaf artifact" of one, and verified a finished one without them. Each is now checked against its checksums."""
    import json

    _, _, run = finished_run
    result = invoke("inspect", run, "--verify")
    assert result.exit_code == 0 and f"{run}: 2 checkpoints match their checksums" in result.stdout, result.output
    partial = tmp_path / "partial"
    shutil.copytree(run, partial)
    (partial / "manifest.json").unlink()
    result = invoke("inspect", partial, "--verify")
    assert result.exit_code == 0 and "2 checkpoints match their checksums" in result.stdout, result.output
    _set_first_value(partial / "checkpoints" / "step-0000004", 0.5)
    result = invoke("inspect", partial, "--verify")
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert "1 checkpoint file not as usaf wrote it" in said and "checkpoints/step-0000004/deltas.safetensors" in said
    assert "(the sha256 recorded differs: edited, or cut short)" in said, said
    report = json.loads(invoke("inspect", partial, "--verify", "--json").stdout)
    assert report["verified"] is False and report["checkpoints"] == [
        {"path": "checkpoints/step-0000004", "changed": ["deltas.safetensors"], "missing": []},
        {"path": "checkpoints/step-0000008", "changed": [], "missing": []},
    ]
    # a deleted file was "not as usaf wrote it", and a checkpoint whose checksums.json was deleted passed as "of a usaf
    # from before checksums" beside its run's others (found in review): each is missing
    lost = tmp_path / "lost"
    shutil.copytree(run, lost)
    (lost / "checkpoints" / "step-0000004" / "optimizer.pt").unlink()
    (lost / "checkpoints" / "step-0000008" / "checksums.json").unlink()
    result = invoke("inspect", lost, "--verify")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "2 checkpoint files missing: checkpoints/step-0000004/optimizer.pt, " \
        "checkpoints/step-0000008/checksums.json" in said and "not as usaf wrote" not in said, said
    report = json.loads(invoke("inspect", lost, "--verify", "--json").stdout)  # a deleted file was only "changed"
    assert [c["missing"] for c in report["checkpoints"]] == [["optimizer.pt"], ["checksums.json"]], report
    # a checkpoint without its state.json dropped out of the check, and the run verified clean (found in review)
    stateless = tmp_path / "stateless"
    shutil.copytree(run, stateless)
    (stateless / "checkpoints" / "step-0000004" / "state.json").unlink()
    for target in (stateless, stateless / "checkpoints" / "step-0000004"):
        result = invoke("inspect", target, *(["--verify"] if target == stateless else []))
        said = " ".join(result.stderr.split())
        assert result.exit_code == 2 and "1 checkpoint file missing: checkpoints/step-0000004/state.json" in said, said
    # final is checked against the run's manifest too: another checkpoint copied over it passed its own checksums, and
    # a lost final/checksums.json was "a usaf from before checksums" (found in review)
    copied = tmp_path / "copied"
    shutil.copytree(run, copied)
    shutil.rmtree(copied / "final")
    shutil.copytree(copied / "checkpoints" / "step-0000004", copied / "final")
    lost_sums = tmp_path / "lost-sums"
    shutil.copytree(run, lost_sums)
    (lost_sums / "final" / "checksums.json").unlink()
    lost_needle = "1 checkpoint file missing: final/checksums.json"
    for target, needle in ((copied, "not as usaf wrote them"), (lost_sums, lost_needle)):
        result = invoke("inspect", target / "final")
        said = " ".join(result.stderr.split())
        assert result.exit_code == 2 and needle in said, said
        # the hint names the intact checkpoint eval, export and generate take ("move the damaged checkpoints out of
        # the run" led nowhere; found in review), and it is not said first that they take final/
        newest = target / "checkpoints" / "step-0000008"
        assert f"hint: eval, export and generate take its newest intact checkpoint, --checkpoint {newest}" in said
        assert "take it as --checkpoint" not in result.stdout
        refused = invoke("export", "--checkpoint", target, "--out", tmp_path / "x")
        said = " ".join(refused.stderr.split())
        assert refused.exit_code == 2 and f"pass --checkpoint {newest} (step 8)" in said, said
    _set_first_value(copied / "checkpoints" / "step-0000008", 0.5)  # the control: the newest damaged too
    said = " ".join(invoke("inspect", copied / "final").stderr.split())
    assert f"--checkpoint {copied / 'checkpoints' / 'step-0000004'}" in said, said
    assert invoke("inspect", run / "final").exit_code == 0  # the control: the run's own final
    # a checkpoint copied out of its run: "eval, export and generate take it" was false, as they need its settings
    outside = tmp_path / "outside"
    shutil.copytree(run / "final", outside / "final")
    result = invoke("inspect", outside / "final")
    assert result.exit_code == 2 and "has no run-settings.json: eval, export and generate refuse it" in result.stderr
    # a finished run with a changed checkpoint: it said "verified" on stdout, then refused; its JSON listed no problem
    # and the checkpoints' files as unlisted (found in review)
    finished = tmp_path / "finished"
    shutil.copytree(run, finished)
    _set_first_value(finished / "checkpoints" / "step-0000004", 0.5)
    result = invoke("inspect", finished, "--verify")
    assert result.exit_code == 2 and "verified" not in result.stdout, result.output
    report = json.loads(invoke("inspect", finished, "--verify", "--json").stdout)
    assert report["verified"] is False and [p["path"] for p in report["problems"]] == [
        "checkpoints/step-0000004/deltas.safetensors"]  # fmt: skip
    assert not [f for f in report["unlisted"] if f.startswith("checkpoints/")], report["unlisted"]
    # its log and settings are named as the run's own, not as files the manifest fails to list (found in review);
    # the control: a file of the user's there still is one
    (finished / "notes.txt").write_text("mine\n")
    said = " ".join(invoke("inspect", run, "--verify").stderr.split()) + " | " + " ".join(
        invoke("inspect", finished, "--verify").stderr.split())  # fmt: skip
    assert "metrics.jsonl, run-settings.json: the run's own log, settings and working files" in said, said
    assert "1 file is not listed in the manifest (not covered by it): notes.txt" in said, said
    started = tmp_path / "started"
    started.mkdir()
    shutil.copy(run / "run-settings.json", started / "run-settings.json")
    result = invoke("inspect", started, "--verify")
    assert result.exit_code == 2 and "no checkpoint yet: nothing to verify" in " ".join(result.stderr.split())


def test_inspect_of_a_checkpoint_with_no_hash_checks_its_files_are_there_and_hashes_none(finished_run, tmp_path):
    """``inspect CHECKPOINT --no-hash`` hashed every file anyway and said "matches its checksums" (found in review):
    the flag was accepted and ignored. It now reads no file: an edit at the same size passes, said unhashed, and a
    missing file is still refused. The control: without --no-hash the same edit is refused, so nothing was hashed."""
    _, _, run = finished_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for checkpoint in (copy / "checkpoints" / "step-0000008", copy / "final"):
        _set_first_value(checkpoint, 1.25)
        unhashed = invoke("inspect", checkpoint, "--no-hash")
        said = " ".join(unhashed.stdout.split())
        assert unhashed.exit_code == 0 and "1 checkpoint with all its files, not hashed (--no-hash)" in said, said
        assert "checksums" not in said.split("--checkpoint", 1)[1]
        hashed = invoke("inspect", checkpoint)
        assert hashed.exit_code == 2 and "deltas.safetensors" in hashed.stderr, hashed.output
    (copy / "final" / "optimizer.pt").unlink()
    missing = invoke("inspect", copy / "final", "--no-hash")
    assert missing.exit_code == 2 and "1 checkpoint file missing: final/optimizer.pt" in missing.stderr, missing.output
