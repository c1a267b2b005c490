"""``usaf score``: which expert weights to train, from gradients on calibration data.

Runs the engine's dense-score mode over every calibration batch (each expert slice's gradient is
reduced into a streaming top-k the moment it exists), selects masks under the budget, measures the
selection's stability on two disjoint halves of the data (scored by the same pass: :func:`calibration_batches`),
records the routing statistics of the same pass, and runs the lr test from the prefix states it recorded. Writes a
``plan`` artifact that ``usaf train`` consumes, with those prefix states in its store (every training sequence's
with ``--cache``; none with ``--no-cache``) so that train's first visits to the sample need not compute them.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from usaf import distributed
from usaf.artifacts import (
    ArtifactWriter,
    InputRecord,
    PlanManifest,
    current_environment,
    default_output,
    load_verified,
    settings_workspace,
)
from usaf.artifacts.lock import holder_of
from usaf.artifacts.manifest import MANIFEST_NAME
from usaf.artifacts.outputs import SCORE_PARTIAL_MARKER, found_at
from usaf.artifacts.plan import (
    LayerRouting,
    LrTestRecord,
    PlanSummary,
    PrefixCacheRecord,
    TensorSelection,
    write_plan_files,
)
from usaf.artifacts.run import SETTINGS_FILE, RunManifest, read_run_settings
from usaf.artifacts.workspace import interrupted_outputs, resolve_data, resolve_model
from usaf.backends import resolve_backend
from usaf.config import refuse_unused, source_of, was_given
from usaf.data.batches import Batch, collate, sample_lines
from usaf.data.tokenizer import load_tokenizer, max_sequence_length, tokenizer_fingerprint
from usaf.data.tokens import TokenLine, scored_targets
from usaf.engine.engine import SparseEngine, TargetsError
from usaf.engine.prefix import PrefixTap
from usaf.engine.selection import SelectionError, jaccard, numel, pool_size, select
from usaf.errors import StopSignal, UsafError
from usaf.families.targets import resolve_targets
from usaf.settings.fields import FRAC, MIN_ENTRIES, default_frac, parse_targets
from usaf.settings.score import LR_TEST_STEPS, ScoreConfig
from usaf.settings.train import DEFAULT_LR
from usaf.stages.engine_setup import frozen_layers_resident, load_for_engine
from usaf.stages.lr_test import CANDIDATES, RULE, cannot_measure, first_divergence, measured, run_lr_test
from usaf.stages.prefix_cache import sample_states_by_key, write_sample_store, write_store
from usaf.stages.progress import NullProgress, Progress, say_backend_notes
from usaf.stages.score_resume import (
    SavedCalibration,
    SavedProbes,
    ScoreProgress,
    finished_plan,
    finished_there,
    run_identity,
    same_run,
)
from usaf.stages.stop import StopRequest, note_at_stop, said_at_stop
from usaf.units import counted, first_few

DEFAULT_TOP_FRACTION = 0.25  # default trainable block: the top quarter of the MoE layers
LEGACY_ENV = {"FRAC": "frac", "TRAIN_FROM": "train_from", "MICROBATCH": "microbatch"}  # the original tool's


def trainable_layers(config: Any, spec: Any) -> list[int]:
    """``--layers``, else every MoE layer from ``--train-from``, else the top quarter of them (at least one).

    With the dense target, dense layers train too: those ``--layers`` names, else every dense layer at or above
    ``--train-from`` (or the first chosen MoE layer).
    """
    moe_layers = spec.moe_layers
    dense = spec.dense_layers if "dense" in resolve_targets(config.targets, spec) else ()
    if config.layers is not None:
        bad = sorted(set(config.layers) - set(moe_layers) - set(dense))
        if bad or not set(config.layers) & set(moe_layers):
            kinds = "MoE or dense" if dense else "MoE"
            raise UsafError(
                f"--layers {config.layers}: not {kinds} layers of this model, or no MoE layer among them",
                f"choose from {list(moe_layers)}" + (f" (MoE) and {list(dense)} (dense), with at least one MoE layer "
                                                     "(the plan scores the routed experts)" if dense else ""),
            )
        return sorted(set(config.layers))
    if config.train_from is not None:
        chosen = [i for i in moe_layers if i >= config.train_from]
        if not chosen:
            raise UsafError(
                f"--train-from {config.train_from}: no MoE layer at or above it", f"MoE layers: {list(moe_layers)}"
            )
        first = config.train_from
    else:
        chosen = list(moe_layers[-max(1, math.ceil(DEFAULT_TOP_FRACTION * len(moe_layers))) :])
        first = chosen[0]
    return sorted(chosen + [i for i in dense if i >= first])


@dataclass(frozen=True)
class CalibrationBatch:
    half: int  # the stability half: 0 (the sample's even positions) or 1 (odd)
    lines: list[TokenLine]
    batch: Batch


def calibration_batches(lines: list[TokenLine], microbatch: int, pad: int) -> list[CalibrationBatch]:
    """The calibration sample's microbatches, each with the stability half it belongs to.

    The halves are the sample's even and odd positions, batched each on its own, and the pass alternates them
    (half 0's first batch, half 1's first, ...). So one backward per batch scores the whole sample and its half
    at once, and duplicated data gives identical halves. The order is the same with stability off, so the plan
    does not depend on whether it was measured.
    """
    halves = [[part[i : i + microbatch] for i in range(0, len(part), microbatch)] for part in (lines[::2], lines[1::2])]
    items = []
    for i in range(max(len(groups) for groups in halves)):
        for half, groups in enumerate(halves):
            if i < len(groups):
                items.append(CalibrationBatch(half, groups[i], collate(groups[i], pad)))
    return items


@dataclass(frozen=True)
class _Rounds:
    """The calibration pass in rounds: round i is every rank's i-th microbatch of its share (one process: the i-th
    microbatch). Under torchrun a stop check is a collective, so every rank checks before every round from the first
    one any rank has still to do, a rank whose share is done or shorter included."""

    first: int  # the first round some rank has still to do
    count: int  # ceil(all microbatches / ranks)


def _counted(
    items: list[CalibrationBatch], progress: Progress, *, done: int, stop: StopRequest, finished: list[int],
    rounds: _Rounds,
) -> Iterator[tuple]:  # fmt: skip
    """``(half, input_ids, labels, mask)`` of each item after the first ``done``, counted on a progress bar and in
    ``finished[0]`` once its backward is over; a stop request is raised between two rounds, never inside one."""
    progress.start("scoring", len(items), "batches", done=done)
    tokens = 0
    for i in range(rounds.first, rounds.count):
        stop.check()
        if not done <= i < len(items):  # done by the interrupted run, or beyond this rank's share
            continue
        item = items[i]
        yield item.half, item.batch.input_ids, item.batch.labels, item.batch.attention_mask
        finished[0] += 1
        tokens += item.batch.tokens
        progress.advance(1, tokens=tokens)
    progress.finish()


@contextlib.contextmanager
def _prefix_tap(engine: SparseEngine, wanted: bool) -> Iterator[PrefixTap | None]:
    """A tap on the calibration pass's forwards, so the lr test need not compute the sample's prefix states again."""
    if not wanted or engine.prefix is None:
        yield None
        return
    tap = engine.prefix_tap()
    try:
        yield tap
    finally:
        tap.close()


def _states_by_line(tap: PrefixTap | None, items: list[CalibrationBatch]) -> dict[int, torch.Tensor] | None:
    """Each scored line's prefix state ``(t, H)`` by its line number, from the tap's one ``(B, T, H)`` per batch."""
    if tap is None or len(tap.states) != len(items):  # not one tapped forward per batch: let the lr test compute
        return None
    tapped, tap.states = tap.states, []  # the padded copies go once the lines' own are cut out
    return {
        line.line: states[i, : len(line.input_ids)].clone()
        for item, states in zip(items, tapped)
        for i, line in enumerate(item.lines)
    }


@dataclass(frozen=True)
class _Inputs:
    """What score has settled before its work: the settings, the launch, the model, the data and the sample."""

    config: ScoreConfig
    world: Any
    backend: Any
    progress: Progress
    model_dir: Path
    model_manifest: Any
    tokenizer: Any
    data_file: Path
    data_fingerprint: str
    lines: list[TokenLine]
    start: float


def run(config: ScoreConfig, *, progress: Progress | None = None) -> tuple[PlanManifest, Path]:
    """Score, select and write the plan; returns its manifest and path.

    The work is done inside the output's partial directory, where a stop request (Ctrl-C) saves the calibration
    pass, the lr test's probes or ``--cache``'s store done so far, and the same command (with or without ``--out``)
    resumes from them (:mod:`usaf.stages.score_resume`). Under torchrun every rank scores its share of the
    calibration microbatches (rank r: microbatches r, r + N, ...) and the accumulators are merged, so the plan equals
    one process's with the same microbatch; the ranks agree on a stop request between two rounds of microbatches and
    each saves its own share; rank 0 runs the lr test and, while the others wait, writes the plan (and the prefix
    store of ``--cache``); it also names the output without ``--out``, checks it and locks it.
    """
    start = time.perf_counter()
    backend = resolve_backend(
        distributed.device_for_rank(None if config.device == "auto" else config.device),
        source=source_of(config, "device"),
    )
    world = distributed.init(config.dist_backend, backend.device)
    progress = (progress or NullProgress()) if world.is_main else NullProgress()
    say_backend_notes(backend, progress)
    if not world.active:  # accepted and unused in one process (found in review)
        refuse_unused(config, "dist_backend", "this is one process, not a torchrun launch",
                      "drop it, or launch with torchrun (or --nproc N)", progress.note)  # fmt: skip
    _refuse_unused_selection(config, progress)
    model_dir, model_manifest = resolve_model(config, progress)
    tokenizer = load_tokenizer(str(model_dir), flag="--model")
    data_file, data_fingerprint = resolve_data(config, tokenizer_fingerprint(tokenizer), progress)
    resolved = {"--model": model_manifest.fingerprint, "--data": data_fingerprint}
    world.refuse_unless_same(resolved, distributed.SAME_INPUTS)  # each rank resolved its own
    identity = run_identity(config, model_fingerprint=model_manifest.fingerprint, data_fingerprint=data_fingerprint,
                            backend=backend, processes=world.size)  # fmt: skip
    out = world.decided_by_main(lambda: _output(config, model_dir.name, identity, progress), "the output's name")
    inputs = {"--model": model_dir, "--data": [config.data, data_file]}
    writer = ArtifactWriter(out, kinds=(PlanManifest.KIND,), overwrite=config.overwrite, inputs=inputs,
                            resumable=True, markers=(SCORE_PARTIAL_MARKER,), defaulted=config.out is None,
                            runs_own_plan=config._into_run)  # fmt: skip
    # rank 0 alone: the lock's check takes the lock for a moment, so two ranks checking at once could refuse each other
    world.decided_by_main(writer.check_target, "the output checked")
    if config.overwrite and not config._into_run:
        world.decided_by_main(lambda: _refuse_replacing_an_unfinished_runs_plan(out, config), "the runs checked")

    # a line beyond the model's context would be scored at positions it never saw (and could exhaust memory)
    context = max_sequence_length(str(model_dir), tokenizer)
    lines = sample_lines(data_file, config.calib_samples, seed=config.seed, vocab_size=len(tokenizer), context=context)
    if not lines:
        raise UsafError(f"--data {data_file}: no sequences", "tokenize some text first")
    if not any(scored_targets(line.labels) for line in lines):  # the file has some (checked): not this sample
        raise UsafError(
            f"--data {data_file}: the {len(lines)} sampled sequences (--calib-samples) have no token to score "
            "(labels all -100, or 1-token sequences): every gradient would be zero",
            "raise --calib-samples, or drop the lines without targets from the file",
        )
    why_not = cannot_measure(lines) if config.lr_test else None  # with --no-lr-test: refused by the settings
    if why_not is not None:  # accepted and unused (found in review)
        refuse_unused(config, "lr_test_steps", f"the lr test will not run ({why_not})", "drop it", progress.note)
    if len(lines) < config.calib_samples:
        given = source_of(config, "calib_samples") + ("" if was_given(config, "calib_samples") else " (default)")
        progress.note(f"{given} {config.calib_samples}: the data has only {counted(len(lines), 'sequence')}; using "
                      "all")  # fmt: skip
    settled = _Inputs(config, world, backend, progress, model_dir, model_manifest, tokenizer, data_file,
                      data_fingerprint, lines, start)  # fmt: skip
    with contextlib.ExitStack() as held:

        def take() -> PlanManifest | None:  # rank 0: the output locked from here to the commit, the work checked
            held.enter_context(writer)
            held.push(_dropped_unless_saved(writer))
            if writer.resumed and (finished := _moved_finished_plan(writer, identity, config.overwrite, progress)):
                return finished
            ScoreProgress.open(writer.dir, identity, out=writer.target, discard=config.overwrite, progress=progress,
                               threads=backend.compute_threads(),
                               run=writer.target.parent if config._into_run else None)  # fmt: skip
            return None

        finished = world.decided_by_main(take, "the output taken")
        if finished is not None:  # killed before its rename: the plan was finished
            return finished, writer.target
        saved = ScoreProgress(writer.dir, progress, rank=world.rank)  # under torchrun, each rank its own share
        if saved.holds_work():  # before any sum: on the CPU the saved work's bits were made at its thread count
            note = backend.same_threads_as(saved.recorded_threads(), "the interrupted score")
            if note is not None:
                progress.note(note)
        return _score(settled, writer, saved)


def _output(config: ScoreConfig, label: str, identity: dict, progress: Progress) -> Path:
    """``--out``; else the default output an interrupted score of this command was writing, which it resumes; else
    a new default name."""
    if config.out is not None:
        return config.out
    workspace = settings_workspace(config)
    found = _interrupted_output(workspace, label, identity)
    if found is not None:  # without --out every run gets a new name: the same command would not find its work
        what = "starting over (--overwrite)" if config.overwrite else "resuming"
        progress.note(f"{what} the interrupted score that was writing {found} (no --out given)")
        return found
    return default_output(workspace, "plan", label)


def _interrupted_output(workspace: Path, label: str, identity: dict) -> Path | None:
    """The default output an interrupted score with this ``identity`` was writing in the workspace (the newest), if
    its saved work is there: without ``--out`` every run gets a new name, so the same command would not find it."""
    for target in interrupted_outputs(workspace, "plan", label):
        if holder_of(target) is not None:  # still being written: another name (it was called interrupted and then
            continue  # refused, naming an --out never given; found in review)
        partial = ArtifactWriter.partial_dir(target)
        saved = ScoreProgress(partial, NullProgress())
        if saved.holds_work() and same_run(saved.recorded_identity(), identity):
            return target
        if finished_there(partial, identity):  # killed before its rename, its bookkeeping gone
            return target
    return None


def _refuse_replacing_an_unfinished_runs_plan(out: Path, config: Any) -> None:
    """``--overwrite`` of the plan an unfinished run of the workspace trains with (interrupted, or training now) is
    refused: replaced, the run can never resume (its record pins the plan), and a run training now would finish
    naming a plan it was not trained with. It replaced it without a word (found in review)."""
    if found_at(out).kind != PlanManifest.KIND:
        return
    plan = os.path.realpath(out)
    for run in _unfinished_runs(settings_workspace(config)):
        try:
            record = read_run_settings(run / SETTINGS_FILE)
        except UsafError:  # an edited record: that run resumes no more either way
            continue
        if isinstance(record, dict) and record.get("plan") == plan:
            raise UsafError(
                f"--out {out}: the plan of the unfinished run {run} (--overwrite would replace it, and that run "
                "could never resume)",
                f"pass another --out, or finish the run first (usaf train --out {run} --resume), or delete {run} "
                "if it is no longer needed",
            )


def _unfinished_runs(workspace: Path) -> list[Path]:
    """The workspace's run directories without a manifest that recorded their settings (begun training)."""
    runs = workspace / RunManifest.KIND
    if not runs.is_dir():
        return []
    return sorted(d for d in runs.iterdir() if d.is_dir() and not d.is_symlink() and not (d / MANIFEST_NAME).exists()
                  and (d / SETTINGS_FILE).is_file())  # fmt: skip


