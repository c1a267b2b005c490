"""``usaf demo``: the whole pipeline on the built-in default, through the same stage functions as the commands.

The default is the small pretrained Qwen3-MoE shipped in ``usaf.demo`` and a fine-tuning task on the Python
standard library's own sources (``usaf.demo.DEMO_DOMAIN``: network, mail and markup packages the model never
saw, with some of their sources held out), so nothing is downloaded. Each stage writes its artifact under a
fixed name in the demo workspace; a rerun reuses the finished ones and resumes the interrupted one (quantize,
score, train and eval keep their work at Ctrl-C), so Ctrl-C at any point loses little.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from usaf.artifacts import (
    EXPORT_KINDS,
    EvalReportManifest,
    HfExportManifest,
    PlanManifest,
    QuantizedModelManifest,
    RunManifest,
    TokensManifest,
    load_manifest,
    load_verified,
)
from usaf.artifacts.loader import artifacts_inside
from usaf.artifacts.outputs import found_at, refuse_unless_replaceable, remove_usaf_made
from usaf.artifacts.writer import discard_partial
from usaf.backends import resolve_backend
from usaf.config import source_of, was_given
from usaf.data.corpus import discover
from usaf.demo import DEMO_DOMAIN, PRETRAIN_DOMAIN, demo_model_dir
from usaf.errors import UsafError
from usaf.settings.argv import command_line
from usaf.settings.demo import DemoConfig
from usaf.settings.eval import EvalConfig
from usaf.settings.export import ExportConfig
from usaf.settings.quantize import QuantizeConfig
from usaf.settings.score import ScoreConfig
from usaf.settings.tokenize import TokenizeConfig
from usaf.settings.train import DEFAULT_LR, TrainConfig
from usaf.stages.progress import NullProgress, Progress
from usaf.stages.quantize_parts import PARTIAL_SETTINGS
from usaf.stages.score_resume import SETTINGS as SCORE_SETTINGS
from usaf.units import first_few

NAME = "demo"  # every artifact of the demo is WORKSPACE/<kind>/demo


@dataclass
class DemoStep:
    """One stage of the demo: its command line, and what it produced."""

    name: str
    command: list[str]
    path: Path
    manifest: Any = None
    reused: bool = False


def paths(workspace: Path) -> dict[str, Path]:
    """Each stage's output, named in full: a relative workspace's report and plots were printed relative beside the
    absolute cache path (found in review)."""
    workspace = Path(os.path.abspath(workspace))
    return {
        "tokens": workspace / "tokens" / NAME,
        "quantized": workspace / "quantized_model" / NAME,
        "plan": workspace / "plan" / NAME,
        "run": workspace / "run" / NAME,
        "eval": workspace / "eval_report" / NAME,
        "export": workspace / "export" / NAME,
    }


QUICK_SOURCES = ("email", "http", "smtplib.py")  # --quick: two packages to train on, one module held out
# Forgetting: three of the pretraining domain's held-out sources, evaluated as raw text (eval time is bounded).
FORGETTING_SOURCES = ("argparse.py", "difflib.py", "textwrap.py")


def forgetting_inputs() -> list[Path]:
    chosen = [x for x in PRETRAIN_DOMAIN.inputs() if x.name in FORGETTING_SOURCES]
    assert len(chosen) == len(FORGETTING_SOURCES) and set(FORGETTING_SOURCES) <= set(PRETRAIN_DOMAIN.held_out)
    return chosen


def domain(config: DemoConfig):
    """The fine-tuning domain: ``usaf.demo.DEMO_DOMAIN``, or three of its sources with ``--quick``; with the
    ``--exclude`` patterns that match a file of this Python only."""
    if not config.quick:
        return _excluding_what_is_here(DEMO_DOMAIN)
    return _excluding_what_is_here(replace(DEMO_DOMAIN, paths=QUICK_SOURCES, held_out=QUICK_SOURCES[-1:]))


@functools.cache
def _excluding_what_is_here(chosen):
    """``chosen`` without the exclude patterns that match nothing under its inputs here: they leave out files of
    other Python versions (3.10-3.13), and tokenize says each pattern that matched nothing, so every demo began with
    a note of 14 "matched no file or directory" patterns, and its shell lines carried them (found in review). The
    files selected are the same."""
    options = chosen.tokenize_options()
    kept = _matching_here(chosen.exclude, options["inputs"], options["include"], options["source_depth"])
    return replace(chosen, exclude=tuple(kept))


def _matching_here(exclude: Sequence[str], inputs: list[Path], include: list[str], source_depth: int) -> list[str]:
    """The patterns of ``exclude`` that match a file or directory under ``inputs`` here."""
    corpus = discover(inputs, include=include, exclude=list(exclude), source_depth=source_depth)
    unmatched = set(corpus.unmatched_patterns)
    return [p for p in exclude if f"--exclude {p}" not in unmatched]


def effective(config: DemoConfig) -> DemoConfig:
    """``--quick`` shortens the run: at most 20 steps and 16 held-out sequences, where those were not given (a given
    --steps 100 was cut to 20 in silence; found in review)."""
    if not config.quick:
        return config
    caps = {"steps": 20, "eval_sequences": 16}
    return config.model_copy(update={name: min(getattr(config, name), cap) for name, cap in caps.items()
                                     if not was_given(config, name)})  # fmt: skip


def stage_settings(config: DemoConfig) -> dict[str, Any]:
    """Each stage's settings, stage by stage: what the demo runs, and what its shell lines say."""
    p = paths(config.workspace)
    model = str(demo_model_dir())
    device = config.device
    stages: dict[str, Any] = {
        "tokenize": TokenizeConfig(**domain(config).tokenize_options(), model=model, seq_len=config.seq_len,
                                   out=p["tokens"]),
        "quantize": QuantizeConfig(model=model, out=p["quantized"], device=device),
        "score": ScoreConfig(model=p["quantized"], data=p["tokens"], frac=config.frac, seed=config.seed, cache=True,
                             out=p["plan"], device=device,
                             stability=False),  # not shown by the demo: two more scoring passes saved
        "train": TrainConfig(model=p["quantized"], data=p["tokens"], plan=p["plan"], eval_data=p["tokens"],
                             steps=config.steps, lr=config.lr, seed=config.seed, out=p["run"], device=device),
        "eval": EvalConfig(model=p["quantized"], checkpoint=p["run"], data=[p["tokens"]],
                           held_out=[p["tokens"], *forgetting_inputs()], max_sequences=config.eval_sequences,
                           out=p["eval"], device=device, seed=config.seed,  # the base-pass cache stays inside the
                           workspace=Path(os.path.abspath(config.workspace))),  # demo's workspace, named in full
    }  # fmt: skip
    if config.export:
        stages["export"] = ExportConfig(model=p["quantized"], checkpoint=p["run"], base=model, out=p["export"])
    return stages


