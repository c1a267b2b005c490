"""The crash harness's ``usaf score``, ``usaf export`` and ``usaf eval`` stages (see :mod:`usaf.testing.crash`).

Export and eval write one artifact through :class:`~usaf.artifacts.writer.ArtifactWriter` (a temporary sibling
renamed into place), so after a kill a consumer sees nothing or a complete artifact, and the rerun of
the same command starts over. ``export``'s rerun must be byte-identical to the uninterrupted run;
``eval``'s must report the same numbers (its report also holds wall-clock times and the cache's path,
and its base pass may come from the base-pass cache the killed run completed). ``score`` works in a partial
directory and saves its pass and its lr test's probes there: its rerun must resume what was saved and write the
plan byte for byte. ``train-fly`` is ``usaf train`` with no plan anywhere: it scores one on the fly into RUN/plan
(that score's partial directory inside the run directory), so a kill in the score or in the training is resumed by
the same command, to the plan and the run an uninterrupted one writes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from usaf.artifacts import EvalReportManifest, HfExportManifest, PlanManifest, load_manifest
from usaf.cli.app import app
from usaf.stages.score_resume import CALIBRATION, PROBES
from usaf.testing.crash import Setup, Stage, TrainStage, Trial, _verified, same_artifact


def build_run(setup: Setup, root: Path, *, steps: int = 4) -> Path:
    """A short train run on the setup's inputs (in-process): the change export and eval read."""
    run = root / "run"
    result = CliRunner().invoke(
        app,
        ["train", "--model", str(setup.quantized), "--data", str(setup.tokens), "--plan", str(setup.plan),
         "--out", str(run), "--steps", str(steps), "--save-every", str(steps), "--seed", "3"],
    )  # fmt: skip
    if result.exit_code != 0:
        raise RuntimeError(result.output)
    return run


class ScoreStage(Stage):
    """``usaf score`` with the lr test (2-step probes): the pass and each probe are saved in its partial directory."""

    name = "score"

    def __init__(self, quantized: Path, tokens: Path) -> None:
        self.quantized, self.tokens = quantized, tokens

    def args(self, out: Path) -> list[str]:
        return ["score", "--model", str(self.quantized), "--data", str(self.tokens), "--out", str(out),
                "--frac", "0.05", "--calib-samples", "8", "--microbatch", "2", "--train-from", "1",
                "--lr-test", "--lr-test-steps", "2"]  # fmt: skip

    def check_visible(self, out: Path) -> tuple[str, list[str]]:
        if not out.exists():
            partial = out.parent / f".{out.name}.usaf-partial"
            saved = [name for name in (CALIBRATION, PROBES) if (partial / name).is_file()]
            return ("nothing (saved work to resume: " + ", ".join(saved) + ")") if saved else "nothing", []
        return "a complete plan", _verified(out, PlanManifest)

    def compare(self, out: Path, reference: Path) -> list[str]:
        problems = same_artifact(out, reference, PlanManifest)
        if problems:
            return problems
        mine, ref = (load_manifest(p, PlanManifest).summary.model_dump() for p in (out, reference))
        for summary in (mine, ref):
            summary.pop("seconds")
            summary["lr_test"].pop("seconds")
        problems += [f"summary {k}: differs from the uninterrupted run" for k in ref if mine.get(k) != ref[k]]
        partial = out.parent / f".{out.name}.usaf-partial"
        if partial.exists():
            problems.append(f"{partial.name} left after the rerun")
        return problems

    def check_rerun(self, trial: Trial, out: Path, before: list, rerun_events: list, stderr: str) -> list[str]:
        """A pass whose save had completed before the kill (its rename logged and not the kill's event) is resumed,
        not scored again, unless the commit had begun (it deletes the saved work once the manifest is written)."""
        kill = [n for n, kind, _ in before if kind in ("KILL", "FAULT")]
        saved = [n for n, kind, path in before if kind == "replace" and path.endswith(CALIBRATION) and n not in kill]
        committing = any(path.endswith("manifest.json") for _, _, path in before)
        if trial.mode == "time" or not saved or committing:
            return []
        match = re.search(r"(\d+) of (\d+) calibration batches done", stderr)
        if not match or match.group(1) != match.group(2):
            return ["the pass saved before the kill was not resumed whole"]
        return []