def _moved_finished_plan(
    writer: ArtifactWriter, identity: dict, overwrite: bool, progress: Progress
) -> PlanManifest | None:
    """The finished plan of this run that the partial directory held (killed between its manifest and its rename),
    now moved into place; None where it held none."""
    manifest = finished_plan(writer.dir, identity, out=writer.target, discard=overwrite, progress=progress)
    if manifest is None:
        return None
    writer.drop(ScoreProgress(writer.dir, progress).bookkeeping())  # what a kill after the manifest left, if any
    writer.commit_foreign()  # only the rename was missing
    progress.note(f"the interrupted score had finished its plan; moved it into place as {writer.target}")
    return manifest


def _dropped_unless_saved(writer: ArtifactWriter):
    """An exit callback: a failed run's partial directory goes, unless it holds saved work that a rerun resumes, or
    a finished plan (stopped between its manifest and its rename) that a rerun moves into place."""

    def drop(exc_type, exc, tb) -> None:
        if exc is None or writer.committed or (writer.dir / MANIFEST_NAME).is_file():  # a finished plan: moved on rerun
            return
        if not ScoreProgress(writer.dir, NullProgress()).holds_work():
            shutil.rmtree(writer.dir, ignore_errors=True)

    return drop


def _score(settled: _Inputs, writer: ArtifactWriter, saved: ScoreProgress) -> tuple[PlanManifest, Path]:
    """Score's work once its output is settled: the pass, the selection, the lr test and the plan's files."""
    config, world, backend, progress = settled.config, settled.world, settled.backend, settled.progress
    lines, data_file, tokenizer = settled.lines, settled.data_file, settled.tokenizer
    model_fingerprint = settled.model_manifest.fingerprint
    loaded, placement = load_for_engine(settled.model_dir, backend, backend.compute_dtype(config.dtype),
                                        config.stream_experts, progress)  # fmt: skip
    layers = trainable_layers(config, loaded.spec)
    targets = resolve_targets(config.targets, loaded.spec)
    try:
        engine = SparseEngine(loaded, trainable_layers=layers, targets=targets, train_router=config.router, **placement)
    except TargetsError as e:
        asked = ",".join(targets)
        raise UsafError(f"--targets {asked}: {e}", "choose other --targets (experts: every model)") from None
    if config.cache and engine.prefix is None:
        raise UsafError(
            f"--cache: no frozen prefix to cache (the first trainable layer is {layers[0]})",
            "drop --cache, or train fewer layers (--train-from above 0)",
        )
    frozen_layers_resident(engine, backend, progress)  # calibration (and --cache) run the frozen layers
    shapes = {name: w.shape for name, w in engine.weights.items()}
    layer_of = {name: loaded.spec.layer_of(name) for name in shapes}
    frac = _selected_share(config.frac, sum(numel(shape) for shape in shapes.values()), progress)
    floored = _under_one_weight(shapes, frac, config.budget)
    if floored:  # the frac alone misstated what trains, in silence (found in review)
        per_expert = config.budget == "per-expert"
        progress.note(f"frac {frac:g}: under one weight in {'each expert of ' if per_expert else ''}{len(floored)} of "
                      f"the {len(shapes)} target tensors, {'each expert' if per_expert else 'each'} of which trains "
                      "one")  # fmt: skip
    pools = pool_size(shapes, frac, config.budget, layer_of)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    settings = {"candidates": pools, "statistic": config.statistic, "exact": config.full_maps,
                "pool_factor": config.candidates_factor}  # fmt: skip
    stop = StopRequest(world)  # under torchrun each check is a collective: every rank makes the same checks
    with stop:
        # the lr test and the plan's prefix store use the states the scoring pass computes (one process: under
        # torchrun each rank would hold its own share of them)
        with _prefix_tap(engine, (config.lr_test or config.cache is not False) and not world.active) as tap:
            every = calibration_batches(lines, config.microbatch, pad)
            items = distributed.shard(every, world)
            halves_wanted = config.stability and len(lines) >= 2
            mine, mine_halves, earlier = _calibration_pass(engine, items, len(every), settings, halves_wanted, tap,
                                                           stop, saved, progress)  # fmt: skip
        accumulators = distributed.merge_scores(mine, world)
        halves = [distributed.merge_scores(half, world) for half in mine_halves]
        distributed.sum_expert_loads(engine, world)
        routing = engine.load_stats(reset=True)
        masks, stability = _selection(accumulators, halves, frac, layer_of, config.budget, targets, data_file, progress)
        sample_states = _states_by_line(tap, items)
        # under torchrun rank 0 runs the test alone (every rank would run the same probes) and the others take its
        # record: one decision, where ranks whose sums differed in the last bits could stop other probes
        lr_record, earlier_probes = world.decided_by_main(
            lambda: _lr_test(config, engine, masks, lines, pad, progress, sample_states, saved, stop), "the lr test"
        )
        stop.check()  # a request during the last probe step: everything is saved, so stop before writing
    seconds = time.perf_counter() - settled.start + earlier + earlier_probes  # an interrupted run's work included
    summary = _summary(config, frac, engine, layers, masks, accumulators, stability, routing, lines, layer_of,
                       model_fingerprint, settled.data_fingerprint, seconds, lr_record)  # fmt: skip
    _note_uncertified(summary, config, progress)
    if not world.is_main:
        world.barrier("plan written")  # by rank 0
        return load_verified(writer.target, PlanManifest, flag="--out"), writer.target
    try:
        saved.clear_outputs()  # what a run that failed while writing left (written again)
        _write_files(writer.dir, masks, accumulators, routing, full_maps=config.full_maps)
        if config.cache is not False and engine.prefix is not None:
            by_key = sample_states_by_key(engine, lines, sample_states or {}, model_fingerprint)
            # under torchrun rank 0 writes the store alone (no collective stop check; its minute saves stay)
            store_stop = stop if not world.active else None
            summary = _with_prefix_store(summary, config, engine, by_key, data_file, writer.dir,
                                         model_fingerprint, tokenizer, pad, progress, saved, store_stop)  # fmt: skip
    except KeyboardInterrupt:  # stopped while writing the plan: "nothing half-written" was said of saved work
        if saved.holds_work() and not said_at_stop():  # (review): what is kept; once (the store's note said it)
            note_at_stop(progress, f"interrupted while writing the plan: its work is saved in {saved.directory}; run "
                                   "the same command to resume")  # fmt: skip
        raise
    manifest = writer.commit(  # locked since run took the output
        PlanManifest,
        exclude=saved.bookkeeping(),
        progress=progress,  # --cache's prefix store: GBs
        inputs=[
            InputRecord(
                role="model", kind="quantized_model", path=str(settled.model_dir), fingerprint=model_fingerprint
            ),
            InputRecord(role="data", kind="tokens", path=str(data_file), fingerprint=settled.data_fingerprint),
        ],
        config=config.model_dump(mode="json"),
        environment=current_environment(**backend.recorded(backend.compute_dtype(config.dtype)), seed=config.seed),
        summary=summary,
    )
    world.barrier("plan written")
    return manifest, writer.target


