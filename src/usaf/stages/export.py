"""``usaf export``: a trained change merged into a Hugging Face model directory, or the change alone.

``--format hf`` writes the family's own checkpoint (its on-disk names and layout, sharded safetensors
with an index, config and tokenizer): with ``--base``, the original full-precision weights with the
change applied; without, the quantized model's dequantized experts plus the change. Tensors stream one
shard and one layer at a time; nothing is re-quantized. The result is reloaded with transformers and
its logits compared with a reference before it is committed (``--no-verify`` skips that).

``--format delta`` writes the change alone (a ``delta`` artifact), which ``--checkpoint`` accepts later.
``--no-checkpoint`` writes the quantized model's dequantized base alone (to compare against), verified the
same way with an empty change.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from usaf.artifacts import (
    EXPORT_KINDS,
    ArtifactWriter,
    DeltaManifest,
    HfExportManifest,
    InputRecord,
    QuantizedModelManifest,
    current_environment,
    default_output,
    settings_workspace,
)
from usaf.artifacts.delta import DELTA_FILE, ROUTERS_FILE, DeltaSummary, DeltaTensorRecord, write_delta_files
from usaf.artifacts.disk import check_free_space
from usaf.artifacts.hf_export import HfExportSummary
from usaf.artifacts.loader import read_manifest_json
from usaf.artifacts.run import TrainedChange
from usaf.backends import resolve_backend
from usaf.config import flag_name, source_of
from usaf.errors import UsafError
from usaf.families import load_model_config, resolve_family
from usaf.settings.export import DEFAULT_SHARD_GIB, ExportConfig
from usaf.stages.change import resolve_model_and_change, stored_base_headers
from usaf.stages.export_base import resolve_base
from usaf.stages.export_shards import plan_shards, write_shards
from usaf.stages.export_sources import OriginalSource, QuantizedSource
from usaf.stages.export_verify import verify
from usaf.stages.progress import NullProgress, Progress, say_backend_notes
from usaf.stages.quantize_parts import copy_model_files
from usaf.units import human_bytes


def run(config: ExportConfig, *, progress: Progress | None = None) -> tuple[Any, Path]:
    """Export; returns the manifest (``hf_export`` or ``delta``) and the output directory."""
    progress = progress or NullProgress()
    started = time.perf_counter()
    _check_device(config)
    model_dir, qmanifest, change = resolve_model_and_change(
        config.model, config.checkpoint, settings_workspace(config), progress, use_change=not config.no_checkpoint
    )
    if change is None:  # --no-checkpoint: the dequantized base alone, an empty change
        change = _no_change(model_dir, qmanifest)
        progress.note(f"--no-checkpoint: exporting the dequantized base of {model_dir} without a change")
    kind = "hf_export" if config.format == "hf" else "delta"
    label = f"{model_dir.name}-base" if config.no_checkpoint else change.source.name
    out = Path(config.out or default_output(settings_workspace(config), kind, label))
    given = {
        "--model": model_dir,
        "--checkpoint": None if config.no_checkpoint else change.source,
        "--base": config.base,
    }
    writer = ArtifactWriter(out, kinds=EXPORT_KINDS, flag="--out", overwrite=config.overwrite, inputs=given,
                            defaulted=config.out is None)
    writer.check_target()  # before any work: an existing --out is refused at once
    inputs = [InputRecord(role="model", kind="quantized_model", path=str(model_dir), fingerprint=qmanifest.fingerprint)]
    if not config.no_checkpoint:
        inputs.append(
            InputRecord(
                role="change", kind=_change_kind(change), path=str(change.source), fingerprint=change.fingerprint
            )
        )
    if config.format == "delta":
        transposed = resolve_family(load_model_config(model_dir)).layout.transposed
        with writer as art:
            summary = _write_delta(art.dir, change, qmanifest, model_dir, transposed=transposed, verify=config.verify)
            manifest = art.commit(
                DeltaManifest,
                inputs=inputs,
                config=config.model_dump(mode="json"),
                environment=current_environment(),
                summary=summary,
            )
        return manifest, writer.target
    return _export_hf(config, model_dir, qmanifest, change, writer, inputs, progress, started)


def _check_device(config: ExportConfig) -> None:
    """``--device`` sets where the verification runs: refused where none runs (it would be recorded as where the
    export ran, and used for nothing). From ``USAF_DEVICE`` or ``--config`` (set for every command) it is unused."""
    if config.device is None or (config.format == "hf" and config.verify):
        return
    if source_of(config, "device") != flag_name("device"):
        return
    if config.format == "delta":
        raise UsafError(
            "--device sets where --format hf verification runs; --format delta runs nothing on a device",
            "drop --device, or pass --format hf",
        )
    off = source_of(config, "verify")  # the flag, or where verification was switched off
    raise UsafError(
        f"--device sets where the verification runs, which --no-verify skips{'' if off == '--verify' else f' ({off})'}"
        ": nothing runs on a device",
        "drop --device, or verify",
    )


def _no_change(model_dir: Path, qmanifest: QuantizedModelManifest) -> TrainedChange:
    """The change of no run: exporting it writes the quantized model's dequantized base as it is."""
    return TrainedChange(
        source=model_dir,
        fingerprint="",
        model_fingerprint=qmanifest.fingerprint,
        trainable_layers=[],
        deltas={},
        routers={},
    )


