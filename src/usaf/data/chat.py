"""Chat conversations rendered with the tokenizer's own template, loss on assistant turns only.

The template is applied to growing prefixes of the conversation: the characters that the
assistant message ``i`` adds are those between the render of ``messages[:i]`` with the generation
prompt and the render of ``messages[:i+1]``. That works for any template that renders prefixes
consistently without needing ``{% generation %}`` markers.

Some render a turn by its place instead: Qwen3's gives the last assistant turn an empty ``<think>`` block that
earlier turns lose once a user speaks after them, and gpt-oss ends the last turn with ``<|return|>``, earlier
ones with ``<|end|>``. Every conversation with two replies was refused for Qwen3, the flagship family (found in
review). For those the reply is found in the whole render itself (:func:`_spans_by_marker`): rendered once with
the reply replaced by a marker, what the real render holds between the marker's prefix and suffix is the reply
(as the template rendered it), followed by the end-of-turn text the reply's own prefix render puts after it
where the whole render has the same. A template that fits neither is reported instead of silently mislabelled.
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
    replies = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if not replies:
        raise UsafError(f"{origin}: the conversation has no assistant message, so nothing to learn", "drop the line")
    spans = _spans_by_prefix(render, full, messages, replies)
    if spans is None:
        spans = _spans_by_marker(render, full, messages, replies)
    if spans is None:
        raise UsafError(
            f"{origin}: the tokenizer's chat template does not render conversation prefixes consistently, nor each "
            "reply where a marker in its place shows it",
            "use a JSONL text field with pre-rendered text instead of 'messages'",
        )
    return full, spans


def _spans_by_prefix(render, full: str, messages: list, replies: list[int]) -> list[tuple[int, int]] | None:
    """Each reply as the characters its message adds to the prefix render, or None where the whole render does not
    begin with a prefix's render (a template that renders turns by their place)."""
    spans = []
    for i in replies:
        start = len(render(messages[:i], True)) if i else 0
        upto = render(messages[: i + 1], False)
        if not full.startswith(upto) or start > len(upto):
            return None
        spans.append((start, len(upto)))
    return spans


_MARKER = "\ue000usaf-reply\ue000"  # a private-use character no template trims or escapes, around a name


def _spans_by_marker(render, full: str, messages: list, replies: list[int]) -> list[tuple[int, int]] | None:
    """Each reply as what the whole render holds where a marker in its place stands, plus the end-of-turn text after
    it (that the reply's own prefix render puts after the marker) where the whole render has that text there too,
    starting where the generation prompt's render ends where the whole render begins with it; None where the
    render around the marker is not the whole render's (the reply changed the rest of it)."""
    spans = []
    for i in replies:
        marked = [*messages[:i], {**messages[i], "content": _MARKER}, *messages[i + 1 :]]
        before, found, after = render(marked, False).partition(_MARKER)
        end = len(full) - len(after)
        if not found or not full.startswith(before) or not full.endswith(after) or end < len(before):
            return None
        _, found, turn_end = render(marked[: i + 1], False).partition(_MARKER)
        if found and turn_end and full.startswith(turn_end, end):  # e.g. "<|im_end|>\n": learning to stop
            end += len(turn_end)
        start = len(before)
        if i and full.startswith(prompt := render(messages[:i], True)) and len(prompt) <= start:
            start = len(prompt)  # from where generation starts, as by prefix: Qwen3's empty <think> block of the last
        spans.append((start, end))  # reply too, as in a one-reply conversation
    return spans


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


def turn_end_ids(tokenizer: Any) -> list[int]:
    """The special token a reply ends with under the tokenizer's chat template (``<|im_end|>``, ``<|eot_id|>``,
    gpt-oss's ``<|return|>``), as a list of one id; empty where the template ends a reply with no special token.

    Tokenize labels it as part of each reply ("learning to stop"), so a chat model stops there; generation stopped
    only at the model's EOS (``<|endoftext|>`` for a Qwen3 base model) and went on inventing turns, the marker
    hidden from the text (found in review)."""
    try:
        with template_errors("the chat template"):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARKER}], tokenize=False
            )
    except UsafError:  # a template that will not render a reply alone: generation stops at the EOS, as it did
        return []
    _, found, tail = rendered.partition(_MARKER)
    ids = tokenizer(tail, add_special_tokens=False, verbose=False)["input_ids"] if found and tail else []
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids[:1] if ids and ids[0] in special else []
