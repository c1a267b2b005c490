"""Resolving a MODEL argument: a local Hugging Face directory, or a hub id from the local cache / hub."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

from usaf.errors import UsafError, not_a

# What usaf needs of a hub repository: weights as safetensors, config, tokenizer. Never *.bin
# pickles, never code (*.py: trust_remote_code is not supported for quantization).
HUB_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "vocab*",
    "merges.txt",
    "*.tiktoken",
]
# The patterns match paths: "*.safetensors" took a repository's subfolders too (gpt-oss-20b's original/ holds a
# second copy of its weights, ~13 GB; found in review). usaf reads a model's top level only.
HUB_IGNORED = ["*/*"]


@contextlib.contextmanager
def hub_logs_quiet() -> Iterator[None]:
    """Within the block, huggingface_hub's own log lines are not printed: where the hub cannot be reached its retries
    printed "'[Errno -2] ...' thrown while requesting HEAD https://huggingface.co/..." and "Retrying in 1s", five
    times over, before usaf's one error line (found in review). The first retry is said once, in usaf's words, as
    the retries take most of a minute. Errors still raise."""
    hub, http = logging.getLogger("huggingface_hub"), logging.getLogger("huggingface_hub.utils._http")
    saved = hub.level, http.level, http.propagate
    retries = _FirstRetry()
    hub.setLevel(logging.ERROR)
    http.setLevel(logging.WARNING)  # its retries reach the handler below, and no other
    http.propagate = False
    http.addHandler(retries)
    try:
        yield
    finally:
        http.removeHandler(retries)
        hub.level, http.level, http.propagate = saved


class _FirstRetry(logging.Handler):
    """Says, once, that the hub is being retried."""

    said = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.said and record.getMessage().startswith("Retrying in"):  # not "Rate limited": the hub answered
            self.said = True
            print("the Hugging Face hub does not answer: huggingface_hub retries for up to a minute "
                  "(HF_HUB_OFFLINE=1 reads the local cache alone)", file=sys.stderr, flush=True)  # fmt: skip


def looks_like_path(model: str) -> bool:
    return model.startswith((".", "/", "~")) or "\\" in model or model.count("/") > 1


def refuse_a_missing_directory(model: str, flag: str) -> None:
    """A MODEL that is no directory here and no ORG/NAME hub id: a mistyped local name (``tiny-mo``). It went to the
    hub, which took a minute to fail where it cannot be reached and never said that no such directory exists (found in
    review). Every Mixture-of-Experts model on the hub has an organisation in its id."""
    local = Path(model).expanduser()
    if "/" not in model and not local.exists():
        raise UsafError(f"{flag} {model}: no such directory (and not a hub id, which reads ORG/NAME)",
                        "check the path, or pass a hub id like Qwen/Qwen3-30B-A3B")  # fmt: skip
    if not local.exists() and local.parent.is_dir() and str(local.parent) not in ("", "."):  # ws/tiny-mo, ws a dir here
        raise UsafError(f"{flag} {model}: no such directory in {local.parent}",
                        "check the path (a hub id's organisation is no directory here)")  # fmt: skip


def resolve_model_dir(model: str, *, flag: str = "MODEL", cache_only: bool = False) -> Path:
    """A local directory for ``model``: the directory itself, or the hub snapshot (cache first; ``cache_only``:
    the cache alone, never the network).

    Honours ``HF_HOME`` and ``HF_HUB_OFFLINE`` through ``huggingface_hub``; downloads only
    :data:`HUB_PATTERNS`, at the repository's top level.
    """
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if local.exists() or looks_like_path(model):
        raise UsafError(
            f"{flag} {local}: {not_a(local, 'directory')}", "pass a model directory or a hub id like Qwen/Qwen3-30B-A3B"
        )
    refuse_a_missing_directory(model, flag)
    # lazy: huggingface_hub only when a hub id must be resolved
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        with hub_logs_quiet():
            return Path(snapshot_download(model, allow_patterns=HUB_PATTERNS, ignore_patterns=HUB_IGNORED,
                                          local_files_only=cache_only))  # fmt: skip
    except HFValidationError:
        raise UsafError(f"{flag} {model}: neither a directory nor a valid hub id", "check the spelling") from None
    except LocalEntryNotFoundError:
        where = "" if cache_only else ", and the hub cannot be reached (HF_HUB_OFFLINE?)"
        raise UsafError(
            f"{flag} {model}: no such directory, and as a hub id not in the local Hugging Face cache{where}",
            "download it once with network access, or pass a local model directory",
        ) from None
    except RepositoryNotFoundError:
        raise UsafError(f"{flag} {model}: no such directory, and no such repository on the hub (or it is gated)",
                        "check the path or the id") from None  # fmt: skip
    except OSError as e:
        raise UsafError(f"{flag} {model}: download failed ({e})", "retry, or pass a local model directory") from None
