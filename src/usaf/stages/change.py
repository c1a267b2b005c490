"""Finding a trained change and its quantized model, checking they belong together, and applying it.

Shared by ``usaf export`` and ``usaf generate``: a change (a run, one of its checkpoints, or an exported
delta) is only meaningful on the quantized model it was trained on, so every path here checks the
model fingerprint the change records against the model's own, and names both when they differ.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from usaf.artifacts import QuantizedModelManifest, RunManifest, load_verified, pick_latest, workspace_dir
from usaf.artifacts.loader import read_manifest_json
from usaf.artifacts.lock import holder_of
from usaf.artifacts.manifest import MANIFEST_NAME
from usaf.artifacts.quantized import open_quantized, read_base_index
from usaf.artifacts.run import SETTINGS_FILE, TrainedChange, checkpoint_dirs, load_trained_change
from usaf.engine.engine import SparseEngine
from usaf.engine.loading import LoadedModel
from usaf.errors import UsafError
from usaf.families import load_model_config, resolve_family
from usaf.families.checkpoint import read_header
from usaf.families.targets import target_of, targets_of
from usaf.stages.engine_setup import load_model
from usaf.stages.progress import NullProgress, Progress


def resolve_model_and_change(
    model: Path | None,
    checkpoint: Path | None,
    workspace: Path | None,
    progress: Progress,
    *,
    use_change: bool = True,
) -> tuple[Path, QuantizedModelManifest, TrainedChange | None]:
    """The quantized model directory, its manifest and the change to apply (None if ``use_change`` is False).

    Neither given, the change is the workspace's newest finished run and the model the one it was trained on (the
    newest model first, as before, found no run where a model was quantized after the run: found in review). Only the
    model given, the change is the newest run trained on it; only the change, the model is the one it was trained on.
    """
    change = given_change(checkpoint, progress) if checkpoint is not None and use_change else None
    ws = workspace_dir(workspace)
    if model is None and change is None and use_change:
        change = newest_run(ws, progress)
    if model is not None:
        manifest = load_verified(model, QuantizedModelManifest, flag="--model", hashes=False)
    elif change is not None:
        model, manifest = model_of_change(ws, change, "the change", progress)
    else:
        found = pick_latest(ws, QuantizedModelManifest, flag="--model", lineage=lambda m: m.summary.source.origin)
        model, manifest = found.path, found.manifest
        progress.note(f"using the quantized model {model} (newest in the workspace)")
    if use_change and change is None:
        try:
            run = pick_latest(
                ws,
                RunManifest,
                flag="--checkpoint",
                accept=lambda m: m.summary.model_fingerprint == manifest.fingerprint,
                wanted=" trained on this model",
            )
        except UsafError as none:  # an unfinished run's checkpoints were not looked at: "no run" (found in review)
            unfinished = unfinished_runs(ws, manifest.fingerprint)
            if not unfinished:
                raise
            raise UsafError(f"{none.message}; {unfinished_note(unfinished[0])}",
                            f"pass --checkpoint {unfinished[0].path} to use it, or finish the run "
                            "with the train command that started it") from None  # fmt: skip
        progress.note(f"using the run {run.path} (newest trained on this model)")
        change = load_trained_change(run.path, flag="--checkpoint")
    if change is not None:
        check_change(change, manifest, model)
    return Path(os.path.abspath(model)), manifest, change  # named in full wherever printed (a relative one was; review)


def model_of_change(
    workspace: Path, change: TrainedChange, named: str, progress: Progress
) -> tuple[Path, QuantizedModelManifest]:
    """The quantized model ``change`` was trained on: the newest in the workspace, else the one its run (or delta)
    recorded, where that still holds it. Run from another directory than the model's, ``--checkpoint RUN`` alone was
    refused while the run's manifest named the model (found in review). ``named``: the change, as the notes say it."""
    try:
        found = pick_latest(workspace, QuantizedModelManifest, flag="--model",
                            accept=lambda m: m.fingerprint == change.model_fingerprint,
                            wanted=f" that {named} {change.source} was trained on")  # fmt: skip
    except UsafError as none:
        recorded = _recorded_model(change)
        if recorded is None:
            raise
        try:
            manifest = load_verified(recorded, QuantizedModelManifest, flag="--model", hashes=False)
        except UsafError:  # damaged since: the workspace's answer stands
            raise none from None
        if manifest.fingerprint != change.model_fingerprint:  # another model there now
            raise none from None
        progress.note(f"using the quantized model {recorded} (the one {named} was trained on, as its run recorded it; "
                      f"none in the workspace {workspace})")  # fmt: skip
        return Path(recorded), manifest
    progress.note(f"using the quantized model {found.path} (the one {named} was trained on)")
    return found.path, found.manifest


