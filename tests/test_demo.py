"""`usaf demo`: the whole pipeline on the built-in model, through the CLI; a rerun reuses every stage."""

from __future__ import annotations

import json
import os

import pytest

from helpers import invoke


def test_quick_demo_runs_end_to_end_and_a_rerun_reuses_it(tmp_path):
    workspace = tmp_path / "demo"
    result = invoke("demo", "--quick", "--workspace", workspace)
    assert result.exit_code == 0, result.output
    for stage in ("tokenize", "quantize", "score", "train", "eval"):
        assert f"✓ {stage}" in result.stdout
    assert "before → after" in result.stdout and "The same, step by step:" in result.stdout
    assert "usaf train --model" in result.stdout and "--steps 20" in result.stdout
    assert (workspace / "eval_report" / "demo" / "report.json").is_file()
    assert (workspace / "cache").is_dir()  # the base-pass cache stays inside the demo's workspace
    assert "matched no file or directory" not in result.output  # 14 patterns of other Pythons were said (review)

    again = invoke("demo", "--quick", "--workspace", workspace, "--json")
    assert again.exit_code == 0, again.output
    assert again.stderr.count("reusing") == 5
    report = json.loads(again.stdout)
    groups = {g["group"]: g for g in report["outcomes"]}
    trained = groups["trained-on sources"]
    assert trained["tuned_ppl"] < trained["base_ppl"]  # the fine-tuning took on the data it saw
    assert set(groups) == {"trained-on sources", "held-out sources, same domain", "pretraining domain (forgetting)"}
    assert all(g["tokens"] > 0 for g in groups.values())

    # other settings on the same workspace: a stage made with others is not shown as this run's (it was, silently)
    before = (workspace / "run" / "demo" / "manifest.json").read_bytes()
    other = invoke("demo", "--quick", "--workspace", workspace, "--steps", 7)
    assert other.exit_code == 2 and "its train stage" in other.stderr and "steps 20 there, 7 now" in other.stderr
    assert "--overwrite" in other.stderr and (workspace / "run" / "demo" / "manifest.json").read_bytes() == before
    # the control: the same settings with the workspace spelled another way (relative) are the same demo
    relative = invoke("demo", "--quick", "--workspace", os.path.relpath(workspace))
    assert relative.exit_code == 0 and relative.stderr.count("reusing") == 5, relative.output
    assert f"report: {workspace / 'eval_report' / 'demo' / 'report.md'}" in " ".join(relative.stdout.split())
    # a demo of before 2026-12-07 recorded the exclude patterns of every Python: the same files, so reused (it was
    # refused as made with other settings); the control: a pattern that matches a file here is another setting
    from usaf.demo import DEMO_DOMAIN
    from usaf.testing.hostile import _resign

    tokens = workspace / "tokens" / "demo"
    kept = (tokens / "manifest.json").read_text()
    recorded = json.loads(kept)
    for exclude, reused in ((list(DEMO_DOMAIN.exclude), True), ([*recorded["config"]["exclude"], "message.py"], False)):
        (tokens / "manifest.json").write_text(json.dumps({**recorded, "config": {**recorded["config"],
                                                                                 "exclude": exclude}}))  # fmt: skip
        _resign(tokens)
        older = invoke("demo", "--quick", "--workspace", workspace)
        if reused:
            assert older.exit_code == 0 and older.stderr.count("reusing") == 5, older.output
        else:
            assert older.exit_code == 2 and "'message.py'] there, [" in older.stderr, older.output
    (tokens / "manifest.json").write_text(kept)
    # an edited stage's manifest is refused as any consumer refuses it: its edited numbers were shown (found in review)
    report = workspace / "eval_report" / "demo" / "manifest.json"
    data = json.loads(report.read_text())
    data["summary"]["max_logit_change"] = 99.0
    report.write_text(json.dumps(data))
    edited = invoke("demo", "--quick", "--workspace", workspace)
    assert edited.exit_code == 2 and "edited after usaf wrote it" in " ".join(edited.stderr.split()), edited.output