def _refuse_unused_selection(config: ScoreConfig, progress: Progress) -> None:
    """Selection settings that would change nothing in this combination (both accepted and unused before; found in
    review): a pool size with exact full maps, a per-expert budget over targets without experts."""
    if config.full_maps:
        refuse_unused(config, "candidates_factor", "--full-maps scores every weight exactly, keeping no candidate pool",
                      "drop one of them", progress.note)  # fmt: skip
    if config.budget == "per-expert" and config.targets is not None and "experts" not in parse_targets(config.targets):
        refuse_unused(config, "budget", f"--targets {config.targets} has no experts to spread --frac over",
                      "drop it, or add experts to --targets", progress.note)  # fmt: skip


def _under_one_weight(shapes, frac: float, budget: str) -> list[str]:
    """The tensors whose own budget ``frac`` puts under one weight, which :func:`select` raises to one: per tensor, or
    per expert slice (``per-expert``: the tensor's whole size hid it; found in review). A shared budget (per-layer,
    global) is one for the tensors together: none of its own."""
    if budget not in ("per-tensor", "per-expert"):
        return []
    unit = {name: shape[1:] if budget == "per-expert" else shape for name, shape in shapes.items()}
    return [name for name, shape in unit.items() if int(frac * numel(shape)) < 1]


