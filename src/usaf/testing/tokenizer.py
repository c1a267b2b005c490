"""A small byte-level BPE tokenizer trained in about a second on standard-library sources."""

from __future__ import annotations

import sysconfig
from pathlib import Path

# ChatML, as used by Qwen models; `{% generation %}` is not needed: usaf derives assistant spans
# by rendering message prefixes.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Fixed modules, so the tokenizer (and every fingerprint made from it) is the same on every machine
# with the same Python minor version.
_TRAINING_MODULES = [
    "json/decoder.py",
    "json/encoder.py",
    "textwrap.py",
    "string.py",
    "shlex.py",
    "fractions.py",
]


def stdlib_dir() -> Path:
    """The Python standard library's source directory (real text present on every machine)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sample_text(max_bytes: int = 200_000) -> list[str]:
    texts, total = [], 0
    for rel in _TRAINING_MODULES:
        path = stdlib_dir() / rel
        if path.is_file() and total < max_bytes:
            text = path.read_text(encoding="utf-8", errors="replace")
            texts.append(text)
            total += len(text)
    return texts


def build_tiny_tokenizer(out_dir: Path | None = None, *, vocab_size: int = 512, model_max_length: int = 2048):
    """Train a byte-level BPE tokenizer with ChatML specials and a chat template.

    Args:
        out_dir: if given, the tokenizer is saved there (``tokenizer.json`` and friends) so that
            ``AutoTokenizer.from_pretrained(out_dir)`` loads it offline.
        vocab_size: total vocabulary size including the special tokens.
        model_max_length: recorded as the tokenizer's maximum sequence length.

    Returns:
        A ``PreTrainedTokenizerFast`` whose eos token is ``<|endoftext|>`` (id 0).
    """
    # lazy: usaf.testing's builders are imported by `usaf tiny-model` and the demo: tokenizers/transformers on use
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_sample_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
    )
    fast.chat_template = CHATML_TEMPLATE
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(str(out_dir))
    return fast
