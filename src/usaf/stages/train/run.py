"""``usaf train``'s stage function: inputs checked → engine → loop → finish.

Light at import (the CLI imports the stage before it knows it will run); torch and the engine come in
with :func:`run`.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from usaf.artifacts import InputRecord, RunManifest, current_environment, load_verified
from usaf.artifacts.disk import guarded_write
from usaf.artifacts.plan import check_masks_fit, check_plan_layers, read_masks
from usaf.artifacts.run import (
    FINAL_DIR,
    METRICS_FILE,
    PREFIX_SPILL,
    PREFIX_SPILL_RANK,
    SETTINGS_FILE,
    ReselectionRecord,
    RunSummary,
    checkpoint_dirs,
    read_metrics,
    run_settings_text,
    step_of,
    trim_metrics,
)
from usaf.artifacts.writer import record_files, write_manifest, write_text_atomic
from usaf.config import refuse_unused, source_of, was_given
from usaf.errors import UsafError
from usaf.stages.progress import NullProgress, Progress, say_backend_notes
from usaf.stages.train.config import TrainConfig
from usaf.units import counted


def run(config: TrainConfig, *, progress: Progress | None = None) -> tuple[RunManifest, Path]:
    """Train; returns the run's manifest and directory."""
    # lazy: the package binds run eagerly and imports no torch (usaf.stages.train stays light)
    from usaf import distributed
    from usaf.backends import resolve_backend
    from usaf.backends.determinism import deterministic_kernels
    from usaf.stages.train.inputs import resolved_inputs

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
    # --out stays locked until the run ends; a full or read-only disk at any write of the run (settings, metrics,
    # a checkpoint, the manifest) is one line naming it, the checkpoints already written stay, and the same
    # command resumes from the newest
    with (
        resolved_inputs(config, backend, world, progress) as inputs,
        guarded_write(inputs.run_dir, flag="--out", resumable=True),
        deterministic_kernels(config.deterministic),
    ):
        return _train(inputs, backend, world, progress, start)


def _train(inputs: Any, backend: Any, world: Any, progress: Progress, start: float) -> tuple[RunManifest, Path]:
    """Build the engine, train from the step the inputs resume at, and finish the run."""
    # lazy: the package binds run eagerly and imports no torch (usaf.stages.train stays light)
    import torch

    # lazy: the package binds run eagerly and imports no torch (usaf.stages.train stays light)
    from usaf.engine.loss_scale import DynamicLossScaler
    from usaf.stages.engine_setup import frozen_layers_resident
    from usaf.stages.train import loop
    from usaf.stages.train.inputs import other_split
    from usaf.stages.train.resume import recorded_threads
    from usaf.stages.train.trainer import Trainer

    config, run_dir = inputs.config, inputs.run_dir
    compute = backend.compute_dtype(config.dtype)
    if inputs.resume_from is not None:  # before any sum: on the CPU its bits need the run's thread count
        threads = backend.same_threads_as(recorded_threads(inputs.resume_from), "the run")
        if threads is not None:
            progress.note(threads)
    engine = _engine(inputs, backend, compute, progress)
    prefix, served = _prefix(engine, inputs, world, progress)  # its store is checked before the run directory is made
    if prefix is not None and _computes_prefixes(prefix[0], inputs, served):
        frozen_layers_resident(engine, backend, progress, planned=config._frozen_resident)
    world.barrier("settings check")  # every rank has read the old settings before rank 0 writes the new
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / SETTINGS_FILE, run_settings_text(inputs.settings_record))  # all or nothing
    world.barrier("run directory")

    scaler = DynamicLossScaler() if compute == torch.float16 else None  # fp16 gradients underflow without it
    torch.manual_seed(config.seed)  # checkpoints store torch's RNG state: unseeded, two equal runs differ in bytes
    trainer = Trainer(
        engine, config, inputs.data, inputs.eval_data, run_dir, steps=inputs.steps,
        reselect_every=inputs.reselect_every, pad_id=inputs.pad_id, prefix=prefix,
        loss_scaler=scaler, world=world, backend=backend,
    )  # fmt: skip
    if inputs.resume_from is not None:
        trainer.load_checkpoint(inputs.resume_from)
        progress.note(f"resuming from {inputs.resume_from} (step {trainer.state.step} of {inputs.steps})")
        ran_at = trainer.state.microbatch or inputs.settings_record.get("microbatch")  # recorded at the run's start
        if (split := other_split(ran_at, trainer.microbatch, config.microbatch)) is not None:
            progress.note(split)
        if (before := trainer.resumed_world_size) != world.size:  # README said exact; it is not (found in review)
            progress.note(f"resumed on {counted(world.size, 'process')}, the run trained on {before} until now: the "
                          "same sums in another order, so equal to an uninterrupted run's to fp32 rounding, not bit "
                          "for bit (a later reselection may pick a few other weights)")  # fmt: skip
        if not (config.deterministic or backend.capabilities.reproducible):
            progress.note(f"on {backend.name} without --deterministic the resumed run equals an uninterrupted one "
                          "only within the device's run-to-run noise (its sums' order varies)")  # fmt: skip
    if world.is_main:  # steps after the checkpoint are logged again; from nothing, all (the step-0 held-out loss too)
        if (run_dir / METRICS_FILE).exists() and not (run_dir / METRICS_FILE).is_file():  # a traceback in the 1st step
            raise UsafError(f"--out {run_dir}: its training log {METRICS_FILE} is not a file",
                            "move it out of the run directory; the run writes it again")  # fmt: skip
        trim_metrics(run_dir, trainer.state.step if inputs.resume_from is not None else -1)
    _held_out_before_training(trainer, progress)
    per_step = inputs.per_step
    if world.active:
        progress.note(f"data parallel: {world.size} processes ({world.backend}), {per_step} sequences per step "
                      f"({per_step // world.size} per process)")  # fmt: skip
    progress.note(_plan_line(engine, trainer, inputs.steps, per_step))
    progress.note(f"lr {config.lr:.1e} (from {inputs.lr_source})"
                  + (f", router lr {config.router_lr:g}" if config.router else ""))  # fmt: skip

    began = (trainer.state.step, trainer.state.tokens)  # a resumed run's: its summary's time and rate are from there
    loop.run_loop(trainer, inputs.steps, progress)
    return _finish(inputs, trainer, backend, time.perf_counter() - start, began, progress)