def _selection(accumulators, halves, frac, layer_of, budget, targets, data_file, progress: Progress):
    """``(masks, stability)``: the plan's selection, and each tensor's overlap of the two halves' selections."""
    floored = _under_one_weight({name: acc.shape for name, acc in accumulators.items()}, frac, budget)
    try:
        masks = select(accumulators, frac=frac, mode=budget, layer_of=layer_of)
    except SelectionError as e:
        # a budget already at its minimum of one weight cannot shrink: "a smaller --frac" was offered (review)
        smaller = "" if len(floored) == len(accumulators) else ", a smaller --frac"
        hint = f"use more --calib-samples{smaller}, or another --budget"
        if "candidate pool" in str(e):  # the pool keeps the tensor's best: more samples need not help (review)
            hint = "pass --full-maps (every score kept, each expert's own best chosen), or another --budget"
        if "attention" in targets:  # a sequence's first position attends only to itself: no q/k gradient there
            hint += " (attention's q/k learn only past a sequence's first token: longer lines, or --targets experts)"
        raise UsafError(f"--data {data_file}: selection smaller than its budget: {e}", hint) from None
    empty = [name for name, mask in masks.items() if mask.numel() == 0]
    if empty and budget in ("per-layer", "global"):  # a shared budget may go to some tensors only: say which lost out
        progress.note(f"--budget {budget}: {len(empty)} of the {len(masks)} target tensors got no weights (the "
                      f"others scored higher) and will not train: {first_few(empty)}")  # fmt: skip  (found in review)
    stability: dict[str, float] = {}
    if halves:
        try:
            a, b = (select(h, frac=frac, mode=budget, layer_of=layer_of) for h in halves)
            # a tensor none of the three selections chose from has no stability: it counted as 1.0, perfectly
            # stable, in the mean (found in review)
            stability = {name: jaccard(a[name], b[name]) for name in masks
                         if masks[name].numel() or a[name].numel() or b[name].numel()}  # fmt: skip
        except SelectionError as e:
            progress.note(f"stability not measured: a half-size sample cannot fill the budget ({e})")
    return masks, stability


