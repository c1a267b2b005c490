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
    # --stream-experts on a CPU: "streaming moves nothing", then the summary said "experts streamed from host
    # memory" (found in review); now the note alone
    asked = " ".join(generate(PROMPT, "--max-new-tokens", 2, "--stream-experts", workspace=root).stderr.split())
    assert "streaming moves nothing" in asked and "experts streamed" not in asked, asked


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


def test_an_empty_reply_under_the_chat_template_says_how_to_continue_the_prompt(workspace, monkeypatch):
    """The demo's model, pretrained on raw code, ends a chat turn at once: generate printed nothing and no word of
    why (found in review). Said, naming --no-chat (the model is made to end at once here). The control: plain text
    generated says nothing of it."""
    import transformers

    root, _, _ = workspace
    said = " ".join(generate(PROMPT, "--max-new-tokens", 4, workspace=root).stderr.split())
    assert "the reply is empty" not in said, said

    def ends_at_once(self, input_ids, generation_config, **_):
        end = generation_config.eos_token_id
        end = end[0] if isinstance(end, list) else end
        return torch.cat([input_ids, torch.tensor([[end]])], dim=1)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", ends_at_once)
    said = " ".join(generate(PROMPT, workspace=root).stderr.split())
    assert "the reply is empty (1 token, ending it)" in said and "--no-chat" in said and "1 token in" in said, said


def test_a_model_given_relative_is_reported_in_full(workspace, monkeypatch):
    """``--model q`` gave ``"model": "q"`` beside an absolute checkpoint (found in review)."""
    root, qdir, run = workspace
    monkeypatch.chdir(qdir.parent)
    result = generate(PROMPT, "--max-new-tokens", 2, "--json", "--model", qdir.name, "--checkpoint", run)
    out = json.loads(result.stdout)
    assert out["model"] == str(qdir) and out["checkpoint"] == str(run)


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


def test_streamed_experts_give_the_same_text_and_copy_each_frozen_layer_once_a_token(workspace, monkeypatch):
    """generate loaded every 4-bit expert onto the device in fp32 (Qwen3-30B-A3B: ~16 GB of experts, ~6 GB of fp32
    weights: no 12 GB card held it; found in review). It places the model as eval and train do now: streamed, the
    frozen layers' experts are copied to the device a layer ahead of each forward (real copies here, ``"copy"``),
    and greedy decoding gives the same text as resident experts, with and without a change. Control: unstreamed,
    nothing is copied."""
    from dataclasses import replace

    from usaf.engine import streaming
    from usaf.settings.generate import GenerateConfig
    from usaf.stages import engine_setup
    from usaf.stages import generate as stage

    root, qdir, run = workspace
    closed = []  # (the streamed layers, what the streamer did), as each closes
    real_close = streaming.ExpertStreamer.close

    def close(self):
        closed.append((self.layers, replace(self.stats)))
        real_close(self)

    monkeypatch.setattr(streaming.ExpertStreamer, "close", close)

    def generations(stream):
        monkeypatch.setattr(engine_setup, "choose_streaming", lambda requested, backend, size: (stream, None))
        return [stage.run(GenerateConfig(prompt=PROMPT, model=qdir, workspace=root, temperature=0, max_new_tokens=12,
                                         **({"checkpoint": run} if trained else {"no_checkpoint": True})))
                for trained in (True, False)]  # fmt: skip

    resident = generations(False)
    assert closed == [] and not any(g.streamed for g in resident)
    streamed = generations("copy")
    assert [g.text for g in streamed] == [g.text for g in resident] and all(g.streamed for g in streamed)
    (with_change, with_stats), (untrained, untrained_stats) = closed
    assert with_change == (0, 1) and untrained == (0, 1, 2)  # the run trains layer 2: its base stays on the device
    # one forward a new token, each running every streamed layer from a copy (the last one prefetches layer 0 for a
    # next forward), at most two layers' copies alive at once
    assert with_stats.order == [0, 1] * streamed[0].new_tokens
    assert untrained_stats.order == [0, 1, 2] * streamed[1].new_tokens
    assert with_stats.copies == len(with_stats.order) + 1 and untrained_stats.copies == len(untrained_stats.order) + 1
    assert max(with_stats.max_alive, untrained_stats.max_alive) <= streaming.BUFFER_LAYERS