def commands(config: DemoConfig) -> list[tuple[str, list[str]]]:
    """The shell commands that do what the demo does, stage by stage (spelled from the same settings)."""
    return [(name, command_line(name, settings)) for name, settings in stage_settings(effective(config)).items()]


def shell_line(command: list[str]) -> str:
    return " ".join(shlex.quote(part) for part in command)


def run(
    config: DemoConfig,
    *,
    progress: Progress | None = None,
    on_step: Callable[[DemoStep], None] | None = None,
) -> tuple[Any, Path]:
    """Run every stage; returns the eval report's manifest and directory (``on_step`` sees each stage)."""
    progress = progress or NullProgress()
    config = effective(config)
    p = paths(config.workspace)
    _refuse_before_any_work(config, p)
    if config.overwrite:
        for artifact, path in p.items():  # each only if usaf made it, of its kind: a user's directory is refused
            remove_usaf_made(path, "--workspace", kinds=_KINDS[artifact])
            if discard_partial(path, _PARTIAL_MARKERS):  # an interrupted quantize's or score's saved work
                progress.note(f"--overwrite: discarded the interrupted run's work for {path}")
    for name, settings in stage_settings(config).items():
        command = command_line(name, settings)
        step = DemoStep(name, command, p[_ARTIFACT[name]])
        if (step.path / "manifest.json").is_file():
            # verified as any consumer does (sizes, the manifest's own checksum): an edited report was reused and its
            # edited numbers shown as the demo's (found in review)
            step.manifest = load_verified(step.path, _MANIFESTS[name], flag="--workspace", hashes=False)
            step.reused = True
            _check_made_with(name, step, settings, config.workspace, p[_ARTIFACT["score"]])
            progress.note(f"{name}: reusing {step.path} (rerun with --overwrite to start over)")
        else:
            progress.note(f"{name}: {shell_line(command)}")
            try:
                step.manifest, _ = importlib.import_module(f"usaf.stages.{name}").run(settings, progress=progress)
            except UsafError as e:
                raise _in_demo_words(e, name, step.path, config.workspace) from None
            except KeyboardInterrupt:  # Ctrl-C, or a StopSignal (SIGTERM, SIGHUP)
                if config.overwrite:  # the stage's "run the same command to resume": with --overwrite it discards
                    progress.note("usaf demo: rerun without --overwrite to resume (with it, that saved work is "
                                  "discarded and the demo starts over)")  # fmt: skip  (found in review)
                raise
        if on_step is not None:
            on_step(step)
    return load_manifest(p["eval"]), p["eval"]