def _calibration_pass(engine, items, every: int, settings, halves_wanted: bool, tap, stop, saved: ScoreProgress,
                      progress):  # fmt: skip
    """The sample's accumulators and the halves' (``[]`` without ``halves_wanted``) over ``items`` (this rank's share
    of ``every`` microbatches), from where an interrupted run saved the pass, and the seconds it had spent on it. The
    pass is saved at its end, and at a stop request, which is then raised (under torchrun each rank its own share)."""
    world = stop.world

    def fresh() -> tuple[dict, list[dict]]:
        made = [engine.score_accumulators(**settings) for _ in range(3 if halves_wanted else 1)]
        return made[0], made[1:]

    engine.load_stats(reset=True)
    sample, halves = fresh()
    counters = {layer: state.tokens_per_expert for layer, state in engine.loaded.experts.items()}
    resumed = saved.calibration(sample, halves, batches=len(items), expert_tokens=counters)
    done, earlier = 0, 0.0
    if resumed is None:
        sample, halves = fresh()  # a file that did not fit may have filled some of them
    else:
        done, earlier = resumed.batches, resumed.seconds
        for layer, counts in resumed.expert_tokens.items():
            counters[layer].copy_(counts)
        if tap is not None:
            tap.states = list(resumed.states)
    dones = world.gather_objects((resumed is not None, done), "the calibration batches done")  # every rank's
    rounds = _Rounds(min(n for _, n in dones), math.ceil(every / world.size))
    if any(found for found, _ in dones):
        progress.note(f"resuming the interrupted score in {saved.directory}: "
                      f"{sum(n for _, n in dones)} of {every} calibration batches done")  # fmt: skip
    finished = [0]
    batches = _counted(items, progress, done=done, stop=stop, finished=finished, rounds=rounds)
    start = time.perf_counter()

    def save() -> bool:
        tokens = {layer: counts.clone() for layer, counts in counters.items()}
        states = list(tap.states) if tap is not None else []
        seconds = earlier + time.perf_counter() - start
        return saved.save_calibration(SavedCalibration(done + finished[0], sample, halves, tokens, states, seconds))

    try:
        if halves:
            engine.dense_scores_in_halves(batches, **settings, into=(sample, halves))
        else:
            engine.dense_scores((b for _, *b in batches), **settings, into=sample)
    except StopSignal:  # raised between two rounds: the accumulators hold whole batches only
        progress.finish()  # the bar as it stopped, then the note
        kept = world.gather_objects((saved.directory is not None and save(), done + finished[0]), "the saved pass")
        if all(ok for ok, _ in kept):
            note_at_stop(
                progress,
                f"interrupted: saved the calibration pass ({sum(n for _, n in kept)} of {every} batches) "
                f"in {saved.directory}; {saved.rerun}",
            )
        raise
    if finished[0]:  # the pass's end: an interrupt or a kill later on does not cost it
        save()
    stop.check()  # a request during the last batch: the pass is saved
    return sample, halves, earlier


