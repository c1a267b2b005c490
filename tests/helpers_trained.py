"""A finished tiny training run made through the real CLI (tokenize → score → train), for export and generate tests."""

from __future__ import annotations

from pathlib import Path

from helpers import invoke
from usaf.testing import stdlib_dir


def tokenize(qdir: Path, out: Path) -> Path:
    """Tokens of two small stdlib modules with the tiny tokenizer (the same for every family's tiny model)."""
    result = invoke(
        "tokenize", stdlib_dir() / "textwrap.py", stdlib_dir() / "shlex.py", "--model", qdir, "--seq-len", 32,
        "--held-out", "shlex.py", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def train_run(
    qdir: Path, tokens: Path, root: Path, *, steps: int = 6, train_from: int = 2, targets: str = "experts"
) -> Path:
    """score + train on ``qdir`` (layers from ``train_from``, ``targets``, routers too, one RigL reselection)."""
    plan, run = root / "plan", root / "run"
    for args in (
        ("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--calib-samples", 8,
         "--train-from", train_from, "--targets", targets, "--no-stability", "--out", plan),
        ("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", run, "--lr", 0.05,
         "--router-lr", 0.01, "--steps", steps, "--reselect-every", steps // 2, "--save-every", steps),
    ):  # fmt: skip
        result = invoke(*args)
        assert result.exit_code == 0, result.output
    return run


def straight_and_resumed(qdir: Path, tokens: Path, plan: Path, root: Path, monkeypatch) -> tuple[Path, Path]:
    """A 12-step RigL run (``--reselect-every 4``) made straight, and again interrupted by Ctrl-C at step 7 (inside
    the scoring window of the reselection at step 8) then resumed by the same command: ``(straight, resumed)``."""

    def train(out):
        return invoke("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", out, "--lr", 0.05,
                      "--steps", 12, "--reselect-every", 4, "--reselect-fraction", 0.3, "--save-every", 0)  # fmt: skip

    straight, resumed = root / "straight", root / "resumed"
    assert train(straight).exit_code == 0
    interrupt_at(7, lambda: train(resumed), monkeypatch)
    result = train(resumed)
    assert result.exit_code == 0 and "resuming from" in result.stderr, result.output
    return straight, resumed


def interrupt_at(step: int, run, monkeypatch):
    """``run()`` (a train command) with Ctrl-C at global step ``step``: it must exit with 130 (saved); its result."""
    from usaf.stages.train import trainer

    real_step = trainer.Trainer.step

    def interrupt(self):
        if self.state.step == step:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(trainer.Trainer, "step", interrupt)
    try:
        result = run()
        assert result.exit_code == 130, result.output
        return result
    finally:
        monkeypatch.setattr(trainer.Trainer, "step", real_step)
