"""Fixtures for tests, demos and benchmarks: tiny tokenizers and tiny MoE models built in-process.

Nothing here downloads anything: tokenizers are trained on the Python standard library's sources,
models are random-initialised from tiny configs and saved in each family's real on-disk layout.
"""

from usaf.testing.models import build_tiny_model, tiny_config_kwargs
from usaf.testing.tokenizer import CHATML_TEMPLATE, build_tiny_tokenizer, stdlib_dir, stdlib_sample_text

__all__ = [
    "CHATML_TEMPLATE",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "stdlib_dir",
    "stdlib_sample_text",
    "tiny_config_kwargs",
]