def _engine(inputs: Any, backend: Any, compute: Any, progress: Progress) -> Any:
    """The engine over the loaded model, its deltas placed on the plan's masks."""
    # lazy: the package binds run eagerly and imports no torch (usaf.stages.train stays light)
    from usaf.engine.engine import SparseEngine, TargetsError
    from usaf.settings.fields import EXPERTS_ONLY
    from usaf.stages.engine_setup import load_for_engine

    config = inputs.config
    loaded, placement = load_for_engine(inputs.model_dir, backend, compute, config.stream_experts, progress)
    masks = read_masks(inputs.plan_dir, inputs.plan)  # checked against the plan's own manifest
    check_plan_layers(inputs.plan_dir, inputs.plan, list(loaded.spec.moe_layers), list(loaded.spec.dense_layers))
    targets = inputs.plan.summary.targets or EXPERTS_ONLY  # a plan from before --targets: the experts
    try:
        engine = SparseEngine(
            loaded,
            trainable_layers=inputs.plan.summary.trainable_layers,
            targets=targets,
            train_router=config.router,
            dense_router_grad=config.dense_router_grad,
            aux_loss_coef=config.aux_loss_coef,
            z_loss_coef=config.z_loss_coef,
            **placement,
        )
    except TargetsError as e:  # e.g. a plan scored on one device, trained on one without index ops
        raise UsafError(
            f"--plan {inputs.plan_dir}: its targets ({','.join(targets)}) cannot train here: {e}",
            "re-run usaf score with other --targets",
        ) from None
    check_masks_fit(inputs.plan_dir, inputs.plan, masks, {name: tuple(w.shape) for name, w in engine.weights.items()})
    engine.set_deltas(masks)
    return engine


