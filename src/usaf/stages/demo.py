"""``usaf demo``: the whole pipeline on the built-in default, through the same stage functions as the commands.

The default is the small pretrained Qwen3-MoE shipped in ``usaf.demo`` and a fine-tuning task on the Python
standard library's own sources (``usaf.demo.DEMO_DOMAIN``: network, mail and markup packages the model never
saw, with some of their sources held out), so nothing is downloaded. Each stage writes its artifact under a
fixed name in the demo workspace; a rerun reuses the finished ones and resumes an interrupted training run,
so Ctrl-C at any point loses at most the steps since the last checkpoint.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from usaf.settings.demo import DemoConfig
from usaf.stages.progress import NullProgress, Progress

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
    from usaf.demo import PRETRAIN_DOMAIN

    chosen = [x for x in PRETRAIN_DOMAIN.inputs() if x.name in FORGETTING_SOURCES]
    assert len(chosen) == len(FORGETTING_SOURCES) and set(FORGETTING_SOURCES) <= set(PRETRAIN_DOMAIN.held_out)
    return chosen


def domain(config: DemoConfig):
    """The fine-tuning domain: ``usaf.demo.DEMO_DOMAIN``, or three of its sources with ``--quick``."""
    from dataclasses import replace

    from usaf.demo import DEMO_DOMAIN

    if not config.quick:
        return DEMO_DOMAIN
    return replace(DEMO_DOMAIN, paths=QUICK_SOURCES, held_out=QUICK_SOURCES[-1:])


def effective(config: DemoConfig) -> DemoConfig:
    """``--quick`` shortens the run (explicit values of other settings are overridden only by it)."""
    if not config.quick:
        return config
    return config.model_copy(update={"steps": min(config.steps, 20), "eval_sequences": min(config.eval_sequences, 16)})


def commands(config: DemoConfig) -> list[tuple[str, list[str]]]:
    """The shell commands that do what the demo does, stage by stage."""
    from usaf.demo import demo_model_dir

    config = effective(config)
    p = paths(config.workspace)
    model = str(demo_model_dir())
    domain_options = domain(config).tokenize_options()
    tokenize = ["usaf", "tokenize", *map(str, domain_options["inputs"]), "--model", model]
    tokenize += ["--seq-len", str(config.seq_len)]
    tokenize += [a for g in domain_options.get("include", []) for a in ("--include", g)]
    tokenize += [a for g in domain_options["exclude"] for a in ("--exclude", g)]
    tokenize += [a for s in domain_options["held_out"] for a in ("--held-out", s)]
    tokenize += ["--source-depth", str(domain_options["source_depth"]), "--decode-errors", "replace"]
    tokenize += ["--out", str(p["tokens"])]
    forgetting = [str(x) for x in forgetting_inputs()]
    out = [
        ("tokenize", tokenize),
        ("quantize", ["usaf", "quantize", model, "--out", str(p["quantized"])]),
        ("score", ["usaf", "score", "--model", str(p["quantized"]), "--data", str(p["tokens"]), "--frac",
                   str(config.frac), "--seed", str(config.seed), "--no-stability", "--cache", "--out", str(p["plan"])]),
        ("train", ["usaf", "train", "--model", str(p["quantized"]), "--data", str(p["tokens"]), "--plan",
                   str(p["plan"]), "--eval-data", str(p["tokens"]), "--steps", str(config.steps), "--lr",
                   str(config.lr), "--seed", str(config.seed), "--out", str(p["run"])]),
        ("eval", ["usaf", "eval", "--model", str(p["quantized"]), "--checkpoint", str(p["run"]), "--data",
                  str(p["tokens"]), "--held-out", str(p["tokens"]), *[a for f in forgetting for a in ("--held-out", f)],
                  "--max-sequences", str(config.eval_sequences), "--out", str(p["eval"])]),
    ]  # fmt: skip
    if config.export:
        out.append(("export", ["usaf", "export", "--model", str(p["quantized"]), "--checkpoint", str(p["run"]),
                               "--base", model, "--out", str(p["export"])]))  # fmt: skip
    return out


def shell_line(command: list[str]) -> str:
    return " ".join(shlex.quote(part) for part in command)


def run(
    config: DemoConfig,
    *,
    progress: Progress | None = None,
    on_step: Callable[[DemoStep], None] | None = None,
) -> tuple[Any, Path]:
    """Run every stage; returns the eval report's manifest and directory (``on_step`` sees each stage)."""
    import shutil

    from usaf.artifacts import load_manifest

    progress = progress or NullProgress()
    config = effective(config)
    p = paths(config.workspace)
    if config.overwrite:
        for path in p.values():
            shutil.rmtree(path, ignore_errors=True)
    for name, command in commands(config):
        step = DemoStep(name, command, p[_ARTIFACT[name]])
        if (step.path / "manifest.json").is_file():
            step.manifest, step.reused = load_manifest(step.path), True
            progress.note(f"{name}: reusing {step.path} (rerun with --overwrite to start over)")
        else:
            progress.note(f"{name}: {shell_line(command)}")
            step.manifest, _ = _STAGES[name](config, p, progress)
        if on_step is not None:
            on_step(step)
    return load_manifest(p["eval"]), p["eval"]


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
    import math

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


