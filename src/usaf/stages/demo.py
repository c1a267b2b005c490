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

from pydantic import Field

from usaf.config import StageConfig
from usaf.stages.progress import NullProgress, Progress

NAME = "demo"  # every artifact of the demo is WORKSPACE/<kind>/demo


class DemoConfig(StageConfig):
    """Settings of ``usaf demo``."""

    workspace: Path = Field(Path("usaf-demo"), description="Where the demo's artifacts go.")
    steps: int = Field(150, ge=1, description="Training steps.")
    frac: float = Field(0.01, gt=0, lt=1, description="Fraction of the trainable layers' expert weights.")
    seq_len: int = Field(256, ge=16, description="Tokens per sequence.")
    lr: float = Field(1e-2, gt=0)
    eval_sequences: int = Field(64, ge=1, description="Sequences per evaluated set (a seeded sample).")
    export: bool = Field(False, description="Also export the fine-tuned model as a Hugging Face directory.")
    device: str = "auto"
    seed: int = 0
    overwrite: bool = Field(False, description="Start over: replace the demo's artifacts.")


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


def commands(config: DemoConfig) -> list[tuple[str, list[str]]]:
    """The shell commands that do what the demo does, stage by stage."""
    from usaf.demo import DEMO_DOMAIN, PRETRAIN_DOMAIN, demo_model_dir

    p = paths(config.workspace)
    model = str(demo_model_dir())
    domain = DEMO_DOMAIN.tokenize_options()
    tokenize = ["usaf", "tokenize", *map(str, domain["inputs"]), "--model", model, "--seq-len", str(config.seq_len)]
    tokenize += [a for g in domain["exclude"] for a in ("--exclude", g)]
    tokenize += [a for s in domain["held_out"] for a in ("--held-out", s)]
    tokenize += ["--source-depth", str(domain["source_depth"]), "--decode-errors", "replace", "--out", str(p["tokens"])]
    forgetting = [str(x) for x in PRETRAIN_DOMAIN.inputs() if x.name in set(PRETRAIN_DOMAIN.held_out)]
    out = [
        ("tokenize", tokenize),
        ("quantize", ["usaf", "quantize", model, "--out", str(p["quantized"])]),
        ("score", ["usaf", "score", "--model", str(p["quantized"]), "--data", str(p["tokens"]), "--frac",
                   str(config.frac), "--seed", str(config.seed), "--cache", "--out", str(p["plan"])]),
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


_ARTIFACT = {"tokenize": "tokens", "quantize": "quantized", "score": "plan", "train": "run", "eval": "eval",
             "export": "export"}  # fmt: skip


def _tokenize(config: DemoConfig, p: dict[str, Path], progress: Progress):
    from usaf.demo import DEMO_DOMAIN, demo_model_dir
    from usaf.stages import tokenize

    settings = tokenize.TokenizeConfig(
        **DEMO_DOMAIN.tokenize_options(), model=str(demo_model_dir()), seq_len=config.seq_len, out=p["tokens"]
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
        device=config.device,
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
    from usaf.demo import PRETRAIN_DOMAIN
    from usaf.stages import eval as eval_stage

    forgetting = [x for x in PRETRAIN_DOMAIN.inputs() if x.name in set(PRETRAIN_DOMAIN.held_out)]
    settings = eval_stage.EvalConfig(
        model=p["quantized"], checkpoint=p["run"], data=[p["tokens"]], held_out=[p["tokens"], *forgetting],
        max_sequences=config.eval_sequences, out=p["eval"], device=config.device, seed=config.seed,
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