def test_dtype_sets_the_weights_the_model_computes_in(workspace):
    root, _, _ = workspace
    args = (PROMPT, "--max-new-tokens", 6, "--temperature", 0, "--json")
    default = json.loads(generate(*args, workspace=root).stdout)
    half = json.loads(generate(*args, "--dtype", "bfloat16", workspace=root).stdout)
    assert default["dtype"] == "float32" and half["dtype"] == "bfloat16"  # the CPU's policy, and the flag
    assert half["new_tokens"] == 6 and not half["streamed"]
    refused = invoke("generate", PROMPT, "--dtype", "float64", "--workspace", root)
    assert refused.exit_code == 2 and "--dtype" in refused.stderr


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


def test_a_prompt_beyond_the_context_a_refusing_template_and_a_tiny_temperature_are_one_line_each(workspace):
    """Each was found in review: a prompt longer than the model's positions generated text from nothing meaningful
    (exit 0); a template's raise_exception and --temperature 1e-45 gave tracebacks."""
    root, qdir, run = workspace
    args = ["--model", qdir, "--checkpoint", run, "--max-new-tokens", 4]
    long = invoke("generate", "word " * 2000, *args, "--no-chat")
    assert long.exit_code == 2 and "the model's context is" in long.stderr, long.output
    fits = invoke("generate", "word " * 200, *args, "--no-chat", "--max-new-tokens", 10**6, "--temperature", 0)
    assert fits.exit_code == 0 and "--max-new-tokens 1000000: at most" in fits.stderr, fits.output  # the control
    tiny = invoke("generate", PROMPT, *args, "--temperature", 1e-45)
    assert tiny.exit_code == 2 and "0 for greedy decoding" in tiny.stderr, tiny.output


def test_a_prompt_past_the_tokenizers_limit_is_encoded_without_transformers_warning(monkeypatch):
    """transformers warned "Token indices sequence length is longer than the specified maximum" (the tokenizer's
    limit) before usaf's one line naming the model's context (found in review). The control: a plain call warns."""
    import transformers.tokenization_utils_base as base

    from usaf.stages.generate import render_prompt
    from usaf.testing import build_tiny_tokenizer

    warned: list[str] = []
    monkeypatch.setattr(base.logger, "warning", lambda message, *a, **k: warned.append(str(message)))
    tokenizer = build_tiny_tokenizer(model_max_length=16)
    text, ids, chat = render_prompt(tokenizer, "word " * 40, chat=False)
    assert len(ids) > 16 and not chat and warned == []
    tokenizer("word " * 40)
    assert any("Token indices sequence length" in w for w in warned), warned


def test_a_chat_template_that_refuses_the_conversation_is_one_line_naming_it():
    """Gemma's and Mistral's templates raise_exception('System role not supported'): a jinja2 traceback in generate
    and in tokenize's chat lines (found in review). The control: the template as it was renders."""
    from usaf.data.chat import assistant_spans
    from usaf.errors import UsafError
    from usaf.stages.generate import render_prompt
    from usaf.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert render_prompt(tokenizer, PROMPT, chat=True)[2] and assistant_spans(tokenizer, chat, "a.jsonl:1")[1]
    tokenizer.chat_template = "{{ raise_exception('System role not supported') }}"
    with pytest.raises(UsafError, match="PROMPT: the tokenizer's chat template refused .*System role not supported"):
        render_prompt(tokenizer, PROMPT, chat=True)
    with pytest.raises(UsafError, match="a.jsonl:1: the tokenizer's chat template refused"):
        assistant_spans(tokenizer, chat, "a.jsonl:1")


def test_sampling_is_not_cut_to_transformers_default_top_k():
    """transformers applies top_k=50 unless told otherwise: --top-p 1.0 sampled only the 50 likeliest tokens."""
    from pathlib import Path

    from usaf.settings.generate import GenerateConfig
    from usaf.stages.generate import generation_config
    from usaf.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    sampled = generation_config(GenerateConfig(prompt="x", top_p=1.0), tokenizer, Path("/nonexistent"), 8)
    assert sampled.top_k == 0 and sampled.do_sample and sampled.max_new_tokens == 8


def test_with_the_chat_template_generation_stops_at_the_token_replies_end_with():
    """Tokenize trains replies to end with the template's turn end (<|im_end|>); generation stopped only at the EOS
    (<|endoftext|>, a Qwen3 base model's too) and went on inventing turns, the marker hidden (found in review). The
    controls: the plain prompt stops at the EOS alone; a template whose replies end with plain text adds nothing."""
    from pathlib import Path

    from usaf.data.chat import turn_end_ids
    from usaf.settings.generate import GenerateConfig
    from usaf.stages.generate import generation_config
    from usaf.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert turn_end_ids(tokenizer) == [im_end] != [tokenizer.eos_token_id]
    settings = GenerateConfig(prompt="x", temperature=0)
    chat = generation_config(settings, tokenizer, Path("/nonexistent"), 8, chat=True)
    plain = generation_config(settings, tokenizer, Path("/nonexistent"), 8)
    assert chat.eos_token_id == [tokenizer.eos_token_id, im_end] and plain.eos_token_id == tokenizer.eos_token_id
    qwen3 = build_tiny_tokenizer()
    qwen3.chat_template = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
    assert turn_end_ids(qwen3) == [im_end]
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
    assert turn_end_ids(tokenizer) == []