def _refuse_before_any_work(config: DemoConfig, p: dict[str, Path]) -> None:
    """What a stage would refuse only when its turn came, refused before any stage runs or ``--overwrite`` deletes
    anything: a ``--workspace`` that is a file, a ``--device`` this machine lacks, a stage's output that usaf may not
    replace (a user's directory or file, a link, another command's artifact). Each stage refused its own, after the
    stages before it had run, and with ``--overwrite`` after every finished stage was deleted (found in review)."""
    existing = config.workspace.absolute()
    while not existing.exists():  # the first of it that exists: a file there (or above it) stops every stage
        existing = existing.parent
    if not existing.is_dir():
        raise UsafError(
            f"--workspace {config.workspace}: {'it' if existing == config.workspace.absolute() else existing} is a "
            "file, not a directory",
            "pass a directory (new, or a demo workspace) as --workspace",
        )
    if others := _others_artifacts(config.workspace, p):
        raise UsafError(
            f"--workspace {config.workspace}: holds usaf artifacts that are not the demo's ({first_few(others)}): the "
            "demo's would be the newest there, and a command there without its inputs named would take them or "
            "refuse to choose",
            "pass another --workspace (a new directory, or a demo workspace such as the default ./usaf-demo)",
        )
    resolve_backend(None if config.device == "auto" else config.device, source=source_of(config, "device"))
    for artifact, path in p.items():
        if artifact != "export" or config.export:  # passes: absent, empty, a demo artifact of the stage's kind
            try:
                refuse_unless_replaceable(path, found_at(path), "--workspace", overwrite=True,
                                          overwrite_flag="--overwrite", kinds=_KINDS[artifact],
                                          replacing=config.overwrite)  # fmt: skip
            except UsafError as e:  # the stage's output named as the workspace (found in review): said as what it is
                said = e.message.removeprefix(f"--workspace {path}: ")
                hint = e.hint if not (e.hint or "").startswith("pass another --workspace") else (  # else its own way
                    f"move {path} out of the workspace, or pass another --workspace (a new directory, or a demo "
                    "workspace)")  # fmt: skip
                raise UsafError(f"--workspace {config.workspace}: where the demo writes its {artifact} ({path}) is "
                                f"{said}", hint) from None  # fmt: skip


def _others_artifacts(workspace: Path, p: dict[str, Path]) -> list[Path]:
    """The usaf artifacts in ``workspace`` (``KIND/NAME``, as every command's --workspace keeps them) that are not the
    demo's own: the demo wrote its artifacts beside a user's, which then took the demo's as the newest (found in
    review)."""
    if not workspace.is_dir():
        return []
    own = {path.resolve() for path in p.values()}
    found = [a for kind in sorted(workspace.iterdir()) if kind.is_dir() for a in artifacts_inside(kind)]
    return [a for a in found if a.resolve() not in own]


def _in_demo_words(error: UsafError, name: str, path: Path, workspace: Path) -> UsafError:
    """A stage's refusal of its ``--out`` as the demo's: the demo has no ``--out`` (its workspace places each stage's
    output), and "--out .../usaf-demo/run/demo: holds another run" named a flag it does not take (found in review)."""
    prefix = f"--out {path}"
    if not error.message.startswith(prefix):
        return error
    message = f"--workspace {workspace}: its {name} stage ({path}){error.message[len(prefix):]}"
    if message.endswith((" already exists there", " is there")):  # another demo wrote it meanwhile: the stage's hint
        # named --resume, --force or another --out, which the demo does not take (found in review)
        return UsafError(message, "rerun the demo: it reuses each finished stage there (another usaf process may "
                         "have written it meanwhile); --overwrite starts over")  # fmt: skip
    return UsafError(message, error.hint.replace("--out", "--workspace") if error.hint else error.hint)