def _recorded_model(change: TrainedChange) -> Path | None:
    """The model's path as recorded where the change was made: a finished run's or a delta's manifest (absolute), an
    unfinished run's settings when absolute there (as given to train); None where nothing usable is recorded."""
    run = change.source if (change.source / MANIFEST_NAME).is_file() else change.source.parent.parent
    try:
        if (run / MANIFEST_NAME).is_file():
            inputs = read_manifest_json(run, flag="--checkpoint").get("inputs") or []
            paths = [each.get("path") for each in inputs if isinstance(each, dict) and each.get("role") == "model"]
        else:
            paths = [json.loads((run / SETTINGS_FILE).read_text(encoding="utf-8")).get("model")]
    except (OSError, ValueError, AttributeError, UsafError):  # unreadable: nothing recorded to offer
        return None
    usable = [Path(path) for path in paths if isinstance(path, str) and os.path.isabs(path) and os.path.isdir(path)]
    return usable[0] if usable else None


@dataclass(frozen=True)
class UnfinishedRun:
    """A stopped run in the workspace: its directory and its newest complete checkpoint."""

    path: Path
    newest: Path


def unfinished_runs(workspace: Path, model_fingerprint: str) -> list[UnfinishedRun]:
    """The unfinished runs in the workspace trained on the model of ``model_fingerprint`` (a run directory holding
    train's settings, no manifest, and a complete checkpoint, at depth 1 or 2), newest first. Read from their
    settings and checkpoint names alone: a checkpoint's deltas are loaded where one is used."""
    found = []
    for settings in [*workspace.glob(f"*/{SETTINGS_FILE}"), *workspace.glob(f"*/*/{SETTINGS_FILE}")]:
        run_dir = settings.parent
        if (run_dir / "manifest.json").exists() or run_dir.name.startswith("."):
            continue
        try:
            recorded = json.loads(settings.read_text(encoding="utf-8")).get("model_fingerprint")
            done = checkpoint_dirs(run_dir, flag="--checkpoint")
        except (OSError, ValueError, AttributeError, UsafError):  # unreadable: nothing to offer
            continue
        if recorded == model_fingerprint and done:
            found.append((settings.stat().st_mtime, UnfinishedRun(run_dir, done[-1])))
    return [run for _, run in sorted(found, key=lambda pair: pair[0], reverse=True)]


def newest_run(ws: Path, progress: Progress) -> TrainedChange | None:
    """The workspace's newest finished run as a change, or None where it has none (the model's own search below then
    says why, unfinished runs included)."""
    try:
        run = pick_latest(ws, RunManifest, flag="--checkpoint")
    except UsafError:
        return None
    progress.note(f"using the run {run.path} (newest in the workspace)")
    return load_trained_change(run.path, flag="--checkpoint")


def given_change(checkpoint: Path, progress: Progress) -> TrainedChange:
    """The change ``--checkpoint`` names, saying which checkpoint an unfinished run gave: eval's report and export's
    output named a step the console never did (found in review)."""
    change = load_trained_change(checkpoint, flag="--checkpoint")
    if change.source.parent.parent == Path(checkpoint).absolute():  # a run directory gave one of its checkpoints
        live = holder_of(Path(checkpoint))
        now = f" (being trained now by {live}: later ones will differ)" if live else ""
        progress.note(f"--checkpoint {checkpoint}: an unfinished run; using its newest checkpoint, "
                      f"{change.source}{now}")  # fmt: skip
    return change


def unfinished_note(run: UnfinishedRun) -> str:
    """What an unfinished run offers, for a message: its run directory and newest checkpoint."""
    return f"the unfinished run {run.path} has checkpoints (the newest: {run.newest.name})"


