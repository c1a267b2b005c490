"""Loading a model's tokenizer (local directory or hub id) and describing it for manifests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from usaf.artifacts.hashing import sha256_file, sha256_text
from usaf.artifacts.loader import holds_artifacts
from usaf.artifacts.tokens import TokenizerRecord
from usaf.data.hub import hub_logs_quiet, refuse_a_missing_directory
from usaf.errors import UsafError, not_a
from usaf.families.modules import transformers_major

_UNBOUNDED = 10**8  # transformers' "no limit" model_max_length is ~1e30


def _needs_remote_code(local: Path) -> bool:
    try:
        config = json.loads((local / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "AutoTokenizer" in (config.get("auto_map") or {})


TOKENIZER_KINDS = ("quantized_model", "hf_export")  # the usaf artifacts that carry their model's tokenizer files
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")  # any one is a start


def has_tokenizer_files(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model: str, *, trust_remote_code: bool = False, flag: str = "--model") -> Any:
    """A fast (Rust-backed) tokenizer for ``model``, a local directory or a hub id.

    Hub ids are resolved by transformers through the Hugging Face cache (``HF_HOME``) and honour
    ``HF_HUB_OFFLINE``. ``trust_remote_code`` is only ever enabled by an explicit user flag.
    """
    # lazy: transformers only when a tokenizer is loaded (usaf.data stays light)
    from transformers import AutoTokenizer

    local = Path(model).expanduser()  # ~/model read as a hub id (review)
    if (model.startswith((".", "/", "~")) or local.exists()) and not local.is_dir():
        raise UsafError(f"{flag} {local}: {not_a(local, 'directory')}", "pass a model directory or a hub id")
    if local.is_dir():
        model = str(local)
    refuse_a_missing_directory(model, flag)
    if local.is_dir() and not has_tokenizer_files(local):
        inside = holds_artifacts(local, flag, TOKENIZER_KINDS, from_workspace=False)  # a workspace's quantized_model/
        if inside is not None:
            raise inside
        # transformers would build an empty one-token tokenizer from config.json alone
        raise UsafError(
            f"{flag} {model}: no tokenizer files (tokenizer.json or tokenizer_config.json) in the directory",
            "copy the model's tokenizer files next to its config.json",
        )
    try:
        with hub_logs_quiet():  # a hub id: its retries' log lines are not usaf's error
            tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as e:  # ImportError: a slow tokenizer's converter needs protobuf
        tokenizer = _saved_by_transformers_5(model, e)
        if tokenizer is None:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if not trust_remote_code and _needs_remote_code(local):
                raise UsafError(
                    f"{flag} {model}: its tokenizer is defined by Python code in the model repository "
                    f"(auto_map in tokenizer_config.json), which usaf does not run by default ({first})",
                    "pass --trust-remote-code to usaf tokenize only if you trust that code",
                ) from None
            changed, maker = _changed_since_made(local) if local.is_dir() else ([], "")
            if changed:  # the hint said to pass a directory holding tokenizer.json, which it did (found in review)
                raise UsafError(
                    f"{flag} {model}: no usable tokenizer ({first}): its {', '.join(changed)} no longer "
                    f"{'matches' if len(changed) == 1 else 'match'} the usaf manifest there (changed or damaged since)",
                    f"restore the file, or rerun the usaf command that made the directory{maker}",
                ) from None
            hint = "pass a model directory holding tokenizer.json, or a hub id available offline in HF_HOME"
            if maker:  # usaf made it as it is: the files came from its source (the hint above can't apply; review)
                hint = f"its tokenizer files are its source model's as they were: mend them there and rerun{maker}"
            raise UsafError(f"{flag} {model}: no usable tokenizer ({first})", hint) from None
    if not getattr(tokenizer, "is_fast", False) or not hasattr(tokenizer, "backend_tokenizer"):
        raise UsafError(
            f"{flag} {model}: the tokenizer has no fast (tokenizer.json) version",
            "convert it once with transformers (AutoTokenizer.from_pretrained(..., use_fast=True).save_pretrained)",
        )
    if len(tokenizer) < 2:
        raise UsafError(f"{flag} {model}: the tokenizer has an empty vocabulary", "check the tokenizer files")
    # A tokenizer.json may be saved with truncation or padding on: transformers resets them per call, but usaf encodes
    # whole documents through the backend itself, which applied them in silence (every document cut to the saved
    # length, or padded with labelled pad tokens; found in review). The fingerprint is then of the tokenizer as used.
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    if tokenizer.eos_token_id is None:
        raise UsafError(f"{flag} {model}: the tokenizer has no EOS token", "packing needs one as a separator")
    return tokenizer


def _saved_by_transformers_5(model: str, error: Exception) -> Any | None:
    """transformers 4.x (the DirectML configuration) on a tokenizer saved by transformers 5.

    Its ``tokenizer_config.json`` names the class ``TokenizersBackend``, which 4.x lacks; the files are a
    plain ``tokenizer.json``, so the generic fast tokenizer reads them (special tokens and chat template
    included). Returns None when that is not the situation.
    """
    local = Path(model)
    if transformers_major() >= 5 or "TokenizersBackend" not in str(error) or not (local / "tokenizer.json").is_file():
        return None
    # lazy: transformers only on this 4.x fallback path
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its "class differs from TokenizersBackend" warning is this very case
    try:
        return PreTrainedTokenizerFast.from_pretrained(model)
    finally:
        hf_logging.set_verbosity(level)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Content hash: vocabulary and rules, special tokens and chat template (not file paths)."""
    parts = {
        "tokenizer": tokenizer.backend_tokenizer.to_str(),
        "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return sha256_text(json.dumps(parts, sort_keys=True))


def model_max_positions(model: str) -> int | None:
    """``max_position_embeddings`` from the model's config.json, if it can be read without a download."""
    path = Path(model) / "config.json"
    if Path(model).is_dir() and not path.is_file():  # a local tokenizer alone: no hub repository of its name
        return None  # (a relative "tok" was looked up on the hub, 6 requests and 20 s; found in review)
    if not path.is_file():
        try:
            # lazy: huggingface_hub only when the config is not local
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(model, "config.json", local_files_only=True))  # the cache, never the network
        except Exception:  # not cached, no such repo: fall back to the tokenizer's own limit
            return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    value = config.get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def max_sequence_length(model: str, tokenizer: Any) -> int | None:
    """The longest sequence the model accepts: its config's positions, else the tokenizer's limit."""
    positions = model_max_positions(model)
    if positions is not None:
        return positions
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < _UNBOUNDED else None


def tokenizer_record(model: str, tokenizer: Any) -> TokenizerRecord:
    limit = getattr(tokenizer, "model_max_length", None)
    return TokenizerRecord(
        name_or_path=model,
        fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        model_max_length=limit if isinstance(limit, int) and limit < _UNBOUNDED else None,
    )


def _changed_since_made(directory: Path) -> tuple[list[str], str]:
    """The tokenizer files a usaf manifest in ``directory`` lists whose sha256 differs now (or which are gone), and
    the command that made it, for the hint (" (usaf quantize)"; empty where the kind names none)."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
        listed = {f["path"]: f["sha256"] for f in manifest["files"]
                  if str(f["path"]).startswith(("tokenizer", "vocab", "merges"))}  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):  # no usaf manifest, or not one of this shape: nothing known
        return [], ""
    changed = sorted(name for name, digest in listed.items()
                     if not (directory / name).is_file() or sha256_file(directory / name) != digest)  # fmt: skip
    maker = {"quantized_model": " (usaf quantize)", "hf_export": " (usaf export)"}.get(manifest.get("kind"), "")
    return changed, maker
