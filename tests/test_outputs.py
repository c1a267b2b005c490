"""Nothing a user owns is lost: an output is never an input, ``--overwrite`` replaces only what usaf made, links
are refused, and one process at a time writes an output (an OS lock naming its holder).

Each refusal is checked for its message (both paths, no ``--overwrite`` suggested where it would not help) and
for what it leaves: the input byte for byte as it was, no temporaries beside it. Negative controls: the same
commands on a new or an empty directory, or on usaf's own artifact with the flag, succeed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import invoke, leftovers
from helpers_trained import train_run
from usaf.artifacts.lock import OutputLock, lock_path
from usaf.artifacts.outputs import found_at, mark_usaf_made, remove_usaf_made
from usaf.errors import UsafError

SRC = str(Path(__file__).resolve().parents[1] / "src")


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (or ``root`` itself) -> its sha256: what 'left intact' is compared by."""
    root = Path(root)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.fixture(scope="module")
def ws(prepared, tmp_path_factory):
    """A quantized model, its tokens and plan, and a finished run (the inputs every command reads)."""
    qdir, tokens, plan = prepared("qwen3_moe")
    run = train_run(qdir, tokens, tmp_path_factory.mktemp("outputs-run"), steps=2, train_from=2)
    return {"model": qdir, "tokens": tokens, "plan": plan, "run": run}


def _user_dir(path: Path) -> Path:
    """A directory of the user's (no usaf manifest) with a file in it."""
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("my own work\n")
    return path


# -- an output that is, contains or lies inside an input ------------------------------------------------------


