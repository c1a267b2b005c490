"""`usaf generate`: streamed, seeded sampling from the quantized model with a trained change applied.

A workspace holds a quantized tiny Qwen3-MoE and a run trained on it (through the real CLI), so the
command's defaults (newest model, newest run trained on it) are exercised too.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import invoke
from helpers_trained import tokenize, train_run
from usaf.artifacts.run import load_trained_change

PROMPT = "def wrap(text, width=70):"


@pytest.fixture(scope="module")
def workspace(quantized, tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    qdir = root / "quantized_model" / "tiny"
    shutil.copytree(quantized("qwen3_moe", num_layers=3, tokenizer=True), qdir)
    run = train_run(qdir, tokenize(qdir, root / "tokens"), root)
    return root, qdir, run


def generate(*args, workspace=None):
    result = invoke("generate", *args, *(("--workspace", workspace) if workspace else ()))
    assert result.exit_code == 0, result.output
    return result


def test_streams_text_and_is_deterministic_with_a_seed(workspace):
    root, _, run = workspace
    first = generate(PROMPT, "--max-new-tokens", 24, "--seed", 3, workspace=root)
    again = generate(PROMPT, "--max-new-tokens", 24, "--seed", 3, workspace=root)
    other = generate(PROMPT, "--max-new-tokens", 24, "--seed", 4, workspace=root)
    assert first.stdout.strip() and first.stdout == again.stdout
    assert other.stdout != first.stdout
    # the defaults: the workspace's model and the newest run trained on it, said on stderr
    assert str(run) in first.stderr and "24 tokens" in first.stderr
    assert "chat template applied (--no-chat: continue the prompt as plain text)" in " ".join(first.stderr.split())
    plain = generate(PROMPT, "--max-new-tokens", 4, "--no-chat", workspace=root)
    assert "chat template" not in plain.stderr  # the control


def test_json_reports_the_change_and_the_chat_template(workspace):
    root, qdir, run = workspace
    out = json.loads(generate(PROMPT, "--max-new-tokens", 8, "--json", workspace=root).stdout)
    assert out["checkpoint"] == str(run) and out["model"] == str(qdir) and out["new_tokens"] == 8
    assert out["chat_template"] and out["rendered_prompt"].startswith("<|im_start|>user\n" + PROMPT)
    plain = json.loads(generate(PROMPT, "--max-new-tokens", 8, "--json", "--no-chat", workspace=root).stdout)
    assert not plain["chat_template"] and plain["rendered_prompt"] == PROMPT
    assert plain["prompt_tokens"] < out["prompt_tokens"]
    untrained = json.loads(generate(PROMPT, "--max-new-tokens", 8, "--json", "--no-checkpoint", workspace=root).stdout)
    assert untrained["checkpoint"] is None


def test_a_tokenizer_without_chat_template_gets_the_plain_prompt(workspace):
    from usaf.data.tokenizer import load_tokenizer
    from usaf.stages.generate import render_prompt

    _, qdir, _ = workspace
    tokenizer = load_tokenizer(str(qdir))
    templated, ids, used = render_prompt(tokenizer, PROMPT, chat=True)
    assert used and tokenizer.convert_tokens_to_ids("<|im_start|>") in ids
    tokenizer.chat_template = None
    rendered, plain_ids, used = render_prompt(tokenizer, PROMPT, chat=True)
    assert not used and rendered == PROMPT and plain_ids == tokenizer(PROMPT)["input_ids"]


def test_with_and_without_the_change_differ(workspace):
    from usaf.data.tokenizer import load_tokenizer
    from usaf.stages.change import model_with_change
    from usaf.stages.generate import render_prompt

    _, qdir, run = workspace
    _, ids, _ = render_prompt(load_tokenizer(str(qdir)), PROMPT, chat=True)
    ids = torch.tensor([ids])
    cpu = torch.device("cpu")
    with torch.no_grad():
        trained = model_with_change(qdir, load_trained_change(run), device=cpu)(input_ids=ids).logits
        untrained = model_with_change(qdir, None, device=cpu)(input_ids=ids).logits
    assert (trained - untrained).abs().max() > 1e-3
    # and the greedy continuations the command prints
    greedy = ("--temperature", 0, "--max-new-tokens", 16, "--json")
    with_change = json.loads(generate(PROMPT, "--checkpoint", run, "--model", qdir, *greedy).stdout)
    without = json.loads(generate(PROMPT, "--no-checkpoint", "--model", qdir, *greedy).stdout)
    assert with_change["text"] != without["text"]


def test_kv_cache_decoding_equals_full_forwards(workspace):
    """usaf's experts implementation keeps no state across calls, so cached decoding is exact."""
    from usaf.stages.change import model_with_change

    _, qdir, run = workspace
    model = model_with_change(qdir, load_trained_change(run), device=torch.device("cpu"))
    ids = torch.randint(1, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    with torch.no_grad():
        cached = model.generate(input_ids=ids, use_cache=True, **kw)
        uncached = model.generate(input_ids=ids, use_cache=False, **kw)
    assert cached.shape[1] == 24 and torch.equal(cached, uncached)


def test_bad_inputs(workspace, tmp_path):
    root, qdir, run = workspace
    result = invoke("generate", PROMPT, "--checkpoint", run, "--no-checkpoint", "--model", qdir)
    assert result.exit_code == 2 and "--no-checkpoint" in result.output
    result = invoke("generate", PROMPT, "--model", qdir, "--checkpoint", tmp_path)
    assert result.exit_code == 2 and "--checkpoint" in result.output
    result = invoke("generate", PROMPT, "--model", qdir, "--checkpoint", run, "--top-p", 0)
    assert result.exit_code == 2 and "--top-p" in result.output
    result = invoke("generate", PROMPT, "--workspace", tmp_path)  # nothing there
    assert result.exit_code == 2 and "--model" in result.output