def _lr_test(config, engine, masks, lines, pad, progress: Progress, states, saved: ScoreProgress, stop):
    """The lr test on the calibration sample (``--lr-test``), from the probes an interrupted run saved; the engine
    is left as it was. ``states``: the sample's prefix states by line number, where the calibration pass recorded
    them. Returns the test's record (None without the test) and the seconds interrupted runs spent on it."""
    if not config.lr_test:
        return None, 0.0
    why_not = cannot_measure(lines)
    if why_not is not None:  # the plan then records no test: train says it uses its default lr
        progress.note(f"lr test skipped: {why_not}; train uses --lr, else its default {DEFAULT_LR:g} "
                      "(calibrate on more lines or sources for the test)")  # fmt: skip
        return None, 0.0
    steps = config.lr_test_steps or LR_TEST_STEPS
    earlier = saved.probes()
    done = earlier.done[: len(CANDIDATES)]
    if done:
        progress.note(f"lr test: {len(done)} of {len(CANDIDATES)} probes done by the interrupted run")
    else:
        progress.note(f"lr test: up to {len(CANDIDATES)} probes of {steps} steps on the calibration sample")
    # fewer where a probe diverges: the rest not run
    progress.start("lr test", len(CANDIDATES) * steps, "steps", done=len(done) * steps)
    start = time.perf_counter()

    def step(lr: float) -> None:
        progress.advance(1, lr=lr)
        stop.check(alone=True)  # between two steps (the probe is run again on resume); one rank runs the test

    finished = [len(done)]

    def probe_done(scores: list) -> None:
        if saved.save_probes(SavedProbes(scores, earlier.seconds + time.perf_counter() - start)):
            finished[0] = len(scores)

    try:
        result = run_lr_test(engine, masks, lines, microbatch=config.microbatch, pad_id=pad, steps=steps,
                             states=states, on_step=step, done=done, on_probe=probe_done)  # fmt: skip
    except StopSignal:
        progress.finish()
        if saved.holds_work():
            probes = "probe" if finished[0] == 1 else "probes"
            note_at_stop(
                progress,
                f"interrupted: saved the calibration pass and {finished[0]} finished lr-test {probes} in "
                f"{saved.directory}; {saved.rerun}",
            )
        raise
    finally:
        progress.finish()
    seconds = earlier.seconds + result.seconds
    stopped = ""
    if result.probes_run < len(CANDIDATES):
        past = first_divergence(result.base_loss, result.candidates, result.losses)
        stopped = f"; the larger lrs not run, past {past}"
    progress.note(
        f"lr test: lr {result.lr:.1e} in {seconds:.1f} s ({result.probes_run} of {len(CANDIDATES)} probes, "
        f"{result.steps} steps{stopped})"
    )
    if not measured(result):
        progress.note(f"warning: lr test: every probe diverged; {result.lr:.1e}, the smallest candidate, is recorded "
                      "as a fallback, not a measured choice (pass train a smaller --lr if its loss rises)")  # fmt: skip
    record = LrTestRecord(
        lr=result.lr,
        candidates=result.candidates,
        heldout_losses=result.losses,
        heldout_gap_se=result.gap_se,
        base_loss=result.base_loss,
        rule=RULE,
        steps=result.steps,
        seconds=seconds,
        probes_run=result.probes_run,
    )
    return record, earlier.seconds