class FlyTrainStage(TrainStage):
    """``usaf train`` without ``--plan`` and with an empty workspace: the plan is scored on the fly into RUN/plan."""

    name = "train-fly"

    def args(self, out: Path) -> list[str]:
        args = super().args(out)
        at = args.index("--plan")
        del args[at : at + 2]
        workspace = out.with_name(f"{out.name}-workspace")  # holds nothing: no plan to find, so one is scored
        return [*args, "--workspace", str(workspace), "--frac", "0.05", "--calib-samples", "8", "--train-from", "1"]

    def check_visible(self, out: Path) -> tuple[str, list[str]]:
        seen, problems = super().check_visible(out)
        if (out / "plan").exists():
            problems += [f"plan: {p}" for p in _verified(out / "plan", PlanManifest)]
        elif (out / ".plan.usaf-partial" / CALIBRATION).is_file():
            seen += " (its plan's scoring pass saved to resume)"
        return seen, problems

    def compare(self, out: Path, reference: Path) -> list[str]:
        problems = super().compare(out, reference)
        problems += [f"plan: {p}" for p in same_artifact(out / "plan", reference / "plan", PlanManifest)]
        if (out / ".plan.usaf-partial").exists():
            problems.append(".plan.usaf-partial left after the rerun")
        return problems

    def check_rerun(self, trial: Trial, out: Path, before: list, rerun_events: list, stderr: str) -> list[str]:
        """The newest checkpoint resumed, and a scoring pass saved before the kill resumed whole (as ``score``)."""
        problems = super().check_rerun(trial, out, before, rerun_events, stderr)
        return problems + ScoreStage.check_rerun(self, trial, out, before, rerun_events, stderr)

class ExportStage(Stage):
    """``usaf export --format hf``: the run's change merged into a Hugging Face directory, verified by a reload."""

    name = "export"

    def __init__(self, quantized: Path, run: Path) -> None:
        self.quantized, self.run = quantized, run

    def args(self, out: Path) -> list[str]:
        return ["export", "--model", str(self.quantized), "--checkpoint", str(self.run), "--out", str(out)]

    def check_visible(self, out: Path) -> tuple[str, list[str]]:
        if not out.exists():
            return "nothing", []
        return "a complete export", _verified(out, HfExportManifest)

    def compare(self, out: Path, reference: Path) -> list[str]:
        return same_artifact(out, reference, HfExportManifest)


# the report's fields that are results (not wall-clock times, paths, or whether the cache served)
_EVAL_RESULTS = ("model_fingerprint", "checkpoint_fingerprint", "data_fingerprint", "base_cache_key",
                 "max_logit_change", "rows", "routing", "trainable_layers")  # fmt: skip


class EvalStage(Stage):
    """``usaf eval``: base vs fine-tuned perplexity per source, with its base-pass cache in its own workspace."""

    name = "eval"

    def __init__(self, quantized: Path, run: Path, tokens: Path) -> None:
        self.quantized, self.run, self.tokens = quantized, run, tokens

    def args(self, out: Path) -> list[str]:
        # a workspace per output: a killed run's cache entry is what its rerun finds (or does not); no plots
        # (matplotlib's import is a third of the run, and its PNGs go through the same ArtifactWriter)
        return ["eval", "--model", str(self.quantized), "--checkpoint", str(self.run), "--data", str(self.tokens),
                "--out", str(out), "--workspace", str(out.with_name(out.name + "-ws")), "--no-plots",
                "--bootstrap", "200"]  # fmt: skip

    def check_visible(self, out: Path) -> tuple[str, list[str]]:
        if not out.exists():
            return "nothing", []
        return "a complete report", _verified(out, EvalReportManifest)

    def compare(self, out: Path, reference: Path) -> list[str]:
        problems = _verified(out, EvalReportManifest)
        if problems:
            return problems
        mine, ref = _report(out), _report(reference)
        return [f"report {key}: differs from the uninterrupted run" for key in _EVAL_RESULTS if mine[key] != ref[key]]


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text(encoding="utf-8"))
