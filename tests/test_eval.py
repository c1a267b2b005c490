"""``usaf eval``: base vs fine-tuned perplexity with bootstrap intervals, the base cache, routing drift,
the checkpoint-applied check and bad inputs — on one tiny run trained through the CLI."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from helpers import invoke, leftovers, stop_at_check
from usaf.artifacts.eval_report import ResultRow
from usaf.artifacts.hashing import sha256_file
from usaf.artifacts.run import run_settings_text
from usaf.testing import stdlib_dir
from usaf.testing.hostile import _resign, resign_checkpoint


def _rewrite_manifest(artifact: Path, manifest: dict) -> None:
    """A test's edit to a manifest, stamped with its new checksum (as a consistent edit would be)."""
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    _resign(artifact)


@pytest.fixture(scope="module")
def trained(quantized, tmp_path_factory):
    """A qwen3_moe run (layers 1-2 train their experts and attention, routers too) memorising textwrap.py; shlex.py
    held out."""
    root = tmp_path_factory.mktemp("eval")
    qdir = quantized("qwen3_moe", num_layers=3, tokenizer=True)
    tokens, plan, run = root / "tokens", root / "plan", root / "run"
    steps = [
        ("tokenize", stdlib_dir() / "textwrap.py", stdlib_dir() / "shlex.py", "--model", qdir, "--seq-len", 32,
         "--held-out", "shlex.py", "--out", tokens),
        ("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--calib-samples", 8, "--train-from", 1,
         "--targets", "experts,attention", "--no-stability", "--out", plan),
        ("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", run, "--lr", 0.05, "--router-lr", 0.01,
         "--steps", 16, "--reselect-every", 8, "--save-every", 8, "--eval-data", tokens),
    ]  # fmt: skip
    for args in steps:
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    return {"q": qdir, "tokens": tokens, "run": run, "workspace": root / "ws"}


@pytest.fixture(scope="module")
def report(trained):
    """The first eval of the finished run (it computes and caches the base pass)."""
    out = trained["workspace"] / "report"
    result = invoke(
        "eval", "--model", trained["q"], "--checkpoint", trained["run"], "--data", trained["tokens"],
        "--held-out", trained["tokens"], "--workspace", trained["workspace"], "--out", out, "--no-plots",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out, result, json.loads((out / "report.json").read_text())


def rows_by(report_json: dict) -> dict[tuple[str, str], dict]:
    """Rows by (set, source); a set's overall row is (set, "all")."""
    return {(r["set"], "all" if r["overall"] else r["source"]): r for r in report_json["rows"]}


def test_training_lowers_the_loss_on_its_data_with_an_interval_that_excludes_zero(trained, report):
    out, result, data = report
    rows = rows_by(data)
    assert set(rows) == {("data", "textwrap.py"), ("data", "all"), ("held-out", "shlex.py"), ("held-out", "all")}
    train = rows[("data", "all")]
    assert train["tuned"]["nll"] < train["base"]["nll"]
    assert train["delta"]["excludes_zero"] and train["delta"]["nll_ci"][1] < 0 and train["delta"]["ppl_ci"][1] < 0
    low, high = train["tuned"]["ppl_ci"]
    assert low <= train["tuned"]["ppl"] <= high
    # one source = its set: the same sequences, so the same resamples and the same interval
    assert rows[("data", "textwrap.py")]["delta"] == train["delta"]
    assert data["inputs"][0]["tokens"] == train["tokens"] and data["max_logit_change"] > 0
    assert "Δ PPL" in result.stdout and "routing drift" in result.stdout and "textwrap.py" in result.stdout
    md = (out / "report.md").read_text()
    assert "| data | textwrap.py |" in md and "## Routing drift" in md
    inspected = invoke("inspect", out, "--json")
    assert inspected.exit_code == 0, inspected.output
    manifest = json.loads(inspected.stdout)
    assert manifest["verified"] and manifest["manifest"]["kind"] == "eval_report"
    roles = {i["role"]: i for i in manifest["manifest"]["inputs"]}
    assert set(roles) == {"model", "checkpoint", "data", "held-out"}
    assert roles["data"]["fingerprint"] == json.loads((trained["tokens"] / "manifest.json").read_text())["fingerprint"]


def test_fine_tuned_heldout_nll_equals_the_runs_own_heldout_loss(trained, report):
    from usaf.artifacts import RunManifest, load_verified

    reported = load_verified(trained["run"], RunManifest).summary.eval_losses[-1][1]
    held = rows_by(report[2])[("held-out", "all")]
    assert held["tuned"]["nll"] == pytest.approx(reported, abs=1e-5)
    assert abs(held["base"]["nll"] - reported) > 1e-3  # negative control: the base model does not match


def test_routing_drift_only_above_the_frozen_layers(report):
    drift = {d["layer"]: d for d in report[2]["routing"]}
    assert set(drift) == {0, 1, 2}
    # layer 0 is below every trained weight: its inputs, hence its routing, cannot change
    assert drift[0]["changed_fraction"] == 0.0
    assert drift[0]["base_tokens_per_expert"] == drift[0]["tuned_tokens_per_expert"]
    assert drift[1]["changed_fraction"] > 0 and drift[2]["changed_fraction"] > 0
    tokens = report[2]["base_pass"]["input_tokens"]
    assert sum(drift[2]["base_tokens_per_expert"]) == 2 * tokens  # top-2 of every real token, no padding


def test_routing_capture_of_the_same_model_twice_does_not_drift(trained):
    from usaf.engine.loading import load_quantized_model
    from usaf.stages.eval.inputs import EvalSequence
    from usaf.stages.eval.passes import batches_of, run_pass
    from usaf.stages.eval.report import routing_drift
    from usaf.stages.progress import NullProgress

    loaded = load_quantized_model(trained["q"])
    lines = (trained["tokens"] / "heldout.jsonl").read_text().splitlines()[:12]
    seqs = [EvalSequence("held-out", "x", (o := json.loads(line))["input_ids"], o["labels"]) for line in lines]
    batches = batches_of(seqs, 5, 0)  # uneven batches: padding must not count
    first, second = (run_pass(loaded.model, loaded.experts, batches, device=torch.device("cpu"),
                              progress=NullProgress(), description="base") for _ in range(2))  # fmt: skip
    assert torch.equal(first.nll, second.nll)
    assert first.input_tokens == sum(len(s.input_ids) for s in seqs) == first.routing[0].shape[0]
    assert all(d.changed_fraction == 0.0 for d in routing_drift(first, second, {i: 4 for i in first.routing}))


def test_the_base_pass_is_cached_and_equals_a_fresh_one(trained, report):
    first = report[2]
    step8 = trained["run"] / "checkpoints" / "step-0000008"
    common = ("--model", trained["q"], "--data", trained["tokens"], "--held-out", trained["tokens"],
              "--workspace", trained["workspace"], "--no-plots")  # fmt: skip
    out = trained["workspace"] / "report-step8"
    result = invoke("eval", *common, "--checkpoint", step8, "--out", out)
    assert result.exit_code == 0, result.output
    cached = json.loads((out / "report.json").read_text())
    assert cached["base_cached"] and cached["base_cache"] == first["base_cache"] and not first["base_cached"]
    assert "reused from the cache" in result.stderr
    assert cached["checkpoint"] == str(step8)
    # the cached base pass keeps no states, so the fine-tuned one runs every layer: twice as long, unsaid before
    said = " ".join(result.stderr.split())
    assert "fine-tuned pass: runs every layer, not from layer 1: the base pass came from the cache" in said, said
    assert "runs every layer" not in report[1].stderr  # the control: the first eval's fresh base pass kept them
    fresh_out = trained["workspace"] / "report-fresh"
    # a fresh base pass, and with experts dequantized per forward instead of once: the same numbers, bit for bit
    result = invoke("eval", *common, "--checkpoint", step8, "--out", fresh_out, "--no-base-cache", "--streaming")
    assert result.exit_code == 0, result.output
    fresh = json.loads((fresh_out / "report.json").read_text())
    assert not fresh["base_cached"] and fresh["base_cache"] is None
    assert cached["experts_resident"] and not fresh["experts_resident"]
    for key in ("rows", "routing"):
        assert fresh[key] == cached[key]  # base numbers identical; tuned ones are the same checkpoint's
    assert [r["base"] for r in cached["rows"]] == [r["base"] for r in first["rows"]]
    assert [r["tuned"] for r in cached["rows"]] != [r["tuned"] for r in first["rows"]]  # another checkpoint


def test_the_fine_tuned_pass_starts_from_the_base_passs_prefix_states(trained, report, tmp_path, monkeypatch):
    """Layers below the first trained one are the base model's in both passes: the fine-tuned pass injects the
    states the base pass computed there. The same report as running every layer (forced by a zero RAM share)."""
    from usaf.stages.eval import passes

    _, result, reused = report  # the module's first eval: a fresh base pass, so the states were kept
    assert "fine-tuned pass: starts at layer 1 from the base pass's states" in result.stderr
    # its rate is of layers 1 up, and says so (the demo's fine-tuned pass looked twice as fast as the base model)
    assert "fine-tuned pass from layer 1 (below it, the base pass's states):" in " ".join(result.stdout.split())
    monkeypatch.setattr(passes, "PREFIX_RAM_SHARE", 0.0)
    out = tmp_path / "every-layer"
    result = invoke(
        "eval", "--model", trained["q"], "--checkpoint", trained["run"], "--data", trained["tokens"],
        "--held-out", trained["tokens"], "--workspace", tmp_path / "ws", "--out", out, "--no-plots",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "fine-tuned pass: runs every layer" in result.stderr and "starts at layer" not in result.stderr
    assert "; fine-tuned pass: " in result.stdout and "from layer" not in result.stdout
    full = json.loads((out / "report.json").read_text())
    assert (full["tuned_pass"]["first_layer"], reused["tuned_pass"]["first_layer"]) == (0, 1)
    for key in ("rows", "routing", "max_logit_change"):
        assert full[key] == reused[key], key


def _zeroed_change(run, tmp_path, qdir):
    """An unfinished copy of the run whose newest checkpoint changes nothing: zero deltas, base routers."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "zero-run"
    shutil.copytree(run, copy)
    (copy / "manifest.json").unlink()
    newest = sorted((copy / "checkpoints").iterdir())[-1]
    deltas = load_file(str(newest / "deltas.safetensors"))
    save_file({k: torch.zeros_like(v) if "values" in k else v for k, v in deltas.items()},
              str(newest / "deltas.safetensors"))  # fmt: skip
    routers = load_file(str(newest / "routers.safetensors"))
    for shard in qdir.glob("base-*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for name in routers:
                if name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    routers[name] = f.get_tensor(name).float()
    save_file(routers, str(newest / "routers.safetensors"))
    resign_checkpoint(newest)  # a consistent forgery: what eval's own check of the change sees
    return copy


def test_a_checkpoint_that_changes_nothing_is_refused(trained, tmp_path):
    zero = _zeroed_change(trained["run"], tmp_path, trained["q"])
    out = tmp_path / "report"
    result = invoke("eval", "--model", trained["q"], "--checkpoint", zero, "--held-out", trained["tokens"],
                    "--workspace", trained["workspace"], "--out", out)  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "changes nothing" in result.stderr and str(zero) in result.stderr
    assert not out.exists() and not leftovers(tmp_path)


def test_a_change_that_never_reaches_the_forward_is_caught(trained, tmp_path, monkeypatch):
    """The original tool's defect: the checkpoint was loaded but never applied; eval reported the base model."""
    from usaf.engine.engine import SparseEngine

    monkeypatch.setattr(SparseEngine, "apply_change", lambda self, change: None)
    out = tmp_path / "report"
    result = invoke("eval", "--model", trained["q"], "--checkpoint", trained["run"], "--held-out", trained["tokens"],
                    "--workspace", trained["workspace"], "--out", out)  # fmt: skip
    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split())  # rich wraps long lines
    assert "tokens unchanged although its deltas" in message and str(trained["run"]) in result.stderr
    assert not out.exists() and not leftovers(tmp_path)


def test_base_only_on_raw_text_reports_per_repository(trained, tmp_path):
    texts = tmp_path / "texts.jsonl"
    shlex_src = (stdlib_dir() / "shlex.py").read_text()
    cuts = [(0, 3000, "alpha"), (3000, 6000, "beta"), (6000, 9000, "alpha"), (9000, 10000, "all")]
    lines = [{"text": shlex_src[a:b], "repo": repo} for a, b, repo in cuts]
    texts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "report"
    result = invoke("eval", "--model", trained["q"], "--held-out", texts, "--held-out", stdlib_dir() / "textwrap.py",
                    "--seq-len", 64, "--workspace", tmp_path / "ws", "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads((out / "report.json").read_text())
    assert data["checkpoint"] is None and data["tuned_pass"] is None and "base model only" in result.stdout
    textwrap = str(stdlib_dir() / "textwrap.py")
    assert [(r["source"], r["overall"], r["input"]) for r in data["rows"]] == [
        ("all", False, str(texts)),  # a source named "all" stays a source
        ("alpha", False, str(texts)),
        ("beta", False, str(texts)),
        ("all", True, str(texts)),  # each input's total, then the set's
        ("textwrap.py", False, textwrap),
        ("all", True, textwrap),
        ("all", True, None),
    ]
    rows = {(r["set"], r["source"]): r for r in data["rows"] if not r["overall"]}
    assert all(r["tuned"] is None and r["delta"] is None for r in data["rows"])
    assert rows[("held-out", "alpha")]["sequences"] > rows[("held-out", "beta")]["sequences"]
    assert {i["kind"] for i in data["inputs"]} == {"text"}
    assert all(d["changed_fraction"] is None for d in data["routing"])
    md = (out / "report.md").read_text()
    assert "**base model only**" in md
    # what eval packed itself is named so, not "text": a chat JSONL was called text (found in review)
    assert f"--held-out `{texts}` (tokenized by eval)" in md and "(text)" not in md, md
    # one model's routing under its own headers, not "base → tuned" (found in review)
    assert "| layer | entropy | max share | dead experts |" in md and "base → tuned" not in md, md
    assert "- experts: dequantized" in md  # the pass ran here; the rerun below reads it from the cache
    again = invoke("eval", "--model", trained["q"], "--held-out", texts, "--held-out", stdlib_dir() / "textwrap.py",
                   "--seq-len", 64, "--workspace", tmp_path / "ws", "--out", tmp_path / "again")  # fmt: skip
    md = (tmp_path / "again" / "report.md").read_text()
    assert again.exit_code == 0 and "- base pass: reused from the cache" in md, again.output
    assert "- experts: none computed: no pass ran" in md and "dequantized per forward" not in md, md
    total = next(r for r in data["rows"] if r["overall"] and r["input"] is None)["base"]  # the table's last row
    shown = f"{total['ppl']:.2f} [{total['ppl_ci'][0]:.2f}, {total['ppl_ci'][1]:.2f}]"  # one precision (it was 2 and 3)
    assert shown in " ".join(result.stdout.replace("│", " ").split()), result.stdout


def test_a_table_of_many_sources_shows_the_largest_and_counts_the_rest(trained, tmp_path, monkeypatch):
    """A corpus of 137 sources printed about 400 lines of table before its total (found in review). The terminal's
    table shows an input's 12 largest sources and a row counting the rest; report.json keeps every one. The control:
    with room for all, no such row."""
    from usaf.cli import eval_

    texts = tmp_path / "texts.jsonl"
    shlex_src = (stdlib_dir() / "shlex.py").read_text()
    lines = [{"text": shlex_src[i * 400 : (i + 1) * 400 + 40 * i], "repo": f"repo{i:02d}"} for i in range(15)]
    texts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    common = ["eval", "--model", trained["q"], "--held-out", texts, "--seq-len", 64, "--no-plots",
              "--workspace", tmp_path / "ws"]  # fmt: skip
    result = invoke(*common, "--out", tmp_path / "report")
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "report" / "report.json").read_text())["rows"]
    sources = sorted((r for r in rows if not r["overall"]), key=lambda r: -r["tokens"])
    assert len(sources) == 15
    shown = " ".join(result.stdout.replace("│", " ").split())
    assert "… 3 more: report.md" in shown, result.stdout
    assert all(r["source"] in shown for r in sources[:12])
    monkeypatch.setattr(eval_, "SOURCES_SHOWN", 100)
    every = invoke(*common, "--out", tmp_path / "every")
    assert every.exit_code == 0 and "more: report.md" not in every.stdout, every.output


