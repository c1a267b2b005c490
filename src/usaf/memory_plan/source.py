"""What the planner reads: a model's ``config.json`` (no weights), and a quantized model's settings.

``MODEL`` may be a Hugging Face model directory, a ``usaf quantize`` output (its ``config.json`` is the
source's, copied byte for byte, and its manifest says the bits and group sizes actually used), or a hub
id, for which only ``config.json`` is fetched: from the local cache first, then from the hub unless
``HF_HUB_OFFLINE`` is set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from usaf.artifacts import MANIFEST_NAME, QuantizedModelManifest, load_manifest
from usaf.data.hub import hub_logs_quiet, looks_like_path
from usaf.errors import UsafError, not_a
from usaf.families import load_model_config


@dataclass(frozen=True)
class QuantSettings:
    """Bits per expert weight and group size (requested; each tensor's effective one may be smaller)."""

    nbits: int = 4
    group_size: int = 128
    source: str = "defaults of usaf quantize"
    effective: dict[str, int] = field(default_factory=dict)  # in-memory tensor name -> group size used


@dataclass(frozen=True)
class ModelSource:
    label: str  # what the user passed
    config: dict[str, Any]
    quant: QuantSettings
    quantized_dir: Path | None  # set when MODEL is a usaf quantize output


def read_model(model: str, *, nbits: int | None, group_size: int | None) -> ModelSource:
    """``config.json`` of ``model`` and the quantization settings the plan assumes.

    A quantized directory's own settings win; flags that contradict them are an error (a plan for
    settings the model was not made with would be wrong without saying so).
    """
    local = Path(model).expanduser()
    if local.is_dir():
        config = load_model_config(local)
        recorded = _quantized_settings(local)
        if recorded is None:
            return ModelSource(model, config, _requested(nbits, group_size), None)
        for flag, given, used in (
            ("--nbits", nbits, recorded.nbits),
            ("--group-size", group_size, recorded.group_size),
        ):
            if given is not None and given != used:
                raise UsafError(
                    f"{flag} {given}: {model} was quantized with {flag} {used}",
                    f"drop {flag} (the quantized model's own setting is used)",
                )
        return ModelSource(model, config, recorded, local)
    if local.exists() or looks_like_path(model):
        raise UsafError(
            f"MODEL {local}: {not_a(local, 'directory')}", "pass a model directory or a hub id like Qwen/Qwen3-30B-A3B"
        )
    return ModelSource(model, _hub_config(model), _requested(nbits, group_size), None)


def _requested(nbits: int | None, group_size: int | None) -> QuantSettings:
    if nbits is None and group_size is None:
        return QuantSettings()
    return QuantSettings(
        nbits=4 if nbits is None else nbits, group_size=128 if group_size is None else group_size, source="flags"
    )


def _quantized_settings(path: Path) -> QuantSettings | None:
    """A quantized model's recorded settings; None for any other model directory, an export's or one holding another
    tool's manifest.json among them (refused until found in review, where quantize takes them)."""
    try:
        kind = json.loads((path / MANIFEST_NAME).read_text(encoding="utf-8")).get("kind")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind != QuantizedModelManifest.KIND:
        return None
    manifest = load_manifest(path, QuantizedModelManifest, flag="MODEL")
    quant = manifest.summary.quant
    return QuantSettings(
        nbits=quant.nbits,
        group_size=quant.group_size_requested,
        source=f"the quantized model's manifest ({quant.method})",
        effective={t.name: t.group_size for t in manifest.summary.tensors},
    )


def _hub_config(repo: str) -> dict[str, Any]:
    """Only ``config.json`` of a hub repository: the cache first, then the hub (honours HF_HUB_OFFLINE)."""
    # lazy: huggingface_hub only when the config comes from the hub
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        cached = try_to_load_from_cache(repo, "config.json")
        with hub_logs_quiet():  # the hub's retry lines are not usaf's error
            path = cached if isinstance(cached, str) else hf_hub_download(repo, "config.json")
    except HFValidationError:
        raise UsafError(f"MODEL {repo}: neither a directory nor a valid hub id", "check the spelling") from None
    except LocalEntryNotFoundError:
        raise UsafError(
            f"MODEL {repo}: no such directory, and as a hub id its config.json is not in the local Hugging Face cache "
            "and the hub cannot be reached",
            "pass a directory holding the model's config.json (no weights are needed)",
        ) from None
    except (RepositoryNotFoundError, EntryNotFoundError):
        raise UsafError(f"MODEL {repo}: no such repository (or no config.json; gated?)", "check the id") from None
    except OSError as e:
        raise UsafError(f"MODEL {repo}: config.json could not be fetched ({e})", "pass a local directory") from None
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsafError(f"{path}: not a readable config.json ({e})", "delete it from the cache and retry") from None
    if not isinstance(config, dict):
        raise UsafError(f"{path}: expected a JSON object", "delete it from the cache and retry")
    return config