@pytest.mark.parametrize("flag", [[], ["--force"], ["--resume"]])
def test_quantize_out_is_its_model_is_refused_even_with_force(tiny_model, tmp_path, flag):
    """Without --force, a usaf-made model as its own --out was told to pass --resume or --force, both refused (found
    in review): the input is named first, whatever the flags."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model("qwen3_moe"), model)
    mark_usaf_made(model, "tiny model")  # as usaf tiny-model writes it: a usaf output, not only an input
    before = snapshot(model)
    result = invoke("quantize", model, "--method", "rtn", "--group-size", 8, "--out", model, *flag)
    assert result.exit_code == 2
    assert f"--out {model} is the input {model}:" in result.stderr, result.stderr
    assert "--force" not in result.stderr.split("(")[-1]  # the fix is another --out, never the flag
    assert snapshot(model) == before


def test_tokenize_out_containing_its_inputs_is_refused(ws, tmp_path):
    top = tmp_path / "project"
    top.mkdir()
    corpus = top / "x.py"
    corpus.write_text("x = 1\n" * 20)
    before = snapshot(top)
    result = invoke("tokenize", corpus, "--model", ws["model"], "--out", top, "--overwrite")
    assert result.exit_code == 2
    assert f"--out {top} contains the input {corpus}:" in result.stderr, result.stderr
    assert snapshot(top) == before and leftovers(tmp_path) == []


def test_a_default_output_inside_an_input_is_refused_as_the_workspaces(ws, tmp_path, monkeypatch):
    """``usaf tokenize .`` from inside the corpus: refused as "--out ... lies inside the input INPUTS .", a flag never
    given and a metavar for a name (found in review). The default output and the workspace are named. The control:
    with --workspace elsewhere, it is written there."""
    top = tmp_path / "project"
    top.mkdir()
    (top / "x.py").write_text("x = 1\n" * 20)
    monkeypatch.chdir(top)
    before = snapshot(top)
    result = invoke("tokenize", ".", "--model", ws["model"])
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and f"error: the default output {top / 'tokens'}/" in said, said
    assert "lies inside the input .: writing there would replace or mix with that input" in said
    assert "pass --out DIR outside every input, or --workspace DIR outside every input" in said
    assert "INPUTS" not in said and snapshot(top) == before
    elsewhere = invoke("tokenize", ".", "--model", ws["model"], "--workspace", tmp_path / "ws")
    assert elsewhere.exit_code == 0 and snapshot(top) == before, elsewhere.output


def test_train_out_inside_its_data_is_refused(ws, tmp_path):
    inside = Path(ws["tokens"]) / "run"
    result = invoke("train", "--model", ws["model"], "--data", ws["tokens"], "--plan", ws["plan"], "--steps", 1,
                    "--out", inside, "--overwrite")  # fmt: skip
    assert result.exit_code == 2
    assert f"--out {inside} lies inside the input --data {ws['tokens']}" in result.stderr, result.stderr
    assert not inside.exists()


def test_score_out_is_its_data_through_a_link_is_refused(ws, tmp_path):
    """Compared after resolving links: a link to the input is the input."""
    link = tmp_path / "link-to-tokens"
    link.symlink_to(ws["tokens"], target_is_directory=True)
    before = snapshot(ws["tokens"])
    result = invoke("score", "--model", ws["model"], "--data", ws["tokens"], "--out", link, "--overwrite",
                    "--calib-samples", 2, "--no-stability")  # fmt: skip
    assert result.exit_code == 2 and "is the input --data" in result.stderr, result.stderr
    assert snapshot(ws["tokens"]) == before


def test_export_out_is_its_model_is_refused(ws, tmp_path):
    before = snapshot(ws["model"])
    result = invoke("export", "--model", ws["model"], "--checkpoint", ws["run"], "--out", ws["model"], "--overwrite")
    assert result.exit_code == 2 and f"is the input --model {ws['model']}" in result.stderr, result.stderr
    assert snapshot(ws["model"]) == before


def test_eval_out_containing_its_run_is_refused(ws, tmp_path):
    parent = Path(ws["run"]).parent
    before = snapshot(ws["run"])
    result = invoke("eval", "--model", ws["model"], "--checkpoint", ws["run"], "--data", ws["tokens"],
                    "--out", parent, "--overwrite", "--no-plots")  # fmt: skip
    assert result.exit_code == 2 and f"contains the input --checkpoint {ws['run']}" in result.stderr, result.stderr
    assert snapshot(ws["run"]) == before


@pytest.mark.parametrize("command", ["score", "eval", "tokenize", "train"])
def test_an_out_inside_an_artifact_that_is_no_input_is_refused(ws, tmp_path, command):
    """`usaf score --out RUN/final/plan` wrote a plan into a finished run it did not read, which then held files its
    manifest did not list (found in review). Refused for every command, naming the artifact. Control: the same
    command with an --out beside the run passes this check (it fails later, or not at all, for its own reasons)."""
    run = tmp_path / "run"
    shutil.copytree(ws["run"], run)
    inside = run / "final" / "mine"
    before = snapshot(run)
    args = {
        "score": ["score", "--model", ws["model"], "--data", ws["tokens"], "--calib-samples", 2, "--no-stability"],
        "eval": ["eval", "--model", ws["model"], "--checkpoint", ws["run"], "--data", ws["tokens"], "--no-plots",
                 "--workspace", tmp_path / "ws"],  # its base-pass cache: not in the directory pytest runs in
        "tokenize": ["tokenize", Path(__file__), "--model", ws["model"]],
        "train": ["train", "--model", ws["model"], "--data", ws["tokens"], "--plan", ws["plan"], "--steps", 1],
    }[command]
    result = invoke(*args, "--out", inside)
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert f"--out {inside} lies inside {run}, a usaf run artifact" in said, said
    assert snapshot(run) == before and not inside.exists()
    beside = invoke(*args, "--out", tmp_path / "beside")
    assert "lies inside" not in beside.stderr, beside.output


# -- --overwrite replaces only what usaf made -------------------------------------------------------------------


@pytest.mark.parametrize("flag", [None, "--overwrite"])
def test_a_users_directory_is_never_replaced(ws, tmp_path, flag):
    mine = _user_dir(tmp_path / "mine")
    before = snapshot(mine)
    args = ["score", "--model", ws["model"], "--data", ws["tokens"], "--out", mine, "--calib-samples", 2,
            "--no-stability", *([flag] if flag else [])]  # fmt: skip
    result = invoke(*args)
    assert result.exit_code == 2 and "a directory usaf did not make" in result.stderr, result.stderr
    assert "notes.txt" in result.stderr and "or --overwrite to replace it" not in result.stderr
    assert snapshot(mine) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("stage", ["score", "quantize"])
@pytest.mark.parametrize("what", ["a directory", "a link"])
def test_what_sits_where_an_unfinished_run_keeps_its_work_is_never_taken_over(ws, tiny_model, tmp_path, stage, what):
    """Score and quantize keep an unfinished run's work in .OUT.usaf-partial and a rerun takes it over (writes into
    it, clears or deletes what is not its own). A user's directory of that name, or a link there to one, is not an
    interrupted run: refused, with --force too, and left as it was (score used to empty a linked directory)."""
    mine = _user_dir(tmp_path / "mine")
    (mine / "manifest-notes.txt").write_text("more of my work\n")
    out = tmp_path / "out"
    partial = tmp_path / ".out.usaf-partial"
    if what == "a link":
        partial.symlink_to(mine, target_is_directory=True)
    else:
        shutil.copytree(mine, partial)
    before = snapshot(mine), snapshot(partial)
    if stage == "score":
        args = ["score", "--model", ws["model"], "--data", ws["tokens"], "--calib-samples", 2, "--no-stability",
                "--out", out, "--overwrite"]  # fmt: skip
    else:
        args = ["quantize", tiny_model("qwen3_moe"), "--method", "rtn", "--group-size", 8, "--out", out, "--force"]
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    expected = "is a symbolic link" if what == "a link" else "none of what an interrupted usaf run leaves there"
    assert expected in result.stderr and ".out.usaf-partial" in result.stderr, result.stderr
    assert (snapshot(mine), snapshot(partial)) == before and not out.exists()


def test_a_link_where_the_lock_file_goes_is_not_written_through(ws, tmp_path):
    """The lock file is opened, truncated and written: a link there to a user's file would have been emptied."""
    precious = tmp_path / "precious.txt"
    precious.write_text("my own work\n")
    out = tmp_path / "out"
    lock_path(out).symlink_to(precious)
    result = invoke("score", "--model", ws["model"], "--data", ws["tokens"], "--calib-samples", 2, "--no-stability",
                    "--out", out)  # fmt: skip
    assert result.exit_code == 2 and "is a symbolic link" in result.stderr, result.output
    assert precious.read_text() == "my own work\n" and not out.exists()


