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
    workspace_dir,
)
from usaf.artifacts.plan import (
    LayerRouting,
    LrTestRecord,
    PlanSummary,
    PrefixCacheRecord,
    TensorSelection,
    write_plan_files,
)
from usaf.artifacts.workspace import resolve_data, resolve_model
from usaf.backends import resolve_backend
from usaf.config import source_of
from usaf.data.batches import Batch, collate, sample_lines
from usaf.data.tokenizer import load_tokenizer, max_sequence_length, tokenizer_fingerprint
from usaf.data.tokens import TokenLine, scored_targets
from usaf.engine.engine import SparseEngine, TargetsError
from usaf.engine.prefix import PrefixTap
from usaf.engine.selection import SelectionError, jaccard, numel, pool_size, select
from usaf.errors import UsafError
from usaf.families.targets import resolve_targets
from usaf.settings.fields import FRAC, MIN_ENTRIES, default_frac
from usaf.settings.score import LR_TEST_STEPS, ScoreConfig
from usaf.stages.engine_setup import frozen_layers_resident, load_for_engine
from usaf.stages.lr_test import CANDIDATES, RULE, first_divergence, run_lr_test
from usaf.stages.prefix_cache import sample_states_by_key, write_sample_store, write_store
from usaf.stages.progress import NullProgress, Progress

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
                f"choose from {list(moe_layers)}" + (f" (MoE) and {list(dense)} (dense)" if dense else ""),
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


def _counted(items: list[CalibrationBatch], progress: Progress, description: str) -> Iterator[tuple]:
    """``(half, input_ids, labels, mask)`` of each item, counted on a progress bar."""
    progress.start(description, len(items), "batches")
    tokens = 0
    for item in items:
        yield item.half, item.batch.input_ids, item.batch.labels, item.batch.attention_mask
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


def run(config: ScoreConfig, *, progress: Progress | None = None) -> tuple[PlanManifest, Path]:
    """Score, select and write the plan; returns its manifest and path.

    Under torchrun every rank scores its share of the calibration microbatches (rank r: microbatches
    r, r + N, ...) and the accumulators are merged, so the plan equals one process's with the same
    microbatch; rank 0 writes it (and the prefix store of ``--cache``, alone) while the others wait.
    """
    start = time.perf_counter()
    backend = resolve_backend(
        distributed.device_for_rank(None if config.device == "auto" else config.device),
        source=source_of(config, "device"),
    )
    world = distributed.init(config.dist_backend, backend.device)
    progress = (progress or NullProgress()) if world.is_main else NullProgress()
    model_dir, model_manifest = resolve_model(config, progress)
    tokenizer = load_tokenizer(str(model_dir), flag="--model")
    data_file, data_fingerprint = resolve_data(config, tokenizer_fingerprint(tokenizer), progress)
    out = config.out or default_output(workspace_dir(config.workspace), "plan", model_dir.name)
    writer = ArtifactWriter(
        out, overwrite=config.overwrite, inputs={"--model": model_dir, "--data": [config.data, data_file]}
    )
    writer.check_target()

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
    if len(lines) < config.calib_samples:
        progress.note(f"--calib-samples {config.calib_samples}: the data has only {len(lines)} sequences; using all")

    loaded, placement = load_for_engine(model_dir, backend, backend.policy.compute, config.stream_experts, progress)
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
    pools = pool_size(shapes, frac, config.budget, layer_of)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    engine.load_stats(reset=True)
    halves_wanted = config.stability and len(lines) >= 2
    # the lr test and the plan's prefix store use the states the scoring pass computes (one process: under torchrun
    # each rank would hold its own share of them)
    with _prefix_tap(engine, (config.lr_test or config.cache is not False) and not world.active) as tap:
        items = distributed.shard(calibration_batches(lines, config.microbatch, pad), world)
        settings = {
            "candidates": pools,
            "statistic": config.statistic,
            "exact": config.full_maps,
            "pool_factor": config.candidates_factor,
        }
        if halves_wanted:
            mine, mine_halves = engine.dense_scores_in_halves(_counted(items, progress, "scoring"), **settings)
        else:
            scored = (b for _, *b in _counted(items, progress, "scoring"))
            mine, mine_halves = engine.dense_scores(scored, **settings), ()
    accumulators = distributed.merge_scores(mine, world)
    halves = [distributed.merge_scores(half, world) for half in mine_halves]
    distributed.sum_expert_loads(engine, world)
    routing = engine.load_stats(reset=True)
    try:
        masks = select(accumulators, frac=frac, mode=config.budget, layer_of=layer_of)
    except SelectionError as e:
        hint = "use more --calib-samples, a smaller --frac, or another --budget"
        if "attention" in targets:  # a sequence's first position attends only to itself: no q/k gradient there
            hint += " (attention's q/k learn only past a sequence's first token: longer lines, or --targets experts)"
        raise UsafError(f"--data {data_file}: selection smaller than its budget: {e}", hint) from None

    stability: dict[str, float] = {}
    if halves:
        try:
            a, b = (select(h, frac=frac, mode=config.budget, layer_of=layer_of) for h in halves)
            stability = {name: jaccard(a[name], b[name]) for name in masks}
        except SelectionError as e:
            progress.note(f"stability not measured: a half-size sample cannot fill the budget ({e})")

    sample_states = _states_by_line(tap, items)
    lr_record = _lr_test(config, engine, masks, lines, pad, progress, sample_states)
    summary = _summary(
        config,
        frac,
        engine,
        layers,
        masks,
        accumulators,
        stability,
        routing,
        lines,
        layer_of,
        model_manifest.fingerprint,
        data_fingerprint,
        time.perf_counter() - start,
        lr_record,
    )
    if not world.is_main:
        world.barrier("plan written")  # by rank 0
        return load_verified(out, PlanManifest, flag="--out"), out
    with writer as art:
        _write_files(art.dir, masks, accumulators, routing, full_maps=config.full_maps)
        if config.cache is not False and engine.prefix is not None:
            by_key = sample_states_by_key(engine, lines, sample_states or {}, model_manifest.fingerprint)
            summary = _with_prefix_store(summary, config, engine, by_key, data_file, art.dir,
                                         model_manifest.fingerprint, tokenizer, pad, progress)  # fmt: skip
        manifest = art.commit(
            PlanManifest,
            inputs=[
                InputRecord(
                    role="model", kind="quantized_model", path=str(model_dir), fingerprint=model_manifest.fingerprint
                ),
                InputRecord(role="data", kind="tokens", path=str(data_file), fingerprint=data_fingerprint),
            ],
            config=config.model_dump(mode="json"),
            environment=current_environment(
                backend=backend.name,
                device=str(backend.device),
                dtype=str(backend.policy.compute).removeprefix("torch."),
                seed=config.seed,
            ),
            summary=summary,
        )
    world.barrier("plan written")
    return manifest, art.target