def _change_kind(change: TrainedChange) -> str:
    try:
        return str(read_manifest_json(change.source)["kind"])
    except UsafError:
        return "checkpoint"


def _stored_shape(shape: list[int], transposed: bool) -> list[int]:
    return [shape[0], shape[2], shape[1]] if transposed else list(shape)


def _write_delta(
    work: Path,
    change: TrainedChange,
    qmanifest: QuantizedModelManifest,
    model_dir: Path,
    *,
    transposed: bool,
    verify: bool,
) -> DeltaSummary:
    write_delta_files(work, change)
    if verify:  # read the files back: the shared artifact must hold exactly the change, bit for bit
        back = load_file(str(work / DELTA_FILE))
        expected = {f"{name}.{part}" for name in change.deltas for part in ("indices", "values")}
        for name, (indices, values) in change.deltas.items():
            if not (torch.equal(back[f"{name}.indices"], indices) and torch.equal(back[f"{name}.values"], values)):
                raise UsafError(f"verification failed: {DELTA_FILE} does not hold {name} as trained", "report this")
        routers = load_file(str(work / ROUTERS_FILE))  # the routers too, and nothing more in either file
        same_routers = set(routers) == set(change.routers) and all(
            torch.equal(routers[name], weight.float().cpu()) for name, weight in change.routers.items()
        )
        if set(back) != expected or not same_routers:
            raise UsafError("verification failed: the delta's files do not hold exactly the change", "report this")
    shapes = {t.name: _stored_shape(t.shape, transposed) for t in qmanifest.summary.tensors}  # (E, O, I)
    if any(name not in shapes for name in change.deltas):  # linear targets: (O, I) weights seen as (1, O, I)
        shapes.update({n: [1, *info.shape] for n, info in stored_base_headers(model_dir).items() if n in change.deltas})
    tensors = [
        DeltaTensorRecord(name=name, shape=shapes[name], entries=int(indices.numel()))
        for name, (indices, _) in sorted(change.deltas.items())
    ]
    source = qmanifest.summary.source
    return DeltaSummary(
        model_fingerprint=qmanifest.fingerprint,
        source_fingerprint=source.fingerprint,
        family=source.family,
        model_type=source.model_type,
        change_fingerprint=change.fingerprint,
        trainable_layers=list(change.trainable_layers),
        tensors=tensors,
        expert_entries=change.expert_entries,
        router_tensors=len(change.routers),
        router_params=sum(int(t.numel()) for t in change.routers.values()),
    )