def _prefix(engine: Any, inputs: Any, world: Any, progress: Progress) -> tuple[tuple[Any, str] | None, bool]:
    """(the frozen-prefix cache, the model's fingerprint) when the engine has a frozen prefix, else None; and whether
    the plan's store holds the states of the run's sequences as the run keys them (:func:`_store_probe`)."""
    # lazy: the package binds run eagerly and imports no torch (usaf.stages.train stays light)
    from usaf.artifacts.prefix_store import open_store
    from usaf.engine.prefix import PrefixCache

    if engine.prefix is None:
        return None, False
    hidden = engine.model.get_input_embeddings().embedding_dim  # the width of every stored state
    record = inputs.plan.summary.prefix_cache
    store = open_store(inputs.plan_dir, record, hidden_size=hidden)  # what usaf score kept
    small = len(inputs.data) <= CALIBRATION_PROBE  # each sequence looked up: read and held in RAM for no hit before
    if store is not None and record.scope != "data" and small and not _store_probe(engine, inputs, store,
                                                                                  probes=len(inputs.data))[0]:
        progress.note("the plan's prefix states (its calibration sample) are of none of this run's sequences as it "
                      "keys them (--seq-len cuts them, or another --dtype, torch or transformers): not used; the "
                      "frozen layers run for every sequence")  # fmt: skip  (found in review)
        store = None
    spill = inputs.run_dir / (PREFIX_SPILL_RANK.format(world.rank) if world.active else PREFIX_SPILL)
    cache = PrefixCache(int(inputs.config.prefix_cache_gib * 2**30), spill, store=store)
    served = False
    if store is not None:
        whose = "the calibration sample"
        if record.scope == "data" and not _store_holds_the_data(inputs):  # another --data's, said (found in review)
            whose = "another --data's training sequences: those of this --data it holds are used"
        elif record.scope == "data":
            held, looked_up = _store_probe(engine, inputs, store)
            served = held == looked_up
            whose = "every training sequence: usaf score --cache" if served else (
                f"usaf score --cache, but {held} of {looked_up} of this run's sequences looked up are there: the "
                "states were computed for other token cuts or another dtype or library version (--seq-len, --dtype, "
                "torch, transformers): the frozen layers run for the rest")  # fmt: skip
        progress.note(f"prefix states of {len(store):,} sequences read from the plan ({whose})")
        config = inputs.config  # said, not refused: by now an --overwrite has replaced the run directory
        if served and was_given(config, "prefix_cache_gib"):  # the cache it sizes holds nothing (unused; review)
            progress.note(f"{source_of(config, 'prefix_cache_gib')} {config.prefix_cache_gib:g}: not used, the "
                          "plan's store serves every training sequence's prefix states (no cache is filled)")
    return (cache, inputs.model.fingerprint), served


STORE_PROBE = 16  # training sequences looked up in a --cache store before the run counts on it for all of them
CALIBRATION_PROBE = 20_000  # data up to this many sequences: each looked up in a calibration store (about a second)