@pytest.mark.parametrize("quick", [False, True])
def test_the_demo_excludes_what_matches_here_and_selects_the_same_files_as_with_every_pattern(quick):
    """The demo's tokenize passed the exclude patterns of every Python from 3.10 to 3.13, and tokenize said each one
    that matched nothing here: every demo began with that note (found in review). The demo keeps those that match;
    the files are those the whole list selects, and what it dropped is what matched nothing (the control)."""
    from dataclasses import replace

    from usaf.data.corpus import discover
    from usaf.demo import DEMO_DOMAIN
    from usaf.settings.demo import DemoConfig
    from usaf.stages.demo import domain

    def walked(chosen):
        options = chosen.tokenize_options()
        return discover(options["inputs"], include=options["include"], exclude=options["exclude"], source_depth=0)

    kept = domain(DemoConfig(quick=quick))
    every = replace(kept, exclude=DEMO_DOMAIN.exclude)
    assert walked(kept).unmatched_patterns == []
    assert [f.path for f in walked(kept).files] == [f.path for f in walked(every).files]
    dropped = [f"--exclude {p}" for p in DEMO_DOMAIN.exclude if p not in kept.exclude]
    assert walked(every).unmatched_patterns == dropped


def test_overwrite_also_discards_an_interrupted_stages_saved_work(tmp_path, monkeypatch):
    """An interrupted score (or quantize) keeps its work in ``.NAME.usaf-partial``; a demo rerun with other settings
    would be refused by it, and the hint is --overwrite, so the demo's --overwrite discards it too. Control: a user's
    file in the workspace stays. The stages themselves are stubbed: what --overwrite removes is under test."""
    from usaf.settings.demo import DemoConfig
    from usaf.stages import demo

    workspace = tmp_path / "demo"
    plan = demo.paths(workspace)["plan"]
    partial = plan.parent / f".{plan.name}.usaf-partial"
    partial.mkdir(parents=True)
    (partial / "score-settings.json").write_text("{}")
    (partial / "score-calibration.pt").write_bytes(b"saved work")
    (workspace / "notes.txt").write_text("mine")
    tokens = demo.paths(workspace)["tokens"]
    unmarked = tokens.parent / f".{tokens.name}.usaf-partial"  # no stage's settings in it: not known to be usaf's
    unmarked.mkdir(parents=True)

    class Stopped(Exception):
        pass

    class Stage:
        @staticmethod
        def run(settings, progress):
            raise Stopped

    monkeypatch.setattr(demo.importlib, "import_module", lambda name: Stage)
    with pytest.raises(Stopped):
        demo.run(DemoConfig(workspace=workspace, quick=True))
    assert partial.is_dir(), "without --overwrite the saved work stays, for the rerun to resume"
    with pytest.raises(Stopped):
        demo.run(DemoConfig(workspace=workspace, quick=True, overwrite=True))
    assert not partial.exists() and (workspace / "notes.txt").read_text() == "mine"
    assert unmarked.is_dir()


def test_a_demo_stopped_under_overwrite_says_to_drop_it_to_resume(tmp_path, monkeypatch):
    """Ctrl-C in ``usaf demo --overwrite``: the stage said "run the same command to resume", and the same command's
    --overwrite discarded the saved work (found in review). The control: without --overwrite nothing more is said."""
    from usaf.settings.demo import DemoConfig
    from usaf.stages import demo
    from usaf.stages.progress import NullProgress

    class Stage:
        @staticmethod
        def run(settings, progress):
            raise KeyboardInterrupt

    class Notes(NullProgress):
        said: list[str] = []

        def note(self, message: str) -> None:
            self.said.append(message)

    monkeypatch.setattr(demo.importlib, "import_module", lambda name: Stage)
    for overwrite in (True, False):
        Notes.said = []
        with pytest.raises(KeyboardInterrupt):
            demo.run(DemoConfig(workspace=tmp_path / "demo", quick=True, overwrite=overwrite), progress=Notes())
        assert any("rerun without --overwrite to resume" in n for n in Notes.said) is overwrite, Notes.said