def check_change(change: TrainedChange, manifest: QuantizedModelManifest, model: Path) -> None:
    """Refuse a change made for another model, or one whose tensors or indices this model does not have."""
    if change.model_fingerprint != manifest.fingerprint:
        raise UsafError(
            f"--checkpoint {change.source}: trained on the quantized model with fingerprint "
            f"{change.model_fingerprint[:16]}…, but --model {model} has fingerprint {manifest.fingerprint[:16]}…",
            "pass the --model the run was trained on (its manifest lists it under inputs)",
        )
    numel = {t.name: t.params for t in manifest.summary.tensors}
    if any(name not in numel for name in change.deltas):  # attention / shared targets: the stored base weights
        numel.update(_linear_target_sizes(change, model))
    layers = set(manifest.summary.moe_layers)
    if set(change.trainable_layers) - layers:  # dense layers train with the dense target
        layers |= set(resolve_family(load_model_config(model)).dense_layers)
    bad_layers = sorted(set(change.trainable_layers) - layers)
    if bad_layers:
        raise UsafError(
            f"--checkpoint {change.source}: trains layers {bad_layers}, which are not MoE or dense layers of "
            f"--model {model}",
            "pass the --model the run was trained on",
        )
    for name, (indices, _) in change.deltas.items():
        if name not in numel:
            raise UsafError(
                f"--checkpoint {change.source}: a delta for {name}, which --model {model} does not have",
                "pass the --model the run was trained on",
            )
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel[name]):
            raise UsafError(
                f"--checkpoint {change.source}: delta indices of {name} out of range for its {numel[name]} weights",
                "the checkpoint is damaged; export it again from the run",
            )
        if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
            raise UsafError(
                f"--checkpoint {change.source}: delta indices of {name} are not sorted and unique",
                "the checkpoint is damaged; export it again from the run",
            )
    if change.routers:
        _check_routers(change, model)


def stored_base_headers(model: Path) -> dict:
    """Name -> header info of every weight the quantized directory stores unquantized (``base-*.safetensors``)."""
    stored = {}
    for file in sorted(set(read_base_index(model).values())):
        stored.update(read_header(model / file))
    return stored


def _linear_target_sizes(change: TrainedChange, model: Path) -> dict[str, int]:
    """Sizes of the stored weights that are linear targets (attention, shared, dense) of the change's layers."""
    spec = resolve_family(load_model_config(model))
    sizes = {}
    for name, info in stored_base_headers(model).items():
        try:
            kind = target_of(name, spec)
        except ValueError:
            continue
        if kind != "experts" and spec.layer_of(name) in change.trainable_layers and len(info.shape) == 2:
            sizes[name] = math.prod(info.shape)
    return sizes


def _check_routers(change: TrainedChange, model: Path) -> None:
    """Every trained router must be a router of the change's layers, with the shape the model stores."""
    spec = resolve_family(load_model_config(model))
    stored = stored_base_headers(model)
    allowed = {n for layer in change.trainable_layers for n in spec.router_names(layer) if n in stored}
    for name, weight in change.routers.items():
        if name not in allowed:
            raise UsafError(
                f"--checkpoint {change.source}: a trained router {name}, which is not a router of its layers "
                f"{list(change.trainable_layers)} in --model {model}",
                "pass the --model the run was trained on",
            )
        if tuple(weight.shape) != tuple(stored[name].shape):
            raise UsafError(
                f"--checkpoint {change.source}: router {name} has shape {list(weight.shape)}, --model {model} "
                f"stores {list(stored[name].shape)}",
                "the checkpoint is damaged, or for another model; pass the --model the run was trained on",
            )


def model_with_change(
    model_dir: Path,
    change: TrainedChange | None,
    *,
    device: torch.device,
    dtype: Any = None,
    progress: Progress | None = None,
) -> nn.Module:
    """The quantized model as the engine runs it, with ``change`` applied (or none), in eval mode.

    ``dtype``: compute dtype of non-expert weights and dequantized bases (default fp32); ``progress``: the load as
    a phase (none inside another phase, as export's verification).
    """
    files = open_quantized(model_dir)
    loaded = load_model(files, progress or NullProgress(), device=device, compute_dtype=dtype or torch.float32)
    if change is not None:
        engine_with_change(loaded, change)  # its state (resident bases, deltas, routers) lives on the model's modules
    loaded.model.eval()
    return loaded.model


def engine_with_change(loaded: LoadedModel, change: TrainedChange, **placement: Any) -> SparseEngine:
    """An engine over ``loaded`` for the change's layers and targets, with the change applied; ``placement``: the
    engine's expert placement (:func:`usaf.stages.engine_setup.load_for_engine`'s)."""
    try:
        engine = engine_for_change(loaded, change, **placement)
        engine.apply_change(change)
    except (KeyError, ValueError) as e:
        raise UsafError(f"--checkpoint {change.source}: cannot be applied ({e})", "pass an intact run") from None
    return engine


def engine_for_change(loaded: LoadedModel, change: TrainedChange, **placement: Any) -> SparseEngine:
    """An engine over ``loaded`` for the change's layers, targets and routers, the change not applied yet (it raises
    ``KeyError``/``ValueError`` for a change that does not fit the model)."""
    return SparseEngine(
        loaded,
        trainable_layers=change.trainable_layers,
        targets=targets_of(change.deltas, loaded.spec, change.trainable_layers),
        train_router=bool(change.routers),
        **placement,
    )
