"""Small helpers shared by test modules (fixtures that build models live in usaf.testing)."""

from __future__ import annotations

import contextlib
import json
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typer.testing import CliRunner

from usaf.cli.app import app
from usaf.stages.progress import NullProgress

runner = CliRunner()


def invoke(*args: str, env: dict[str, str] | None = None):
    """Run the real CLI in-process; returns click's Result (exit_code, stdout, stderr)."""
    return runner.invoke(app, [str(a) for a in args], env=env)


@contextlib.contextmanager
def ctrl_c_at_step(step: int) -> Iterator[None]:
    """Within the block, ``usaf train`` is interrupted as by Ctrl-C when it is about to run step ``step + 1``."""
    from usaf.stages.train import trainer

    real_step = trainer.Trainer.step

    def interrupt(self):
        if self.state.step == step:
            raise KeyboardInterrupt
        return real_step(self)

    trainer.Trainer.step = interrupt
    try:
        yield
    finally:
        trainer.Trainer.step = real_step


def stop_at_check(monkeypatch, n: int) -> None:
    """The run's n-th stop check (``StopRequest.check``) raises as Ctrl-C does; 0 never (score checks before every
    calibration batch, once after the pass, and after every probe step)."""
    import signal

    from usaf.errors import StopSignal
    from usaf.stages.stop import StopRequest

    calls = [0]

    def check(self, **how) -> None:
        calls[0] += 1
        if calls[0] == n:
            raise StopSignal(signal.SIGINT)

    monkeypatch.setattr(StopRequest, "check", check)

def explain(result) -> str:
    """A failed run's output and, for a crash (not a usaf error's exit), its traceback: an assertion message that
    points at the line, where ``result.output`` alone names only the exception."""
    if result.exc_info is None or isinstance(result.exception, SystemExit):
        return result.output
    return result.output + "".join(traceback.format_exception(*result.exc_info))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def same_plan(a: Path, b: Path) -> None:
    """Two plans alike: every listed file byte-identical (by sha256), the summary equal but for the seconds."""
    from usaf.artifacts import PlanManifest, load_verified

    ma, mb = load_verified(a, PlanManifest), load_verified(b, PlanManifest)
    assert {f.path: f.sha256 for f in ma.files} == {f.path: f.sha256 for f in mb.files}
    sa, sb = ma.summary.model_dump(), mb.summary.model_dump()
    for s in (sa, sb):
        s.pop("seconds")
        s["lr_test"].pop("seconds")
    assert sa == sb


def leftovers(directory: Path) -> list[str]:
    """Hidden temporaries an interrupted or failed write might have left behind."""
    return sorted(p.name for p in directory.iterdir() if ".usaf-tmp-" in p.name or ".usaf-old-" in p.name)


def reference_model(source, loaded):
    """transformers' model of the source checkpoint with each expert tensor replaced by its dequantization."""
    import torch
    from transformers import AutoModelForCausalLM

    from usaf.families.modules import FusedView, transformers_major
    from usaf.quant import dequantize

    # transformers 4.x has no experts registry: its own per-expert forward is the reference there
    kwargs = {"experts_implementation": "eager"} if transformers_major() >= 5 else {}
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs).eval()
    spec = loaded.spec
    view = FusedView(model, spec)
    with torch.no_grad():
        for layer, state in loaded.experts.items():
            for name, weight in ((spec.gate_up_name(layer), state.gate_up), (spec.down_name(layer), state.down)):
                view.set(name, dequantize(weight.q))
    return model


class LargestAllocation(TorchDispatchMode):
    """Records the largest storage any aten op newly allocates, in bytes: what a per-allocation limit sees.

    Outputs sharing storage with an input (views) allocate nothing and are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [*args, *(kwargs or {}).values()]
        given = {a.untyped_storage().data_ptr() for a in inputs if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


class RecordingProgress(NullProgress):
    """A stage's progress calls in order: ``(description, total, unit)`` for a start, ``(amount, counters)`` for an
    advance, ``"finish"``; notes as :class:`NullProgress` keeps them."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list = []

    def start(self, description: str, total: int | None, unit: str, *, done: int = 0) -> None:
        self.events.append((description, total, unit, done) if done else (description, total, unit))

    def advance(self, amount: int, **counters: float) -> None:
        self.events.append((amount, counters))

    def finish(self) -> None:
        self.events.append("finish")