def test_memory_that_runs_out_is_one_line_with_the_ways_out(workspace, monkeypatch):
    """Out of memory while generate loads the model (a 12 GB card at Qwen3-30B-A3B's size, before generate streamed
    the experts there) was torch's traceback (found in review). One line now, naming torch's message; another error
    keeps its traceback (the control: a bug must stay visible)."""
    import torch

    from usaf.stages import generate as stage

    root, _, _ = workspace

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(stage, "load_for_engine", out_of_memory)
    result = invoke("generate", PROMPT, "--workspace", root)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and errors == ["error: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB)"]
    assert "--device cpu" in result.stderr and "Traceback" not in result.stderr

    def bug(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(stage, "load_for_engine", bug)
    result = invoke("generate", PROMPT, "--workspace", root)
    assert result.exit_code == 1 and isinstance(result.exception, RuntimeError)


def test_a_model_directory_usaf_does_not_take_is_named_with_the_way_on(tiny_model, tmp_path):
    """--model an original Hugging Face directory or an export said only "not a usaf artifact" / "expected
    'quantized_model'" (found in review): the hint says what usaf takes. The control: a directory of neither kind
    keeps the generic hint."""
    original = tiny_model("qwen3_moe", num_layers=2, tokenizer=True)
    result = invoke("generate", PROMPT, "--model", original)
    assert result.exit_code == 2 and f"run usaf quantize {original} first" in " ".join(result.stderr.split())
    export = tmp_path / "export"
    export.mkdir()
    (export / "manifest.json").write_text('{"kind": "hf_export", "schema_version": 1}')
    result = invoke("generate", PROMPT, "--model", export)
    assert result.exit_code == 2 and "loads with transformers" in " ".join(result.stderr.split())
    (tmp_path / "empty").mkdir()
    result = invoke("generate", PROMPT, "--model", tmp_path / "empty")
    assert result.exit_code == 2 and "usaf quantize" not in result.stderr, result.output


def test_a_template_that_will_not_render_a_reply_alone_leaves_the_eos_alone():
    """turn_end_ids renders a one-reply conversation of its own: a template refusing it must not stop generate."""
    from usaf.data.chat import turn_end_ids
    from usaf.testing import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('a system message first') }}"
    assert turn_end_ids(tokenizer) == []


def test_streamed_decoding_reads_each_new_token_s_routed_experts_without_copying_layers(quantized, monkeypatch):
    """With 16 experts and top-2, a new token's forward routes to at most 2 of each layer's 16: it reads them from
    host memory, where it copied each whole layer (found in review); the prompt's forward still copies every layer,
    a layer ahead. The same greedy text as resident experts."""
    from dataclasses import replace

    from usaf.engine import streaming
    from usaf.settings.generate import GenerateConfig
    from usaf.stages import engine_setup
    from usaf.stages import generate as stage

    qdir = quantized("qwen3_moe", num_layers=2, tokenizer=True, num_experts=16)
    closed = []
    real_close = streaming.ExpertStreamer.close
    monkeypatch.setattr(streaming.ExpertStreamer, "close", lambda self: (closed.append(replace(self.stats)),
                                                                         real_close(self)))  # fmt: skip

    def generation(stream):
        monkeypatch.setattr(engine_setup, "choose_streaming", lambda requested, backend, size: (stream, None))
        return stage.run(GenerateConfig(prompt=PROMPT, model=qdir, no_checkpoint=True, temperature=0,
                                        max_new_tokens=6))  # fmt: skip

    resident, streamed = generation(False), generation("copy")
    assert streamed.text == resident.text and streamed.streamed and streamed.new_tokens > 1
    (stats,) = closed
    decoded = streamed.new_tokens - 1  # the first new token comes from the prompt's forward
    assert stats.order == [0, 1] * (1 + decoded)
    # the prompt's two layers, and layer 0 prefetched by its last (which the first new token uses)
    assert stats.copies == 2 + 1 and stats.routed_only == 2 * decoded - 1


