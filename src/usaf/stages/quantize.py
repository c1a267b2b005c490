"""``usaf quantize``: a Hugging Face MoE checkpoint -> a self-contained quantized model directory.

One MoE layer's experts at a time: read its on-disk tensors lazily, fuse them into the in-memory
layout transformers v5 uses, quantize, and save the layer to ``layers/`` in a resumable partial
directory. Then the non-expert weights are copied, shard by shard, as safetensors in their own dtype,
and ``experts_q4.pt`` is assembled by a streaming writer, so peak memory is one layer's experts plus
one shard, whatever the number of layers. The finished directory appears atomically; an interrupted
run leaves ``.NAME.usaf-partial`` and the same command resumes from it, taking each finished layer file whose bytes
are those its ``.sha256`` sidecar recorded (:mod:`usaf.artifacts.checksums`) and quantizing the others again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from usaf.artifacts import ArtifactWriter, InputRecord, current_environment, default_output, settings_workspace
from usaf.artifacts.checksums import doubt, seal
from usaf.artifacts.disk import check_free_space, removed_on_failure
from usaf.artifacts.hashing import sha256_tensors
from usaf.artifacts.loader import load_verified
from usaf.artifacts.manifest import MANIFEST_NAME
from usaf.artifacts.outputs import (
    check_not_an_input,
    found_at,
    manifest_kind,
    refuse_unless_replaceable,
    usaf_made,
)
from usaf.artifacts.quantized import (
    EXPERTS_FILE,
    QuantizedModelManifest,
    QuantizedModelSummary,
    QuantSettingsRecord,
    TensorQuantRecord,
)
from usaf.artifacts.workspace import interrupted_outputs
from usaf.artifacts.writer import write_text_atomic
from usaf.backends import resolve_backend
from usaf.backends.transfer import is_host
from usaf.config import source_of
from usaf.data.hub import resolve_model_dir
from usaf.data.tokenizer import TOKENIZER_FILES, has_tokenizer_files, load_tokenizer
from usaf.errors import UsafError
from usaf.families import load_model_config, load_tensors, map_checkpoint, read_checkpoint, resolve_family
from usaf.quant import QuantizedTensor, dequantize, quantize_experts
from usaf.quant.ptfile import StreamingTorchSave
from usaf.settings.quantize import QuantizeConfig
from usaf.stages.progress import NullProgress, Progress, say_backend_notes
from usaf.stages.quantize_parts import (
    PARTIAL_SETTINGS,
    base_shard_plan,
    copy_model_files,
    source_record,
    write_base_shards,
)
from usaf.stages.stop import note_at_stop, rerun_to_resume

LAYERS_DIR = "layers"
# Kept until the manifest is written: a kill while the model's files are copied and hashed (minutes at 30B) once
# lost every quantized layer (layers/ went when experts_q4.pt was assembled; found in review).
BOOKKEEPING = (PARTIAL_SETTINGS, LAYERS_DIR)


def _made_with(manifest: QuantizedModelManifest, settings: dict[str, Any], origin: str, files: dict[str, Any]) -> bool:
    """The output quantizes this source (``origin``: its fingerprint reads headers only, so the directory too tells
    two fine-tunes of one architecture apart; ``files``: and the files' sizes and times, one re-saved in place) with
    these settings."""
    s = manifest.summary
    done = (s.source.fingerprint, s.quant.method, s.quant.nbits, s.quant.group_size_requested)
    recorded = _recorded_files(manifest)
    same_files = recorded is None or recorded == files  # quantized by an older usaf: the origin decides
    return done == tuple(settings.values()) and s.source.origin == origin and same_files


def _recorded_files(manifest: QuantizedModelManifest) -> dict[str, Any] | None:
    """The source files a quantized model was made from, as :func:`_source_files` gives them (None: not recorded).
    Without them a model re-saved in place with other weights was taken for the one quantized (found in review)."""
    source = manifest.summary.source
    if any(shard.modified_ns is None for shard in source.shards):
        return None
    return {"path": source.path, "files": [[s.name, s.bytes, s.modified_ns] for s in source.shards]}


# In an interrupted run's partial-settings.json beside the settings: the source's weight files as they were. The
# source fingerprint reads their headers only (hashing tens of GB at every start would cost minutes), so two
# fine-tunes of one architecture share it; the files' path, sizes and modification times tell them apart.
SOURCE_FILES = "source_files"


def _source_files(model_dir: Path, infos: dict[str, Any]) -> dict[str, Any]:
    """The source's weight files as they are on disk now: the model's path and (name, bytes, mtime in ns) each."""
    files = []
    for name in sorted({info.file for info in infos.values()}):
        stat = (model_dir / name).stat()
        files.append([name, stat.st_size, stat.st_mtime_ns])
    return {"path": str(model_dir.resolve()), "files": files}


def _same_work(recorded: dict[str, Any], settings: dict[str, Any], files: dict[str, Any]) -> bool:
    """An interrupted run's recorded settings against this run's: equal settings, from the same source files. One
    read back from its manifest (killed after the manifest, before the rename: a whole, verified output) or written by
    an older usaf holds no files: its settings decide."""
    mine = {key: value for key, value in recorded.items() if key != SOURCE_FILES}
    return mine == settings and recorded.get(SOURCE_FILES, files) == files


def _differences(recorded: dict[str, Any], settings: dict[str, Any], files: dict[str, Any]) -> str:
    """What keeps an interrupted run's work from this run's, in flags (it said only "other settings", and nothing
    said which: its layers were lost to --force; found in review)."""
    flags = {"method": "--method", "nbits": "--nbits", "group_size": "--group-size"}
    said = [f"{flags[key]} {recorded[key]}, not {settings[key]}" for key in flags
            if key in recorded and recorded[key] != settings.get(key)]  # fmt: skip
    if recorded.get("source") != settings.get("source"):
        said.append("another model")
    elif recorded.get(SOURCE_FILES, files) != files:
        said.append("the model's files changed since")
    return "; ".join(said) or "other settings"


def _done_differences(
    manifest: QuantizedModelManifest, settings: dict[str, Any], origin: str, files: dict[str, Any]
) -> str:
    """What keeps a finished output from this run's, in flags, as for an interrupted one (it said "another model ...
    or other settings", and not which; found in review)."""
    q, source = manifest.summary.quant, manifest.summary.source
    recorded = {"source": source.fingerprint, "method": q.method, "nbits": q.nbits,
                "group_size": q.group_size_requested}  # fmt: skip
    said = _differences(recorded, settings, files)  # the settings, or another model
    if said != "other settings":
        return said
    done_files = _recorded_files(manifest)
    if done_files is not None and done_files["path"] != files["path"]:
        return f"the model in {done_files['path']}, not {files['path']}"
    if done_files is not None and done_files != files:
        return "the model's files as they were before they changed"
    return f"the model in {source.origin}" if source.origin != origin else said


def _partial_settings(partial: Path) -> dict[str, Any] | None:
    """The settings an interrupted run recorded in its partial directory (None: none readable)."""
    try:
        return json.loads((partial / PARTIAL_SETTINGS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    try:  # killed between writing the manifest and the rename: the manifest says what it was
        manifest = load_verified(partial, QuantizedModelManifest, flag="--out", hashes=False)
    except UsafError:
        return None
    s = manifest.summary
    settings = {
        "source": s.source.fingerprint,
        "method": s.quant.method,
        "nbits": s.quant.nbits,
        "group_size": s.quant.group_size_requested,
    }
    files = _recorded_files(manifest)
    return settings if files is None else {**settings, SOURCE_FILES: files}


def _interrupted_output(
    workspace: Path, label: str, settings: dict[str, Any], files: dict[str, Any]
) -> Path | None:
    """The default output an interrupted quantization with these ``settings`` of these source ``files`` was writing
    in the workspace (the newest), where its partial directory says so."""
    for target in interrupted_outputs(workspace, "quantized_model", label):
        recorded = _partial_settings(ArtifactWriter.partial_dir(target))
        if recorded is not None and _same_work(recorded, settings, files):
            return target
    return None


def _committed_partial(
    partial: Path, settings: dict[str, Any], origin: str, files: dict[str, Any]
) -> QuantizedModelManifest | None:
    """The manifest of a partial directory that is complete and verified (every sha256), else None."""
    if not (partial / MANIFEST_NAME).is_file():
        return None
    try:
        manifest = load_verified(partial, QuantizedModelManifest, flag="--out")
    except UsafError:
        (partial / MANIFEST_NAME).unlink()  # a manifest that does not match its files: redo the commit
        return None
    return manifest if _made_with(manifest, settings, origin, files) else None


def _done_bytes(partial: Path) -> int:
    """Bytes an interrupted run already wrote (not needed again)."""
    return sum(p.stat().st_size for p in partial.rglob("*") if p.is_file())


def _estimate_note(weights: dict[str, torch.Tensor], config: QuantizeConfig, device: torch.device, layers: int) -> str:
    """Quantize one expert slice of each of a layer's tensors to time them, and extrapolate to the ``layers`` left.

    Each tensor is timed: pricing every slice as gate_up's (twice down's size) overestimated Qwen3-30B-A3B's run by
    half, and counting the layers a resumed run had already saved overestimated it more (found in review)."""
    per_layer = 0.0
    for w in weights.values():  # (E, ., .) each
        start = time.perf_counter()
        with contextlib.suppress(ValueError):  # a damaged slice: the layer's own quantization names it, one line
            quantize_experts(w[:1].float(), method=config.method, nbits=config.nbits, group_size=config.group_size,
                             device=device)  # fmt: skip
        per_layer += (time.perf_counter() - start) * w.shape[0]
    total = per_layer * layers
    hours, rest = divmod(int(total), 3600)
    # under a minute: "0h00m00s", and a faster method offered for it, read as noise in every demo (found in review)
    took = "under a minute" if total < 60 else f"{hours}h{rest // 60:02d}m{rest % 60:02d}s"
    hint = "; --method rtn is much faster on CPU" if config.method == "hqq" and total >= 60 else ""
    slices = layers * sum(w.shape[0] for w in weights.values())
    return (
        f"estimated {took} on CPU for the {layers} MoE layers left ({slices} expert slices, {per_layer:.1f} s a "
        f"layer, {config.method}){hint}"
    )


class DamagedModel(UsafError):
    """The source model's weights cannot be quantized (non-finite, or scales past fp16): no rerun gets past them."""


def _tokenizer_problem(directory: Path) -> str | None:
    """Why the tokenizer the later stages will read from ``directory`` does not load, as they load it (no remote
    code), or None where it does."""
    try:
        load_tokenizer(str(directory), flag="MODEL")
    except UsafError as e:
        return e.message.split(": ", 1)[-1]
    return None


@contextlib.contextmanager
def _kept_on_stop(work: Path, layers: int, progress: Progress, *, force: bool) -> Iterator[None]:
    """On Ctrl-C (or SIGTERM), say how many layers are kept and how to go on: it said only that nothing half-written
    was left, and a rerun with other settings was refused without naming the kept ones (found in review)."""
    try:
        yield
    except KeyboardInterrupt:
        kept = kept_layers(work)
        progress.finish()
        again = rerun_to_resume("--force" if force else None)
        note_at_stop(progress, f"interrupted: {kept} of {layers} MoE layers quantized and kept in {work}; {again}")
        raise


def kept_layers(work: Path) -> int:
    """The finished layer files an interrupted quantize kept in ``work`` (not their checksums, nor a temporary)."""
    return sum(1 for _ in (work / LAYERS_DIR).glob("layer-*.pt")) if (work / LAYERS_DIR).is_dir() else 0


def _save_layer(path: Path, layer: dict[str, Any]) -> None:
    """Write a finished layer with its checksum (recorded before the rename: no moment has the file without it)."""
    tmp = path.with_suffix(".tmp")
    with removed_on_failure(tmp):  # a full disk leaves no torn layer file
        torch.save(layer, tmp)
        seal(path, written_at=tmp)
    os.replace(tmp, path)


def _load_layer(path: Path, progress: Progress) -> dict[str, Any] | None:
    """A finished layer file, or None if it is absent, unreadable or not the bytes its checksum records (then it
    is redone: a changed byte that still read as numbers was merged into the output, found in review)."""
    if not path.is_file():
        return None
    if why := doubt(path):
        progress.note(f"{path}: not as usaf wrote it ({why}): quantizing the layer again")
        return None
    try:
        return torch.load(path, weights_only=True)
    except Exception:  # a file cut short by a crash: redo the layer
        return None


def run(config: QuantizeConfig, *, progress: Progress | None = None) -> tuple[QuantizedModelManifest, Path]:
    """Quantize ``config.model``'s experts; returns the manifest and the output directory."""
    progress = progress or NullProgress()
    if config.model is None:
        raise UsafError("MODEL is required: a model directory or hub id", "e.g. usaf quantize Qwen/Qwen3-30B-A3B")
    model_dir = resolve_model_dir(config.model)
    if manifest_kind(model_dir) == QuantizedModelManifest.KIND:  # else "no expert tensors ... the download may be
        raise UsafError(f"MODEL {model_dir}: already a usaf quantized model",  # incomplete" (found in review)
                        "pass the original model (score and train take this one as --model)")  # fmt: skip
    # an artifact (tokens, a plan, a run: a manifest; a tiny model usaf made is a model) was "no config.json" with a
    # hint about Hugging Face's layout (found in review)
    if manifest_kind(model_dir) is not None and (made := usaf_made(model_dir)) is not None:
        raise UsafError(f"MODEL {model_dir}: {made}, not a model",
                        "pass the original model's directory or hub id")  # fmt: skip
    spec = resolve_family(load_model_config(model_dir))
    infos = read_checkpoint(model_dir)
    plan = map_checkpoint(model_dir, spec)
    source = source_record(config.model, model_dir, spec, infos)
    backend = resolve_backend(None if config.device == "auto" else config.device, source=source_of(config, "device"))
    say_backend_notes(backend, progress)

    settings = {
        "source": source.fingerprint,
        "method": config.method,
        "nbits": config.nbits,
        "group_size": config.group_size,
    }
    files = _source_files(model_dir, infos)
    out = config.out
    label = _label(config.model, model_dir)
    if out is None:  # a default output is new at every start: the same command finds the one it was writing
        out = _interrupted_output(settings_workspace(config), label, settings, files)
        if out is not None:
            progress.note(f"resuming the interrupted quantization that was writing {out} (no --out given)")
    out = Path(out or default_output(settings_workspace(config), "quantized_model", label))
    flag = "--out" if config.out is not None else "--workspace"  # the default output is the workspace's: name that
    writer = ArtifactWriter(out, kinds=(QuantizedModelManifest.KIND,), overwrite=config.force, overwrite_flag="--force",
                            inputs={"MODEL": model_dir}, resumable=True, markers=(PARTIAL_SETTINGS,),
                            flag=flag, defaulted=config.out is None)  # fmt: skip
    # first: --out MODEL of a usaf-made model was told to pass --resume or --force, both refused; and before the lock,
    # whose directory was made inside the input before the refusal (both found in review)
    check_not_an_input(out, flag, {"MODEL": model_dir}, defaulted=config.out is None)
    with writer.lock:  # taken before the partial directory is looked at: another quantize may be writing it
        found = found_at(out)
        if found.state == "usaf":  # another command's output: refused before --resume or --force is offered for it
            refuse_unless_replaceable(out, found, "--out", overwrite=True, overwrite_flag="--force", kinds=writer.kinds,
                                      replacing=not config.resume)  # added files: kept by --resume alone
        if found.state == "usaf" and not config.force:
            if config.resume:
                manifest = load_verified(out, QuantizedModelManifest, flag="--out", hashes=False)
                if not _made_with(manifest, settings, source.origin, files):
                    raise UsafError(f"--out {out}: holds a quantization with "
                                    f"{_done_differences(manifest, settings, source.origin, files)}",
                                    "pass --force to replace it, or another --out")  # fmt: skip
                progress.note(f"{out} is already complete; nothing to do")
                return manifest, out
            raise UsafError(
                f"--out {out}: {found.what} already exists there", "pass --resume to accept it, --force to replace it"
            )
        writer.check_target()  # a link, a file or a directory usaf did not make: refused whatever the flags
        if config.resume and not ArtifactWriter.partial_dir(out).is_dir():  # else a new one was made (found in review)
            if config.out is None:
                raise UsafError(f"--resume: no interrupted quantization of this model in {out.parent}",
                                "pass the --out to accept, or drop --resume to quantize it")  # fmt: skip
            raise UsafError(f"--resume: --out {out} holds nothing to accept or resume", "drop --resume to quantize it")

        experts_source_bytes = sum(_source_bytes(layer, infos) for layer in plan.experts)
        shards = base_shard_plan(plan, infos)
        base_bytes = sum(infos[n].nbytes for shard in shards for n in shard.disk_names)
        partial = ArtifactWriter.partial_dir(out)
        if partial.is_dir():
            recorded = _partial_settings(partial)
            # The settings are the first thing a run writes: without them (killed while writing them) it did no work.
            same = recorded is None or _same_work(recorded, settings, files)
            if config.force or not same:
                if not same and not config.force:
                    raise UsafError(
                        f"--out {out}: an interrupted run with other settings or another model (or the model's "
                        f"files changed since) left {partial}: {_differences(recorded, settings, files)}",
                        "rerun with its settings to resume it, or pass --force to discard it",
                    )
                shutil.rmtree(partial)
        done = _done_bytes(partial) if partial.is_dir() else 0
        # Layer files and the assembled experts_q4.pt coexist briefly; 4-bit codes + fp16 scales < 0.4 x bf16.
        needed = int(experts_source_bytes * (config.nbits / 16 + 0.1) * 2 + base_bytes)
        check_free_space(out, max(needed - done, 0), what="the quantized model")

        with writer as art:
            art.needed = max(needed - done, 0)  # named if the disk fills anyway
            if art.resumed and (complete := _committed_partial(art.dir, settings, source.origin, files)) is not None:
                art.drop(BOOKKEEPING)  # killed after its manifest was written, before its bookkeeping went
                art.commit_foreign()  # only the rename was missing
                return complete, art.target
            write_text_atomic(art.dir / PARTIAL_SETTINGS, json.dumps({**settings, SOURCE_FILES: files}))
            if art.resumed:
                progress.note(f"resuming the interrupted run in {art.dir}")
            # through the assembly too: stopped there, all layers were kept and the rerun resumes, unsaid (review)
            with _kept_on_stop(art.dir, len(plan.experts), progress, force=config.force):
                try:
                    records, packing, digests = _quantize_layers(config, plan, model_dir, infos, art.dir,
                                                                 backend.device, progress)  # fmt: skip
                except DamagedModel:  # no rerun gets past it: the partial kept for one blocked the next (review)
                    art.resumable = False
                    raise
                write_base_shards(shards, model_dir, infos, art.dir, progress)
                _assemble_experts(plan, art.dir, progress)
                copy_model_files(model_dir, art.dir)
            if not has_tokenizer_files(model_dir):  # said where it can be mended, not first by generate (review)
                progress.note(f"MODEL {model_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): tokenize, "
                              "score, train, eval and generate read the quantized model's; copy the original's "
                              "next to MODEL's config.json and quantize again (--force)")  # fmt: skip
            elif (broken := _tokenizer_problem(art.dir)) is not None:  # some files, no
                progress.note(f"MODEL {model_dir}: its tokenizer does not load ({broken}): score, train, eval and "
                              "generate read the quantized model's; mend the original's tokenizer files and quantize "
                              "again (--force)")  # fmt: skip  (a tokenizer_config.json alone passed; found in review)
            summary = _summary(config, source, plan, infos, records, packing, experts_source_bytes, art.dir, shards,
                               digests)  # fmt: skip
            manifest = art.commit(
                QuantizedModelManifest,
                exclude=BOOKKEEPING,
                progress=progress,
                inputs=[InputRecord(role="model", kind="hf_model", path=config.model, fingerprint=source.fingerprint)],
                config=config.model_dump(mode="json"),
                environment=current_environment(**backend.recorded(torch.float32)),
                summary=summary,
            )
        return manifest, art.target


def _label(model: str, model_dir: Path) -> str:
    """What a default output is named after: the directory given, or a hub id's repository name (its snapshot's
    directory is named by the revision's hash: ``quantized_model/0123abcd...-20261206-...``, found in review)."""
    if Path(model).expanduser().is_dir():  # resolved: "." named every output "-run", the name of nothing (review)
        return model_dir.resolve().name
    return model.rstrip("/").rsplit("/", 1)[-1]


def _weight_tensors(layer: Any) -> list[Any]:
    """The layer's fused expert weight plans (gate_up, down); biases are kept, not quantized."""
    return [t for t in layer.tensors if t.role in ("gate_up", "down")]


def _source_bytes(layer: Any, infos: dict, target: str | None = None) -> int:
    return sum(infos[n].nbytes for t in _weight_tensors(layer) if target in (None, t.target) for n in t.source_names)


def _quantize_layers(
    config: QuantizeConfig,
    plan: Any,
    model_dir: Path,
    infos: dict,
    work: Path,
    device: torch.device,
    progress: Progress,
) -> tuple[list[TensorQuantRecord], str, dict[int, str]]:
    """Quantize every MoE layer not already saved in ``work/layers``; returns per-tensor records, the packing and
    each layer's digest of its on-disk expert tensors (absent for a layer saved by a usaf that recorded none)."""
    layers_dir = work / LAYERS_DIR
    layers_dir.mkdir(exist_ok=True)
    total_bytes = sum(_source_bytes(layer, infos) for layer in plan.experts)
    estimated = not is_host(device)  # the estimate is only printed for CPU runs
    records: list[TensorQuantRecord] = []
    digests: dict[int, str] = {}
    packing = ""
    progress.start("quantizing experts", total_bytes, "bytes")
    for done, layer in enumerate(plan.experts, start=1):
        layer_bytes = _source_bytes(layer, infos)
        path = layers_dir / f"layer-{layer.layer:05d}.pt"
        saved = _load_layer(path, progress)
        if saved is None:
            on_disk = load_tensors(model_dir, layer.source_names, infos)
            digest = sha256_tensors(on_disk)  # what export --base checks the original's experts against
            fused = layer.fuse(on_disk)  # in-memory name -> fused tensor
            del on_disk
            weights = {t.target: fused[t.target] for t in _weight_tensors(layer)}
            if not estimated:
                later = plan.experts[done - 1 :]
                left = sum(not (layers_dir / f"layer-{each.layer:05d}.pt").is_file() for each in later)
                progress.note(_estimate_note(weights, config, device, left))
                estimated = True
            entries, errors = {}, {}
            for name, w in weights.items():
                try:
                    q = quantize_experts(w, method=config.method, nbits=config.nbits, group_size=config.group_size,
                                         transposed=layer.layout.transposed, device=device)  # fmt: skip
                except ValueError as e:  # non-finite weights, or scales past fp16: a traceback (found in review)
                    raise DamagedModel(f"MODEL {model_dir}: {name}: {e}",
                                       "the checkpoint is damaged: re-download or re-save it") from None  # fmt: skip
                entries[name] = q
                errors[name] = _relative_error(w, q)
            saved = {"entries": {k: q.to_dict() for k, q in entries.items()}, "errors": errors, "digest": digest}
            _save_layer(path, saved)
            del fused, weights, entries
        if "digest" in saved:
            digests[layer.layer] = saved["digest"]
        for name, entry in saved["entries"].items():
            q = QuantizedTensor.from_dict(entry, name=name)
            packing = q.packing
            records.append(
                TensorQuantRecord(
                    name=name,
                    layer=layer.layer,
                    shape=list(q.memory_shape),
                    group_size=q.group_size,
                    params=q.shape[0] * q.shape[1] * q.shape[2],
                    source_bytes=_source_bytes(layer, infos, name),
                    quantized_bytes=q.nbytes,
                    rel_error=float(saved["errors"][name]),
                )
            )
        progress.advance(layer_bytes, layers=done)
    progress.finish()
    return records, packing, digests


def _relative_error(w: torch.Tensor, q: QuantizedTensor) -> float:
    """||W - deq||_F / ||W||_F, one expert at a time (memory: one expert slice)."""
    num = den = 0.0
    for e in range(q.shape[0]):
        ref = w[e].float()
        diff = dequantize(q, experts=[e])[0] - ref
        num += float(diff.pow(2).sum())
        den += float(ref.pow(2).sum())
    return (num / den) ** 0.5 if den > 0 else 0.0


def _assemble_experts(plan: Any, work: Path, progress: Progress) -> None:
    """Stream every layer file into one ``experts_q4.pt`` (one layer in memory); ``layers/`` goes at the commit."""
    layers_dir = work / LAYERS_DIR
    progress.start(f"writing {EXPERTS_FILE}", len(plan.experts), "layers")
    with StreamingTorchSave(work / EXPERTS_FILE) as archive:
        for layer in plan.experts:
            saved = torch.load(layers_dir / f"layer-{layer.layer:05d}.pt", weights_only=True)
            for name, entry in saved["entries"].items():
                archive.add(name, entry)
            progress.advance(1)
    progress.finish()


def _summary(
    config: QuantizeConfig,
    source: Any,
    plan: Any,
    infos: dict,
    records: list[TensorQuantRecord],
    packing: str,
    experts_source_bytes: int,
    work: Path,
    shards: list,
    digests: dict[int, str],
) -> QuantizedModelSummary:
    quantized_bytes = sum(r.quantized_bytes for r in records)
    kept = [n for shard in shards for n in shard.disk_names]
    base_bytes = sum(p.stat().st_size for p in work.glob("base-*.safetensors"))
    errors = [r.rel_error for r in records]
    if not records:
        raise UsafError("no expert tensors were quantized", "the model has no MoE layers usaf recognises")
    return QuantizedModelSummary(
        source=source,
        quant=QuantSettingsRecord(
            method=config.method,
            nbits=config.nbits,
            group_size_requested=config.group_size,
            packing=packing,
            device=config.device,
        ),
        moe_layers=[layer.layer for layer in plan.experts],
        tensors=records,
        tensors_quantized=len(records),
        params_quantized=sum(r.params for r in records),
        tensors_kept=len(kept),
        params_kept=sum(infos[n].numel for n in kept),
        tensors_ignored=sorted(plan.ignored),
        experts_source_bytes=experts_source_bytes,
        experts_quantized_bytes=quantized_bytes,
        base_bytes=base_bytes,
        compression_ratio=experts_source_bytes / max(quantized_bytes, 1),
        mean_rel_error=sum(errors) / len(errors),
        max_rel_error=max(errors),
        group_sizes_adjusted=[f"{r.name}: {r.group_size}" for r in records if r.group_size != config.group_size],
        expert_digests=digests,
    )
