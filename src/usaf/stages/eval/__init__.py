"""``usaf eval``: the base and the fine-tuned model on the same sequences, with intervals and routing drift.

1. Resolve the quantized model and the checkpoint (a run, an unfinished run or one checkpoint) and check
   that the checkpoint was trained on this model; read the sequences (``resolve``, ``inputs``).
2. Base pass on the quantized model as loaded (``passes``), unless the workspace's cache has it
   (``cache``: keyed by model, sequences and how they are run, never by the checkpoint). Ctrl-C (SIGTERM,
   SIGHUP) stops either pass between two microbatches and keeps what it did in that cache; the same eval goes
   on from there.
3. Apply the change in a ``SparseEngine`` and check that the logits of the longest batch moved (the
   original tool's eval never applied its checkpoint and nobody noticed); fine-tuned pass.
4. Per-source, per-input and per-set rows with bootstrap intervals (``stats``), routing drift, ``report.json``,
   ``report.md`` and plots (``plots``), written atomically as an ``eval_report`` artifact.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import transformers

from usaf._version import __version__
from usaf.artifacts import (
    ArtifactWriter,
    EvalReportManifest,
    InputRecord,
    current_environment,
    default_output,
    disk,
    settings_workspace,
)
from usaf.artifacts.eval_report import PLOTS_DIR, REPORT_JSON, REPORT_MD, EvalSummary, InputSummary, PassSummary
from usaf.artifacts.manifest import MANIFEST_NAME
from usaf.artifacts.outputs import output_overlap
from usaf.artifacts.run import CHECKPOINTS_DIR, step_of
from usaf.backends import resolve_backend
from usaf.config import source_of
from usaf.data.tokenizer import load_tokenizer, max_sequence_length
from usaf.distributed import world
from usaf.engine.prefix import PrefixTap
from usaf.errors import UsafError
from usaf.settings.eval import EvalConfig
from usaf.stages.change import engine_for_change
from usaf.stages.engine_setup import load_for_engine, make_resident, stream_every_layer
from usaf.stages.eval import cache, memory, overlap, passes, plots  # modules, read at call time (tests patch them)
from usaf.stages.eval.inputs import HELD_OUT, sequences_fingerprint
from usaf.stages.eval.passes import (
    batch_hidden,
    batches_of,
    max_logit_change,
    run_pass,
)
from usaf.stages.eval.plots import CURVES_FILE, INSTALL_HINT, LOAD_FILE, RunCurves, plot_curves, plot_load, run_curves
from usaf.stages.eval.report import markdown, result_rows, routing_drift
from usaf.stages.eval.resolve import model_and_change, read_inputs
from usaf.stages.eval.stats import CONFIDENCE
from usaf.stages.progress import NullProgress, Progress, say_backend_notes
from usaf.stages.stop import StopRequest, note_at_stop
from usaf.units import human_bytes


@dataclass
class _Outcome:
    """What the passes produced, for the report."""

    model_dir: Path
    model_fingerprint: str
    change: Any  # usaf.artifacts.run.TrainedChange, or None (base only)
    inputs: list  # [EvalInput]
    sequences: list  # [EvalSequence], inputs in order
    data_fingerprint: str
    cache_key: str
    cache_entry: Path | None
    base: Any  # PassResult
    tuned: Any  # PassResult or None
    logit_change: float | None
    num_experts: dict[int, int]
    resident: bool
    heldout_in_training: int | None = None  # held-out sequences found in the run's training tokens; None: unchecked
    overlap_note: str | None = None  # what that count means, or why it was not checked
    tuned_kept: tuple[Path, str] | None = None  # where and under which key a stopped fine-tuned pass kept its work
    curves: RunCurves | None = None  # the run's logged losses, read with its change


def run(config: EvalConfig, *, progress: Progress | None = None) -> tuple[EvalReportManifest, Path]:
    """Evaluate and write the report; returns its manifest and directory."""
    progress = progress or NullProgress()
    start = time.perf_counter()
    workspace = settings_workspace(config)
    if config.plots and not plots.matplotlib_available():
        raise UsafError("--plots: matplotlib is not installed", f"{INSTALL_HINT}, or pass --no-plots")
    model_dir, model_manifest, change = model_and_change(config, workspace, progress)
    curves = _curves_of(change) if config.plots is not False else None
    tokenizer = load_tokenizer(str(model_dir), flag="--model")
    out = config.out or default_output(workspace, EvalReportManifest.KIND, _label(model_dir, change))
    given = {"--model": model_dir, "--checkpoint": change.source if change else None, "--data": config.data,
             "--held-out": config.held_out}  # fmt: skip
    writer = ArtifactWriter(out, kinds=(EvalReportManifest.KIND,), overwrite=config.overwrite, inputs=given,
                            defaulted=config.out is None)
    writer.check_target()
    _refuse_out_holding_the_cache(config, out, workspace)
    context = max_sequence_length(str(model_dir), tokenizer)
    inputs = read_inputs(config, workspace, model_dir, change, tokenizer, context, progress)
    found, overlap_note, training = _held_out_in_training(change, workspace, inputs, len(tokenizer), context, progress)
    writer.inputs = {**given, **_read_paths(change, inputs, training)}
    writer.check_target()  # again, before the passes: with the inputs found in the workspace and the run's
    config = _cache_outside_the_inputs(config, workspace, writer.inputs, progress)
    backend = resolve_backend(None if config.device == "auto" else config.device, source=source_of(config, "device"))
    say_backend_notes(backend, progress)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop = StopRequest(world())  # entered around each pass only: elsewhere Ctrl-C stops at once, as before
    outcome = _evaluate(config, workspace, (model_dir, model_manifest), change, inputs, backend, pad, progress, stop)
    outcome.heldout_in_training, outcome.overlap_note, outcome.curves = found, overlap_note, curves
    written = _write(config, writer, backend, outcome, start, progress)
    if outcome.tuned_kept is not None:  # a stopped fine-tuned pass's work: the report holds it now
        cache.drop_kept(*outcome.tuned_kept)
    return written


def _refuse_out_holding_the_cache(config: EvalConfig, out: Path, workspace: Path) -> None:
    """An ``--out`` that is or holds the workspace's ``cache/`` (``--out X --workspace X``, both new): the passes
    wrote the cache into it and the commit then refused it as a directory usaf did not make, after the whole eval
    (hours on a real model; found in review). Refused before any pass."""
    cache_root = (workspace / cache.CACHE_SUBDIR).parent.resolve()
    if config.base_cache and cache_root.is_relative_to(out.resolve()):
        raise UsafError(
            f"--out {out}: is or holds the workspace's cache {cache_root}, where eval keeps its passes before the "
            "report is written",
            "pass an --out inside the workspace (its default) or elsewhere, or --no-base-cache",
        )


def _cache_outside_the_inputs(config: EvalConfig, workspace: Path, inputs: dict, progress: Progress) -> EvalConfig:
    """The settings with the base cache off, said, where the workspace's cache is, holds or lies inside an input or
    any usaf artifact (eval run from inside its --held-out directory or its model: the workspace is the current
    directory). The report's --out was refused there, but the passes wrote the cache into the user's directory or
    the model, whose manifest then listed files it did not hold (found in review). Eval goes on without it."""
    if not config.base_cache:
        return config
    cache_dir = workspace / cache.CACHE_SUBDIR
    found = output_overlap(cache_dir, inputs)
    if found is None:
        return config
    progress.note(f"the base pass is not cached (nor are stopped passes kept to resume): the workspace's cache "
                  f"{cache_dir} {found[0]}; pass a --workspace {found[2]} to keep them")  # fmt: skip
    return config.model_copy(update={"base_cache": False})


def _evaluate(config, workspace, model, change, inputs, backend, pad, progress, stop) -> _Outcome:
    """The base pass (or its cached result) and the fine-tuned pass over the same batches, each from where a stop
    request kept it in the workspace's cache (not with ``--no-base-cache``, which keeps nothing there). ``model``:
    ``(directory, manifest)``."""
    model_dir, model_fp = model[0], model[1].fingerprint
    sequences = [s for item in inputs for s in item.sequences]
    batches = batches_of(sequences, config.microbatch, pad)
    data_fp = sequences_fingerprint(sequences)
    compute = backend.compute_dtype(config.dtype)
    key_parts = _cache_key_parts(model, data_fp, config.microbatch, backend, compute)
    key = cache.cache_key(key_parts)
    entry = cache.entry_dir(workspace, key) if config.base_cache else None

    stream = False if config.resident else config.stream_experts
    loaded, placement = load_for_engine(model_dir, backend, compute, stream, progress)
    if change is not None:
        _refuse_empty_change(change, loaded.model)  # before a base pass that would be wasted
    memory.check_routing_fits(inputs, loaded.experts, loaded.spec.top_k, 1 + (change is not None))
    input_tokens = sum(b.tokens for b in batches)
    base = cache.load(entry, key, sequences=len(sequences), input_tokens=input_tokens) if entry else None
    resident = False
    if base is None or change is not None:  # a pass will run
        wanted = False if placement["stream_experts"] else config.resident
        resident, nbytes = make_resident(loaded, backend, wanted, progress=progress)
        size = human_bytes(nbytes)
        progress.note(
            f"experts dequantized once ({size})" if resident else f"experts dequantized per forward (all: {size})"
        )
    prefix = None  # the states entering the checkpoint's first trained layer, per batch, kept from the base pass
    untapped = None  # why the base pass kept none where a tap would have: the fine-tuned pass runs every layer
    if base is not None:
        progress.note(f"base pass: reused from the cache {entry} (same model, sequences and settings)")
        untapped = "the base pass came from the cache, which keeps its losses and routing, not its states"
    else:
        streamer = stream_every_layer(loaded, backend, placement)  # the base pass: every layer
        earlier = _resumed(entry, key, batches, "base", backend, progress)
        # the fine-tuned pass starts from the states this pass taps: of every batch, so not when resuming
        tap = _prefix_tap(loaded, change, batches, progress) if earlier is None else None
        if earlier is not None:
            untapped = "the base pass resumed, and its part done before keeps no states"
        try:
            with stop:
                base = run_pass(loaded.model, loaded.experts, batches, device=backend.device, progress=progress,
                                description="base model", earlier=earlier, stop=stop.check,
                                on_stop=_keeper(entry, key, key_parts, len(batches), "base", progress))  # fmt: skip
        finally:
            if tap is not None:
                tap.close()
        prefix = tap.states if tap is not None else None
        if streamer is not None:
            streamer.close()  # the fine-tuned pass's engine streams its own frozen layers
        if entry is not None:
            _cache_base(entry, key, key_parts, base, progress)
    tuned, logit_change, tuned_kept = None, None, None
    if change is not None and untapped is not None and min(change.trainable_layers) > 0:
        # it took twice as long, unsaid (found in review); the numbers are the same
        progress.note(f"fine-tuned pass: runs every layer, not from layer {min(change.trainable_layers)}: {untapped} "
                      "(the same numbers, more time)")  # fmt: skip
    if change is not None:
        tuned_key = cache.tuned_key(key_parts, change.fingerprint)
        tuned_entry = cache.tuned_dir(workspace, tuned_key) if config.base_cache else None
        keeping = _TunedKeeping(tuned_entry, tuned_key, key_parts, stop)
        tuned_kept = (tuned_entry, tuned_key) if tuned_entry is not None else None
        tuned, logit_change = _tuned_pass(loaded, change, batches, backend, progress, placement, base, prefix,
                                          keeping)  # fmt: skip
    else:
        progress.note("no checkpoint: evaluating the base model only")
    return _Outcome(
        model_dir, model_fp, change, inputs, sequences, data_fp, key, entry, base, tuned, logit_change,
        {layer: state.num_experts for layer, state in loaded.experts.items()}, resident, tuned_kept=tuned_kept,
    )  # fmt: skip


@dataclass(frozen=True)
class _TunedKeeping:
    """Where and under which key the fine-tuned pass keeps its work at a stop request (no ``entry``: nowhere)."""

    entry: Path | None
    key: str
    parts: dict
    stop: StopRequest


def _resumed(entry: Path | None, key: str, batches: list, what: str, backend, progress: Progress):
    """The part of the ``what`` pass a stop request kept in ``entry`` (a note says how much), or None. The rest of
    the eval then computes at the thread count the kept part ran at (the CPU's bits depend on it)."""
    earlier = cache.load_partial(entry, key, batches) if entry is not None else None
    if earlier is not None:
        progress.note(f"{what} pass: resuming after {earlier.batches} of {len(batches)} microbatches, kept in {entry}")
        note = backend.same_threads_as(earlier.threads, f"the kept {what} pass")
        if note is not None:
            progress.note(note)
    return earlier


def _keeper(entry: Path | None, key: str, parts: dict, total: int, what: str, progress: Progress, complete=None):
    """``on_stop`` of a pass: keep the pass so far in ``entry`` (``complete(partial)`` first fills what it holds
    from elsewhere), and say where; without ``entry`` (``--no-base-cache``) say that nothing is kept."""

    def keep(partial: passes.PartialPass) -> None:
        progress.finish()  # the bar as it stopped, then the note
        if entry is None:
            progress.note(f"interrupted: the {what} pass is not kept (--no-base-cache keeps nothing in the workspace)")
            return
        if partial.batches == 0:
            return
        if complete is not None:
            partial = complete(partial)
        try:
            cache.save(entry, key, parts, partial.result, batches=partial.batches)
        except Exception as e:
            cause = _cache_failure(e)
            if cause is None:
                raise
            progress.note(f"interrupted: the {what} pass could not be kept in {entry} ({cause})")  # nothing kept: said
            return
        note_at_stop(
            progress,
            f"interrupted: kept the {what} pass ({partial.batches} of {total} microbatches) in {entry}; "
            "run the same command to resume",
        )

    return keep


def _held_out_in_training(change, workspace: Path, inputs, vocab: int, context, progress: Progress):
    """``(held-out sequences the run trained on, a note, the training tokens read)``; ``(None, why not, None)`` when
    not checked (:mod:`usaf.stages.eval.overlap`), ``(None, None, None)`` when there is nothing to check."""
    if not any(item.set == HELD_OUT for item in inputs):
        return None, None, None

    def not_checked(why: str) -> tuple[None, str, None]:
        note = f"held-out sequences not checked against the run's training data: {why}"
        progress.note(note)
        return None, note, None

    training, why_not = overlap.training_tokens(change, workspace)
    if training is None:
        return (None, None, None) if why_not is None else not_checked(why_not)
    try:
        found = overlap.held_out_overlap(inputs, training, vocab_size=vocab, context=context, progress=progress)
    except UsafError as e:  # a check on a file the user did not pass: say why it was not made, and go on
        return not_checked(e.message)
    packed_here = [item.path for item in inputs if item.set == HELD_OUT and item.kind == "text"]
    note = overlap.overlap_note(found, packed_here)
    if note is not None:
        progress.note(("warning: " if found.found else "") + note)
    return found.found, note, training.path


def _read_paths(change, inputs, training: Path | None) -> dict[str, Any]:
    """Every path eval reads, by what named it (``--out`` may be, hold or lie in none): the inputs as read, found in
    the workspace too, the run behind a checkpoint (``RUN/checkpoints/step-N`` names only the step) and the training
    tokens the held-out overlap read."""
    data = overlap.run_data(change)
    paths: dict[str, Any] = {}
    for item in inputs:
        paths.setdefault(item.flag, []).append(item.path)
    paths["the run of --checkpoint"] = data.run_dir if data is not None else None
    if training is not None and (training.parent / MANIFEST_NAME).is_file():
        training = training.parent  # a tokens directory's train.jsonl: the directory is the input
    paths["the run's training tokens"] = training
    return paths


def _label(model_dir: Path, change) -> str:
    return change.source.name if change is not None else f"{model_dir.name}-base"


def _cache_key_parts(model, data_fp: str, microbatch: int, backend, compute: torch.dtype) -> dict:
    """``model``: ``(directory, manifest)``."""
    directory, manifest = model
    return {
        "model": manifest.fingerprint,
        "model_files": cache.files_as_they_stand(directory, [f.path for f in manifest.files]),
        "sequences": data_fp,
        "microbatch": microbatch,
        "device": backend.device.type,
        "device_name": backend.device_name,  # the card (or CPU): kernels differ, and cached NLLs with them (in review)
        "dtype": str(compute).removeprefix("torch."),
        "usaf": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


# -- the fine-tuned pass ----------------------------------------------------------------------------------


def _refuse_empty_change(change, model) -> None:
    """A checkpoint whose deltas are all zero and whose routers equal the model's changes nothing: say so."""
    if any(bool(values.ne(0).any()) for _, values in change.deltas.values()):
        return
    for name, weight in change.routers.items():
        try:
            base = model.get_parameter(name)
        except AttributeError:
            return  # not this model's router: apply_change will name it
        if not torch.equal(weight.float(), base.detach().float().cpu()):
            return
    raise UsafError(
        f"--checkpoint {change.source}: changes nothing (its {change.expert_entries:,} delta values are all zero "
        "and its routers equal the base model's): the fine-tuned model would be the base model",
        "pass a checkpoint of a run that trained (check its loss in metrics.jsonl)",
    )


def _prefix_tap(loaded, change, batches, progress: Progress):
    """A tap on the checkpoint's first trained layer for the base pass, or None (no checkpoint, nothing frozen
    below it, or the states would take over ``PREFIX_RAM_SHARE`` of the available RAM)."""
    if change is None or min(change.trainable_layers) == 0:
        return None
    first = min(change.trainable_layers)
    model = loaded.model
    width = model.config.hidden_size
    element = next(model.parameters()).element_size()
    needed = sum(b.input_ids.numel() for b in batches) * width * element  # (B, S, H) per batch, padded
    available = psutil.virtual_memory().available
    if needed > passes.PREFIX_RAM_SHARE * available:
        progress.note(
            f"fine-tuned pass: runs every layer (the base pass's states at layer {first} would take "
            f"{human_bytes(needed)}, over {passes.PREFIX_RAM_SHARE:.0%} of the available RAM)"
        )
        return None
    return PrefixTap(model.model.layers[first])


def _tuned_pass(loaded, change, batches, backend, progress: Progress, placement: dict, base, prefix,
                keeping: _TunedKeeping):  # fmt: skip
    """Apply the change in an engine, prove it moved the logits, and run the same batches through it, from where a
    stop request kept it (``keeping``).

    ``prefix``: per batch, the hidden states entering the change's first trained layer in the base pass (or
    None). The layers below it are the base model's in both passes, so the fine-tuned pass starts there, and
    their routing is the base pass's.
    """
    # first: a kept part sets the thread count, and the logit check below is part of the report
    earlier = _resumed(keeping.entry, keeping.key, batches, "fine-tuned", backend, progress)
    try:
        engine = engine_for_change(loaded, change, **placement)
        # the batch of the most real tokens: a short one may route through none of the changed experts
        probe = max(batches, key=lambda b: int(b.attention_mask.sum()))
        before = batch_hidden(engine.model, probe, backend.device)  # (B, S, H) of the engine without change
        engine.apply_change(change)
    except (ValueError, KeyError) as e:
        raise UsafError(
            f"--checkpoint {change.source}: does not fit this model ({e})", "pass a matching --model"
        ) from None
    after = batch_hidden(engine.model, probe, backend.device)
    moved = max_logit_change(engine.model, before, after, probe.attention_mask)  # real positions only
    if moved == 0.0:  # deltas under the weights' rounding came first: a bug was named alone (found in review)
        largest = max((float(values.abs().max()) for _, values in change.deltas.values() if values.numel()),
                      default=0.0)  # fmt: skip
        raise UsafError(
            f"--checkpoint {change.source}: applying it leaves the logits of {int(probe.attention_mask.sum())} "
            "tokens unchanged although its deltas or routers differ from the base model (largest |delta| "
            f"{largest:.3g}): its deltas may be below the rounding of the weights they add to (a tiny --lr or few "
            "steps), none of these tokens may route through a changed expert, or the change is not reaching the "
            "forward (a bug in usaf)",
            "train with a larger --lr or more steps, or evaluate on more text (a larger --microbatch checks more "
            "tokens); if neither explains it, report it with the checkpoint",
        )
    del before, after
    if prefix is None:
        keep = _keeper(keeping.entry, keeping.key, keeping.parts, len(batches), "fine-tuned", progress)
        with torch.no_grad(), keeping.stop:
            tuned = run_pass(engine.model, loaded.experts, batches, device=backend.device, progress=progress,
                             description="fine-tuned model", earlier=earlier, stop=keeping.stop.check,
                             on_stop=keep)  # fmt: skip
        return tuned, moved
    first = engine.prefix.start
    running = {layer: state for layer, state in loaded.experts.items() if layer >= first}

    def with_base_routing(result):  # the layers below ``first`` route as in the base pass, token for token
        rows = result.input_tokens
        result.routing = {layer: base.routing[layer][:rows] if layer < first else result.routing[layer]
                          for layer in loaded.experts}  # fmt: skip
        return result

    def kept(partial: passes.PartialPass) -> passes.PartialPass:
        return passes.PartialPass(partial.batches, with_base_routing(partial.result))

    keep = _keeper(keeping.entry, keeping.key, keeping.parts, len(batches), "fine-tuned", progress, complete=kept)
    progress.note(f"fine-tuned pass: starts at layer {first} from the base pass's states (layers below are unchanged)")
    with torch.no_grad(), keeping.stop:
        tuned = run_pass(engine.model, running, batches, device=backend.device, progress=progress,
                         description="fine-tuned model", earlier=earlier, stop=keeping.stop.check, on_stop=keep,
                         around=lambda i: engine.injected(prefix[i].to(backend.device)))  # fmt: skip
    tuned = with_base_routing(tuned)
    tuned.first_layer = first
    return tuned, moved


def _cache_base(entry: Path, key: str, key_parts: dict, base: Any, progress: Progress) -> None:
    """Keep the base pass for the next eval; a disk without room for it only costs that reuse."""
    try:
        cache.save(entry, key, key_parts, base)
    except Exception as e:
        cause = _cache_failure(e)
        if cause is None:
            raise
        progress.note(f"base pass: not cached in {entry} ({cause}); the next eval computes it again")
        return
    progress.note(f"base pass: computed and cached in {entry}")


def _cache_failure(e: BaseException) -> str | None:
    """Why the workspace's cache could not take a pass, or None for an error of usaf's. Any OS error only costs the
    reuse (a full disk, a file named ``cache`` in the workspace, no permission there), never the eval's report."""
    cause = disk.cause_of(e)
    if cause is None and isinstance(e, OSError):
        cause = f"{e.strerror or type(e).__name__}: {e.filename}" if e.filename else str(e)
    return cause


# -- the report -------------------------------------------------------------------------------------------


def _write(config: EvalConfig, writer: ArtifactWriter, backend, o: _Outcome, start: float, progress: Progress):
    """Rows, drift, plots, ``report.json``/``report.md`` and the manifest, committed atomically."""
    rows = result_rows(o.inputs, o.base, o.tuned, samples=config.bootstrap, seed=config.seed)
    drift = routing_drift(o.base, o.tuned, o.num_experts)
    with writer as art:
        plots, plots_note = _plots(config, art.dir, o.curves, drift, rows, progress)
        change = o.change
        summary = EvalSummary(
            model_fingerprint=o.model_fingerprint,
            checkpoint=str(change.source) if change is not None else None,
            checkpoint_fingerprint=change.fingerprint if change is not None else None,
            trainable_layers=list(change.trainable_layers) if change is not None else [],
            data_fingerprint=o.data_fingerprint,
            base_cache_key=o.cache_key,
            base_cache=os.path.abspath(o.cache_entry) if o.cache_entry is not None else None,
            base_cached=o.base.cached,
            max_logit_change=o.logit_change,
            experts_resident=o.resident,
            compute_dtype=str(backend.compute_dtype(config.dtype)).removeprefix("torch."),
            inputs=[_input_summary(item) for item in o.inputs],
            rows=rows,
            routing=drift,
            bootstrap_samples=config.bootstrap,
            confidence=CONFIDENCE,
            seed=config.seed,
            base_pass=_pass_summary(o.base, len(o.sequences)),
            tuned_pass=_pass_summary(o.tuned, len(o.sequences)) if o.tuned is not None else None,
            plots=plots,
            plots_note=plots_note,
            heldout_in_training=o.heldout_in_training,
            overlap_note=o.overlap_note,
            seconds=time.perf_counter() - start,
        )
        (art.dir / REPORT_JSON).write_text(summary.model_dump_json(indent=1) + "\n", encoding="utf-8")
        (art.dir / REPORT_MD).write_text(markdown(summary, model=os.path.abspath(o.model_dir)), encoding="utf-8")
        manifest = art.commit(
            EvalReportManifest,
            inputs=_input_records(o),
            config=config.model_dump(mode="json"),
            environment=current_environment(**backend.recorded(backend.compute_dtype(config.dtype)), seed=config.seed),
            summary=summary,
        )
    return manifest, art.target


def _input_records(o: _Outcome) -> list[InputRecord]:
    records = [
        InputRecord(role="model", kind="quantized_model", path=str(o.model_dir), fingerprint=o.model_fingerprint)
    ]
    if o.change is not None:
        records.append(
            InputRecord(role="checkpoint", kind="run", path=str(o.change.source), fingerprint=o.change.fingerprint)
        )
    records += [
        InputRecord(role=item.set, kind=item.kind, path=str(item.path), fingerprint=item.fingerprint)
        for item in o.inputs
    ]
    return records


def _plots(config: EvalConfig, work: Path, curves: RunCurves | None, drift, rows,
           progress: Progress) -> tuple[list[str], str | None]:  # fmt: skip
    if config.plots is False:
        return [], None
    if not plots.matplotlib_available():
        note = f"plots skipped: matplotlib is not installed ({INSTALL_HINT})"
        progress.note(note)
        return [], note
    (work / PLOTS_DIR).mkdir()
    held = [r for r in rows if r.set == HELD_OUT and r.overall and r.input is None]  # the set's, every input
    base_heldout = held[0].base.nll if held else None
    made = []
    if curves is not None:
        plot_curves(curves, work / PLOTS_DIR / CURVES_FILE, base_heldout=base_heldout)
        made.append(f"{PLOTS_DIR}/{CURVES_FILE}")
    plot_load(drift, work / PLOTS_DIR / LOAD_FILE)
    made.append(f"{PLOTS_DIR}/{LOAD_FILE}")
    return made, None


def _curves_of(change) -> RunCurves | None:
    """The logged losses of the change's run, where it is a run or a checkpoint of one (a delta has none)."""
    if change is None:
        return None
    step = step_of(change.source, flag="--checkpoint") if change.source.parent.name == CHECKPOINTS_DIR else None
    return run_curves(change.source, step=step)


def _input_summary(item) -> InputSummary:
    return InputSummary(
        set=item.set,
        flag=item.flag,
        path=str(item.path),
        kind=item.kind,
        fingerprint=item.fingerprint,
        sequences=len(item.sequences),
        tokens=sum(s.scored for s in item.sequences),
        unscored=sum(1 for s in item.sequences if not s.scored),
        sampled_from=item.sampled_from,
    )


def _pass_summary(result, sequences: int) -> PassSummary:
    return PassSummary(
        sequences=sequences,
        input_tokens=result.input_tokens,
        seconds=result.seconds,
        tokens_per_s=result.input_tokens / max(result.seconds, 1e-9),
        cached=result.cached,
        first_layer=result.first_layer,
    )
