"""``usaf generate``: sampled text from the quantized model with a trained change applied, streamed.

The model is the one training and evaluation use (4-bit experts, the change's sparse deltas and routers
through the engine), placed as they place it: the unquantized weights in the backend's compute dtype (bf16 on
a GPU) and, where the 4-bit experts would take over half the free device memory (Qwen3-30B-A3B's ~16 GB on a
12 GB card), the frozen layers' experts streamed from host memory a layer ahead (``--stream-experts``). It is
driven by transformers' own ``generate`` with its KV cache: usaf's experts implementation maps ``(T, H)`` routed
tokens to ``(T, H)`` outputs with no state across calls, so a decoding step with one new token and cached
keys/values is the same computation as a full forward (a test checks greedy decoding with and without the cache
agree, and streamed against resident).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, TextStreamer

from usaf.artifacts import settings_workspace
from usaf.artifacts.run import TrainedChange
from usaf.backends import resolve_backend
from usaf.config import refuse_unused, source_of
from usaf.data.chat import template_errors, turn_end_ids
from usaf.data.tokenizer import load_tokenizer, max_sequence_length
from usaf.errors import UsafError
from usaf.settings.generate import GenerateConfig
from usaf.stages.change import engine_with_change, resolve_model_and_change
from usaf.stages.engine_setup import load_for_engine, stream_every_layer
from usaf.stages.progress import NullProgress, Progress, say_backend_notes
from usaf.units import counted


@dataclass(frozen=True)
class Generation:
    model: Path
    checkpoint: Path | None
    prompt: str
    rendered_prompt: str  # what was tokenized: the chat-templated prompt, or the prompt itself
    chat_template: bool  # whether the chat template was applied
    prompt_tokens: int
    text: str
    new_tokens: int
    seconds: float
    device: str
    dtype: str  # of the unquantized weights, as the model holds them ("bfloat16")
    streamed: bool  # whether the 4-bit experts were streamed from host memory (through the streaming hooks)
    unified_memory: bool  # host and device memory are one (CPU, Apple silicon): streaming moved nothing


def render_prompt(tokenizer: Any, prompt: str, *, chat: bool) -> tuple[str, list[int], bool]:
    """The text to encode, its token ids and whether the chat template was applied.

    With a template, the prompt is one user message followed by the assistant's generation prompt, and the
    rendered text is encoded without adding special tokens again (the template writes its own).
    """
    if chat and getattr(tokenizer, "chat_template", None):
        with template_errors("PROMPT"):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        return rendered, list(tokenizer(rendered, add_special_tokens=False, verbose=False)["input_ids"]), True
    # verbose=False: transformers' "longer than the specified maximum" warning came before usaf's error, with the
    # tokenizer's limit, not the model's context the error names (found in review)
    return prompt, list(tokenizer(prompt, verbose=False)["input_ids"]), False


def _streamer(tokenizer: Any, on_text: Callable[[str], None]) -> Any:
    class Streamer(TextStreamer):
        """transformers' word-boundary streaming, handing text to a callback instead of print()."""

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if text:
                on_text(text)

    return Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def generation_config(
    config: GenerateConfig, tokenizer: Any, model_dir: Path, max_new_tokens: int, *, chat: bool = False
) -> Any:
    """Sampling settings from the flags only (``max_new_tokens``: ``--max-new-tokens`` within the context);
    end-of-sequence ids from the model's generation config, and with the chat template (``chat``) the token its
    replies end with (:func:`usaf.data.chat.turn_end_ids`)."""
    eos = tokenizer.eos_token_id
    if (model_dir / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id or eos  # e.g. Qwen's two end tokens
    if chat:
        ends = [eos] if isinstance(eos, int) else list(eos or [])
        eos = ends + [i for i in turn_end_ids(tokenizer) if i not in ends]
    # top_k=0: transformers' default of 50 would cut every distribution to its 50 likeliest tokens, which --top-p
    # 1.0 does not ask for (found in review)
    sampling = {"do_sample": True, "temperature": config.temperature, "top_p": config.top_p, "top_k": 0}
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        **(sampling if config.temperature > 0 else {"do_sample": False}),
    )