def test_a_stages_refusal_of_its_out_is_said_of_the_demo_s_workspace(tmp_path, monkeypatch):
    """An interrupted demo rerun with other --steps: "--out .../usaf-demo/run/demo: holds another run", a flag the
    demo does not take (found in review). The control: a refusal of anything else passes through as it is."""
    from usaf.errors import UsafError
    from usaf.settings.demo import DemoConfig
    from usaf.stages import demo

    workspace = tmp_path / "demo"
    refusal = []

    class Stage:
        @staticmethod
        def run(settings, progress):
            raise UsafError(*refusal)

    monkeypatch.setattr(demo.importlib, "import_module", lambda name: Stage)
    tokens = demo.paths(workspace)["tokens"]
    refusal[:] = [f"--out {tokens}: holds another run (other settings)", "another --out, or --overwrite to replace it"]
    with pytest.raises(UsafError) as e:
        demo.run(DemoConfig(workspace=workspace, quick=True))
    assert e.value.message == f"--workspace {workspace}: its tokenize stage ({tokens}): holds another run (other " \
                              "settings)" and e.value.hint == "another --workspace, or --overwrite to replace it"
    # another demo wrote the stage's output meanwhile: quantize's hint named --resume and --force (review)
    refusal[:] = [f"--out {tokens}: a usaf tokens artifact already exists there", "pass --resume to accept it, "
                  "--force to replace it"]  # fmt: skip
    with pytest.raises(UsafError) as e:
        demo.run(DemoConfig(workspace=workspace, quick=True))
    assert e.value.hint.startswith("rerun the demo: it reuses each finished stage there") and "--force" not in \
        e.value.hint  # fmt: skip
    refusal[:] = ["--model x: no such directory", "check the path"]
    with pytest.raises(UsafError) as e:
        demo.run(DemoConfig(workspace=workspace, quick=True))
    assert e.value.message == "--model x: no such directory"


def test_the_step_by_step_commands_name_the_workspace_in_full():
    """Every path of the printed commands was absolute but eval's --workspace, which a copy run elsewhere read as
    another workspace (found in review)."""
    from pathlib import Path

    from usaf.settings.demo import DemoConfig
    from usaf.stages import demo

    (_, eval_line), = [(name, line) for name, line in demo.commands(DemoConfig(workspace=Path("rel-demo")))
                       if name == "eval"]  # fmt: skip
    given = eval_line[eval_line.index("--workspace") + 1]
    assert Path(given).is_absolute() and Path(given).name == "rel-demo", eval_line


def test_quick_caps_the_steps_and_held_out_sequences_not_given():
    """--quick --steps 100 ran 20 steps in silence (found in review): a value given wins, the others are capped."""
    from usaf.config import resolve_config
    from usaf.settings.demo import DemoConfig
    from usaf.stages.demo import effective

    given = effective(resolve_config(DemoConfig, section="demo", cli={"quick": True, "steps": 100}, env={}))
    assert (given.steps, given.eval_sequences) == (100, 16)
    capped = effective(resolve_config(DemoConfig, section="demo", cli={"quick": True}, env={}))
    assert capped.steps == 20 and capped.eval_sequences == 16
    plain = resolve_config(DemoConfig, section="demo", cli={}, env={})
    assert effective(plain) == plain and plain.steps > 20  # control: without --quick nothing is capped


