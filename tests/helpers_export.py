"""Export checks shared by the export tests: run ``usaf export``, and logits of an export and of the engine."""

from __future__ import annotations

import json

import torch

from helpers import invoke


def export(*args):
    result = invoke("export", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def hf_logits(path, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def engine_logits(qdir, change, ids):
    from usaf.stages.change import model_with_change

    with torch.no_grad():
        return model_with_change(qdir, change, device=torch.device("cpu"))(input_ids=ids).logits


def ids_for(qdir, n=3, t=20):
    return torch.randint(0, 512, (n, t), generator=torch.Generator().manual_seed(7))