def _with_prefix_store(summary, config, engine, by_key, data_file, work, model_fingerprint, tokenizer, pad, progress,
                       saved: ScoreProgress, stop: StopRequest | None):  # fmt: skip
    """The summary with the prefix store written into the plan: every training sequence's (``--cache``, the
    sample's ``by_key`` reused; from where an interrupted run saved it, and saved at a stop request), else the
    calibration sample's alone (``by_key``; none when it is empty or the disk has no room for it)."""
    if config.cache:
        resume = saved.store()
        if resume is not None:
            progress.note(f"prefix cache: {resume['lines']:,} sequences stored by the interrupted run")
        try:
            with stop or contextlib.nullcontext():
                stored = write_store(engine, data_file, work, model_fingerprint=model_fingerprint,
                                     vocab_size=len(tokenizer), pad_id=pad, microbatch=config.microbatch,
                                     progress=progress, known=by_key, resume=resume, stop=stop,
                                     on_save=saved.save_store if saved.directory is not None else None)  # fmt: skip
        except StopSignal:
            progress.finish()
            if (store := saved.store()) is not None:
                note_at_stop(
                    progress,
                    f"interrupted: saved the plan's work and its prefix store's first {store['lines']:,} "
                    f"sequences in {saved.directory}; {saved.rerun}",
                )
            raise
    else:
        stored = write_sample_store(engine, by_key, work, model_fingerprint=model_fingerprint, progress=progress)
        if not stored:
            return summary
    dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
    scope = "data" if config.cache else "calibration"
    record = PrefixCacheRecord(**stored, scope=scope, start=engine.prefix.start, dtype=dtype)
    return summary.model_copy(update={"prefix_cache": record})