def test_a_stage_made_with_a_setting_not_given_now_is_not_reused(tmp_path, monkeypatch):
    """`usaf demo --frac 0.05` then `usaf demo` reused the 0.05 plan and run and showed their result as the default's:
    a setting not given now was not compared (found in review). The lr train takes from the plan's lr test is what an
    unset lr means (the control: a run of the plan's lr is reused)."""
    from types import SimpleNamespace

    from usaf.errors import UsafError
    from usaf.settings.score import ScoreConfig
    from usaf.settings.train import TrainConfig
    from usaf.stages import demo

    def step(name, **recorded):
        made = demo.DemoStep(name, [], tmp_path / name)
        made.manifest = SimpleNamespace(config=recorded)
        return made

    monkeypatch.setattr(demo, "_plan_lr", lambda plan: 1e-3)
    with pytest.raises(UsafError, match="frac 0.05 there, the default now"):
        demo._check_made_with("score", step("score", frac=0.05), ScoreConfig(), tmp_path, tmp_path / "plan")
    demo._check_made_with("score", step("score", frac=None), ScoreConfig(), tmp_path, tmp_path / "plan")
    with pytest.raises(UsafError, match="lr 0.5 there, 0.001 now"):
        demo._check_made_with("train", step("train", lr=0.5), TrainConfig(), tmp_path, tmp_path / "plan")
    demo._check_made_with("train", step("train", lr=1e-3), TrainConfig(), tmp_path, tmp_path / "plan")


class _Stopped(Exception):
    pass


@pytest.fixture
def finished_demo(tmp_path, monkeypatch):
    """A demo workspace whose tokenize, quantize and score stages are finished (manifests of their kinds) and whose
    stages, if any runs, raise ``_Stopped``: what the demo deletes or refuses before running is under test."""
    from usaf.stages import demo

    workspace = tmp_path / "demo"
    paths = demo.paths(workspace)
    for artifact, kind in (("tokens", "tokens"), ("quantized", "quantized_model"), ("plan", "plan")):
        paths[artifact].mkdir(parents=True)
        (paths[artifact] / "manifest.json").write_text(json.dumps({"kind": kind, "usaf_version": "0", "files": []}))

    class Stage:
        @staticmethod
        def run(settings, progress):
            raise _Stopped

    monkeypatch.setattr(demo.importlib, "import_module", lambda name: Stage)
    return workspace, paths


def test_what_a_later_stage_would_refuse_is_refused_before_overwrite_deletes_anything(finished_demo):
    """`usaf demo --overwrite` deleted the finished tokens, quantized model and plan, then refused the user's directory
    at run/demo (found in review); a bad --device the same, after tokenize had run again. Both are refused first,
    naming --workspace and --device. Control: with the user's directory gone, --overwrite deletes the stages."""
    from usaf.errors import UsafError
    from usaf.settings.demo import DemoConfig
    from usaf.stages import demo

    workspace, paths = finished_demo
    paths["run"].mkdir(parents=True)
    (paths["run"] / "notes.txt").write_text("mine")
    finished = [paths[name] / "manifest.json" for name in ("tokens", "quantized", "plan")]
    with pytest.raises(UsafError, match=r"--workspace .*: where the demo writes its run \(.*run/demo\) is a "
                       "directory usaf did not make") as refused:  # the stage's output, not the workspace (review)
        demo.run(DemoConfig(workspace=workspace, quick=True, overwrite=True))
    assert refused.value.hint.startswith(f"move {paths['run']} out of the workspace, or pass another --workspace")
    assert all(f.is_file() for f in finished) and (paths["run"] / "notes.txt").read_text() == "mine"

    (paths["run"] / "notes.txt").unlink()
    with pytest.raises(UsafError, match="--device foo"):
        demo.run(DemoConfig(workspace=workspace, quick=True, overwrite=True, device="foo"))
    assert all(f.is_file() for f in finished)

    with pytest.raises(_Stopped):  # control: nothing in the way, so the stages are deleted and the first runs
        demo.run(DemoConfig(workspace=workspace, quick=True, overwrite=True))
    assert not any(f.exists() for f in finished)


