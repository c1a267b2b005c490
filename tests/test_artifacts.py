"""Artifacts: atomic writes, typed loading with clear errors, verification, workspace discovery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from helpers import invoke, leftovers
from usaf.artifacts import (
    ArtifactWriter,
    InputRecord,
    Manifest,
    TokensManifest,
    current_environment,
    default_output,
    load_manifest,
    load_verified,
    pick_latest,
    register,
    verify_files,
)
from usaf.artifacts.outputs import remove_usaf_made
from usaf.artifacts.tokens import TokenizerRecord, TokensSummary
from usaf.errors import UsafError


@register
class NoteManifest(Manifest):
    """A throwaway kind for these tests."""

    KIND = "test_note"
    SCHEMA_VERSION = 2
    summary: dict


def write_note(target: Path, text: str = "hello", *, origin: str = "a", overwrite: bool = False) -> NoteManifest:
    with ArtifactWriter(target, kinds=(NoteManifest.KIND,), overwrite=overwrite) as art:
        (art.dir / "note.txt").write_text(text)
        (art.dir / "sub").mkdir()
        (art.dir / "sub" / "more.bin").write_bytes(b"\x00\x01" * 100)
        return art.commit(
            NoteManifest,
            inputs=[InputRecord(role="origin", kind="files", path=origin, fingerprint=origin)],
            config={"text": text},
            environment=current_environment(),
            summary={"origin": origin},
        )


def test_commit_writes_files_then_manifest_and_records_hashes(tmp_path):
    target = tmp_path / "out"
    manifest = write_note(target)
    on_disk = json.loads((target / "manifest.json").read_text())
    assert on_disk["kind"] == "test_note" and on_disk["schema_version"] == 2
    assert [f["path"] for f in on_disk["files"]] == ["note.txt", "sub/more.bin"]
    assert manifest.file("sub/more.bin").bytes == 200
    assert all(c.ok for c in verify_files(target, manifest))
    assert leftovers(tmp_path) == []


def test_failure_inside_the_writer_leaves_nothing(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError), ArtifactWriter(target, kinds=(NoteManifest.KIND,)) as art:
        (art.dir / "half.txt").write_text("partial")
        raise RuntimeError("crash mid-write")
    assert not target.exists()
    assert leftovers(tmp_path) == []


def test_a_resumable_writer_stopped_before_its_first_file_leaves_nothing_and_one_with_work_keeps_it(tmp_path):
    """Ctrl-C as quantize began writing its first file left ``.q.usaf-partial`` holding only that temporary, after
    "nothing half-written was left behind", unlisted by usaf inspect (found in review). The control: work in it stays
    for the rerun to resume."""
    for first, kept in (("settings.json.usaf-tmp-1-0a1b2c3d", False), ("settings.json", True)):
        target = tmp_path / f"out-{kept}"
        writer = ArtifactWriter(target, kinds=(NoteManifest.KIND,), resumable=True)
        with pytest.raises(KeyboardInterrupt), writer as art:
            (art.dir / "layers").mkdir()
            (art.dir / first).write_text("{")
            raise KeyboardInterrupt
        assert ArtifactWriter.partial_dir(target).is_dir() is kept and not target.exists()


def test_existing_output_needs_overwrite_and_is_replaced_atomically(tmp_path):
    target = tmp_path / "out"
    write_note(target, "one")
    with pytest.raises(UsafError, match="already exists"):
        write_note(target, "two")
    assert (target / "note.txt").read_text() == "one"
    write_note(target, "two", overwrite=True)
    assert (target / "note.txt").read_text() == "two"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("how", ["overwrite", "remove"])
def test_a_users_directory_put_there_while_usaf_looked_is_never_deleted(tmp_path, monkeypatch, how):
    """Between the look at an output and the rename that sets it aside, another process may put a user's directory
    under that name: what is deleted must be what was checked. It was not before 2026-12-06 (found in review)."""
    from usaf.artifacts import outputs

    target = tmp_path / "out"
    write_note(target, "one")
    real = outputs.old_sibling

    def swapped_in_between(path: Path) -> Path:  # runs after the look, before the rename
        os.replace(target, tmp_path / "usafs")
        target.mkdir()
        (target / "thesis.tex").write_text("mine")
        return real(path)

    monkeypatch.setattr(outputs, "old_sibling", swapped_in_between)
    with pytest.raises(UsafError, match="usaf did not make"):
        write_note(target, "two", overwrite=True) if how == "overwrite" else remove_usaf_made(target, "--out")
    assert (target / "thesis.tex").read_text() == "mine"
    monkeypatch.setattr(outputs, "old_sibling", real)  # the control: the same call without the swap replaces it
    os.replace(target, tmp_path / "theirs")
    os.replace(tmp_path / "usafs", target)
    write_note(target, "two", overwrite=True) if how == "overwrite" else remove_usaf_made(target, "--out")
    assert (target / "note.txt").read_text() == "two" if how == "overwrite" else not target.exists()


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.usaf-tmp-{dead.stdout.strip()}-deadbeef"
    stale.mkdir()
    alive = tmp_path / f".out.usaf-tmp-{os.getpid()}-cafecafe"  # ours: must survive
    alive.mkdir()
    write_note(tmp_path / "out")
    assert not stale.exists() and alive.exists()


def test_stale_temporaries_of_other_outputs_beside_it_are_removed_under_their_lock(tmp_path):
    """A default output is named by its start time: a killed tokenize's temporary (GBs) was left for good, no later
    write having its name, while inspect said the next write of that name deletes it (found in review). A write
    removes the dead temporaries of the outputs beside it too, each under that output's lock. Controls: one whose
    output another process is writing (its lock held) stays, and so do a live process's and a replaced output's
    (.usaf-old: killed mid --overwrite, the only copy of what it replaced)."""
    from usaf.artifacts.lock import OutputLock

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = dead.stdout.strip()
    stale = tmp_path / f".20261207-090822-big.usaf-tmp-{pid}-deadbeef"
    held = tmp_path / f".busy.usaf-tmp-{pid}-deadbeef"
    alive = tmp_path / f".other.usaf-tmp-{os.getpid()}-cafecafe"
    replaced = tmp_path / f".older.usaf-old-{pid}-deadbeef"
    for path in (stale, held, alive, replaced):
        path.mkdir()
    with OutputLock(tmp_path / "busy"):  # in this process: the writer below would take its own lock, not this one
        write_note(tmp_path / "out")
    assert not stale.exists() and held.exists() and alive.exists() and replaced.exists()


def test_loader_errors_are_one_clear_line(tmp_path):
    with pytest.raises(UsafError, match="no such directory"):
        load_manifest(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsafError, match="not a usaf artifact"):
        load_manifest(tmp_path / "empty")
    target = tmp_path / "note"
    write_note(target)
    with pytest.raises(UsafError, match="is a 'test_note' artifact, expected 'tokens'"):
        load_manifest(target, TokensManifest, flag="--data")
    manifest_path = target / "manifest.json"
    good = manifest_path.read_text()
    data = json.loads(good)
    for version, hint in ((3, "upgrade usaf"), (1, "re-run the stage")):
        manifest_path.write_text(json.dumps({**data, "schema_version": version}))
        with pytest.raises(UsafError, match=f"schema version {version}, this usaf reads version 2") as e:
            load_manifest(target)
        assert hint in e.value.hint
    manifest_path.write_text(json.dumps({**data, "kind": "from_the_future"}))
    with pytest.raises(UsafError, match="unknown artifact kind 'from_the_future'") as e:
        load_manifest(target)
    # it told every edited kind to upgrade usaf (found in review): the hint names both causes and the version to check
    assert "else the file was edited" in e.value.hint and f"usaf_version {data['usaf_version']!r}" in e.value.hint
    manifest_path.write_text(json.dumps({**data, "fingerprint": 42}))
    with pytest.raises(UsafError, match="invalid manifest at 'fingerprint'"):
        load_manifest(target)
    manifest_path.write_text(good[: len(good) // 2])
    with pytest.raises(UsafError, match="unreadable manifest"):
        load_manifest(target)
    manifest_path.write_text(good)
    assert load_manifest(target).kind == "test_note"  # control: the original still loads


def test_verification_catches_truncation_and_modification(tmp_path):
    target = tmp_path / "note"
    write_note(target)
    assert load_verified(target, NoteManifest)  # control
    blob = target / "sub" / "more.bin"
    original = blob.read_bytes()
    blob.write_bytes(original[:-1])
    with pytest.raises(UsafError, match=r"sub/more.bin: 199 bytes, manifest says 200 \(truncated\?\)"):
        load_verified(target, NoteManifest)
    blob.write_bytes(original + b"x")  # grown: it was "truncated?" too (found in review)
    with pytest.raises(UsafError, match=r"sub/more.bin: 201 bytes, manifest says 200 \(modified: grown\)"):
        load_verified(target, NoteManifest)
    blob.write_bytes(b"\xff" + original[1:])  # same size, one byte flipped
    with pytest.raises(UsafError, match="sha256 differs"):
        load_verified(target, NoteManifest)
    assert load_verified(target, NoteManifest, hashes=False)  # size-only check cannot see a flipped byte
    blob.unlink()
    with pytest.raises(UsafError, match="sub/more.bin: missing"):
        load_verified(target, NoteManifest)


def test_hashing_an_output_and_checking_it_are_phases_of_bytes(tmp_path):
    """At a real model's size the commit's hashing and inspect's check took a minute or more in silence (found in
    review): each is a phase over the files' bytes, advanced as they are read. The checks' results and order are
    those without a progress (the control)."""
    from helpers import RecordingProgress

    target = tmp_path / "note"
    progress = RecordingProgress()
    with ArtifactWriter(target, kinds=(NoteManifest.KIND,)) as art:
        (art.dir / "note.txt").write_text("hello")
        (art.dir / "big.bin").write_bytes(b"\x01" * (3 << 20))  # several hashing blocks
        manifest = art.commit(NoteManifest, progress=progress, inputs=[], config={},
                              environment=current_environment(), summary={})  # fmt: skip
    total = 5 + (3 << 20)
    assert progress.events[0] == ("hashing the output", total, "bytes") and progress.events[-1] == "finish"
    advances = [amount for amount, _ in progress.events[1:-1]]
    assert sum(advances) == total and len(advances) >= 4
    (target / "note.txt").write_text("HELLO")  # same size, modified
    checking = RecordingProgress()
    checks = verify_files(target, manifest, progress=checking)
    assert checks == verify_files(target, manifest) and [c.ok for c in checks] == [True, False]
    assert checking.events[0] == ("checking sha256", total, "bytes")
    assert sum(amount for amount, _ in checking.events[1:-1]) == total


def test_inspect_prints_and_verifies(tmp_path):
    target = tmp_path / "note"
    write_note(target, origin="src-a")
    result = invoke("inspect", target)
    assert result.exit_code == 0, result.output
    assert "test_note artifact" in result.stdout and "note.txt" in result.stdout and "ok" in result.stdout
    result = invoke("inspect", target, "--json")
    data = json.loads(result.stdout)
    assert data["verified"] is True and data["manifest"]["summary"] == {"origin": "src-a"}
    (target / "note.txt").write_text("changed!")
    result = invoke("inspect", target, "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["verified"] is False
    assert "fail verification" in result.stderr and "note.txt" in result.stderr
    result = invoke("inspect", tmp_path / "nothing")
    assert result.exit_code == 2 and "no such file or directory" in result.stderr


def test_default_output_is_unique_and_in_the_workspace(tmp_path):
    now = datetime(2026, 1, 2, 3, 4, 5)
    first = default_output(tmp_path, "tokens", "My Corpus!", now=now)
    assert first == tmp_path / "tokens" / "20260102-030405-my-corpus"
    first.mkdir(parents=True)
    assert default_output(tmp_path, "tokens", "My Corpus!", now=now).name == "20260102-030405-my-corpus-2"
    # A label that is itself a default output's name does not stack timestamps.
    assert default_output(tmp_path, "plan", "20250101-000000-tiny-moe", now=now).name == "20260102-030405-tiny-moe"


def test_pick_latest_takes_the_newest_and_refuses_mixed_lineage(tmp_path):
    with pytest.raises(UsafError, match="no 'test_note' artifact in the workspace"):
        pick_latest(tmp_path, NoteManifest, flag="--note")
    write_note(tmp_path / "notes" / "old", origin="a")
    write_note(tmp_path / "new", origin="a")
    (tmp_path / "notes" / ".hidden.usaf-tmp-1-x").mkdir()  # temporaries are never candidates
    # Make the timestamps unambiguous.
    for name, delta in ((tmp_path / "notes" / "old", -60), (tmp_path / "new", 0)):
        path = name / "manifest.json"
        data = json.loads(path.read_text())
        data["created_at"] = (datetime.now(timezone.utc) + timedelta(seconds=delta)).isoformat()
        path.write_text(json.dumps(data))
    lineage = lambda m: m.summary["origin"]  # noqa: E731
    assert pick_latest(tmp_path, NoteManifest, flag="--note", lineage=lineage).path == (tmp_path / "new").resolve()
    write_note(tmp_path / "other", origin="b")
    with pytest.raises(UsafError, match="2 different origins") as e:
        pick_latest(tmp_path, NoteManifest, flag="--note", lineage=lineage)
    assert "--note" in e.value.hint
    # Without a lineage rule the newest wins regardless.
    assert pick_latest(tmp_path, NoteManifest, flag="--note").path == (tmp_path / "other").resolve()


def test_tokens_manifest_round_trips(tmp_path):
    summary = TokensSummary(
        tokenizer=TokenizerRecord(name_or_path="t", fingerprint="f", vocab_size=10, eos_token_id=0),
        seq_len=8,
        stride=0,
        train_sequences=1,
        heldout_sequences=0,
        train_tokens=8,
        heldout_tokens=0,
        train_loss_tokens=8,
        heldout_loss_tokens=0,
        documents=1,
        input_bytes=10,
        skipped_binary_files=0,
        skipped_empty_documents=0,
        relabelled_shifted_lines=0,
        heldout_sources=[],
        sources=[],
    )
    with ArtifactWriter(tmp_path / "tok", kinds=(TokensManifest.KIND,)) as art:
        (art.dir / "train.jsonl").write_text("{}\n")
        art.commit(TokensManifest, inputs=[], config={}, environment=current_environment(), summary=summary)
    assert load_verified(tmp_path / "tok", TokensManifest).summary == summary


def test_save_tensors_gives_the_umasks_mode_where_safetensors_gives_0600(tmp_path):
    import safetensors.torch
    import torch

    from usaf.artifacts.tensor_file import save_tensors

    tensors = {"w": torch.ones(3)}
    old = os.umask(0o027)
    try:
        save_tensors(tensors, tmp_path / "ours.safetensors")
        safetensors.torch.save_file(tensors, str(tmp_path / "raw.safetensors"))
        (tmp_path / "plain.json").write_text("{}")
    finally:
        os.umask(old)
    mode = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert mode["ours.safetensors"] == mode["plain.json"] == 0o640, mode
    # negative control: what the library alone does (safetensors >= 0.8: its temporary's 0600)
    assert mode["raw.safetensors"] in (0o600, 0o640), mode