def _export_hf(
    config: ExportConfig,
    model_dir: Path,
    qmanifest: QuantizedModelManifest,
    change: TrainedChange,
    writer: ArtifactWriter,
    inputs: list[InputRecord],
    progress: Progress,
    started: float,
):
    spec = resolve_family(load_model_config(model_dir))
    dtype = getattr(torch, config.dtype) if config.dtype else None
    base_dir, base_fp = None, None
    if config.base is not None:
        base = resolve_base(config.base, spec, qmanifest, model_dir, change)
        base_dir, base_fp = base.dir, base.fingerprint
        writer.inputs = {**writer.inputs, "--base": base_dir}  # a hub id's snapshot directory: --out not in it
        writer.check_target()
        inputs.append(InputRecord(role="base", kind="hf_model", path=config.base, fingerprint=base_fp))
        source: Any = OriginalSource(base.dir, spec, change, dtype, base.infos, base.plan, base.experts)
    else:
        source = QuantizedSource(model_dir, spec, change, dtype)
    # not "auto", which picks a GPU, where fp32 models rarely fit; none without verification, which alone computes
    verify_on = source_of(config, "device")
    backend = resolve_backend(config.device, source=verify_on, default="cpu") if config.verify else None
    say_backend_notes(backend, progress)
    max_bytes = int((config.max_shard_gib or DEFAULT_SHARD_GIB) * 2**30)
    shards = plan_shards(source.units, max_bytes)
    _note_oversized_shards(shards, max_bytes, config, progress)
    # before any shard is written: the whole model at its output dtype, plus a little for config and tokenizer
    writer.needed = sum(u.nbytes for u in source.units) + 2**20  # also named if the disk fills anyway
    check_free_space(writer.target, writer.needed, what="the exported model")
    if backend is not None:
        _check_verify_memory(qmanifest, backend)
    with writer as art:
        records = write_shards(source, shards, art.dir, progress)
        counts = source.counts
        if counts.expert_tensors_changed != len(change.deltas) or counts.router_tensors != len(change.routers):
            raise RuntimeError(  # every trained tensor must land somewhere: a miss is a bug, never a silent drop
                f"applied {counts.expert_tensors_changed}/{len(change.deltas)} deltas and "
                f"{counts.router_tensors}/{len(change.routers)} routers"
            )
        notes = list(counts.notes)
        if (rounding := source.rounding_note()) is not None:
            notes.append(rounding)
        notes += _model_files(base_dir or model_dir, art.dir, config.dtype)
        checked = None
        if config.verify:
            checked = verify(
                art.dir,
                spec=spec,
                model_dir=model_dir,
                change=change,
                base_dir=base_dir,
                expert_dtype=source.expert_dtype,
                written=source.written,
                override=dtype,
                device=backend.device,
                progress=progress,
            )
        summary = HfExportSummary(
            base="original" if base_dir is not None else "dequantized",
            base_path=str(base_dir) if base_dir is not None else None,
            base_fingerprint=base_fp,
            model_fingerprint=qmanifest.fingerprint,
            change_fingerprint=None if config.no_checkpoint else change.fingerprint,
            change_source=None if config.no_checkpoint else str(change.source),
            family=spec.family,
            model_type=spec.model_type,
            dtype=config.dtype or "original",
            shards=records,
            tensors=sum(r.tensors for r in records),
            bytes=sum(r.bytes for r in records),
            expert_tensors_changed=counts.expert_tensors_changed,
            expert_entries=counts.expert_entries,
            expert_entries_rounded_away=counts.entries_rounded_away,
            router_tensors=counts.router_tensors,
            tensors_copied=counts.tensors_copied,
            notes=notes,
            verify=checked,
            seconds=time.perf_counter() - started,
        )
        manifest = art.commit(
            HfExportManifest,
            progress=progress,
            inputs=inputs,
            config=config.model_dump(mode="json"),
            environment=current_environment(**backend.recorded(torch.float32)) if backend else current_environment(),
            summary=summary,
        )
    return manifest, writer.target


# The reloaded export in fp32 is the largest of the models verification loads (one after another): every parameter
# at 4 bytes, and a margin for the activations of the probe and the allocator.
VERIFY_MARGIN = 1.1


def _note_oversized_shards(shards: list, max_bytes: int, config: ExportConfig, progress: Progress) -> None:
    """Shards over ``--max-shard-gib`` (went over it in silence; found in review): a unit, such as one MoE layer's
    experts, is produced together and never split across files."""
    over = [sum(u.nbytes for u in shard) for shard in shards if sum(u.nbytes for u in shard) > max_bytes]
    if over:
        progress.note(f"{source_of(config, 'max_shard_gib')} {config.max_shard_gib or DEFAULT_SHARD_GIB:g}: "
                      f"{len(over)} of the {len(shards)} shards are larger (up to {human_bytes(max(over))}): one "
                      "layer's experts, or one tensor, are written whole into one shard")  # fmt: skip


def _check_verify_memory(qmanifest: QuantizedModelManifest, backend: Any) -> None:
    """Refuse, before any shard is written, a verification that cannot fit where it runs: at Qwen3-30B-A3B's size it
    needs ~122 GB, and a 32 GB machine was killed by the OS after writing 61 GB of shards (found in review)."""
    s = qmanifest.summary
    need = int(4 * (s.params_quantized + s.params_kept) * VERIFY_MARGIN)
    free = backend.free_memory()
    if free is not None and need > free:
        raise UsafError(
            f"--verify reloads the export in fp32 on {backend.device}: about {human_bytes(need)}, and "
            f"{human_bytes(free)} is free there",
            "pass --no-verify (the export is then written unchecked), or verify where the memory is (--device)",
        )


def _model_files(source_dir: Path, work: Path, dtype: str | None) -> list[str]:
    """Copy config, generation config and tokenizer; edit config.json only where the export differs."""
    copy_model_files(source_dir, work)
    config = json.loads((work / "config.json").read_text(encoding="utf-8"))
    notes = []
    if "quantization_config" in config:  # the export's weights are dense: a stale entry would misload them
        config.pop("quantization_config")
        notes.append("config.json: quantization_config removed (the exported weights are not quantized)")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    if dtype is not None and any(config.get(key) != dtype for key in keys):  # said only of a change (found in review)
        for key in keys:
            config[key] = dtype
        notes.append(f"config.json: {'/'.join(keys)} set to {dtype}")
    if notes:  # re-written with its own field names and order; otherwise it stays byte for byte the original
        (work / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return notes
