"""Tampered and inconsistent artifacts (issue 19) through the real CLI: plans, prefix stores and quantized models
edited and re-signed, each answered with one error line naming the file, exit 2, and no run directory left.

The catalogue is :mod:`usaf.testing.hostile_artifacts`; the negative controls show that the same commands on
the untouched copies succeed, so each case fails because of what it breaks.
"""

from __future__ import annotations

import json
import shutil

from helpers import invoke
from usaf.testing import hostile, hostile_artifacts

CASES = hostile_artifacts.cases()


def test_the_catalogue_covers_every_reader_and_is_distinct():
    by_reader = {r: [c.name for c in CASES if c.reader == r] for r in hostile_artifacts.READERS}
    assert all(len(names) >= 10 for names in by_reader.values()), {r: len(n) for r, n in by_reader.items()}
    assert {c.reader for c in CASES} == set(hostile_artifacts.READERS)
    assert len({(c.reader, c.name) for c in CASES}) == len(CASES) >= 40
    assert not set(hostile_artifacts.READERS) & set(hostile.READERS)  # new reader categories, not hostile's


def test_negative_control_the_untouched_plan_copy_trains(bench, tmp_path):
    """A copy of the bench's plan, re-signed as every case is, trains: the re-signing itself breaks nothing."""
    plan = shutil.copytree(hostile_artifacts.bench_plan(bench.root), tmp_path / "plan")
    hostile._resign(plan)
    result = invoke(*hostile_artifacts.train_args(bench, tmp_path, plan=plan))
    assert result.exit_code == 0, result.output
    assert "prefix states of 8 sequences read from the plan" in result.stderr + result.stdout
    assert (tmp_path / "out" / "manifest.json").is_file()
    verified = invoke("inspect", "--verify", plan)
    assert verified.exit_code == 0 and "plan artifact verified" in verified.stdout


def test_negative_control_the_untouched_quantized_copy_scores_evaluates_and_verifies(bench, tmp_path):
    model = hostile._copy_quantized(bench, tmp_path)
    hostile._resign(model)
    assert invoke(*hostile._score(bench, tmp_path, model=model)).exit_code == 0
    evaluated = invoke("eval", "--model", model, "--data", bench.tokens, "--bootstrap", "100", "--out",
                       tmp_path / "report", "--workspace", tmp_path)  # fmt: skip
    assert evaluated.exit_code == 0, evaluated.output
    verified = invoke("inspect", "--verify", model, "--json")
    assert verified.exit_code == 0 and json.loads(verified.stdout)["verified"] is True


def test_inspect_verify_json_reports_the_forged_fingerprint(bench, tmp_path):
    model = hostile._copy_quantized(bench, tmp_path)
    data = json.loads((model / "manifest.json").read_text())
    data["fingerprint"] = "0" * 64
    (model / "manifest.json").write_text(json.dumps(data))
    result = invoke("inspect", "--verify", model, "--json")
    assert result.exit_code == 2
    report = json.loads(result.stdout)
    assert report["verified"] is False
    assert report["problems"] == [{"path": "manifest.json", "problem": report["problems"][0]["problem"]}]
    assert "does not match the sha256 of the files it lists" in report["problems"][0]["problem"]


def test_plain_inspect_also_refuses_the_forged_fingerprint_even_without_hashing(bench, tmp_path):
    plan = shutil.copytree(hostile_artifacts.bench_plan(bench.root), tmp_path / "plan")
    assert invoke("inspect", plan, "--no-hash").exit_code == 0  # negative control
    data = json.loads((plan / "manifest.json").read_text())
    data["fingerprint"] = "0" * 64
    (plan / "manifest.json").write_text(json.dumps(data))
    result = invoke("inspect", plan, "--no-hash")
    assert result.exit_code == 2
    assert f"error: {plan / 'manifest.json'}: its fingerprint 0000000000000000 does not match" in result.stderr


def test_inspect_without_hashing_says_a_file_is_size_checked_not_hashed(bench, tmp_path):
    """``inspect --no-hash`` showed "ok" beside the sha256 column for a file whose bytes had changed at the same size
    (found in review). The control: hashed, the change is found."""
    plan = shutil.copytree(hostile_artifacts.bench_plan(bench.root), tmp_path / "plan")
    index = plan / "prefix_index.json"
    text = index.read_text()
    index.write_text(text.replace("1", "2", 1))  # the same size, other bytes
    unhashed = invoke("inspect", plan, "--no-hash")
    assert unhashed.exit_code == 0 and "size ok, unhashed" in unhashed.stdout, unhashed.output
    assert "│ ok" not in unhashed.stdout
    hashed = invoke("inspect", plan)
    assert hashed.exit_code == 2 and "sha256 differs from the manifest" in " ".join(hashed.output.split())