def _store_probe(engine: Any, inputs: Any, store: Any, probes: int = STORE_PROBE) -> tuple[int, int]:
    """How many of up to ``probes`` training sequences, spread over the data and cut as the run cuts them
    (``--seq-len``), the store holds under the keys this run computes (their tokens, the dtype, torch's and
    transformers' versions: ``engine.prefix_key``), and how many were looked up. A store of this very data missed
    every state under ``--seq-len`` or ``--dtype`` while the run said it held them, and left the frozen layers
    quantized for the misses (found in review)."""
    # lazy: the package binds run eagerly and imports no torch (usaf.stages.train stays light)
    import torch

    n, cut = len(inputs.data), inputs.config.seq_len
    rows = sorted({i * n // probes for i in range(min(n, probes))})
    keys = [engine.prefix_key(torch.tensor(inputs.data[i].input_ids[:cut]), inputs.model.fingerprint) for i in rows]
    return sum(key in store for key in keys), len(keys)


def _computes_prefixes(cache: Any, inputs: Any, served: bool) -> bool:
    """Whether the run will run its frozen layers: sequences the plan's store lacks (all but usaf score --cache's of
    this very data, ``served`` as the run keys its states: another data's store of as many sequences left the frozen
    layers quantized and ran them at every miss, found in review), or held-out data (whose states the store never
    holds)."""
    complete = (cache.store is not None and served and _store_holds_the_data(inputs)
                and len(cache.store) >= len(inputs.data))  # fmt: skip
    return not complete or inputs.eval_data is not None


def _store_holds_the_data(inputs: Any) -> bool:
    """The plan's store is ``usaf score --cache``'s of this run's data (its every training sequence)."""
    summary = inputs.plan.summary
    scope = summary.prefix_cache.scope if summary.prefix_cache is not None else None
    return scope == "data" and summary.tokens_fingerprint == inputs.data_fingerprint


def _plan_line(engine: Any, trainer: Any, steps: int, per_step: int) -> str:
    # lazy: the package binds run eagerly and imports no torch (usaf.stages.train stays light)
    from usaf.stages.train.loop import memory_parts

    counts = engine.trainable_count()
    memory = engine.memory(optimizer=trainer.optimizer)
    return (
        f"training {counts['delta_entries']:,} weights of the {'/'.join(engine.targets)} + "
        f"{counts['router_params']:,} router weights "
        f"in layers {list(engine.layers)} for {counted(steps, 'step')} of {per_step} sequences; "
        f"memory: {memory_parts(memory)}"
    )


def _held_out_before_training(trainer: Any, progress: Progress) -> None:
    """The untrained model's held-out loss, at step 0 (every rank: it is all-reduced), so the run's held-out losses
    go from before training to after it; with only the final one (``--eval-every 0``) the summary showed it twice."""
    # lazy: the package binds run eagerly and imports no torch (usaf.stages.train stays light)
    from usaf.stages.train import loop

    state = trainer.state
    if trainer.eval_data is None or state.step != 0 or state.eval_losses:
        return
    loss = loop.held_out_loss(trainer, progress)
    if loss is not None:
        state.eval_losses.append([0, loss])
        trainer.log({"step": 0, "eval_loss": loss})


LOSS_WINDOW_MAX = 50  # steps averaged at each end of a run, at most


def loss_ends(losses: list[float]) -> tuple[int | None, float | None, float | None]:
    """``(window, mean of the first window losses, mean of the last window)``: a quarter of the steps, at most
    :data:`LOSS_WINDOW_MAX` (all None without a loss). One step's loss is one microbatch's, as noisy as the
    data: a 30-step run on the demo model went 4.62 -> 4.89, its first and last 7 steps 4.75 -> 4.58."""
    if not losses:
        return None, None, None
    window = max(1, min(LOSS_WINDOW_MAX, len(losses) // 4))
    return window, sum(losses[:window]) / window, sum(losses[-window:]) / window


RISE = 0.01  # the held-out loss ending this much (relative) above its lowest is said: an overfit, not noise


def held_out_rise(eval_losses: list, run_dir: Path) -> str | None:
    """A warning where the held-out loss ended above its lowest by more than :data:`RISE`, naming the step it was
    lowest at and the checkpoint that holds it (if one does). A run whose held-out loss rose at every evaluation, to
    above the untrained model's, was summarised as any other, its last (worst) weights in ``final/`` (found in
    review)."""
    measured = [(int(step), float(loss)) for step, loss in eval_losses if loss is not None and math.isfinite(loss)]
    if len(measured) < 2:
        return None
    best_step, best = min(measured, key=lambda point: (point[1], point[0]))
    last_step, last = measured[-1]
    if last <= best * (1 + RISE):
        return None
    untrained = measured[0][1] if measured[0][0] == 0 else None
    rose_past = untrained is not None and best_step != 0 and last > untrained
    above = f", above the untrained model's {untrained:.4f}" if rose_past else ""
    try:
        kept = [d for d in checkpoint_dirs(run_dir, flag="--out") if step_of(d, flag="--out") == best_step]
    except UsafError:  # a step-N directory renamed by hand: the warning still says the rise, at a finished run's end
        kept = []
    if best_step == 0:
        way = "the untrained weights were the best: train fewer steps, or with a smaller --lr"
    elif kept:
        way = f"{kept[0]} holds the weights of step {best_step} (eval, export and generate take it as --checkpoint)"
    else:
        way = (f"no checkpoint holds step {best_step}: train --steps {best_step}, or save checkpoints where the "
               "held-out loss is measured (--save-every equal to --eval-every)")  # fmt: skip
    return (f"warning: the held-out loss rose from {best:.4f} at step {best_step} to {last:.4f} at step "
            f"{last_step}{above}: the run overfit its training data, and final/ holds its last weights; {way}")


def _checkpoints_kept(run_dir: Path) -> dict[str, int]:
    """How many checkpoints the run keeps and their bytes: said in the summary (33 of them were 168 of a run's 174 MB,
    in silence; found in review)."""
    kept = checkpoint_dirs(run_dir, flag="--out")
    size = sum(f.stat().st_size for d in kept for f in d.rglob("*") if f.is_file())
    return {"checkpoints": len(kept), "checkpoint_bytes": size}


def _finish(
    inputs: Any, trainer: Any, backend: Any, seconds: float, began: tuple[int, int], progress: Progress
) -> tuple[RunManifest, Path]:
    """The held-out loss of the final weights, ``final/``, and (rank 0) the run's manifest; ``began``: the step and
    tokens this start trained from (a resumed run's summary said its whole tokens came in this start's seconds:
    twice the rate; found in review)."""
    # lazy: the package binds run eagerly and imports no torch (usaf.stages.train stays light)
    from usaf.engine.reselect import cumulative_delta
    from usaf.stages.train import loop

    state, run_dir = trainer.state, inputs.run_dir
    if trainer.eval_data is not None and (not state.eval_losses or state.eval_losses[-1][0] != state.step):
        loss = loop.final_held_out_loss(trainer, progress)  # of the final weights, always reported
        state.eval_losses.append([state.step, loss])
        trainer.log({"step": state.step, "eval_loss": loss})
    final = trainer.save_checkpoint(run_dir / FINAL_DIR)
    if state.first_loss is None:
        raise UsafError("every step was skipped (non-finite loss or gradient)", "lower --lr or check the data")
    cache = trainer.prefix[0] if trainer.prefix else None
    hits, misses = trainer.world.sum_floats([cache.hits, cache.misses] if cache else [0, 0], "prefix-cache counts")
    if cache is not None:
        cache.drop_spill()  # the finished run needs its spilled states no more (GBs at a real model's size)
    if not trainer.world.is_main:
        trainer.world.barrier("manifest")  # rank 0 writes it
        return load_verified(run_dir, RunManifest, flag="--out"), run_dir
    counts = trainer.engine.trainable_count()
    model_fp = inputs.model.fingerprint
    logged = read_metrics(run_dir / METRICS_FILE)[0] if (run_dir / METRICS_FILE).is_file() else []
    window, first_mean, last_mean = loss_ends([loss for _, loss in logged])
    if state.skipped:  # a count in the summary's table alone before: a run of skipped steps read as trained (review)
        progress.note(f"{state.skipped:,} of the run's {state.step:,} steps were skipped (a non-finite loss or "
                      "gradient; their weights were left as they were): a lower --lr, or check the data")  # fmt: skip
    if (rose := held_out_rise(state.eval_losses, run_dir)) is not None:
        progress.note(rose)
    steps_logged = len({step for step, _ in logged})
    if (trained := state.step - state.skipped) > steps_logged:  # the summary says of what
        progress.note(f"{METRICS_FILE} holds the loss of {steps_logged:,} of the run's {trained:,} trained steps "
                      "(lines removed or damaged): the loss means below are of those")  # fmt: skip
    summary = RunSummary(
        model_fingerprint=model_fp,
        plan_fingerprint=inputs.plan.fingerprint,
        data_fingerprint=inputs.data_fingerprint,
        trainable_layers=list(trainer.engine.layers),
        steps=state.step,
        tokens=state.tokens,
        skipped_steps=state.skipped,
        first_loss=state.first_loss,
        final_loss=state.last_loss,
        loss_window=window,
        first_losses_mean=first_mean,
        last_losses_mean=last_mean,
        eval_losses=state.eval_losses,
        expert_entries=counts["delta_entries"],
        router_params=counts["router_params"],
        frozen_entries=sum(int(w.frozen_indices.numel()) for w in trainer.engine.weights.values()),
        changed_entries=sum(int(cumulative_delta(w)[0].numel()) for w in trainer.engine.weights.values()),
        reselections=[ReselectionRecord(**r) for r in state.reselections],
        routing_warnings=state.routing_warnings,
        prefix_cache_hits=int(hits) if cache else None,
        prefix_cache_misses=int(misses) if cache else None,
        world_size=trainer.world.size,
        lr=inputs.config.lr,
        lr_source=inputs.lr_source,
        seconds=seconds,
        resumed_at_step=began[0] if inputs.resume_from is not None else None,
        session_tokens=state.tokens - began[1],
        **_checkpoints_kept(run_dir),
    )
    manifest = write_manifest(
        run_dir,
        RunManifest,
        record_files(run_dir, (p for p in final.rglob("*") if p.is_file())),
        inputs=[
            InputRecord(role="model", kind="quantized_model", path=str(inputs.model_dir), fingerprint=model_fp),
            InputRecord(role="plan", kind="plan", path=str(inputs.plan_dir), fingerprint=inputs.plan.fingerprint),
            InputRecord(role="data", kind="tokens", path=str(inputs.data_file), fingerprint=inputs.data_fingerprint),
        ],
        config=inputs.config.model_dump(mode="json"),
        environment=current_environment(
            **backend.recorded(next(trainer.engine.model.parameters()).dtype), seed=inputs.config.seed
        ),
        summary=summary,
    )
    trainer.world.barrier("manifest")
    return manifest, run_dir