def test_quantize_force_on_a_users_directory_is_refused(tiny_model, tmp_path):
    mine = _user_dir(tmp_path / "mine")
    result = invoke("quantize", tiny_model("qwen3_moe"), "--method", "rtn", "--group-size", 8, "--out", mine, "--force")
    assert result.exit_code == 2 and "usaf never replaces or deletes it, with or without --force" in result.stderr
    assert (mine / "notes.txt").read_text() == "my own work\n"


@pytest.mark.parametrize("flag", [[], ["--overwrite"]])
def test_train_on_a_users_directory_is_refused(ws, tmp_path, flag):
    mine = _user_dir(tmp_path / "mine")
    result = invoke("train", "--model", ws["model"], "--data", ws["tokens"], "--plan", ws["plan"], "--steps", 1,
                    "--out", mine, *flag)  # fmt: skip
    assert result.exit_code == 2 and "a directory usaf did not make" in result.stderr, result.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_demo_overwrite_refuses_a_users_directory_where_a_stage_writes(tmp_path):
    from usaf.stages.demo import paths

    workspace = tmp_path / "ws"
    target = next(iter(paths(workspace).values()))
    _user_dir(target)
    result = invoke("demo", "--workspace", workspace, "--overwrite")
    assert result.exit_code == 2 and "a directory usaf did not make" in result.stderr, result.stderr
    assert (target / "notes.txt").is_file()


def test_overwrite_replaces_usafs_own_artifact_and_an_empty_directory_is_used(ws, tmp_path):
    """Negative control: the refusals above are about whose directory it is, not about existing at all."""
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["score", "--model", ws["model"], "--data", ws["tokens"], "--calib-samples", 2, "--no-stability"]
    assert invoke(*args, "--out", empty).exit_code == 0 and (empty / "manifest.json").is_file()
    again = invoke(*args, "--out", empty)
    assert again.exit_code == 2 and "a usaf plan artifact already exists there" in again.stderr
    assert "--overwrite to replace it" in again.stderr
    assert invoke(*args, "--out", empty, "--overwrite").exit_code == 0
    assert leftovers(tmp_path) == []


def test_an_empty_directory_is_filled_where_it_is_keeping_its_mode_and_inode(ws, tmp_path):
    """An empty --out was replaced by a new directory at the end: a ``chmod 2770`` shared directory came back
    ``drwxr-xr-x`` and world-readable (found in review). It is filled in place now, and so is the usaf artifact
    there on --overwrite where it cannot be renamed (a mount point: EBUSY below, the rename's answer there). The
    control: a new --out is made as before."""
    from usaf.artifacts import in_place, outputs

    empty = tmp_path / "shared"
    empty.mkdir()
    empty.chmod(0o2770)
    before = empty.stat()
    args = ["score", "--model", ws["model"], "--data", ws["tokens"], "--calib-samples", 2, "--no-stability"]
    assert invoke(*args, "--out", empty).exit_code == 0 and (empty / "manifest.json").is_file()
    after = empty.stat()
    assert (after.st_ino, oct(after.st_mode)) == (before.st_ino, oct(before.st_mode))
    assert sorted(p.name for p in empty.iterdir()) == sorted(p.name for p in ws["plan"].iterdir())

    real_replace = os.replace

    def mount_point(src, dst, *a, **k):  # renaming the output itself fails as at a mount point
        if Path(src) == empty:
            raise OSError(16, "Device or resource busy", str(src))
        return real_replace(src, dst, *a, **k)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(outputs.os, "replace", mount_point)
        again = invoke(*args, "--seed", 1, "--out", empty, "--overwrite")
    assert again.exit_code == 0, again.output
    assert empty.stat().st_ino == before.st_ino and leftovers(tmp_path) == []
    assert outputs.found_at(empty).state == "usaf" and not (empty / outputs.FILLING_MARKER).exists()
    assert in_place.cannot_be_moved(OSError(16, "busy"), empty)
    assert not in_place.cannot_be_moved(OSError(13, "denied"), empty)  # the control: only a mount point's answer
    new = tmp_path / "new"
    assert invoke(*args, "--out", new).exit_code == 0 and (new / "manifest.json").is_file()


def test_a_fill_cut_short_reads_as_usafs_unfinished_output_and_is_replaced(ws, tmp_path):
    """A kill while the entries move in (or while a mount point's artifact is deleted in place) leaves the marker:
    the directory is usaf's unfinished output, which --overwrite replaces, not a user's directory refused for good.
    Across file systems entries are copied. The control: without the marker the same leftovers are a user's."""
    from usaf.artifacts import in_place, outputs

    empty = tmp_path / "out"
    empty.mkdir()
    args = ["score", "--model", ws["model"], "--data", ws["tokens"], "--calib-samples", 2, "--no-stability"]
    real_move = in_place._move
    moved = []

    def cut_after_one(src, dst):
        if moved:
            raise KeyboardInterrupt
        moved.append(dst)
        real_move(src, dst)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(in_place, "_move", cut_after_one)
        assert invoke(*args, "--out", empty).exit_code == 130
    assert len(moved) == 1 and not (empty / "manifest.json").exists()
    found = outputs.found_at(empty)
    assert (found.state, found.kind) == ("usaf", "plan"), found
    refused = invoke(*args, "--out", empty)
    assert refused.exit_code == 2 and "--overwrite to replace it" in refused.stderr, refused.output

    real_rename = os.rename

    def another_file_system(src, dst):
        if Path(dst).parent == empty:
            raise OSError(18, "Invalid cross-device link", str(src))
        return real_rename(src, dst)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(in_place.os, "rename", another_file_system)
        done = invoke(*args, "--out", empty, "--overwrite")
    assert done.exit_code == 0, done.output
    assert outputs.found_at(empty).kind == "plan" and not (empty / outputs.FILLING_MARKER).exists()
    assert invoke("inspect", empty).exit_code == 0 and leftovers(tmp_path) == []
    control = tmp_path / "control"
    control.mkdir()
    (control / "selection.safetensors").write_bytes(b"x")
    assert outputs.found_at(control).state == "foreign"


