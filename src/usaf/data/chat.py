"""Chat conversations rendered with the tokenizer's own template, loss on assistant turns only.

The template is applied to growing prefixes of the conversation: the characters that the
assistant message ``i`` adds are those between the render of ``messages[:i]`` with the generation
prompt and the render of ``messages[:i+1]``. That works for any template that renders prefixes
consistently (every common one does) without needing ``{% generation %}`` markers, and a template
that does not is reported instead of silently mislabelled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from usaf.data.packing import IGNORE_INDEX
from usaf.errors import UsafError


@contextlib.contextmanager
def template_errors(origin: str) -> Iterator[None]:
    """A chat template's own refusal (Gemma's and Mistral's ``raise_exception('System role not supported')``, a
    role order it does not take) as one line naming ``origin``, not a jinja2 traceback (found in review)."""
    from jinja2.exceptions import TemplateError  # lazy: jinja2 comes with transformers' chat templates

    try:
        yield
    except TemplateError as e:
        raise UsafError(
            f"{origin}: the tokenizer's chat template refused this conversation ({e})",
            "fix it as the template asks (a system message, the order of the roles), or give pre-rendered text",
        ) from None


def assistant_spans(tokenizer: Any, messages: list[dict[str, Any]], origin: str) -> tuple[str, list[tuple[int, int]]]:
    """Render ``messages`` and return the text plus the character spans of assistant replies."""

    def render(msgs: list[dict[str, Any]], generation_prompt: bool) -> str:
        with template_errors(origin):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)

    full = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render(messages[:i], True)) if i else 0
        end = len(render(messages[: i + 1], False))
        if not full.startswith(render(messages[: i + 1], False)) or start > end:
            raise UsafError(
                f"{origin}: the tokenizer's chat template does not render conversation prefixes consistently",
                "use a JSONL text field with pre-rendered text instead of 'messages'",
            )
        spans.append((start, end))
    if not spans:
        raise UsafError(f"{origin}: the conversation has no assistant message, so nothing to learn", "drop the line")
    return full, spans


def label_chat(tokenizer: Any, messages: list[dict[str, Any]], origin: str) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and labels that are -100 outside assistant replies."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsafError(
            f"{origin}: chat 'messages' given, but the tokenizer has no chat template",
            "use a tokenizer with a chat template, or give plain text in a text field",
        )
    text, spans = assistant_spans(tokenizer, messages, origin)
    enc = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    labels = []
    span_index = 0
    for token_id, (char_start, _) in zip(enc.ids, enc.offsets):
        while span_index < len(spans) and char_start >= spans[span_index][1]:
            span_index += 1
        inside = span_index < len(spans) and spans[span_index][0] <= char_start < spans[span_index][1]
        labels.append(token_id if inside else IGNORE_INDEX)
    return list(enc.ids), labels