def test_a_workspace_that_is_a_file_and_a_file_at_a_stage_s_output_are_refused_before_any_stage_runs(
    finished_demo, tmp_path
):
    """A file as --workspace was named as a tokens --out the lock could not be made in, and a file at plan/demo was
    found after tokenize and quantize ran, as "pass another --out", a flag demo does not have (found in review)."""
    from usaf.errors import UsafError
    from usaf.settings.demo import DemoConfig
    from usaf.stages import demo

    afile = tmp_path / "config.json"
    afile.write_text("{}")
    for workspace, where in ((afile, "it"), (afile / "sub", str(afile))):
        with pytest.raises(UsafError, match=f"--workspace {workspace}: {where} is a file, not a directory"):
            demo.run(DemoConfig(workspace=workspace, quick=True))
    workspace, paths = finished_demo
    (paths["tokens"] / "manifest.json").unlink()  # a stage to run before the plan's
    paths["tokens"].rmdir()
    paths["run"].parent.mkdir()
    paths["run"].write_text("x")
    with pytest.raises(UsafError, match=r"--workspace .*: where the demo writes its run \(.*run/demo\) is a file, "
                       "not a directory") as refused:  # fmt: skip
        demo.run(DemoConfig(workspace=workspace, quick=True))
    assert refused.value.hint == f"move {paths['run']} out of the workspace, or pass another --workspace (a new " \
        "directory, or a demo workspace)"  # fmt: skip


def test_overwrite_refuses_a_stage_holding_a_file_usaf_did_not_write_before_deleting_any(finished_demo):
    """A file a user put into a finished stage's directory was deleted with it by --overwrite (found in review)."""
    from usaf.errors import UsafError
    from usaf.settings.demo import DemoConfig
    from usaf.stages import demo

    workspace, paths = finished_demo
    (paths["plan"] / "notes.md").write_text("mine")
    finished = [paths[name] / "manifest.json" for name in ("tokens", "quantized", "plan")]
    with pytest.raises(UsafError, match=r"plan/demo\) is a usaf plan artifact holding 1 file usaf did not write "
                       "there") as refused:  # fmt: skip
        demo.run(DemoConfig(workspace=workspace, quick=True, overwrite=True))
    assert refused.value.hint.startswith(f"move them out of {paths['plan']}")  # the refusal's own way on, kept
    assert all(f.is_file() for f in finished) and (paths["plan"] / "notes.md").read_text() == "mine"


def test_a_workspace_holding_a_users_artifacts_is_refused_before_any_stage_runs(tmp_path):
    """``usaf demo --workspace W`` wrote the demo's artifacts beside a user's in W, where they became the newest: a
    later command there without its inputs named took them or refused to choose (found in review). Refused before
    anything is written. The control: the same artifact moved to another workspace leaves W to the demo's tokenize."""
    from usaf.demo import demo_model_dir
    from usaf.testing import stdlib_dir

    workspace = tmp_path / "mine"
    made = invoke("tokenize", stdlib_dir() / "textwrap.py", "--model", demo_model_dir(), "--seq-len", 64,
                  "--workspace", workspace)  # fmt: skip
    assert made.exit_code == 0, made.output
    (theirs,) = (workspace / "tokens").iterdir()
    before = sorted(p.relative_to(workspace) for p in workspace.rglob("*"))
    refused = invoke("demo", "--quick", "--workspace", workspace)
    said = " ".join(refused.stderr.split())
    assert refused.exit_code == 2 and f"holds usaf artifacts that are not the demo's ({theirs})" in said, said
    assert "tokenize:" not in refused.output
    assert sorted(p.relative_to(workspace) for p in workspace.rglob("*")) == before
    theirs.rename(tmp_path / "moved")  # the control: the check passes W with the demo's own stages to come
    from usaf.settings.demo import DemoConfig
    from usaf.stages import demo

    demo._refuse_before_any_work(DemoConfig(quick=True, workspace=workspace), demo.paths(workspace))