def test_an_out_name_with_no_room_for_usafs_files_beside_it_is_one_error(ws, tiny_model, tmp_path):
    """A legal --out name of 245 bytes ended with a traceback (``File name too long`` for its lock file), and one
    of 236 with "cannot create it" of a path that can be made (found in review): the room usaf needs beside an
    output is checked first, by every writer. The control: the longest name it allows is written."""
    from usaf.artifacts.outputs import SIBLING_EXTRA

    longest = os.pathconf(tmp_path, "PC_NAME_MAX") - SIBLING_EXTRA
    corpus = tmp_path / "x.py"
    corpus.write_text("x = 1\n" * 20)
    for args in (["tokenize", corpus, "--model", ws["model"]], ["quantize", tiny_model("qwen3_moe"), "--method", "rtn"],
                 ["score", "--model", ws["model"], "--data", ws["tokens"]], ["train", "--model", ws["model"], "--data",
                 ws["tokens"], "--plan", ws["plan"], "--steps", 1]):  # fmt: skip
        out = tmp_path / "outs" / ("d" * (longest + 1))
        result = invoke(*args, "--out", out)
        said = " ".join(result.stderr.split())
        assert result.exit_code == 2 and f"a name of {longest + 1} bytes;" in said, (args[0], result.output)
        assert f"give it a name of at most {longest} bytes" in said and "Traceback" not in result.output
        assert not (tmp_path / "outs").exists() or not list((tmp_path / "outs").iterdir())
    out = tmp_path / "outs" / ("d" * longest)
    assert invoke("tokenize", corpus, "--model", ws["model"], "--out", out).exit_code == 0
    assert (out / "manifest.json").is_file()


_ANOTHER_KIND = {  # command -> (the artifact of another kind put at its --out, its arguments but --out)
    "score": ("tokens", ["score", "--model", "{model}", "--data", "{tokens}", "--calib-samples", 2, "--no-stability",
                         "--overwrite"]),
    "train": ("plan", ["train", "--model", "{model}", "--data", "{tokens}", "--plan", "{plan}", "--steps", 1,
                       "--overwrite"]),
    "tokenize": ("plan", ["tokenize", "{corpus}", "--model", "{model}", "--overwrite"]),
    "quantize": ("tokens", ["quantize", "{source}", "--method", "rtn", "--group-size", 8, "--force"]),
    "export": ("tokens", ["export", "--model", "{model}", "--checkpoint", "{run}", "--overwrite"]),
    "eval": ("plan", ["eval", "--model", "{model}", "--checkpoint", "{run}", "--data", "{tokens}", "--no-plots",
                      "--overwrite"]),
}  # fmt: skip


@pytest.mark.parametrize("command", list(_ANOTHER_KIND))
def test_overwrite_never_replaces_another_commands_artifact(ws, tiny_model, tmp_path, command):
    """``usaf score --out TOKENS --overwrite`` replaced the tokens directory with a plan (found in review): the flag
    replaces only what the command itself writes there."""
    kind, args = _ANOTHER_KIND[command]
    other = tmp_path / f"a-{kind}"
    shutil.copytree(ws[kind], other)  # a copy: not an input of the command, so only its kind protects it
    corpus = tmp_path / "x.py"
    corpus.write_text("x = 1\n" * 20)
    places = {**ws, "corpus": corpus, "source": tiny_model("qwen3_moe")}
    before = snapshot(other)
    result = invoke(*[a.format(**places) if isinstance(a, str) else a for a in args], "--out", other)
    assert result.exit_code == 2, result.output
    assert f"--out {other}: a usaf {kind} artifact;" in result.stderr, result.stderr
    assert "replaces only what this command writes there" in result.stderr, result.stderr
    assert snapshot(other) == before and leftovers(tmp_path) == []
    # without the flag too, and the flag is never offered for it (it offered --overwrite, then refused it; review)
    flagless = [a for a in args if a not in ("--overwrite", "--force")]
    result = invoke(*[a.format(**places) if isinstance(a, str) else a for a in flagless], "--out", other)
    assert result.exit_code == 2 and "replaces only what this command writes there" in result.stderr, result.stderr
    assert "--overwrite" not in result.stderr and "--force" not in result.stderr and "--resume" not in result.stderr
    assert snapshot(other) == before and leftovers(tmp_path) == []