def test_held_out_sequences_the_run_trained_on_are_counted_and_said(trained, report, tmp_path):
    """Held-out text the run trained on (textwrap.py, packed as training packed it) is counted as such and warned
    about; the tokens' own held-out split is the control (none of it trained on)."""
    _, result, data = report
    assert data["heldout_in_training"] == 0 and data["overlap_note"] is None and "warning" not in result.stderr
    out = tmp_path / "memorised"
    text = stdlib_dir() / "textwrap.py"
    result = invoke("eval", "--model", trained["q"], "--checkpoint", trained["run"], "--seq-len", 32, "--no-plots",
                    "--held-out", text, "--workspace", tmp_path / "ws", "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads((out / "report.json").read_text())
    (held,) = [r for r in data["rows"] if r["overall"]]
    assert data["heldout_in_training"] == held["sequences"] > 0
    said = f"{held['sequences']} of the {held['sequences']} held-out sequences"
    assert said in " ".join(result.stderr.split()) and said in " ".join(result.stdout.split())
    assert "**warning**: " + said in (out / "report.md").read_text()
    # the same text packed at another length is not found: that 0 read as a clean result (found in review); said
    out = tmp_path / "repacked"
    result = invoke("eval", "--model", trained["q"], "--checkpoint", trained["run"], "--seq-len", 40, "--no-plots",
                    "--held-out", text, "--workspace", tmp_path / "ws", "--out", out)  # fmt: skip
    data = json.loads((out / "report.json").read_text())
    assert result.exit_code == 0 and data["heldout_in_training"] == 0, result.output
    assert f"the text eval packed itself ({text}) is found there only where it was packed as the training tokens " \
        "were" in data["overlap_note"] and "warning" not in result.stderr, data["overlap_note"]


def test_the_runs_training_tokens_are_found_by_fingerprint_and_not_claimed_when_gone(trained, tmp_path):
    from usaf.artifacts.run import load_trained_change
    from usaf.stages.eval.overlap import training_tokens

    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    manifest = json.loads((run / "manifest.json").read_text())
    for record in manifest["inputs"]:
        if record["role"] == "data":
            record["path"] = str(tmp_path / "moved" / "train.jsonl")
    _rewrite_manifest(run, manifest)
    found, why_not = training_tokens(load_trained_change(run), tmp_path / "empty-workspace")
    assert found is None and "are not in the workspace or where it ran" in why_not
    found, _ = training_tokens(load_trained_change(trained["run"]), tmp_path / "empty-workspace")  # the control
    assert found.path == trained["tokens"] / "train.jsonl"
    # a run given a tokens JSONL as --data: that file, known by its bytes' fingerprint
    from usaf.artifacts.hashing import sha256_file

    jsonl = tmp_path / "data.jsonl"
    shutil.copy(trained["tokens"] / "train.jsonl", jsonl)
    for record in manifest["inputs"]:
        if record["role"] == "data":
            record["path"] = str(jsonl)
    manifest["summary"]["data_fingerprint"] = sha256_file(jsonl)
    _rewrite_manifest(run, manifest)
    found, why_not = training_tokens(load_trained_change(run), tmp_path / "empty-workspace")
    assert (found.path, found.sequences, why_not) == (jsonl, None, None)
    # that file damaged since: the check is not made, and eval says why instead of failing on a file not passed
    from usaf.stages.eval import _held_out_in_training
    from usaf.stages.eval.inputs import EvalInput, EvalSequence
    from usaf.stages.progress import NullProgress

    jsonl.write_text(jsonl.read_text() + "{not json\n")
    manifest["summary"]["data_fingerprint"] = sha256_file(jsonl)
    _rewrite_manifest(run, manifest)
    held = [EvalInput("held-out", tmp_path / "x", "text", "", [EvalSequence("held-out", "x", [1, 2, 3], [1, 2, 3])])]
    progress = NullProgress()
    count, note, _ = _held_out_in_training(load_trained_change(run), tmp_path, held, 10**6, None, progress)
    assert count is None and "not checked against the run's training data" in note and "not valid JSON" in note
    assert note in progress.notes


def test_a_text_directory_skips_hidden_files_as_tokenize_does(trained, tmp_path):
    """A directory of raw text: a hidden file is left out and said so (as usaf tokenize); --all-files reads it."""
    texts = tmp_path / "texts"
    texts.mkdir()
    shutil.copy(stdlib_dir() / "shlex.py", texts / "shlex.py")
    shutil.copy(stdlib_dir() / "textwrap.py", texts / ".textwrap.py")
    sources = {}
    for extra in ((), ("--all-files",)):
        out = tmp_path / f"report{len(extra)}"
        result = invoke("eval", "--model", trained["q"], "--held-out", texts, "--seq-len", 64, "--no-plots",
                        "--workspace", tmp_path / "ws", "--out", out, *extra)  # fmt: skip
        assert result.exit_code == 0, result.output
        rows = json.loads((out / "report.json").read_text())["rows"]
        sources[extra] = {r["source"] for r in rows if not r["overall"]}
        said = "skipped under the directory inputs: 1 hidden (.textwrap.py)" in " ".join(result.stderr.split())
        assert said == (not extra)
    assert sources[()] == {"texts/shlex.py"} and sources[("--all-files",)] == {"texts/shlex.py", "texts/.textwrap.py"}


def test_raw_text_that_is_not_utf8_is_read_with_its_bad_bytes_replaced_and_said(trained, tmp_path):
    """Eval reads raw text as tokenize's --decode-errors replace does, and said nothing: the perplexity of a Latin-1
    file was reported as if it were the text (found in review). A note names the file, and no flag eval lacks.
    Control: the UTF-8 file beside it is not counted."""
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1") * 40)
    shutil.copy(stdlib_dir() / "shlex.py", texts / "shlex.py")
    result = invoke("eval", "--model", trained["q"], "--held-out", texts, "--seq-len", 64, "--no-plots",
                    "--workspace", tmp_path / "ws", "--out", tmp_path / "report")  # fmt: skip
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert "1 file not UTF-8, read with their undecodable bytes replaced by U+FFFD, e.g." in said
    assert "latin1.txt" in said and "--decode-errors" not in said


def test_each_held_out_input_gets_its_own_total(trained, report, tmp_path):
    """--held-out A --held-out B: one total per input, each equal to evaluating that input alone."""
    python = stdlib_dir() / "textwrap.py"  # raw text, the module the run memorised (its held-out one is shlex.py)
    q, run, workspace = trained["q"], trained["run"], trained["workspace"]
    common = ("--model", q, "--checkpoint", run, "--workspace", workspace, "--no-plots")
    text = ("--seq-len", 32)  # for the raw text only (refused when every input is tokenized)
    both = tmp_path / "both"
    result = invoke("eval", *common, "--held-out", trained["tokens"], "--held-out", python, *text, "--out", both)
    assert result.exit_code == 0, result.output
    rows = json.loads((both / "report.json").read_text())["rows"]
    totals = {r["input"]: r for r in rows if r["overall"]}
    assert list(totals) == [str(trained["tokens"]), str(python), None]
    alone = {}
    for path in (trained["tokens"], python):
        out = tmp_path / path.name
        result_alone = invoke("eval", *common, "--held-out", path, *(text if path == python else ()), "--out", out)
        assert result_alone.exit_code == 0, result_alone.output
        (alone[str(path)],) = [r for r in json.loads((out / "report.json").read_text())["rows"] if r["overall"]]
    for path, row in alone.items():
        mine = totals[path]
        assert (mine["sequences"], mine["tokens"]) == (row["sequences"], row["tokens"])
        assert mine["base"]["nll"] == pytest.approx(row["base"]["nll"], abs=1e-6)
        assert mine["tuned"]["nll"] == pytest.approx(row["tuned"]["nll"], abs=1e-6)
        # and the same interval: seeded by the input's own sequences, not by their positions after other inputs
        assert mine["delta"]["nll_ci"] == pytest.approx(row["delta"]["nll_ci"], abs=1e-9), (mine, row)
    # negative control: the two inputs score differently, and the pooled row is neither
    held, memorised, pooled = (totals[k]["tuned"]["nll"] for k in totals)
    assert held - memorised > 0.01 and memorised < pooled < held
    assert totals[None]["tokens"] == sum(r["tokens"] for r in alone.values())
    # each input here has one source, whose row its total repeats: report.json keeps the totals (above), the
    # tables leave them out and show the sources and the pooled row
    assert Counter(r["input"] for r in rows if not r["overall"]) == {str(trained["tokens"]): 1, str(python): 1}
    printed = " ".join(result.stdout.split())
    assert python.name in printed and "all inputs" in printed and "all: " not in printed
    md = (both / "report.md").read_text()
    assert f"| held-out | {python.name} |" in md and "| held-out | **all inputs** |" in md and "**all: " not in md


def test_tables_show_an_input_total_only_where_the_input_has_several_sources():
    from usaf.artifacts.eval_report import Estimate
    from usaf.stages.eval.report import row_label, shown_rows

    def row(source, path, overall=False):
        estimate = Estimate(nll=1.0, ppl=2.7, nll_ci=None, ppl_ci=None)
        return ResultRow(set="held-out", source=source, overall=overall, input=path, sequences=2, tokens=10,
                         base=estimate, tuned=None, delta=None)  # fmt: skip

    rows = [row("a.py", "one"), row("all", "one", True), row("b", "two"), row("c", "two"), row("all", "two", True),
            row("all", None, True)]  # fmt: skip
    shown = shown_rows(rows)
    assert [row_label(r, rows) for r in shown] == ["a.py", "b", "c", "all: two", "all inputs"]
    assert shown_rows(shown[1:]) == shown[1:]  # negative control: nothing more to drop
    # a set of one source: its total repeats that source's row too, and was shown (found in review)
    alone = [row("smtplib.py", "one"), row("all", "one", True), row("all", None, True)]
    assert [row_label(r, alone) for r in shown_rows(alone)] == ["smtplib.py"]


def test_plots_need_matplotlib(trained, report, tmp_path, monkeypatch):
    from usaf.stages.eval import plots

    monkeypatch.setattr(plots, "matplotlib_available", lambda: False)
    out = tmp_path / "report"
    args = ("eval", "--model", trained["q"], "--checkpoint", trained["run"], "--held-out", trained["tokens"],
            "--workspace", trained["workspace"], "--out", out)  # fmt: skip
    result = invoke(*args, "--plots")
    assert result.exit_code == 2 and "--plots: matplotlib is not installed" in result.stderr and not out.exists()
    result = invoke(*args)  # default: plots when possible, and a plain note when not
    assert result.exit_code == 0, result.output
    data = json.loads((out / "report.json").read_text())
    assert data["plots"] == [] and "matplotlib is not installed" in data["plots_note"]
    assert "pip install 'usaf[plot]'" in result.stderr


def test_plots_with_matplotlib(trained, report, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    result = invoke("eval", "--model", trained["q"], "--checkpoint", trained["run"], "--held-out", trained["tokens"],
                    "--workspace", trained["workspace"], "--out", out, "--plots")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads((out / "report.json").read_text())
    assert data["plots"] == ["plots/training_curves.png", "plots/expert_load.png"]
    for plot in data["plots"]:
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert invoke("inspect", out).exit_code == 0


def test_bad_inputs_name_the_file_and_leave_nothing(trained, tmp_path):
    q, tokens = trained["q"], trained["tokens"]
    foreign = tmp_path / "foreign-run"
    shutil.copytree(trained["run"], foreign)
    (foreign / "manifest.json").unlink()
    settings = json.loads((foreign / "run-settings.json").read_text())
    (foreign / "run-settings.json").write_text(run_settings_text({**settings, "model_fingerprint": "f" * 64}))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    long_line = tmp_path / "long.jsonl"
    long_line.write_text(json.dumps({"input_ids": [5] * 600, "labels": [5] * 600}) + "\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"text": "fine", "source": "a"}) + "\n{not json\n")
    model_fp = json.loads((q / "manifest.json").read_text())["fingerprint"]
    pretokenized, copy = tmp_path / "held.jsonl", tmp_path / "held-copy.jsonl"
    lines = (tokens / "heldout.jsonl").read_text().splitlines()[:4]
    for path in (pretokenized, copy):
        path.write_text("".join(json.dumps({"input_ids": json.loads(line)["input_ids"]}) + "\n" for line in lines))
    cases = [
        (("--checkpoint", foreign, "--held-out", tokens), [f"--checkpoint {foreign}", "f" * 16, model_fp[:16]]),
        (("--held-out", empty), [f"--held-out {empty}", "holds no sequences"]),
        (("--held-out", long_line), [f"{long_line}:1", "600 tokens", "context of 512"]),
        (("--held-out", broken), [f"{broken}:2", "not valid JSON"]),
        (("--data", stdlib_dir() / "shlex.py", "--seq-len", 1000), ["--seq-len 1000", "context of 512"]),
        (("--held-out", tmp_path / "missing"), [f"--held-out {tmp_path / 'missing'}", "no such file"]),
        (("--held-out", tokens, "--seq-len", 64, "--text-field", "body"), ["--seq-len, --text-field", "raw-text"]),
        (("--held-out", tokens, "--all-files"), ["--all-files", "raw-text"]),
        # raw text, but none of the kind the setting reads: accepted and unused before (found in review)
        (("--held-out", stdlib_dir() / "shlex.py", "--source-depth", 3), ["--source-depth 3", "is a directory"]),
        (("--held-out", stdlib_dir() / "shlex.py", "--text-field", "body"), ["--text-field body", "is a JSONL file"]),
        (("--held-out", tokens, "--bootstrap", 10**8), ["--bootstrap", "1000000"]),  # torch.quantile's limit is 2^24
        # one input twice: its sequences counted twice in the pooled row, its interval too narrow (found in review)
        (("--held-out", tokens, "--held-out", f"{tokens}/"), [f"--held-out {tokens}", "the same input given twice"]),
        # ... or a copy of it under another name (found in review)
        (("--held-out", pretokenized, "--held-out", copy), [f"--held-out {pretokenized} and {copy}",
                                                            "the same sequences (one fingerprint)"]),  # fmt: skip
    ]
    for args, expected in cases:
        out = tmp_path / "out"
        result = invoke("eval", "--model", q, *args, "--workspace", tmp_path / "ws", "--out", out)
        assert result.exit_code == 2, (args, result.output)
        message = " ".join(result.stderr.split())  # rich wraps long lines
        assert all(e in message for e in expected), (expected, result.stderr)
        assert not out.exists() and not leftovers(tmp_path), args


def test_checkpoint_alone_finds_the_model_it_was_trained_on(trained, tmp_path):
    workspace = tmp_path / "ws"
    shutil.copytree(trained["q"], workspace / "quantized_model" / "q")
    out = tmp_path / "report"
    result = invoke("eval", "--checkpoint", trained["run"], "--held-out", trained["tokens"], "--max-sequences", 8,
                    "--workspace", workspace, "--out", out, "--no-plots")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "the one --checkpoint was trained on" in result.stderr
    data = json.loads((out / "report.json").read_text())
    assert data["inputs"][0]["sequences"] == 8 and data["rows"][-1]["sequences"] == 8


def test_bootstrap_is_seeded_ratio_of_sums_and_paired():
    from usaf.stages.eval.stats import bootstrap_row

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(50, 200, (200,), generator=g)
    difficulty = 2 + 4 * torch.rand(200, generator=g)  # nats/token, varying a lot between sequences
    base = difficulty * tokens
    tuned = (difficulty - 0.05 + 0.01 * torch.randn(200, generator=g)) * tokens  # a small, consistent gain
    a = bootstrap_row(base, tuned, tokens, samples=1000, seed=3)
    assert a == bootstrap_row(base, tuned, tokens, samples=1000, seed=3)
    assert a != bootstrap_row(base, tuned, tokens, samples=1000, seed=4)
    assert a.base_nll == pytest.approx(float(base.sum() / tokens.sum())) and a.tokens == int(tokens.sum())
    assert a.base_ci[0] < a.base_nll < a.base_ci[1] and a.delta_ci[1] < 0
    # pairing cancels the shared difficulty: the difference is known far better than either model's NLL
    assert a.delta_ci[1] - a.delta_ci[0] < 0.1 * (a.base_ci[1] - a.base_ci[0])
    single = bootstrap_row(base[:1], tuned[:1], tokens[:1], samples=1000, seed=3)
    assert single.base_ci is None and single.delta_ci is None and single.delta_nll < 0


def test_workspace_tokens_without_a_held_out_split_are_named_as_training_text(trained, tmp_path):
    """No --data/--held-out: tokens with a held-out split give both sets; tokens without one give the training set
    and a note saying the figures measure the fit to it (negative control: the split's tokens get no such note)."""
    from usaf.data.tokenizer import load_tokenizer, tokenizer_fingerprint
    from usaf.stages.eval.resolve import default_tokens
    from usaf.stages.progress import NullProgress

    fingerprint = tokenizer_fingerprint(load_tokenizer(str(trained["q"]), flag="--model"))
    with_split = tmp_path / "with-split"
    shutil.copytree(trained["tokens"], with_split / "tokens")
    progress = NullProgress()
    assert default_tokens(with_split, None, fingerprint, progress) == ([with_split / "tokens"],) * 2
    assert not any("no held-out split" in n for n in progress.notes)

    without = tmp_path / "without-split"
    result = invoke("tokenize", stdlib_dir() / "textwrap.py", "--model", trained["q"], "--seq-len", 32,
                    "--out", without / "tokens")  # fmt: skip
    assert result.exit_code == 0, result.output
    progress = NullProgress()
    assert default_tokens(without, None, fingerprint, progress) == ([without / "tokens"], [])
    (note,) = progress.notes  # the base model alone: no run's fit to its training text to warn of (review)
    assert "no held-out split" in note and "fit to the training text" not in note, note
    from usaf.stages.eval.resolve import _split_of

    progress = NullProgress()  # a run's tokens without a split: the fit is warned of
    assert _split_of(without / "tokens", 0, progress) == ([without / "tokens"], [])
    (note,) = progress.notes
    assert "no held-out split" in note and "fit to the training text" in note and "--held-out-frac" in note


def _eval(trained, workspace, out, *extra, microbatch: int = 4, checkpoint=None):
    return invoke(
        "eval", "--model", trained["q"], "--checkpoint", checkpoint or trained["run"], "--data", trained["tokens"],
        "--held-out", trained["tokens"], "--workspace", workspace, "--out", out, "--no-plots",
        "--microbatch", microbatch, *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def straight(trained, tmp_path_factory) -> dict:
    """An uninterrupted eval of the finished run with microbatches of 4 (a batch's size can change the last bits)."""
    root = tmp_path_factory.mktemp("eval-straight")
    result = _eval(trained, root / "ws", root / "report")
    assert result.exit_code == 0, result.output
    return json.loads((root / "report" / "report.json").read_text())


@pytest.fixture(scope="module")
def microbatches(straight) -> int:
    """Microbatches of 4 sequences in one pass of these evals."""
    return -(-straight["base_pass"]["sequences"] // 4)


def _same_report(out, reference: dict) -> None:
    data = json.loads((out / "report.json").read_text())
    for key in ("rows", "routing", "max_logit_change"):
        assert data[key] == reference[key], key


@pytest.mark.parametrize("which", ["base", "fine-tuned"])
def test_an_eval_stopped_in_a_pass_keeps_it_and_the_same_command_resumes(
    trained, straight, microbatches, tmp_path, monkeypatch, which
):
    """Ctrl-C between two microbatches of either pass (the 2nd stop check: one microbatch done; the fine-tuned pass
    checks after the base pass's ``microbatches``) keeps the pass so far in the workspace's cache; the same command
    goes on from there to the report an uninterrupted eval writes, and the kept work is gone."""
    from usaf.stages.eval import cache

    assert microbatches >= 3  # else there is no pass to stop in the middle of
    ws, out = tmp_path / "ws", tmp_path / "report"
    stop_at_check(monkeypatch, 2 if which == "base" else microbatches + 2)
    stopped = _eval(trained, ws, out)
    monkeypatch.undo()
    assert stopped.exit_code == 130, stopped.output
    assert f"interrupted: kept the {which} pass (1 of {microbatches} microbatches)" in stopped.stderr
    assert not out.exists() and leftovers(tmp_path) == []
    subdir = cache.CACHE_SUBDIR if which == "base" else cache.TUNED_SUBDIR
    (entry,) = (ws / subdir).iterdir()
    assert json.loads((entry / cache.META_FILE).read_text())["batches"] == 1
    resumed = _eval(trained, ws, out)
    assert resumed.exit_code == 0, resumed.output
    assert f"{which} pass: resuming after 1 of {microbatches} microbatches" in resumed.stderr
    _same_report(out, straight)
    assert not (ws / cache.TUNED_SUBDIR).exists() or not any((ws / cache.TUNED_SUBDIR).iterdir())
    (entry,) = (ws / cache.CACHE_SUBDIR).iterdir()
    assert json.loads((entry / cache.META_FILE).read_text())["batches"] is None  # the whole base pass now


def test_kept_work_of_another_eval_is_not_taken_and_no_base_cache_keeps_nothing(trained, tmp_path, monkeypatch):
    """The control: a pass kept with microbatches of 4 is another pass's work for microbatches of 2 (its key
    differs), so it is run in full; and with --no-base-cache a stop keeps nothing in the workspace."""
    ws = tmp_path / "ws"
    stop_at_check(monkeypatch, 2)
    assert _eval(trained, ws, tmp_path / "a").exit_code == 130
    stop_at_check(monkeypatch, 2)  # counted afresh
    stopped = _eval(trained, tmp_path / "ws-none", tmp_path / "b", "--no-base-cache")
    monkeypatch.undo()
    assert stopped.exit_code == 130 and "--no-base-cache keeps nothing in the workspace" in stopped.stderr
    assert not (tmp_path / "ws-none" / "cache").exists()
    other = _eval(trained, ws, tmp_path / "c", microbatch=2)
    assert other.exit_code == 0, other.output
    assert "resuming" not in other.stderr and "base pass: computed and cached" in other.stderr


@pytest.mark.parametrize("which", ["base", "fine-tuned"])
def test_a_resumed_pass_computes_at_the_thread_count_its_kept_part_ran_at(
    trained, microbatches, tmp_path, monkeypatch, which
):
    """The CPU's sums are bit-identical at one thread count only, and usaf lowers the count on a busy machine: a
    kept pass records the count it ran at and the rerun computes at it (here kept at 1, resumed where 2 were
    chosen), saying so; the whole eval from there, the logit check of the fine-tuned pass included."""
    from usaf.stages.eval import cache

    ws, out = tmp_path / "ws", tmp_path / "report"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        stop_at_check(monkeypatch, 2 if which == "base" else microbatches + 2)
        assert _eval(trained, ws, out).exit_code == 130
        monkeypatch.undo()
        (entry,) = (ws / (cache.CACHE_SUBDIR if which == "base" else cache.TUNED_SUBDIR)).iterdir()
        assert json.loads((entry / cache.META_FILE).read_text())["threads"] == 1
        torch.set_num_threads(2)  # what an idler machine's choice would be
        monkeypatch.delenv("OMP_NUM_THREADS")  # the suite's pinned count, which a resume leaves alone
        resumed = _eval(trained, ws, out)
        assert resumed.exit_code == 0, resumed.output
        assert f"resuming at the 1 torch threads the kept {which} pass ran at" in resumed.stderr
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("recorded_again", [True, False])
def test_kept_sums_changed_on_disk_are_taken_only_with_their_sha256(trained, straight, tmp_path, monkeypatch,
                                                                    recorded_again):
    """Kept sums changed on disk, their sha256 recorded again: they change the report, so the rerun took them (the
    control of the resume: it did not recompute them). Left as recorded (a changed byte that still read as numbers
    was reported as the base model's loss; found in review): the entry is not taken, the pass runs whole and the
    report is the straight run's."""
    from safetensors.torch import load_file, save_file

    from usaf.stages.eval import cache

    ws, out = tmp_path / "ws", tmp_path / "report"
    stop_at_check(monkeypatch, 2)
    assert _eval(trained, ws, out).exit_code == 130
    monkeypatch.undo()
    (entry,) = (ws / cache.CACHE_SUBDIR).iterdir()
    kept = load_file(str(entry / cache.TENSORS_FILE))
    kept["nll"] = kept["nll"] + 1.0  # every sequence of the kept microbatch one nat worse
    save_file(kept, str(entry / cache.TENSORS_FILE))
    if recorded_again:
        meta = json.loads((entry / cache.META_FILE).read_text())
        (entry / cache.META_FILE).write_text(json.dumps({**meta, "sha256": sha256_file(entry / cache.TENSORS_FILE)}))
    resumed = _eval(trained, ws, out)
    assert resumed.exit_code == 0, resumed.output
    assert ("base pass: resuming after 1 of" in resumed.stderr) == recorded_again, resumed.stderr
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert ([r["base"]["nll"] for r in rows] == [r["base"]["nll"] for r in straight["rows"]]) != recorded_again
    assert [r["tuned"] for r in rows] == [r["tuned"] for r in straight["rows"]]  # the fine-tuned pass ran in full


def _another_run(trained, root):
    """A copy of the trained run whose step-8 checkpoint holds other deltas (twice the values): another run of the
    same model, with a checkpoint of the same name."""
    from safetensors.torch import load_file, save_file

    other = root / "other-run"
    shutil.copytree(trained["run"], other)
    deltas = other / "checkpoints" / "step-0000008" / "deltas.safetensors"
    tensors = load_file(str(deltas))
    save_file({k: v * 2 if v.is_floating_point() else v for k, v in tensors.items()}, str(deltas))
    resign_checkpoint(deltas.parent)
    return other


def test_a_checkpoints_fingerprint_is_its_content_not_its_name(trained, tmp_path):
    """Two runs of one model both have a step-0000008: the name told them apart from nothing. The same files
    elsewhere are the same change (the control: not the path either)."""
    from usaf.artifacts.run import load_trained_change

    mine = trained["run"] / "checkpoints" / "step-0000008"
    copy = tmp_path / "copy"
    shutil.copytree(trained["run"], copy)
    fingerprint = load_trained_change(mine).fingerprint
    assert load_trained_change(copy / "checkpoints" / "step-0000008").fingerprint == fingerprint
    other = _another_run(trained, tmp_path) / "checkpoints" / "step-0000008"
    assert load_trained_change(other).fingerprint != fingerprint
    assert load_trained_change(mine.parent / "step-0000016").fingerprint != fingerprint


def test_another_runs_checkpoint_of_the_same_name_does_not_take_a_kept_pass(
    trained, microbatches, tmp_path, monkeypatch
):
    """A fine-tuned pass kept for one run's step-8 is not another run's step-8 pass: that eval runs its own in full
    (its report equals a straight eval's) and leaves the kept one, which the first checkpoint's eval then takes."""
    from usaf.stages.eval import cache

    mine = trained["run"] / "checkpoints" / "step-0000008"
    theirs = _another_run(trained, tmp_path) / "checkpoints" / "step-0000008"
    ws = tmp_path / "ws"
    stop_at_check(monkeypatch, microbatches + 2)  # one microbatch into the fine-tuned pass
    stopped = _eval(trained, ws, tmp_path / "a", checkpoint=mine)
    monkeypatch.undo()
    assert stopped.exit_code == 130 and "kept the fine-tuned pass (1 of" in stopped.stderr, stopped.output
    (kept,) = (ws / cache.TUNED_SUBDIR).iterdir()
    other = _eval(trained, ws, tmp_path / "b", checkpoint=theirs)
    assert other.exit_code == 0 and "fine-tuned pass: resuming" not in other.stderr, other.output
    straight = _eval(trained, tmp_path / "ws-straight", tmp_path / "c", checkpoint=theirs)
    assert straight.exit_code == 0, straight.output
    _same_report(tmp_path / "b", json.loads((tmp_path / "c" / "report.json").read_text()))
    assert kept.is_dir()
    resumed = _eval(trained, ws, tmp_path / "d", checkpoint=mine)  # the control: its own checkpoint takes it
    assert resumed.exit_code == 0 and "fine-tuned pass: resuming after 1 of" in resumed.stderr, resumed.output
    assert not kept.exists()


def test_only_a_kept_pass_is_deleted_after_its_report(tmp_path):
    """What the eval deletes once its report is written: a part of a pass kept under its key, nothing else there."""
    from usaf.stages.eval import cache
    from usaf.stages.eval.passes import PassResult

    result = PassResult(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.int64),
                        {0: torch.zeros(3, 2, dtype=torch.uint8)}, 3, 1.0)  # fmt: skip
    kept, whole, other_key, mine = (tmp_path / name for name in ("kept", "whole", "other-key", "mine"))
    cache.save(kept, "k", {}, result, batches=1)
    cache.save(whole, "k", {}, result)
    cache.save(other_key, "x", {}, result, batches=1)
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's file")
    for directory in (kept, whole, other_key, mine):
        cache.drop_kept(directory, "k")
    assert not kept.exists() and whole.is_dir() and other_key.is_dir() and (mine / "notes.txt").is_file()


def _unfinished(run: Path, where: Path) -> Path:
    """A copy of ``run`` as it was before its last step: no manifest, no final/."""
    shutil.copytree(run, where)
    (where / "manifest.json").unlink()
    shutil.rmtree(where / "final")
    return where


def test_out_is_refused_where_it_is_or_lies_in_what_eval_reads_found_in_the_workspace(trained, tmp_path):
    """Only the inputs given by flag were checked: --out at the tokens found in the workspace, with --overwrite,
    replaced them with the report; --out inside the run of a --checkpoint RUN/checkpoints/step-N was taken (found
    in review). The control: another --out writes the report."""
    workspace = tmp_path / "ws"
    tokens = workspace / "tokens" / "t"
    shutil.copytree(trained["tokens"], tokens)
    step = sorted((trained["run"] / "checkpoints").iterdir())[-1]
    unfinished = _unfinished(trained["run"], tmp_path / "unfinished")  # refused as an unfinished run since 2026-12-07
    unfinished_step = unfinished / "checkpoints" / step.name
    common = ["eval", "--model", trained["q"], "--workspace", workspace, "--max-sequences", 4, "--no-plots"]
    for out, checkpoint, extra, named in [
        # refused as another command's output (tokens) before the workspace's inputs are resolved
        (tokens, step, ["--overwrite"], "a usaf tokens artifact; usaf replaces only what this command writes there"),
        # inside a finished artifact: refused as such since 2026-12-06, an input or not
        (tokens / "report", step, [], f"lies inside {tokens}, a usaf tokens artifact"),
        (trained["run"] / "report", step, ["--held-out", trained["tokens"]], f"lies inside {trained['run']}, a usaf"),
        (unfinished / "report", unfinished_step, ["--held-out", trained["tokens"]],
         f"lies inside {unfinished}, an unfinished usaf run"),
    ]:  # fmt: skip
        refused = invoke(*common, "--checkpoint", checkpoint, *extra, "--out", out)
        message = " ".join(refused.stderr.split())
        assert refused.exit_code == 2 and named in message, (out, refused.output)
    assert (tokens / "manifest.json").is_file() and not (tokens / "report").exists()
    assert not (trained["run"] / "report").exists() and not (unfinished / "report").exists()
    done = invoke(*common, "--checkpoint", step, "--out", tmp_path / "report")
    assert done.exit_code == 0, done.output


def test_a_checkpoint_of_a_run_finished_or_not_is_evaluated_on_its_runs_tokens_and_checked_against_them(
    trained, tmp_path
):
    """A checkpoint (RUN/checkpoints/step-N) or an unfinished run records its data in run-settings.json: eval took
    the workspace's newest tokens instead, and never checked the held-out text against the training data (found in
    review). The control: the finished run, as before."""
    workspace = tmp_path / "ws"
    shutil.copytree(trained["tokens"], workspace / "tokens" / "t")
    newer = invoke("tokenize", stdlib_dir() / "glob.py", stdlib_dir() / "fnmatch.py", "--model", trained["q"],
                   "--seq-len", 32, "--held-out", "fnmatch.py",
                   "--out", workspace / "tokens" / "newer")  # fmt: skip
    assert newer.exit_code == 0, newer.output
    unfinished = _unfinished(trained["run"], tmp_path / "unfinished")
    step = sorted((trained["run"] / "checkpoints").iterdir())[-1]
    common = ["eval", "--model", trained["q"], "--workspace", workspace, "--no-plots"]
    for checkpoint in (step, unfinished, trained["run"]):
        result = invoke(*common, "--checkpoint", checkpoint, "--max-sequences", 4, "--out", tmp_path / "r1")
        assert result.exit_code == 0 and f"using the tokens {workspace / 'tokens' / 't'}" in result.stderr, (
            checkpoint, result.output)  # fmt: skip
        # which checkpoint an unfinished run gave is said (only report.md named it; review), and recorded absolute
        said = " ".join(result.stderr.split())
        newest = f"an unfinished run; using its newest checkpoint, {unfinished / 'checkpoints' / step.name}"
        assert (newest in said) == (checkpoint == unfinished), said  # the control: a checkpoint or a finished run
        assert json.loads((tmp_path / "r1" / "report.json").read_text())["checkpoint"] == str(
            unfinished / "checkpoints" / step.name if checkpoint == unfinished else checkpoint)  # fmt: skip
        shutil.rmtree(tmp_path / "r1")
        seen = invoke(*common, "--checkpoint", checkpoint, "--held-out", stdlib_dir() / "textwrap.py",
                      "--seq-len", 32, "--out", tmp_path / "r2")  # fmt: skip
        assert seen.exit_code == 0, seen.output
        report = json.loads((tmp_path / "r2" / "report.json").read_text())
        assert report["heldout_in_training"] and "are in the run's training data" in seen.stderr, checkpoint
        assert "the same text in several sources" in " ".join(seen.stderr.split())  # a split cannot part (review)
        shutil.rmtree(tmp_path / "r2")


def test_raw_text_eval_cannot_read_is_said_as_tokenize_says_it(trained, tmp_path):
    """A --held-out directory of UTF-16 text was "no text or JSONL files (binary files are skipped)" (found in
    review). The control: with a UTF-8 file beside it, it evaluates and names the one it skipped."""
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "notes.txt").write_text("def f(x):\n    return x\n" * 20, encoding="utf-16")
    args = ["eval", "--model", trained["q"], "--held-out", texts, "--no-plots", "--workspace", tmp_path / "ws"]
    refused = invoke(*args, "--out", tmp_path / "r1")
    said = " ".join(refused.stderr.split())
    assert refused.exit_code == 2 and "no text or JSONL files (1 UTF-16/UTF-32 text file (convert to UTF-8) " \
        "skipped)" in said, said
    (texts / "b.py").write_text("def g(y):\n    return y + 1\n" * 20)
    done = invoke(*args, "--out", tmp_path / "r2")
    said = " ".join(done.stderr.split())
    assert done.exit_code == 0 and f"1 UTF-16 or UTF-32 text file skipped, e.g. {texts / 'notes.txt'}" in said, said


def test_settings_eval_would_not_use_are_refused_from_flags_and_noted_from_shared_sources(trained, tmp_path,
                                                                                         monkeypatch):  # fmt: skip
    """USAF_SEQ_LEN (README's example, meant for tokenize and train too) failed every eval of tokenized inputs."""
    args = ["eval", "--model", trained["q"], "--held-out", trained["tokens"], "--max-sequences", 4, "--no-plots",
            "--workspace", tmp_path / "ws"]  # fmt: skip
    refused = invoke(*args, "--seq-len", 64, "--out", tmp_path / "flag")
    assert refused.exit_code == 2 and "--seq-len: settings of raw-text inputs" in refused.stderr, refused.output
    monkeypatch.setenv("USAF_SEQ_LEN", "64")
    noted = invoke(*args, "--out", tmp_path / "env")
    assert noted.exit_code == 0 and "USAF_SEQ_LEN 64: a setting of raw-text inputs, unused" in noted.stderr, (
        noted.output)  # fmt: skip


def test_a_text_directory_with_its_own_manifest_json_is_text_and_a_cache_that_cannot_be_written_costs_a_note(
    trained, tmp_path, monkeypatch
):
    """A web app's manifest.json made eval read its directory as a usaf artifact (and refuse it); a file named
    "cache" in the workspace made the base pass's caching fail with a traceback after the pass (found in review)."""
    app = tmp_path / "app"
    app.mkdir()
    shutil.copy(stdlib_dir() / "shlex.py", app / "shlex.py")
    (app / "manifest.json").write_text(json.dumps({"manifest_version": 3, "name": "an extension"}))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "cache").write_text("the user's")
    result = invoke("eval", "--model", trained["q"], "--held-out", app, "--seq-len", 32, "--max-sequences", 4,
                    "--workspace", workspace, "--out", tmp_path / "report", "--no-plots")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "base pass: not cached in" in result.stderr and (workspace / "cache").read_text() == "the user's"
    inputs = json.loads((tmp_path / "report" / "report.json").read_text())["inputs"]
    assert [i["kind"] for i in inputs] == ["text"]
    (app / "manifest.json").write_text('{"kind": "tokens", "usaf_version": "0"')  # the control: a damaged usaf one
    damaged = invoke("eval", "--model", trained["q"], "--held-out", app, "--workspace", workspace,
                     "--out", tmp_path / "other", "--no-plots")  # fmt: skip
    assert damaged.exit_code == 2 and "manifest.json" in damaged.stderr, damaged.output


def test_the_base_cache_key_names_the_card_not_only_the_device_type():
    """Two GPUs of one type round differently: a base pass cached on one was taken on the other (found in review).
    Control: the same card gives the same key."""
    from types import SimpleNamespace

    import torch

    from usaf.stages.eval import _cache_key_parts, cache

    def key(card: str, dtype: torch.dtype = torch.bfloat16) -> str:
        backend = SimpleNamespace(device=torch.device("cuda", 0), device_name=card)
        model = (Path("/nowhere"), SimpleNamespace(fingerprint="model", files=[]))
        return cache.cache_key(_cache_key_parts(model, "sequences", 2, backend, dtype))

    assert key("NVIDIA H100 80GB HBM3") != key("NVIDIA GeForce RTX 4070") and key("A") == key("A")
    assert key("A", torch.float32) != key("A")  # and the dtype the passes computed in (--dtype)


def test_an_input_set_in_a_config_table_is_named_there_when_refused(trained, tmp_path):
    """A held_out from a --config table was refused as "--held-out f4.txt", a flag never given (found in review).
    Named where it was set. The control: from the flag, the flag."""
    toml = tmp_path / "d.toml"
    toml.write_text('[eval]\nheld_out = ["f4.txt"]\n')
    common = ["eval", "--model", trained["q"], "--checkpoint", trained["run"], "--workspace", tmp_path / "ws"]
    cases = ((("--config", toml), f"--config {toml} [eval] held_out"), (("--held-out", "f4.txt"), "--held-out"))
    for args, named in cases:
        result = invoke(*common, *args, "--out", tmp_path / "out")
        said = " ".join(result.stderr.split())
        assert result.exit_code == 2 and f"error: {named} f4.txt: no such file or directory" in said, said


def test_a_model_file_replaced_by_one_of_the_same_size_misses_the_base_cache(trained, tmp_path):
    """A model's experts_q4.pt replaced by another quantization's of the same size kept the manifest's fingerprint:
    eval took the first model's cached base pass and reported it beside the second model's fine-tuned pass (found in
    review). The key holds the files as they stand (size, modification time). The control: the model untouched
    reuses the cache."""
    model = tmp_path / "model"
    shutil.copytree(trained["q"], model)
    common = ["eval", "--model", model, "--checkpoint", trained["run"], "--held-out", trained["tokens"],
              "--max-sequences", 4, "--no-plots", "--workspace", tmp_path / "ws"]  # fmt: skip
    assert invoke(*common, "--out", tmp_path / "first").exit_code == 0
    again = invoke(*common, "--out", tmp_path / "again")
    assert again.exit_code == 0 and "base pass: reused from the cache" in again.stderr, again.output
    experts = model / "experts_q4.pt"
    experts.write_bytes(experts.read_bytes())  # written again (the same bytes: the key cannot tell, and misses)
    replaced = invoke(*common, "--out", tmp_path / "replaced")
    assert replaced.exit_code == 0, replaced.output
    assert "reused from the cache" not in replaced.stderr and "base pass: computed" in replaced.stderr, replaced.stderr


def test_a_killed_cache_saves_temporary_is_cleared_by_the_next_save(tmp_path):
    """A save killed mid-write left its temporary directory beside the entry for good (found in review): hundreds
    of MB at a real model's size. The control: a live process's temporary is kept."""
    import os
    import subprocess
    import sys

    from usaf.stages.eval import cache
    from usaf.stages.eval.passes import PassResult

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    entry = tmp_path / "cache" / "eval-base" / ("0" * 32)
    stale = entry.with_name(f".{entry.name}.usaf-tmp-{dead.stdout.strip()}-deadbeef")
    alive = entry.with_name(f".{entry.name}.usaf-tmp-{os.getpid()}-cafecafe")
    for directory in (stale, alive):
        directory.mkdir(parents=True)
        (directory / "base.safetensors").write_bytes(b"\0" * 100)
    result = PassResult(torch.zeros(2), torch.ones(2), {}, 2, 0.1)
    cache.save(entry, "k", {}, result)
    assert not stale.exists() and alive.exists() and (entry / cache.META_FILE).is_file()


def test_a_run_given_a_tokens_file_and_a_delta_are_checked_and_evaluated_on_what_they_trained_on(trained, tmp_path):
    """A run trained on ``--data TOKENS/train.jsonl`` (fingerprinted by the file's bytes): its tokens were passed
    over (a file beside a manifest was taken for a directory's) so its held-out check said they could not be found
    and a plain ``usaf eval`` was refused; a delta's check was skipped in silence (found in review). The run a delta
    was exported from is followed while it holds the same change; gone, the report says why it was not checked."""
    from usaf.artifacts.hashing import sha256_file

    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    manifest = json.loads((run / "manifest.json").read_text())
    file = trained["tokens"] / "train.jsonl"
    for record in manifest["inputs"]:
        if record["role"] == "data":
            record["path"] = str(file)
    manifest["summary"]["data_fingerprint"] = sha256_file(file)
    _rewrite_manifest(run, manifest)
    out = tmp_path / "report"
    result = invoke("eval", "--model", trained["q"], "--checkpoint", run, "--workspace", tmp_path / "ws",
                    "--out", out, "--no-plots", "--max-sequences", 8)  # fmt: skip
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert f"using the tokens {trained['tokens']} (train.jsonl as --data, heldout.jsonl as --held-out)" in said
    assert json.loads((out / "report.json").read_text())["heldout_in_training"] == 0  # checked: none trained on

    delta = tmp_path / "delta"
    assert invoke("export", "--model", trained["q"], "--checkpoint", run, "--format", "delta",
                  "--out", delta).exit_code == 0  # fmt: skip
    for name, then in (("followed", None), ("gone", lambda: shutil.rmtree(run))):
        if then is not None:
            then()
        out = tmp_path / f"delta-{name}"
        result = invoke("eval", "--model", trained["q"], "--checkpoint", delta, "--held-out", trained["tokens"],
                        "--workspace", tmp_path / "ws", "--out", out, "--no-plots", "--max-sequences", 8)  # fmt: skip
        assert result.exit_code == 0, result.output
        report = json.loads((out / "report.json").read_text())
        if name == "followed":
            assert report["heldout_in_training"] == 0 and report["overlap_note"] is None
        else:
            assert report["heldout_in_training"] is None
            assert "the run it was exported from is not where it was" in report["overlap_note"]
            assert "not checked against the run's training data" in " ".join(result.stderr.split())


def test_an_out_that_is_or_holds_the_workspaces_cache_is_refused_before_any_pass(trained, tmp_path):
    """``--out X --workspace X`` (both new): the passes wrote X/cache and the commit then refused X as a directory usaf
    did not make, after the whole eval (found in review). Refused first now; --no-base-cache keeps no cache there, and
    is the control."""
    common = ["eval", "--model", trained["q"], "--checkpoint", trained["run"], "--held-out", trained["tokens"],
              "--max-sequences", 4, "--no-plots"]  # fmt: skip
    for out, workspace in ((tmp_path / "x", tmp_path / "x"), (tmp_path / "y", tmp_path / "y" / "inner")):
        refused = invoke(*common, "--out", out, "--workspace", workspace)
        assert refused.exit_code == 2 and "is or holds the workspace's cache" in refused.output, refused.output
        assert not out.exists() and not (workspace / "cache").exists()
    done = invoke(*common, "--out", tmp_path / "x", "--workspace", tmp_path / "x", "--no-base-cache")
    assert done.exit_code == 0, done.output


def test_a_workspace_inside_an_input_keeps_no_cache_there_and_says_so(trained, tmp_path):
    """Run from inside its --held-out directory (the workspace is the current directory), eval refused a default
    --out there but wrote its cache into the user's directory; run from inside the model, into the finished model,
    whose manifest then did not list it (found in review). Eval goes on without the cache, and says so. The control: a
    workspace beside the input keeps it."""
    text = tmp_path / "mytext"
    text.mkdir()
    (text / "wrap.py").write_text((stdlib_dir() / "textwrap.py").read_text())
    common = ["eval", "--model", trained["q"], "--checkpoint", trained["run"], "--max-sequences", 4, "--no-plots"]
    for workspace, held_out in ((text, text), (trained["q"], trained["tokens"])):
        before = sorted(p.name for p in workspace.iterdir())
        report = tmp_path / f"report-{workspace.name}"
        result = invoke(*common, "--held-out", held_out, "--workspace", workspace, "--out", report)
        assert result.exit_code == 0, result.output
        said = " ".join(result.stderr.split())
        assert "the base pass is not cached" in said and f"{workspace / 'cache' / 'eval-base'} lies inside the input" \
            in said, said  # fmt: skip
        assert sorted(p.name for p in workspace.iterdir()) == before
        assert json.loads((report / "report.json").read_text())["base_cache"] is None
    beside = tmp_path / "beside"
    result = invoke(*common, "--held-out", text, "--workspace", beside, "--out", tmp_path / "control")
    assert result.exit_code == 0 and "not cached" not in result.stderr, result.output
    assert (beside / "cache" / "eval-base").is_dir()


def test_the_training_curves_of_a_checkpoint_mark_the_step_evaluated(trained, tmp_path, monkeypatch):
    """A checkpoint's eval plotted the whole run's curves, past the state evaluated, unmarked (found in review)."""
    pytest.importorskip("matplotlib")
    import usaf.stages.eval as stage

    marked = []
    real = stage.plot_curves
    monkeypatch.setattr(stage, "plot_curves", lambda curves, *a, **k: marked.append(curves.evaluated_step) or real(
        curves, *a, **k))  # fmt: skip
    step = trained["run"] / "checkpoints" / "step-0000008"
    for checkpoint in (step, trained["run"]):  # the finished run's end is the control: nothing to mark
        out = tmp_path / checkpoint.name
        result = invoke("eval", "--model", trained["q"], "--checkpoint", checkpoint, "--held-out", trained["tokens"],
                        "--workspace", trained["workspace"], "--out", out, "--plots", "--max-sequences", 4)  # fmt: skip
        assert result.exit_code == 0, result.output
        assert (out / "plots" / "training_curves.png").is_file()
    assert marked == [8, None]


def test_a_source_field_no_raw_jsonl_line_has_is_said(trained, tmp_path):
    """eval's raw JSONL: --source-field NAME that no line has was unused in silence (found in review)."""
    lines = tmp_path / "lines.jsonl"
    text = (stdlib_dir() / "shlex.py").read_text()[:4000]
    lines.write_text("".join(json.dumps({"text": text, "origin": f"o{i}"}) + "\n" for i in range(2)))
    common = ["eval", "--model", trained["q"], "--held-out", lines, "--text-field", "text", "--no-plots",
              "--workspace", tmp_path / "ws", "--seq-len", 32, "--max-sequences", 4]  # fmt: skip
    said = invoke(*common, "--source-field", "nosuch", "--out", tmp_path / "said")
    assert said.exit_code == 0 and "--source-field nosuch: no JSONL line has it" in " ".join(said.stderr.split())
    read = invoke(*common, "--source-field", "origin", "--out", tmp_path / "read")  # the control
    assert read.exit_code == 0 and "no JSONL line has it" not in read.stderr, read.output


def test_the_training_split_eval_picks_itself_is_a_seeded_sample(trained, report, tmp_path, monkeypatch):
    """Without --data/--held-out eval takes the run's tokens; their training split, most of a user's data and run
    twice, is sampled (``TRAINING_SAMPLE``, shrunk here to fit the tiny split), the held-out split is whole, and the
    note, report.json and report.md say so. Controls: the same tokens given as --data are evaluated whole (the
    ``report`` fixture), and a given --max-sequences samples both splits, with no default-sample note."""
    from usaf.stages.eval import resolve

    manifest = json.loads((trained["tokens"] / "manifest.json").read_text())["summary"]
    whole, held = manifest["train_sequences"], manifest["heldout_sequences"]
    monkeypatch.setattr(resolve, "TRAINING_SAMPLE", 6)
    assert whole > 6 and held > 6
    out = tmp_path / "picked"
    result = invoke("eval", "--model", trained["q"], "--checkpoint", trained["run"], "--workspace", tmp_path / "ws",
                    "--out", out, "--no-plots")  # fmt: skip
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert f"--data: a seeded sample of 6 of the {whole:,} training sequences" in said
    assert f"--data {trained['tokens']} --held-out {trained['tokens']} evaluates all of them" in said
    inputs = {i["set"]: i for i in json.loads((out / "report.json").read_text())["inputs"]}
    assert (inputs["data"]["sequences"], inputs["data"]["sampled_from"]) == (6, whole)
    assert (inputs["held-out"]["sequences"], inputs["held-out"]["sampled_from"]) == (held, None)
    assert f"6 sequences (a seeded sample of its {whole:,})" in (out / "report.md").read_text()

    given = {i["set"]: i for i in report[2]["inputs"]}  # control: --data TOKENS is evaluated whole
    assert (given["data"]["sequences"], given["data"]["sampled_from"]) == (whole, None)
    out = tmp_path / "max"
    result = invoke("eval", "--model", trained["q"], "--checkpoint", trained["run"], "--workspace", tmp_path / "ws",
                    "--out", out, "--no-plots", "--max-sequences", 4)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "seeded sample of" not in " ".join(result.stderr.split())
    inputs = {i["set"]: i for i in json.loads((out / "report.json").read_text())["inputs"]}
    assert [(i["sequences"], i["sampled_from"]) for i in inputs.values()] == [(4, whole), (4, held)]


def test_routing_sets_beyond_the_ram_are_refused_before_any_pass_naming_a_sample_that_fits(
    trained, report, tmp_path, monkeypatch
):
    """The passes keep every token's top-k set of every MoE layer (384 bytes a token and pass on Qwen3-30B-A3B): an
    eval over more than the RAM holds failed hours in. Refused before the first pass now, naming the --max-sequences
    that fits; that value then runs (the control), as does the same eval with RAM to spare (the ``report`` fixture)."""
    from types import SimpleNamespace

    from usaf.stages.eval import memory

    tokens = report[2]["base_pass"]["input_tokens"]
    per_token = 3 * 2 * 2  # 3 MoE layers, top-2, uint8, base and fine-tuned passes
    available = tokens * per_token / 2  # the routing sets take 2 / 0.75 of it
    monkeypatch.setattr(memory, "psutil", SimpleNamespace(virtual_memory=lambda: SimpleNamespace(available=available)))
    out = tmp_path / "report"
    refused = _eval(trained, tmp_path / "ws", out)
    said = " ".join(refused.output.split())
    assert refused.exit_code == 2 and f"for each of {tokens:,} tokens), over 75% of the" in said, refused.output
    assert not out.exists() and not (tmp_path / "ws" / "cache").exists()  # no pass ran
    fits = int(said.split("pass --max-sequences ")[1].split()[0])
    result = _eval(trained, tmp_path / "ws", out, "--max-sequences", fits)
    assert result.exit_code == 0, result.output
    evaluated = json.loads((out / "report.json").read_text())["base_pass"]["input_tokens"]
    assert evaluated * per_token <= 0.75 * available < (evaluated + 2 * 32) * per_token  # fits, and not by far


def test_dtype_sets_what_both_passes_compute_in_and_keys_the_base_cache(trained, tmp_path):
    """``--dtype`` (train and generate had it; eval computed in the backend's dtype alone, so a run trained with
    ``--dtype float32`` on a GPU was evaluated in bf16). bfloat16 on the CPU moves the numbers (a --dtype accepted and
    ignored would give auto's bit for bit), is recorded, and does not reuse auto's fp32 base pass."""
    reports = {}
    for dtype in ("auto", "bfloat16"):
        out = tmp_path / dtype
        result = _eval(trained, tmp_path / "ws", out, "--max-sequences", 6, "--dtype", dtype)
        assert result.exit_code == 0, result.output
        reports[dtype] = json.loads((out / "report.json").read_text())
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["environment"]["dtype"] == reports[dtype]["compute_dtype"]
    auto, bf16 = reports["auto"], reports["bfloat16"]
    assert (auto["compute_dtype"], bf16["compute_dtype"]) == ("float32", "bfloat16")
    assert not bf16["base_cached"] and bf16["base_cache_key"] != auto["base_cache_key"]
    rows = [(a["base"]["nll"], b["base"]["nll"], a["tuned"]["nll"], b["tuned"]["nll"])
            for a, b in zip(auto["rows"], bf16["rows"], strict=True)]  # fmt: skip
    assert all(0 < abs(ab - bb) < 0.05 and 0 < abs(at - bt) < 0.05 for ab, bb, at, bt in rows)
    assert "computed in bfloat16" in (tmp_path / "bfloat16" / "report.md").read_text()


def test_the_report_names_inputs_given_relative_by_their_absolute_paths(trained, tmp_path, monkeypatch):
    """The demo's report.md named the model, the data and the base-pass cache relative to where eval ran (a report
    read elsewhere named nothing; found in review) while the checkpoint was absolute. The control: the paths as given
    are relative, and none of them is in the report as given."""
    import os

    monkeypatch.chdir(tmp_path)
    model, tokens = (os.path.relpath(trained[k], tmp_path) for k in ("q", "tokens"))
    assert not os.path.isabs(model) and not os.path.isabs(tokens)
    result = invoke("eval", "--model", model, "--checkpoint", trained["run"], "--held-out", tokens,
                    "--workspace", "ws", "--out", "report", "--no-plots")  # fmt: skip
    assert result.exit_code == 0, result.output
    md = (tmp_path / "report" / "report.md").read_text()
    assert f"- model: `{trained['q']}`" in md and f"--held-out `{trained['tokens']}` (tokens)" in md, md
    assert f"(`{tmp_path / 'ws' / 'cache' / 'eval-base'}/" in md, md
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert {i["path"] for i in report["inputs"]} == {str(trained["tokens"])}
    assert all(os.path.isabs(r["input"]) for r in report["rows"] if r["input"] is not None)


def test_sequences_with_nothing_to_score_are_counted_and_said(trained, tmp_path):
    """A JSONL of 6 sequences, 2 of them all -100: the report said "6 sequences" over rows of 4, without a word (found
    in review). Said on the console and beside the input in report.md. A base-only report no longer defines a Δ it
    does not show. The control: all 6 scored, nothing said."""
    lines = (trained["tokens"] / "train.jsonl").read_text().splitlines()[:6]
    records = [json.loads(text) for text in lines]
    for record in records[:2]:
        record["labels"] = [-100] * len(record["input_ids"])
    data = tmp_path / "some-unscored.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    common = ["eval", "--model", trained["q"], "--data", data, "--no-plots", "--workspace", tmp_path / "ws"]
    result = invoke(*common, "--checkpoint", trained["run"], "--out", tmp_path / "r1")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert f"--data {data}: 2 of its 6 sequences have no token to score" in said, said
    assert "6 sequences (2 with no scored token, so in no row)" in (tmp_path / "r1" / "report.md").read_text()
    report = json.loads((tmp_path / "r1" / "report.json").read_text())
    assert report["inputs"][0]["unscored"] == 2 and {r["sequences"] for r in report["rows"]} == {4}
    base_only = invoke(*common, "--out", tmp_path / "r2")
    assert base_only.exit_code == 0 and "Δ = fine-tuned" not in (tmp_path / "r2" / "report.md").read_text()
    assert "Δ = fine-tuned − base, paired" in (tmp_path / "r1" / "report.md").read_text()
    whole = tmp_path / "all-scored.jsonl"
    whole.write_text("".join(line + "\n" for line in lines))
    control = invoke("eval", "--model", trained["q"], "--data", whole, "--no-plots", "--workspace", tmp_path / "ws",
                     "--out", tmp_path / "r3")  # fmt: skip
    assert control.exit_code == 0 and "no token to score" not in control.stderr
    assert "no scored token" not in (tmp_path / "r3" / "report.md").read_text()


def test_the_terminal_table_wraps_a_long_source_rather_than_cutting_it(report):
    """On 80 columns "http/cookiejar.py" and "http/cookies.py" were both "http/cooki…" (found in review)."""
    import io

    from rich.console import Console

    from usaf.artifacts import EvalReportManifest, load_verified
    from usaf.cli.eval_ import _print_summary

    out, _, _ = report
    manifest = load_verified(out, EvalReportManifest)
    rows = [r.model_copy(update={"source": "some/long/package/" + r.source}) if not r.overall else r
            for r in manifest.summary.rows]  # fmt: skip
    manifest = manifest.model_copy(update={"summary": manifest.summary.model_copy(update={"rows": rows})})
    shown = io.StringIO()
    _print_summary(Console(file=shown, width=80), manifest, out)
    cells = "".join(line.split("│")[2].strip() for line in shown.getvalue().splitlines() if line.count("│") > 3)
    assert "…" not in shown.getvalue().split("routing")[0] and "some/long/package/" in cells, shown.getvalue()


def test_report_md_counts_one_sequence_in_the_singular(report):
    """"(tokenized by eval): 1 sequences" (found in review)."""
    from usaf.artifacts import EvalReportManifest, load_verified
    from usaf.stages.eval.report import markdown

    out, _, _ = report
    summary = load_verified(out, EvalReportManifest).summary
    one = summary.model_copy(update={"inputs": [summary.inputs[0].model_copy(update={"sequences": 1})]})
    assert "`: 1 sequence, " in markdown(one, model="m").replace("` (tokens): ", "`: ")
    assert "sequences, " in markdown(summary, model="m")  # the control


def test_a_workspaces_directory_of_artifacts_names_one_as_text_input_and_as_tokenizer(trained, tmp_path):
    """A workspace's tokens/ as --held-out was read as text, its artifact skipped, and refused as "no text or JSONL
    files ... check the path"; a workspace's quantized_model/ as tokenize's --model was "no tokenizer files" (found in
    review). Each now names the artifact to pass, and a workspace given to tokenize's --model is not sent to
    --workspace (tokenize takes no model from it). The control: the artifacts themselves are taken."""
    ws = tmp_path / "ws"
    tokens, qdir = ws / "tokens" / "t", ws / "quantized_model" / "q"
    shutil.copytree(trained["tokens"], tokens)
    shutil.copytree(trained["q"], qdir)
    refused = invoke("eval", "--model", qdir, "--held-out", tokens.parent, "--no-plots", "--out", tmp_path / "r",
                     "--workspace", ws)
    said = " ".join(refused.stderr.split())
    assert refused.exit_code == 2 and f"--held-out {tokens.parent}: holds 1 usaf artifact, and is not one" in said
    assert f"--held-out {tokens}" in said, said
    assert "skipped 1 usaf output" not in refused.output  # said of the input it refused, first (review)
    text = stdlib_dir() / "shlex.py"
    for model, needles in [(qdir.parent, ["holds 1 usaf artifact", f"--model {qdir}"]),
                           (ws, ["a usaf workspace, not an artifact", f"pass an artifact in it (--model {qdir})"])]:
        result = invoke("tokenize", text, "--model", model, "--out", tmp_path / "tokens")
        said = " ".join(result.stderr.split())
        assert result.exit_code == 2 and all(n in said for n in needles) and "--workspace" not in said, said
        assert not (tmp_path / "tokens").exists()
    assert invoke("tokenize", text, "--model", qdir, "--out", tmp_path / "tokens").exit_code == 0
    done = invoke("eval", "--model", qdir, "--held-out", tokens, "--no-plots", "--max-sequences", 4,
                  "--out", tmp_path / "r", "--workspace", ws)  # fmt: skip
    assert done.exit_code == 0, done.output


def test_eval_with_neither_model_nor_checkpoint_takes_the_newest_run_and_its_model(trained, quantized, tmp_path):
    """In a workspace with quantized models of two origins, eval with neither --model nor --checkpoint refused to
    choose, where export and generate took the newest run and the model it was trained on (found in review). It
    takes them too, and says which. The control: with no run, the base model alone still needs the choice."""
    ws = tmp_path / "ws"
    shutil.copytree(trained["q"], ws / "quantized_model" / "a")
    shutil.copytree(quantized("olmoe", num_layers=3, tokenizer=True), ws / "quantized_model" / "b")
    shutil.copytree(trained["tokens"], ws / "tokens" / "t")
    shutil.copytree(trained["run"], ws / "run" / "r")
    result = invoke("eval", "--workspace", ws, "--max-sequences", 2, "--no-plots", "--out", tmp_path / "report")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0, result.output
    assert f"using the run {ws / 'run' / 'r'} (newest in the workspace)" in said, said
    assert f"using the quantized model {ws / 'quantized_model' / 'a'} (the one the run was trained on)" in said, said
    shutil.rmtree(ws / "run")
    refused = invoke("eval", "--workspace", ws, "--max-sequences", 2, "--no-plots", "--out", tmp_path / "base")
    assert refused.exit_code == 2 and "of 2 different origins" in " ".join(refused.stderr.split()), refused.output


def test_a_change_under_the_weights_rounding_is_said_as_such_not_as_a_bug_alone(prepared, tmp_path):
    """A run at ``--lr 1e-30`` has deltas that differ from zero and change no weight once added: eval said "the
    change is not reaching the forward (a bug in usaf)" (found in review). The message names the rounding first,
    with the largest delta. The control: the same run at a real lr is evaluated."""
    qdir, tokens, plan = prepared("qwen3_moe")
    common = ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 2, "--no-router",
              "--save-every", 0]  # fmt: skip
    assert invoke(*common, "--lr", 1e-30, "--out", tmp_path / "tiny").exit_code == 0
    result = invoke("eval", "--model", qdir, "--checkpoint", tmp_path / "tiny", "--data", tokens, "--no-plots",
                    "--out", tmp_path / "report", "--workspace", tmp_path)  # fmt: skip
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "leaves the logits of" in said and "(largest |delta| 1" in said, result.output
    assert "its deltas may be below the rounding of the weights they add to (a tiny --lr or few steps)" in said
    assert "train with a larger --lr or more steps" in said and not (tmp_path / "report").exists()
    assert invoke(*common, "--lr", 1e-2, "--out", tmp_path / "real").exit_code == 0
    done = invoke("eval", "--model", qdir, "--checkpoint", tmp_path / "real", "--data", tokens, "--no-plots",
                  "--out", tmp_path / "report", "--workspace", tmp_path)  # fmt: skip
    assert done.exit_code == 0, done.output


def test_the_training_curves_are_the_runs_as_its_change_was_read(trained, tmp_path, monkeypatch):
    """The curves were read after the passes: a run replaced with --overwrite meanwhile put the new run's 30 steps
    beside the old run's numbers (found in review). They are read with the change now: a metrics.jsonl changed
    during the passes is not drawn. The control: the run's own curves are."""
    pytest.importorskip("matplotlib")
    import usaf.stages.eval as stage

    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    drawn = []
    real_plot, real_pass = stage.plot_curves, stage.run_pass

    def replaced_during_the_passes(*a, **k):
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 99.0}) + "\n")
        return real_pass(*a, **k)

    monkeypatch.setattr(stage, "plot_curves", lambda curves, *a, **k: drawn.append(curves) or real_plot(
        curves, *a, **k))  # fmt: skip
    monkeypatch.setattr(stage, "run_pass", replaced_during_the_passes)
    result = invoke("eval", "--model", trained["q"], "--checkpoint", run, "--held-out", trained["tokens"],
                    "--workspace", trained["workspace"], "--out", tmp_path / "report", "--plots",
                    "--max-sequences", 4)  # fmt: skip
    assert result.exit_code == 0, result.output
    (curves,) = drawn
    assert len(curves.train) > 1 and 99.0 not in [loss for _, loss in curves.train], curves.train
    from usaf.artifacts.run import read_metrics

    assert curves.train == read_metrics(trained["run"] / "metrics.jsonl")[0]  # the run's, as it was


def test_an_eval_of_the_runs_own_tokens_alone_says_forgetting_was_not_measured(trained, tmp_path):
    """The default eval (the run's own held-out split) said nothing of forgetting, which a reviewer measured at 41-136 %
    higher PPL on the model's pretraining domain (found in review): said not measured, and how to. The control: with
    other text held out, not said."""
    common = ["eval", "--model", trained["q"], "--checkpoint", trained["run"], "--workspace", trained["workspace"],
              "--no-plots", "--max-sequences", 4]  # fmt: skip
    alone = invoke(*common, "--out", tmp_path / "alone")
    assert alone.exit_code == 0, alone.output
    said = " ".join(alone.stdout.split())
    assert "not measured: forgetting (what the change costs on other text)" in said, said
    assert "add --held-out FILES of text the model knew before training" in said
    other = invoke(*common, "--held-out", stdlib_dir() / "textwrap.py", "--out", tmp_path / "other")
    assert other.exit_code == 0 and "not measured: forgetting" not in other.stdout, other.output
