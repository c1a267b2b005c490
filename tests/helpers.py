"""Small helpers shared by test modules (fixtures that build models live in usaf.testing)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from usaf.cli.app import app

runner = CliRunner()


def invoke(*args: str, env: dict[str, str] | None = None):
    """Run the real CLI in-process; returns click's Result (exit_code, stdout, stderr)."""
    return runner.invoke(app, [str(a) for a in args], env=env)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def leftovers(directory: Path) -> list[str]:
    """Hidden temporaries an interrupted or failed write might have left behind."""
    return sorted(p.name for p in directory.iterdir() if ".usaf-tmp-" in p.name or ".usaf-old-" in p.name)


def reference_model(source, loaded):
    """transformers' model of the source checkpoint with each expert tensor replaced by its dequantization."""
    import torch
    from transformers import AutoModelForCausalLM

    from usaf.quant import dequantize

    model = AutoModelForCausalLM.from_pretrained(source, experts_implementation="eager").eval()
    spec = loaded.spec
    with torch.no_grad():
        for layer, state in loaded.experts.items():
            for name, weight in ((spec.gate_up_name(layer), state.gate_up), (spec.down_name(layer), state.down)):
                model.get_parameter(name).copy_(dequantize(weight.q))
    return model