_ARTIFACT = {"tokenize": "tokens", "quantize": "quantized", "score": "plan", "train": "run", "eval": "eval",
             "export": "export"}  # fmt: skip


def _tokenize(config: DemoConfig, p: dict[str, Path], progress: Progress):
    from usaf.demo import demo_model_dir
    from usaf.stages import tokenize

    settings = tokenize.TokenizeConfig(
        **domain(config).tokenize_options(), model=str(demo_model_dir()), seq_len=config.seq_len, out=p["tokens"]
    )
    return tokenize.run(settings, progress=progress)


def _quantize(config: DemoConfig, p: dict[str, Path], progress: Progress):
    from usaf.demo import demo_model_dir
    from usaf.stages import quantize

    return quantize.run(
        quantize.QuantizeConfig(model=str(demo_model_dir()), out=p["quantized"], device=config.device),
        progress=progress,
    )


def _score(config: DemoConfig, p: dict[str, Path], progress: Progress):
    from usaf.stages import score

    settings = score.ScoreConfig(
        model=p["quantized"], data=p["tokens"], frac=config.frac, seed=config.seed, cache=True, out=p["plan"],
        device=config.device, stability=False,  # not shown by the demo: two more scoring passes saved
    )  # fmt: skip
    return score.run(settings, progress=progress)


def _train(config: DemoConfig, p: dict[str, Path], progress: Progress):
    from usaf.stages import train

    settings = train.TrainConfig(
        model=p["quantized"], data=p["tokens"], plan=p["plan"], eval_data=p["tokens"], steps=config.steps,
        lr=config.lr, seed=config.seed, out=p["run"], device=config.device,
    )  # fmt: skip
    return train.run(settings, progress=progress)


def _eval(config: DemoConfig, p: dict[str, Path], progress: Progress):
    from usaf.stages import eval as eval_stage

    forgetting = forgetting_inputs()
    settings = eval_stage.EvalConfig(
        model=p["quantized"], checkpoint=p["run"], data=[p["tokens"]], held_out=[p["tokens"], *forgetting],
        max_sequences=config.eval_sequences, out=p["eval"], device=config.device, seed=config.seed,
        workspace=config.workspace,  # the base-pass cache stays inside the demo's workspace
    )  # fmt: skip
    return eval_stage.run(settings, progress=progress)


def _export(config: DemoConfig, p: dict[str, Path], progress: Progress):
    from usaf.demo import demo_model_dir
    from usaf.stages import export

    settings = export.ExportConfig(model=p["quantized"], checkpoint=p["run"], base=str(demo_model_dir()),
                                   out=p["export"])  # fmt: skip
    return export.run(settings, progress=progress)


_STAGES = {
    "tokenize": _tokenize,
    "quantize": _quantize,
    "score": _score,
    "train": _train,
    "eval": _eval,
    "export": _export,
}