def _within_context(config: GenerateConfig, prompt_tokens: int, context: int | None, progress: Progress) -> int:
    """``--max-new-tokens``, cut (and said) to what the model's context leaves after the prompt; a prompt that fills
    the context is refused (the model computes nothing meaningful past its positions; tokenize and eval refuse the
    same)."""
    if context is None:
        return config.max_new_tokens
    left = context - prompt_tokens
    if left <= 0:
        raise UsafError(
            f"PROMPT: {prompt_tokens} tokens{' with the chat template' if config.chat else ''}, the model's context is "
            f"{context} (max_position_embeddings)",
            "shorten the prompt",
        )
    if config.max_new_tokens > left:
        progress.note(f"--max-new-tokens {config.max_new_tokens}: at most {left}, the context ({context} tokens) "
                      f"less the prompt's {prompt_tokens}")  # fmt: skip
        return left
    return config.max_new_tokens


@contextlib.contextmanager
def placed_model(
    model_dir: Path, change: TrainedChange | None, backend: Any, config: GenerateConfig, progress: Progress
) -> Iterator[tuple[Any, bool]]:
    """The quantized model with ``change`` applied (or none), in eval mode, placed as eval and train place it
    (``--dtype``, ``--stream-experts``); and whether its experts stream. The streaming ends on leaving."""
    compute = backend.compute_dtype(config.dtype)
    loaded, placement = load_for_engine(model_dir, backend, compute, config.stream_experts, progress)
    # with a change, its engine streams the frozen layers (a trained layer's base stays on the device)
    engine = engine_with_change(loaded, change, **placement) if change is not None else None
    streamer = engine.streamer if engine is not None else stream_every_layer(loaded, backend, placement)
    loaded.model.eval()
    try:
        yield loaded.model, bool(placement["stream_experts"])
    finally:
        if streamer is not None:
            streamer.close()


def run(
    config: GenerateConfig, *, on_text: Callable[[str], None] | None = None, progress: Progress | None = None
) -> Generation:
    """Generate from ``config.prompt``; new text goes to ``on_text`` as it is decoded."""
    progress = progress or NullProgress()
    if not config.prompt:
        raise UsafError("PROMPT is empty", 'pass the text to continue, e.g. usaf generate "def fib(n):"')
    if config.temperature == 0:  # greedy decoding draws nothing: both were accepted and unused (found in review)
        for field in ("top_p", "seed"):
            refuse_unused(config, field, "--temperature 0 decodes greedily, drawing nothing",
                          "drop it, or pass a --temperature above 0 to sample", progress.note)  # fmt: skip
    model_dir, _, change = resolve_model_and_change(
        config.model, config.checkpoint, settings_workspace(config), progress, use_change=not config.no_checkpoint
    )
    backend = resolve_backend(None if config.device == "auto" else config.device, source=source_of(config, "device"))
    say_backend_notes(backend, progress)
    tokenizer = load_tokenizer(str(model_dir), flag="--model")
    rendered, ids, templated = render_prompt(tokenizer, config.prompt, chat=config.chat)
    if config.chat and not templated:
        progress.note("the tokenizer has no chat template: the prompt is used as it is")
    max_new_tokens = _within_context(config, len(ids), max_sequence_length(str(model_dir), tokenizer), progress)
    input_ids = torch.tensor([ids], device=backend.device)  # (1, T)
    text_streamer = _streamer(tokenizer, on_text) if on_text is not None else None
    with placed_model(model_dir, change, backend, config, progress) as (model, streamed), torch.no_grad():
        torch.manual_seed(config.seed)  # sampling draws from torch's global generator: same seed, same text
        started = time.perf_counter()
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=generation_config(config, tokenizer, model_dir, max_new_tokens, chat=templated),
            streamer=text_streamer,
        )
        seconds = time.perf_counter() - started
        dtype = str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")
    new = output[0, input_ids.shape[1] :].tolist()
    text = tokenizer.decode(new, skip_special_tokens=True)
    if templated and not text.strip():  # empty output, no word (a model pretrained on raw text; found in review)
        progress.note(f"the reply is empty ({counted(len(new), 'token')}, ending it): the prompt was rendered as a "
                      "chat turn with the tokenizer's template; a model trained on raw text continues a prompt with "
                      "--no-chat")  # fmt: skip
    return Generation(
        model=model_dir,
        checkpoint=change.source if change is not None else None,
        prompt=config.prompt,
        rendered_prompt=rendered,
        chat_template=templated,
        prompt_tokens=len(ids),
        text=text,
        new_tokens=len(new),
        seconds=seconds,
        device=str(backend.device),
        dtype=dtype,
        streamed=streamed,
        unified_memory=backend.capabilities.unified_memory,
    )