def _write_files(work: Path, masks: dict, accumulators: dict, routing: dict, *, full_maps: bool) -> None:
    write_plan_files(
        work,
        masks,
        {name: acc.ranked() for name, acc in accumulators.items()},
        {layer: vars(load) for layer, load in routing.items()},
        full_maps={name: acc.dense_map() for name, acc in accumulators.items()} if full_maps else None,
    )


def _selected_share(given: float | None, weights: int, progress: Progress) -> float:
    """``--frac`` as given, else the default share of ``weights`` (the trainable layers' target weights)."""
    if given is not None:
        return given
    frac = default_frac(weights)
    if frac != FRAC:
        progress.note(
            f"frac {frac:.4g}: the default {FRAC:g} would train {int(FRAC * weights):,} of these layers' "
            f"{weights:,} target weights, fewer than {MIN_ENTRIES:,} (pass --frac to choose)"
        )
    return frac


def _note_uncertified(summary: PlanSummary, config: ScoreConfig, progress: Progress) -> None:
    """Masks the candidate pool cannot prove to be the exact top-k: said, with the way to the exact one. The printout
    read as the exact selection, which only ``inspect``'s ``certified: false`` told apart (found in review)."""
    uncertified = [t.name for t in summary.tensors if not t.certified]
    if not uncertified or config.full_maps:
        return
    n, total = len(uncertified), len(summary.tensors)
    which = "the mask is" if total == 1 else f"the {n} masks are" if n == total else (
        f"{n} of the {total} masks {'is' if n == 1 else 'are'}")
    progress.note(f"{which} not proven the exact top-k of |grad| (e.g. {uncertified[0]}): the candidate "
                  f"pool (--candidates-factor {config.candidates_factor}) can miss weights whose importance came late; "
                  "on real text its masks held 90-97 % of the exact ones' importance. --full-maps selects exactly "
                  "(4 bytes of memory per target weight)")  # fmt: skip


def _summary(
    config,
    frac: float,
    engine,
    layers,
    masks,
    accumulators,
    stability,
    routing,
    lines,
    layer_of,
    model_fingerprint: str,
    data_fingerprint: str,
    seconds: float,
    lr_test: LrTestRecord | None,
) -> PlanSummary:
    budgets = pool_size({n: a.shape for n, a in accumulators.items()}, frac, config.budget, layer_of)
    tensors = []
    for name, idx in masks.items():
        acc = accumulators[name]
        experts, rows, cols = acc.shape
        per_expert = torch.bincount(idx // (rows * cols), minlength=experts).tolist()
        tensors.append(
            TensorSelection(
                name=name,
                layer=layer_of[name],
                shape=list(acc.shape),
                budget=budgets[name] if config.budget == "per-tensor" else int(idx.numel()),
                selected=int(idx.numel()),
                candidates=int(acc.ranked()[0].numel()),
                per_expert=per_expert,
                certified=bool(acc.certified(int(idx.numel()))) if config.budget == "per-tensor" else acc.exact,
                stability=stability.get(name),
            )
        )
    entries = sum(t.selected for t in tensors)
    router_params = engine.trainable_count()["router_params"]
    if entries == 0 or (config.budget in ("per-tensor", "per-expert") and any(t.selected == 0 for t in tensors)):
        raise UsafError("the selection is empty for some tensor", "check the data and --frac")
    return PlanSummary(
        model_fingerprint=model_fingerprint,
        tokens_fingerprint=data_fingerprint,
        trainable_layers=layers,
        frac=frac,
        frac_given=config.frac is not None,
        budget=config.budget,
        statistic=config.statistic,
        router=config.router,
        targets=list(engine.targets),
        calib_samples=len(lines),
        calib_tokens=sum(len(line.input_ids) for line in lines),
        tensors=tensors,
        expert_entries=entries,
        router_params=router_params,
        trainable_params=entries + router_params,
        stability_mean=sum(stability.values()) / len(stability) if stability else None,
        routing=[LayerRouting(layer=layer, **vars(load)) for layer, load in routing.items()],
        lr_test=lr_test,  # validated with the rest (model_copy would skip the record's checks)
        seconds=seconds,
    )