def _check_made_with(name: str, step: DemoStep, settings: Any, workspace: Path, plan: Path) -> None:
    """Refuse to reuse a stage made with other settings than this demo's (``--steps``, ``--quick``, ...): its result
    would be shown as this run's. Compared: what the demo sets for the stage, against the stage's recorded config;
    a setting not given now too (a stage made with ``--frac 0.05`` was reused by a demo without it, its result shown
    as the default's; found in review), where the stage records it unset as unset: train records the lr it took
    from the plan's lr test (``plan``), which is what the demo's unset lr means."""
    recorded = step.manifest.config
    wanted = settings.model_dump(mode="json")
    excluded = recorded.get("exclude") if name == "tokenize" else None
    if isinstance(excluded, list) and all(isinstance(p, str) for p in excluded):  # a demo before 2026-12-07 recorded
        # the patterns of every Python, and was refused as made with other settings (the same files; found in review)
        recorded = {**recorded, "exclude": _matching_here(excluded, settings.inputs, settings.include,
                                                          settings.source_depth)}  # fmt: skip
    if name == "train" and wanted.get("lr") is None:
        wanted["lr"] = _plan_lr(plan)
    differ = [f"{key} {_shown(recorded.get(key))} there, {_shown(value)} now" for key, value in wanted.items()
              if key in recorded and _named(recorded[key]) != _named(value)]  # fmt: skip
    if differ:
        raise UsafError(
            f"--workspace {workspace}: its {name} stage ({step.path}) was made with other settings: "
            + "; ".join(differ),
            "rerun with the settings of before, or pass --overwrite to start over (or another --workspace)",
        )


def _plan_lr(plan: Path) -> float:
    """The lr train takes from the demo's plan (:func:`usaf.stages.train.inputs.with_lr`'s, without --lr)."""
    test = load_manifest(plan).summary.lr_test
    return test.lr if test is not None else DEFAULT_LR


def _shown(value: Any) -> str:
    """A setting as a user reads it: "the default" for one not given ("frac None there"; found in review)."""
    return "the default" if value is None else repr(value)


def _named(value: Any) -> Any:
    """A path by its last component (the workspace spelled relative or absolute, or moved, or usaf reinstalled
    elsewhere, is the same demo; the domain's sources keep their names), anything else as it is."""
    if isinstance(value, list):
        return [_named(v) for v in value]
    return Path(value).name if isinstance(value, str) and os.sep in value else value


@dataclass(frozen=True)
class Outcome:
    """Base and fine-tuned perplexity of one group of evaluated sources (token-weighted)."""

    group: str
    sources: int
    tokens: int
    base_ppl: float
    tuned_ppl: float | None


def outcomes(config: DemoConfig, report: dict) -> list[Outcome]:
    """The eval report's per-source rows in the demo's three groups: the sequences trained on, the same
    domain's held-out sources, and the pretraining domain's held-out sources (forgetting)."""
    held_out = set(domain(effective(config)).held_out)
    groups: dict[str, list[dict]] = {"trained-on sources": [], "held-out sources, same domain": [],
                                     "pretraining domain (forgetting)": []}  # fmt: skip
    for row in report["rows"]:
        if row["overall"]:
            continue
        if row["set"] == "data":
            groups["trained-on sources"].append(row)
        elif row["source"] in held_out:
            groups["held-out sources, same domain"].append(row)
        else:
            groups["pretraining domain (forgetting)"].append(row)
    out = []
    for name, rows in groups.items():
        tokens = sum(r["tokens"] for r in rows)
        if not tokens:
            continue

        def ppl(side: str, rows=rows, tokens=tokens) -> float | None:
            if any(r.get(side) is None for r in rows):
                return None
            return math.exp(sum(r[side]["nll"] * r["tokens"] for r in rows) / tokens)

        out.append(Outcome(name, len(rows), tokens, ppl("base"), ppl("tuned")))
    return out


_PARTIAL_MARKERS = (PARTIAL_SETTINGS, SCORE_SETTINGS)  # what quantize and score write first in a partial directory
_ARTIFACT = {"tokenize": "tokens", "quantize": "quantized", "score": "plan", "train": "run", "eval": "eval",
             "export": "export"}  # fmt: skip
_MANIFESTS = {"tokenize": TokensManifest, "quantize": QuantizedModelManifest, "score": PlanManifest,
              "train": RunManifest, "eval": EvalReportManifest, "export": HfExportManifest}  # fmt: skip
_KINDS = {"tokens": (TokensManifest.KIND,), "quantized": (QuantizedModelManifest.KIND,), "plan": (PlanManifest.KIND,),
          "run": (RunManifest.KIND,), "eval": (EvalReportManifest.KIND,), "export": EXPORT_KINDS}  # fmt: skip