def test_without_a_finished_run_an_unfinished_one_is_named_with_the_way_to_use_it(workspace, tmp_path):
    """A workspace whose only run was stopped (checkpoints, no manifest): generate said there was no run at all,
    and eval evaluated the base model alone without a word (found in review). Both name the run and the flag that
    uses its newest checkpoint, which then works. Control: a workspace without any run says no such thing."""
    from helpers import ctrl_c_at_step

    root, qdir, _ = workspace
    ws = tmp_path / "ws"
    shutil.copytree(qdir, ws / "quantized_model" / "tiny")
    model = ws / "quantized_model" / "tiny"
    bare = invoke("generate", PROMPT, "--workspace", ws, "--max-new-tokens", 2)
    assert bare.exit_code == 2 and "unfinished run" not in bare.stderr, bare.output  # the control
    with ctrl_c_at_step(2):
        stopped = invoke("train", "--model", model, "--data", root / "tokens", "--plan", root / "plan", "--out",
                         ws / "run" / "stopped", "--steps", 6, "--save-every", 1, "--lr", 0.05)  # fmt: skip
    assert stopped.exit_code == 130, stopped.output
    run = ws / "run" / "stopped"
    result = invoke("generate", PROMPT, "--workspace", ws, "--max-new-tokens", 2)
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert f"the unfinished run {run} has checkpoints (the newest: step-0000002)" in said
    assert f"pass --checkpoint {run} to use it" in said
    assert invoke("generate", PROMPT, "--workspace", ws, "--checkpoint", run, "--max-new-tokens", 2).exit_code == 0
    evaluated = invoke("eval", "--workspace", ws, "--data", root / "tokens", "--max-sequences", 2, "--no-plots",
                       "--out", tmp_path / "report")  # fmt: skip
    assert evaluated.exit_code == 0, evaluated.output
    said = " ".join(evaluated.stderr.split())
    assert "no finished run for this model, so the base model alone: the unfinished run" in said
    assert f"--checkpoint {run} evaluates it" in said


def test_a_damaged_tokenizer_in_a_usaf_model_is_named_as_such(workspace, tmp_path):
    """A tokenizer.json changed in a quantized model was answered "pass a model directory holding tokenizer.json",
    which it was (found in review, from usaf generate). The file that no longer matches the manifest is named, with
    the way back. Control: the same damage in a directory usaf did not make keeps the general hint."""
    _, qdir, _ = workspace
    (tmp_path / "x.py").write_text("x = 1\n" * 20)
    for made_by_usaf in (True, False):
        model = tmp_path / f"model-{made_by_usaf}"
        shutil.copytree(qdir, model)
        if not made_by_usaf:
            (model / "manifest.json").unlink()
        raw = bytearray((model / "tokenizer.json").read_bytes())
        raw[40:48] = b"XXXXXXXX"
        (model / "tokenizer.json").write_bytes(bytes(raw))
        # tokenize takes any tokenizer directory (generate refuses one usaf did not make before reading it)
        result = invoke("tokenize", tmp_path / "x.py", "--model", model, "--out", tmp_path / f"t-{made_by_usaf}")
        assert result.exit_code == 2, result.output
        said = " ".join(result.stderr.split())
        assert "no usable tokenizer" in said
        named = "its tokenizer.json no longer matches the usaf manifest there" in said
        assert named == made_by_usaf and ("usaf quantize" in said) == made_by_usaf, said
    # the command named is the one that made the directory (it said usaf quantize of an export; found in review)
    export = tmp_path / "model-True"
    manifest = json.loads((export / "manifest.json").read_text())
    (export / "manifest.json").write_text(json.dumps({**manifest, "kind": "hf_export"}))
    result = invoke("tokenize", tmp_path / "x.py", "--model", export, "--out", tmp_path / "t-export")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "(usaf export)" in said and "usaf quantize" not in said, said


@pytest.mark.parametrize("text", ["def parse(x):\n    return None", ""])
def test_text_cut_by_ctrl_c_ends_its_line_before_the_interrupt_is_said(monkeypatch, tmp_path, text):
    """Ctrl-C while text streamed: "interrupted: ..." was printed on the text's last line ("return Noneinterrupted")
    (found in review). The text ends its line first. The control: with no text streamed, no empty line."""
    from usaf.stages import generate as stage

    def streams_then_stops(settings, *, on_text=None, progress=None):
        if text:
            on_text(text)
        raise KeyboardInterrupt

    monkeypatch.setattr(stage, "run", streams_then_stops)
    result = invoke("generate", PROMPT, "--workspace", tmp_path)
    assert result.exit_code == 130, result.output
    assert result.stdout == (text + "\n" if text else ""), repr(result.stdout)