_OWN_KIND = {  # command -> (its own artifact put at its --out, its arguments but --out, the flag that replaces)
    "score": ("plan", ["score", "--model", "{model}", "--data", "{tokens}", "--calib-samples", 2, "--no-stability"],
              "--overwrite"),
    "train": ("run", ["train", "--model", "{model}", "--data", "{tokens}", "--plan", "{plan}", "--steps", 1],
              "--overwrite"),
    "tokenize": ("tokens", ["tokenize", "{corpus}", "--model", "{model}"], "--overwrite"),
    "quantize": ("model", ["quantize", "{source}", "--method", "rtn", "--group-size", 8], "--force"),
}  # fmt: skip


@pytest.mark.parametrize("command", list(_OWN_KIND))
def test_overwrite_never_deletes_files_a_user_added_to_a_usaf_artifact(ws, tiny_model, tmp_path, command):
    """A model card added to an export, notes in an eval report or a tokens directory: ``--overwrite`` deleted them
    with the artifact (found in review). Refused, naming them, before any work; the flag is not offered for it
    either. Control: with the file moved out, the flag replaces the artifact."""
    kind, args, flag = _OWN_KIND[command]
    own = tmp_path / f"a-{kind}"
    shutil.copytree(ws[kind], own)
    (own / "notes").mkdir()
    (own / "notes" / "README.md").write_text("my model card\n")
    corpus = tmp_path / "x.py"
    corpus.write_text("x = 1\n" * 20)
    places = {**ws, "corpus": corpus, "source": tiny_model("qwen3_moe")}
    args = [a.format(**places) if isinstance(a, str) else a for a in args]
    before = snapshot(own)
    for flags in ([flag], []):
        result = invoke(*args, *flags, "--out", own)
        assert result.exit_code == 2, result.output
        said = " ".join(result.stderr.split())
        assert f"--out {own}: a usaf" in said and "holding 1 file usaf did not write there (notes/README.md)" in said
        assert f"move them out of {own}" in said and snapshot(own) == before and leftovers(tmp_path) == []
    shutil.rmtree(own / "notes")
    replaced = invoke(*args, flag, "--out", own)
    assert replaced.exit_code == 0, replaced.output


def test_a_runs_own_prefix_spill_files_are_not_taken_for_a_users(ws, tmp_path):
    """train writes its prefix states beyond --prefix-cache-gib to RUN/prefix-cache.bin (a rank's under torchrun)
    until the run finishes: the first version of the check above counted them as a user's, and refused to start an
    interrupted run over (found in review). Control: a user's file beside them is still named."""
    run = tmp_path / "run"
    shutil.copytree(ws["run"], run)
    for name in ("prefix-cache.bin", "prefix-cache-rank1.bin"):
        (run / name).write_bytes(b"states")
    assert found_at(run).added == ()
    (run / "prefix-cache-mine.bin").write_bytes(b"mine")
    assert found_at(run).added == ("prefix-cache-mine.bin",)
    (run / "prefix-cache-mine.bin").unlink()
    replaced = invoke("train", "--model", ws["model"], "--data", ws["tokens"], "--plan", ws["plan"], "--steps", 1,
                      "--out", run, "--overwrite")  # fmt: skip
    assert replaced.exit_code == 0, replaced.output