def _lr_test(config, engine, masks, lines, pad, progress: Progress, states) -> LrTestRecord | None:
    """The lr test on the calibration sample (``--lr-test``); the engine is left as it was. ``states``: the
    sample's prefix states by line number, where the calibration pass recorded them."""
    if not config.lr_test:
        return None
    steps = config.lr_test_steps or LR_TEST_STEPS
    progress.note(f"lr test: up to {len(CANDIDATES)} probes of {steps} steps on the calibration sample")
    progress.start("lr test", len(CANDIDATES) * steps, "steps")  # fewer where a probe diverges: the rest not run
    try:
        result = run_lr_test(engine, masks, lines, microbatch=config.microbatch, pad_id=pad, steps=steps,
                             states=states, on_step=lambda lr: progress.advance(1, lr=lr))  # fmt: skip
    finally:
        progress.finish()
    stopped = ""
    if result.probes_run < len(CANDIDATES):
        past = first_divergence(result.base_loss, result.candidates, result.losses)
        stopped = f"; the larger lrs not run, past {past}"
    progress.note(
        f"lr test: lr {result.lr:.1e} in {result.seconds:.1f} s ({result.probes_run} of {len(CANDIDATES)} probes, "
        f"{result.steps} steps{stopped})"
    )
    return LrTestRecord(
        lr=result.lr,
        candidates=result.candidates,
        heldout_losses=result.losses,
        heldout_gap_se=result.gap_se,
        base_loss=result.base_loss,
        rule=RULE,
        steps=result.steps,
        seconds=result.seconds,
        probes_run=result.probes_run,
    )


def _with_prefix_store(summary, config, engine, by_key, data_file, work, model_fingerprint, tokenizer, pad, progress):
    """The summary with the prefix store written into the plan: every training sequence's (``--cache``, the
    sample's ``by_key`` reused), else the calibration sample's alone (``by_key``; none when it is empty or the disk
    has no room for it)."""
    if config.cache:
        stored = write_store(
            engine,
            data_file,
            work,
            model_fingerprint=model_fingerprint,
            vocab_size=len(tokenizer),
            pad_id=pad,
            microbatch=config.microbatch,
            progress=progress,
            known=by_key,
        )
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