def test_overwrite_replaces_export_in_its_other_format(ws, tmp_path):
    """Negative control of the test above: export's two formats are both its own."""
    out = tmp_path / "export"
    args = ["export", "--model", ws["model"], "--checkpoint", ws["run"], "--out", out]
    assert invoke(*args, "--format", "delta").exit_code == 0 and found_at(out).kind == "delta"
    replaced = invoke(*args, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert found_at(out).kind == "hf_export" and leftovers(tmp_path) == []


def test_train_overwrite_replaces_a_finished_run(ws, tmp_path):
    run = train_run(ws["model"], ws["tokens"], tmp_path, steps=2)
    again = invoke("train", "--model", ws["model"], "--data", ws["tokens"], "--plan", ws["plan"], "--steps", 1,
                   "--out", run)  # fmt: skip
    assert again.exit_code == 2 and "a finished run is there" in again.stderr
    replaced = invoke("train", "--model", ws["model"], "--data", ws["tokens"], "--plan", ws["plan"], "--steps", 1,
                      "--out", run, "--overwrite")  # fmt: skip
    assert replaced.exit_code == 0, replaced.output
    assert leftovers(tmp_path) == []


def test_train_overwrite_refuses_to_delete_the_plan_it_is_given_inside_the_run(ws, tmp_path):
    """``--plan RUN/plan --out RUN --overwrite`` (the plan a run scored on the fly, exempt from the never-an-input
    rule) deleted the run and the plan with it, then crashed with a traceback (found in review). Refused before
    anything is deleted; the control is the test above (--overwrite with a plan elsewhere replaces the run)."""
    run = tmp_path / "run"
    shutil.copytree(ws["run"], run)
    shutil.copytree(ws["plan"], run / "plan")
    before = snapshot(run)
    result = invoke("train", "--model", ws["model"], "--data", ws["tokens"], "--plan", run / "plan", "--steps", 1,
                    "--out", run, "--overwrite")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"--plan {run / 'plan'} lies inside --out {run}, which --overwrite deletes" in result.stderr, result.stderr
    assert snapshot(run) == before and leftovers(tmp_path) == []


def test_what_usaf_made_is_recognised(ws, tmp_path):
    assert found_at(ws["run"]).what == "a usaf run artifact"
    assert found_at(ws["plan"]).what == "a usaf plan artifact"
    unfinished = tmp_path / "unfinished"
    (unfinished / "checkpoints").mkdir(parents=True)
    (unfinished / "run-settings.json").write_text("{}")
    assert found_at(unfinished).state == "usaf"
    fake = _user_dir(tmp_path / "fake")
    (fake / "manifest.json").write_text('{"kind": "plan"}')  # not usaf's: no usaf_version
    assert found_at(fake).state == "foreign"
    with pytest.raises(UsafError, match="usaf did not make"):
        remove_usaf_made(fake, "--out")
    assert (fake / "notes.txt").is_file()


# -- links ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_out_is_refused_and_its_target_kept(ws, tmp_path, dangling):
    target = tmp_path / "target"
    if not dangling:
        args = ["score", "--model", ws["model"], "--data", ws["tokens"], "--calib-samples", 2, "--no-stability"]
        assert invoke(*args, "--out", target).exit_code == 0  # a usaf artifact behind the link
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    before = snapshot(target) if not dangling else {}
    result = invoke("score", "--model", ws["model"], "--data", ws["tokens"], "--calib-samples", 2, "--no-stability",
                    "--out", link, "--overwrite")  # fmt: skip
    assert result.exit_code == 2 and f"--out {link}: a symbolic link (to {target})" in result.stderr, result.stderr
    assert link.is_symlink() and (snapshot(target) == before if not dangling else not target.exists())
    assert leftovers(tmp_path) == []


# -- one writer per output ----------------------------------------------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import sys, time
    sys.argv = ["usaf", "train", "--out", sys.argv[1]]
    from usaf.artifacts.lock import OutputLock
    OutputLock(sys.argv[3]).acquire()
    print("held", flush=True)
    time.sleep(120)
    """
)


@pytest.fixture
def holder():
    """``holder(path)``: another process that holds ``path``'s output lock (killed at the end)."""
    procs = []

    def start(path: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": SRC})  # fmt: skip
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_second_train_on_the_same_out_is_refused_naming_the_holder(ws, tmp_path, holder):
    run = tmp_path / "run"
    proc = holder(run)
    result = invoke("train", "--model", ws["model"], "--data", ws["tokens"], "--plan", ws["plan"], "--steps", 1,
                    "--out", run)  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"--out {run}: another usaf process is writing it (PID {proc.pid}: usaf train --out {run})" in result.stderr
    assert not run.exists()


def test_a_second_quantize_on_the_same_out_is_refused(tiny_model, tmp_path, holder):
    out = tmp_path / "q"
    proc = holder(out)
    result = invoke("quantize", tiny_model("qwen3_moe"), "--method", "rtn", "--group-size", 8, "--out", out)
    assert result.exit_code == 2 and f"(PID {proc.pid}" in result.stderr, result.stderr
    assert not out.exists() and not (tmp_path / ".q.usaf-partial").exists()


def test_a_killed_holders_lock_is_stale_and_taken_over(ws, tmp_path, holder):
    out = tmp_path / "plan"
    proc = holder(out)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lock_path(out).is_file()  # left behind by the kill
    result = invoke("score", "--model", ws["model"], "--data", ws["tokens"], "--calib-samples", 2, "--no-stability",
                    "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert not lock_path(out).exists()  # released (and removed) at the end


def test_the_lock_is_released_on_an_error_and_in_process_writers_exclude_each_other(tmp_path):
    out = tmp_path / "x"
    first = OutputLock(out).acquire()
    with pytest.raises(UsafError, match=rf"another usaf process is writing it \(PID {os.getpid()}"):
        OutputLock(out).acquire()
    first.release()
    with pytest.raises(RuntimeError), OutputLock(out):
        raise RuntimeError("a stage failed")
    OutputLock(out).acquire().release()  # free again: released on the exception


def test_an_out_under_a_file_names_the_file(tmp_path):
    """``--out afile/sub`` said "cannot create its lock file .sub.usaf-lock: File exists" (found in review). Now the
    file in the way, at any depth; the control: the same path under a directory locks."""
    (tmp_path / "afile").write_text("data\n")
    for out in (tmp_path / "afile" / "sub", tmp_path / "afile" / "sub" / "deeper"):
        with pytest.raises(UsafError, match=f"--out {out}: {tmp_path / 'afile'}: a file, not a directory"):
            OutputLock(out).acquire()
    (tmp_path / "dlink").symlink_to(tmp_path / "nowhere")  # a link to nothing is said so, not called a file (review)
    with pytest.raises(UsafError, match=f"{tmp_path / 'dlink'}: a symbolic link to nothing"):
        OutputLock(tmp_path / "dlink" / "x").acquire()
    assert (tmp_path / "afile").read_text() == "data\n"
    OutputLock(tmp_path / "dir" / "sub" / "deeper").acquire().release()


def test_without_os_locks_the_pid_in_the_file_decides(tmp_path, monkeypatch):
    """On a file system without advisory locks: a live PID holds it, a dead one's lock is stale."""
    import errno

    from usaf.artifacts import lock as lock_module

    def no_locks(fd):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module, "_try_lock", no_locks)
    out = tmp_path / "x"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock_path(out).write_text(f'{{"pid": {sleeper.pid}, "command": "usaf quantize"}}')
        with pytest.raises(UsafError, match=rf"PID {sleeper.pid}: usaf quantize"):
            OutputLock(out).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()
    taken = OutputLock(out).acquire()  # its holder is gone: stale
    assert f'"pid": {os.getpid()}' in lock_path(out).read_text()
    taken.release()
    assert not lock_path(out).exists()


def test_eval_and_export_read_a_run_being_written(ws, tmp_path):
    """A run whose trainer holds its lock (no manifest yet): readers use its newest complete checkpoint."""
    run = tmp_path / "run"
    result = invoke("train", "--model", ws["model"], "--data", ws["tokens"], "--plan", ws["plan"], "--steps", 4,
                    "--save-every", 2, "--out", run, "--reselect-every", 0)  # fmt: skip
    assert result.exit_code == 0, result.output
    (run / "manifest.json").unlink()  # as while training: checkpoints on disk, the run not finished
    with OutputLock(run):
        report = invoke("eval", "--model", ws["model"], "--checkpoint", run, "--data", ws["tokens"],
                        "--out", tmp_path / "report", "--workspace", tmp_path, "--no-plots")  # fmt: skip
        assert report.exit_code == 0, report.output
        export = invoke("export", "--model", ws["model"], "--checkpoint", run, "--format", "delta",
                        "--out", tmp_path / "delta")  # fmt: skip
        assert export.exit_code == 0, export.output


def test_stale_replaced_outputs_of_dead_processes_are_cleared(ws, tmp_path):
    out = tmp_path / "plan"
    stale = tmp_path / ".plan.usaf-old-999999999-deadbeef"
    _user_dir(stale)  # what a kill between the two renames of a replacement leaves
    result = invoke("score", "--model", ws["model"], "--data", ws["tokens"], "--calib-samples", 2, "--no-stability",
                    "--out", out)  # fmt: skip
    assert result.exit_code == 0 and not stale.exists() and leftovers(tmp_path) == []


def test_train_scoring_on_the_fly_that_fails_leaves_no_run_directory(ws, tmp_path):
    run = tmp_path / "run"
    result = invoke("train", "--model", ws["model"], "--data", ws["tokens"], "--steps", 1, "--layers", 99,
                    "--workspace", tmp_path / "empty-workspace", "--out", run)  # fmt: skip
    assert result.exit_code == 2 and "99" in result.stderr, result.output
    assert not run.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("files", [[{"size": 1}], [["a", "b"]], [{"path": ["x"]}], [7, None]])
def test_an_edited_manifest_s_file_list_is_no_crash_where_an_output_is_looked_at(tmp_path, files):
    """The files a manifest lists decide what usaf wrote there (added_files): an edited list of another shape is
    answered as a listing of nothing (every file then counts as added), never a traceback. Control: a list of
    records names exactly the file it lacks."""
    import json

    out = tmp_path / "plan"
    out.mkdir()
    (out / "masks.safetensors").write_bytes(b"x")
    (out / "manifest.json").write_text(json.dumps({"kind": "plan", "usaf_version": "0", "files": files}))
    assert found_at(out).added == ("masks.safetensors",)
    listed = [{"path": "masks.safetensors", "size": 1}]
    (out / "manifest.json").write_text(json.dumps({"kind": "plan", "usaf_version": "0", "files": listed}))
    (out / "notes.txt").write_text("mine")
    assert found_at(out).added == ("notes.txt",)


def test_files_a_user_put_in_a_runs_checkpoints_plan_or_unfinished_final_are_named_not_deleted(ws, tmp_path):
    """A run's checkpoints/, on-the-fly plan/ and (unfinished) final/ counted as usaf's whole: ``--overwrite`` deleted
    notes put there (found in review). Only a checkpoint's own files and the plan's listed ones are usaf's now.
    Controls: the run's own files are never named, and a run without the notes is replaced."""
    run = tmp_path / "run"
    shutil.copytree(ws["run"], run)
    shutil.copytree(ws["plan"], run / "plan")  # where a run scores its plan on the fly
    assert found_at(run).added == ()
    step = next((run / "checkpoints").iterdir())
    notes = ["checkpoints/NOTES.md", f"checkpoints/{step.name}/extra/a.txt", "plan/NOTES.md"]
    for rel in notes:
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text("mine\n")
    assert found_at(run).added == tuple(sorted(notes))
    args = ["train", "--model", ws["model"], "--data", ws["tokens"], "--plan", ws["plan"], "--steps", 1, "--out", run]
    refused = invoke(*args, "--overwrite")
    assert refused.exit_code == 2 and "holding 3 files usaf did not write there" in " ".join(refused.stderr.split())
    assert all((run / rel).is_file() for rel in notes)

    (run / "manifest.json").unlink()  # unfinished: final/ is a checkpoint's, not the manifest's
    (run / "final" / "mine.txt").write_text("mine\n")
    assert found_at(run).added == tuple(sorted([*notes, "final/mine.txt"]))
    for rel in [*notes, "final/mine.txt"]:
        (run / rel).unlink()
    replaced = invoke(*args, "--overwrite")
    assert replaced.exit_code == 0, replaced.output


def test_a_checkpoint_written_again_keeps_the_files_a_user_put_in_it(tmp_path):
    """A resumed run writes the step of an incomplete checkpoint again, deleting the directory first: a user's file
    in it went with it (found in review). It is carried into the new checkpoint; the stale checkpoint files are not."""
    import torch

    from usaf.artifacts.run import Checkpoint, write_checkpoint

    step = tmp_path / "step-0000004"
    step.mkdir()
    (step / "mine.txt").write_text("mine\n")
    (step / "state.json").write_text("{}")  # a stale file of usaf's: replaced
    checkpoint = Checkpoint(deltas={}, routers={}, state={"step": 4}, optimizer={}, schedule={},
                            rng=torch.get_rng_state())  # fmt: skip
    write_checkpoint(step, checkpoint)
    assert (step / "mine.txt").read_text() == "mine\n"
    assert sorted(p.name for p in step.iterdir()) == sorted(["mine.txt", "deltas.safetensors", "routers.safetensors",
                                                             "optimizer.pt", "state.json",
                                                             "checksums.json"])  # fmt: skip
    assert (step / "state.json").read_text() != "{}"


def test_an_out_inside_an_unfinished_run_is_refused_but_its_own_plan_directory(ws, tmp_path):
    """``usaf train --out RUN/checkpoints/mine`` wrote a whole run inside an unfinished one, which --overwrite of the
    outer run then deleted (found in review). Refused now, as inside a finished artifact; ``RUN/plan``, where train
    scores the plan it was given none of, stays open (the control: a run scoring its plan on the fly finishes)."""
    run = tmp_path / "run"
    shutil.copytree(ws["run"], run)
    (run / "manifest.json").unlink()  # unfinished
    args = ["train", "--model", ws["model"], "--data", ws["tokens"], "--plan", ws["plan"], "--steps", 1]
    before = snapshot(run)
    for inside in (run / "checkpoints" / "mine", run / "inner"):
        result = invoke(*args, "--out", inside)
        said = " ".join(result.stderr.split())
        assert result.exit_code == 2 and f"--out {inside} lies inside {run}, an unfinished usaf run" in said, said
        assert snapshot(run) == before
    # RUN/plan is the run's own plan's alone: a user's score or export written there was deleted with the run by
    # train --overwrite (found in review)
    plan = run / "plan"
    for command in (["score", "--model", ws["model"], "--data", ws["tokens"], "--calib-samples", 4, "--no-lr-test"],
                    ["export", "--model", ws["model"], "--checkpoint", ws["run"]]):  # fmt: skip
        result = invoke(*command, "--out", plan)
        said = " ".join(result.stderr.split())
        assert result.exit_code == 2 and f"--out {plan} lies inside {run}, an unfinished usaf run" in said, said
        assert snapshot(run) == before
    fresh = tmp_path / "fresh"
    scored = invoke("train", "--model", ws["model"], "--data", ws["tokens"], "--steps", 2, "--calib-samples", 4,
                    "--lr", 1e-3, "--out", fresh)  # fmt: skip
    assert scored.exit_code == 0, scored.output
    assert (fresh / "plan" / "manifest.json").is_file()
    # inspect --verify named the plan's files "the run's own log and settings", five of them (found in review)
    said = " ".join(invoke("inspect", fresh, "--verify").stderr.split())
    assert "of the plan the run scored for itself (plan/" in said and "plan/manifest.json" not in said, said


def test_a_users_directory_is_named_with_both_marks_usaf_looks_for(tmp_path):
    """It said "no usaf manifest.json" of the --out of usaf tiny-model, which writes none (its mark is .usaf-made;
    found in review). The control: the same directory with the mark is usaf's."""
    found = found_at(_user_dir(tmp_path / "mine"))
    assert found.state == "foreign" and "no usaf manifest.json or .usaf-made marker" in found.what, found.what
    mark_usaf_made(tmp_path / "mine", "tiny model")
    assert found_at(tmp_path / "mine").state == "usaf"


def test_a_mount_points_artifact_is_looked_at_again_before_it_is_emptied(ws, tmp_path):
    """Emptied in place (a mount point), the artifact is checked again right before deletion, as the rename's path
    re-looks: a file a user put there after the first look is kept and refused, not deleted. The control: the test
    above replaces it when nothing was added."""
    from usaf.artifacts import outputs

    out = tmp_path / "mounted"
    args = ["score", "--model", ws["model"], "--data", ws["tokens"], "--calib-samples", 2, "--no-stability"]
    assert invoke(*args, "--out", out).exit_code == 0
    real_replace = os.replace

    def busy_after_a_user_adds_a_file(src, dst, *a, **k):
        if Path(src) == out:
            (out / "notes.txt").write_text("mine")  # added between the first look and the deletion
            raise OSError(16, "Device or resource busy", str(src))
        return real_replace(src, dst, *a, **k)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(outputs.os, "replace", busy_after_a_user_adds_a_file)
        refused = invoke(*args, "--seed", 1, "--out", out, "--overwrite")
    assert refused.exit_code == 2 and "usaf did not write there (notes.txt)" in refused.stderr, refused.output
    assert (out / "notes.txt").read_text() == "mine" and (out / "manifest.json").is_file()
