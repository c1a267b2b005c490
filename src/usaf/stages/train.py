"""``usaf train``: sparse fine-tuning of a quantized MoE model from a plan, with RigL reselection.

The run directory holds ``run-settings.json``, ``metrics.jsonl``, atomic ``checkpoints/step-N/`` and, when
the run completes, ``final/`` and ``manifest.json``. Ctrl-C writes a checkpoint of the last finished
step; running the same command again (or ``--resume``) continues from the newest checkpoint exactly.

Under ``torchrun`` every rank runs this same function (see :mod:`usaf.distributed`): checks and reads on
every rank, writes on rank 0 between barriers, collectives in the same order everywhere.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import time
from pathlib import Path

from usaf.artifacts import (
    InputRecord,
    PlanManifest,
    RunManifest,
    current_environment,
    default_output,
    find_artifacts,
    load_verified,
    workspace_dir,
)
from usaf.artifacts.plan import MASKS_FILE
from usaf.artifacts.run import FINAL_DIR, SETTINGS_FILE, RunSummary, trim_metrics
from usaf.artifacts.writer import remove_stale_temporaries_inside, write_text_atomic
from usaf.distributed import PeerLost, World
from usaf.errors import UsafError
from usaf.settings.train import TrainConfig
from usaf.stages.progress import NullProgress, Progress
from usaf.stages.score import resolve_data, resolve_model

# The original tool's environment variables, honoured below --config (README documents them).
LEGACY_ENV = {
    "FRAC": "frac",
    "STEPS": "steps",
    "EPOCHS": "epochs",
    "TRAIN_FROM": "train_from",
    "MICROBATCH": "microbatch",
    "LR_PEAK": "lr",
    "RESELECT_EVERY": "reselect_every",
    "DATASET_PATH": "data",
    "QUANT_PATH": "model",
}


def _settings_fingerprint(config: TrainConfig, model_fp: str, plan_fp: str, data_fp: str, world: World) -> dict:
    """What a resumed run must share with the interrupted one.

    The split of a step's sequences into processes and microbatches is left out: only the global batch
    (microbatch × grad-accum × processes) decides which sequences a step trains on, so a run may resume
    with another world size or microbatch as long as that product is the same.
    """
    skip = {"resume", "overwrite", "out", "workspace", "dist_backend", "stream_experts", "microbatch", "grad_accum",
            "vram", "ram", "prefix_cache_gib"}  # where things live and how a batch is split: not the result
    keep = config.model_dump(mode="json", exclude=skip)
    global_batch = config.microbatch * config.grad_accum * world.size
    return {**keep, "global_batch": global_batch, "model_fingerprint": model_fp, "plan_fingerprint": plan_fp,
            "data_fingerprint": data_fp}  # fmt: skip


PLAN_DIR = "plan"  # inside the run directory: the plan scored on the fly when none was given or found


def _resolve_plan(
    config: TrainConfig, model_fp: str, model_dir: Path, data: Path, run_dir: Path, progress: Progress
) -> tuple[Path, PlanManifest]:
    """``--plan``; else the workspace's newest plan for this model; else one scored now into RUN/plan."""
    if config.plan is not None:
        path, plan = config.plan, load_verified(config.plan, PlanManifest, flag="--plan")
    elif (run_dir / PLAN_DIR / "manifest.json").is_file():  # scored on the fly by an earlier, interrupted start
        path = run_dir / PLAN_DIR
        plan = load_verified(path, PlanManifest, flag="--plan")
    else:
        found = find_artifacts(workspace_dir(config.workspace), PlanManifest)
        own = run_dir.resolve()
        mine = [a for a in found if a.manifest.summary.model_fingerprint == model_fp and own not in a.path.parents]
        if mine:  # newest first
            path, plan = mine[0].path, mine[0].manifest
            progress.note(f"using the plan {path} (newest made for this model)")
        else:
            path, plan = _score_on_the_fly(config, model_dir, data, run_dir, progress)
    if plan.summary.model_fingerprint != model_fp:
        raise UsafError(
            f"--plan {path}: made for another quantized model (fingerprint {plan.summary.model_fingerprint[:16]}), "
            f"not --model {model_dir} (fingerprint {model_fp[:16]})",
            f"re-run usaf score --model {model_dir}",
        )
    return path, plan


def _score_on_the_fly(config: TrainConfig, model_dir: Path, data: Path, run_dir: Path, progress: Progress):
    from usaf.distributed import world
    from usaf.stages import score

    if run_dir.exists() and any(run_dir.iterdir()):
        raise UsafError(
            f"--out {run_dir}: holds another run (other settings or inputs)",
            "pass another --out, or --overwrite to replace it",
        )
    progress.note(f"no --plan and none in the workspace for this model: scoring now into {run_dir / PLAN_DIR}")
    world().barrier("run directory check")  # every rank has looked before rank 0 creates it
    if world().is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    options = ("frac", "train_from", "layers", "calib_samples", "statistic", "budget", "router", "device", "seed",
               "stream_experts")
    settings = score.ScoreConfig(
        model=model_dir,
        data=data,
        out=run_dir / PLAN_DIR,
        microbatch=config.microbatch,
        stability=False,
        **{name: getattr(config, name) for name in options},
    )
    manifest, path = score.run(settings, progress=progress)
    return path, manifest


def run(config: TrainConfig, *, progress: Progress | None = None) -> tuple[RunManifest, Path]:
    """Train; returns the run's manifest and directory."""
    import torch
    from safetensors.torch import load_file

    from usaf import distributed
    from usaf.backends import resolve_backend
    from usaf.data.dataset import TokenDataset
    from usaf.data.tokenizer import load_tokenizer, tokenizer_fingerprint
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loss_scale import DynamicLossScaler
    from usaf.engine.prefix import PrefixCache
    from usaf.stages.engine_setup import load_for_engine
    from usaf.stages.prefix_cache import open_store
    from usaf.stages.train_budget import apply_budget
    from usaf.stages.trainer import LoopSettings, Trainer, latest_checkpoint

    start = time.perf_counter()
    backend = resolve_backend(distributed.device_for_rank(None if config.device == "auto" else config.device))
    world = distributed.init(config.dist_backend, backend.device)
    progress = (progress or NullProgress()) if world.is_main else NullProgress()
    model_dir, model_manifest = resolve_model(config, progress)
    tokenizer = load_tokenizer(str(model_dir), flag="--model")
    data_file, data_fp = resolve_data(config, tokenizer_fingerprint(tokenizer), progress)
    run_dir = Path(config.out or default_output(workspace_dir(config.workspace), "run", model_dir.name))
    if run_dir.exists() and config.overwrite and world.is_main:
        shutil.rmtree(run_dir)
    world.barrier("overwrite")
    if (run_dir / "manifest.json").is_file():
        raise UsafError(f"--out {run_dir}: a finished run is there", "pass another --out, or --overwrite")
    if config.resume and not run_dir.exists():
        raise UsafError(f"--out {run_dir}: nothing to resume there", "drop --resume to start a new run")
    data = TokenDataset(data_file, vocab_size=len(tokenizer))
    if len(data) == 0:
        raise UsafError(f"--data {data_file}: no sequences", "tokenize some text first")
    given_plan = _given_plan_layer(config)
    budgeted = apply_budget(config, model_dir, backend, data, given_plan, progress)
    data_source = config.data if config.data is not None else data_file.parent
    plan_dir, plan = _resolve_plan(budgeted, model_manifest.fingerprint, model_dir, data_source, run_dir, progress)
    first = plan.summary.trainable_layers[0]
    if given_plan is None and budgeted is not config and budgeted.train_from not in (None, first):
        budgeted = apply_budget(config, model_dir, backend, data, first, progress)  # a plan from the workspace
    config = budgeted
    settings_record = _settings_fingerprint(config, model_manifest.fingerprint, plan.fingerprint, data_fp, world)

    resume_from = None
    if run_dir.exists() and world.is_main:
        remove_stale_temporaries_inside(run_dir)  # e.g. run-settings.json of a start killed while writing it
    world.barrier("stale temporaries")
    if run_dir.exists():
        previous = run_dir / SETTINGS_FILE
        if previous.is_file() and _read_settings(previous) == settings_record:
            resume_from = latest_checkpoint(run_dir)
        elif any(p.name != PLAN_DIR for p in run_dir.iterdir()):
            raise UsafError(
                f"--out {run_dir}: holds another run (other settings or inputs)",
                "pass another --out, or --overwrite to replace it",
            )

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eval_data = None
    if config.eval_data is not None:
        eval_file, _ = resolve_data(
            config.model_copy(update={"data": config.eval_data}), tokenizer_fingerprint(tokenizer), progress
        )
        if eval_file.name == "train.jsonl":
            eval_file = eval_file.with_name("heldout.jsonl")
        eval_data = TokenDataset(eval_file, vocab_size=len(tokenizer))
    per_step = config.microbatch * config.grad_accum * world.size  # the global batch, in sequences
    steps = config.steps or max(1, math.ceil((config.epochs or 1.0) * len(data) / per_step))
    reselect_every = _reselect_every(config.reselect_every, steps, progress)
    _check_seq_len(config.seq_len, str(model_dir), tokenizer)

    compute = backend.policy.compute if config.dtype == "auto" else getattr(torch, config.dtype)
    loaded, placement = load_for_engine(model_dir, backend, compute, config.stream_experts, progress)
    engine = SparseEngine(
        loaded,
        trainable_layers=plan.summary.trainable_layers,
        train_router=config.router,
        aux_loss_coef=config.aux_loss_coef,
        z_loss_coef=config.z_loss_coef,
        **placement,
    )
    masks = load_file(str(plan_dir / MASKS_FILE))
    unknown = set(masks) - set(engine.weights)
    if unknown:
        raise UsafError(
            f"--plan {plan_dir}: masks for tensors this model does not train: {sorted(unknown)[:3]}",
            "re-run usaf score for this model",
        )
    engine.set_deltas(masks)

    world.barrier("settings check")  # every rank has read the old settings before rank 0 writes the new
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / SETTINGS_FILE, json.dumps(settings_record, indent=1))  # a kill: all or nothing
    world.barrier("run directory")
    prefix = None
    if engine.prefix is not None:
        store = open_store(plan_dir)  # written by usaf score --cache
        spill = run_dir / (f"prefix-cache-rank{world.rank}.bin" if world.active else "prefix-cache.bin")
        cache = PrefixCache(int(config.prefix_cache_gib * 2**30), spill, store=store)
        prefix = (cache, model_manifest.fingerprint)
        if store is not None:
            progress.note(f"prefix states of {len(store):,} sequences read from the plan (usaf score --cache)")
    loop = LoopSettings(
        steps=steps,
        microbatch=config.microbatch,
        grad_accum=config.grad_accum,
        lr=config.lr,
        router_lr=config.router_lr,
        weight_decay=config.weight_decay,
        clip=config.clip,
        warmup_steps=int(config.warmup * steps),
        reselect_every=reselect_every,
        reselect_fraction=config.reselect_fraction,
        eval_every=config.eval_every,
        save_every=config.save_every,
        seed=config.seed,
        seq_len=config.seq_len,
    )
    scaler = DynamicLossScaler() if compute == torch.float16 else None  # fp16 gradients underflow without it
    torch.manual_seed(config.seed)  # checkpoints store torch's RNG state: unseeded, two equal runs differ in bytes
    trainer = Trainer(
        engine, loop, data, eval_data, run_dir, pad_id=pad, prefix=prefix, loss_scaler=scaler, world=world
    )
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
        progress.note(f"resuming from {resume_from} (step {trainer.state.step} of {steps})")
    if world.is_main:
        trim_metrics(run_dir, trainer.state.step)  # steps after the checkpoint (or all, from 0) are logged again
    if world.active:
        progress.note(f"data parallel: {world.size} processes ({world.backend}), {per_step} sequences per step "
                      f"({per_step // world.size} per process)")  # fmt: skip
    progress.note(_plan_line(engine, trainer, steps, per_step))
    _loop(trainer, steps, progress)
    return _finish(
        config,
        trainer,
        run_dir,
        model_dir,
        model_manifest,
        plan_dir,
        plan,
        data_file,
        data_fp,
        backend,
        time.perf_counter() - start,
    )


def _given_plan_layer(config: TrainConfig) -> int | None:
    """The first trainable layer of ``--plan`` (None without one)."""
    if config.plan is None:
        return None
    return load_verified(config.plan, PlanManifest, flag="--plan").summary.trainable_layers[0]


def _read_settings(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # unreadable: treated as another run's, never a traceback
        return None


DEFAULT_RESELECT_EVERY = 50


def _reselect_every(requested: int | None, steps: int, progress: Progress) -> int:
    """``--reselect-every`` as given; by default 50, or a static mask when the run is too short for one."""
    if requested is not None:
        if requested > steps:
            raise UsafError(
                f"--reselect-every {requested} exceeds the run's {steps} steps", "lower it, or pass 0 for a static mask"
            )
        return requested
    if steps <= DEFAULT_RESELECT_EVERY:
        progress.note(f"a {steps}-step run is too short for a reselection every {DEFAULT_RESELECT_EVERY}: static mask")
        return 0
    return DEFAULT_RESELECT_EVERY


def _check_seq_len(seq_len: int | None, model: str, tokenizer) -> None:
    from usaf.data.tokenizer import max_sequence_length

    limit = max_sequence_length(model, tokenizer)
    if seq_len is not None and limit is not None and seq_len > limit:
        raise UsafError(f"--seq-len {seq_len} exceeds the model's context ({limit} tokens)", f"use at most {limit}")


def _plan_line(engine, trainer, steps: int, per_step: int) -> str:
    counts = engine.trainable_count()
    memory = engine.memory(optimizer=trainer.optimizer)
    return (
        f"training {counts['delta_entries']:,} expert weights + {counts['router_params']:,} router weights "
        f"in layers {list(engine.trainable_layers)} for {steps} steps of {per_step} sequences; "
        f"memory: {_memory_parts(memory)}"
    )


def _memory_parts(memory: dict[str, int]) -> str:
    from usaf.units import human_bytes

    return ", ".join(f"{k.replace('_', ' ')} {human_bytes(v)}" for k, v in memory.items() if v)


def _loop(trainer, steps: int, progress: Progress) -> None:
    progress.start("training", steps, "steps")
    progress.advance(trainer.state.step)
    stop = _StopRequest(trainer.world)
    try:
        with stop:  # also around the save below: a repeated signal (torchrun forwards one) must not cut it short
            try:
                _steps(trainer, steps, progress, stop)
            except KeyboardInterrupt:
                saved = trainer.save_checkpoint(trainer.checkpoint_dir())  # with the scores collected so far
                if trainer.collector is not None:
                    trainer.collector.close()
                note = f"interrupted: saved {saved} (step {trainer.state.step}); run the same command to resume"
                progress.note(note)
                raise
    except PeerLost as e:
        from usaf.stages.trainer import latest_checkpoint

        last = latest_checkpoint(trainer.run_dir)
        where = f"the newest complete checkpoint is {last}" if last else "no checkpoint was written yet"
        raise UsafError(f"{e.message}; {where}", e.hint) from None
    finally:
        progress.finish()


class _StopRequest:
    """Ctrl-C (or torchrun's SIGTERM) stops the run at the next step boundary, never inside a step.

    A signal only sets a flag; the loop checks it before each step (data parallel: the ranks agree on it
    with one all-reduce, so all of them reach the collective checkpoint together) and raises
    KeyboardInterrupt there, so the checkpoint holds whole steps only. In one process a second Ctrl-C
    leaves at once without writing (the last checkpoint stays intact); under torchrun repeated signals
    change nothing (a terminal's Ctrl-C reaches every rank and torchrun forwards it again; a rank stuck in
    a step is torchrun's to kill). Installed only in the main thread (Python's rule for signal handlers).
    """

    def __init__(self, world: World) -> None:
        self.world = world
        self.requested = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _StopRequest:
        import threading

        if threading.current_thread() is threading.main_thread():
            signals = (signal.SIGINT, signal.SIGTERM) if self.world.active else (signal.SIGINT,)
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested and not self.world.active:
            raise SystemExit(130)  # the second Ctrl-C: leave now, no checkpoint
        self.requested = True

    def check(self) -> None:
        if self.world.any(self.requested):
            raise KeyboardInterrupt


def _steps(trainer, steps: int, progress: Progress, stop: _StopRequest) -> None:
    from usaf.distributed import merge_scores
    from usaf.engine.reselect import collect_scores, reselect, update_fraction

    s = trainer.s
    first = trainer.state.step
    while trainer.state.step < steps:
        stop.check()
        step = trainer.state.step
        # Grow candidates are ranked by the gradients of the last SCORE_BATCHES steps before a reselection.
        if s.reselect_every and trainer.collector is None and _collecting(step, s.reselect_every, steps):
            trainer.collector = collect_scores(trainer.engine)
        record = trainer.step()
        trainer.log(record)
        if step == first:  # activations are measured by the first training forward: the full account
            cache = trainer.prefix[0] if trainer.prefix else None
            memory = trainer.engine.memory(optimizer=trainer.optimizer, cache=cache)
            progress.note(f"memory after the first step: {_memory_parts(memory)}")
        for note in record.get("notes", []):
            progress.note(note)
        for warning in record.get("routing_warnings", []):
            progress.note(f"warning: {warning}")
        if s.reselect_every and trainer.state.step % s.reselect_every == 0 and trainer.state.step < steps:
            fraction = update_fraction(trainer.state.step, steps, s.reselect_fraction)
            scores, trainer.collector = trainer.collector, None
            if scores is not None:
                scores.close()  # sinks off: the accumulators stay readable
                if fraction > 0:
                    merged = merge_scores(scores.accumulators, trainer.world)  # every rank the same
                    report = reselect(trainer.engine, trainer.optimizer, merged, fraction)
                    trainer.log({"reselection": trainer.record_reselection(trainer.state.step, report)})
        if s.eval_every and trainer.state.step % s.eval_every == 0:
            loss = trainer.evaluate()
            if loss is not None:
                trainer.state.eval_losses.append([trainer.state.step, loss])
                trainer.log({"step": trainer.state.step, "eval_loss": loss})
        if s.save_every and trainer.state.step % s.save_every == 0:
            trainer.save_checkpoint(trainer.checkpoint_dir())
        progress.advance(1, tokens=trainer.state.tokens, loss=record["loss"])


def _collecting(step: int, every: int, steps: int) -> bool:
    """Whether step ``step`` (0-based) is one of the batches that rank candidates for the next reselection."""
    from usaf.stages.trainer import SCORE_BATCHES

    position = (step % every) + 1  # 1..every within the current cycle
    return position > every - SCORE_BATCHES and (step // every + 1) * every < steps


def _finish(config, trainer, run_dir, model_dir, model_manifest, plan_dir, plan, data_file, data_fp, backend, seconds):
    from usaf.artifacts.run import ReselectionRecord
    from usaf.artifacts.writer import record_files, write_manifest

    state = trainer.state
    if trainer.eval_data is not None and (not state.eval_losses or state.eval_losses[-1][0] != state.step):
        loss = trainer.evaluate()  # the held-out loss of the final weights, always reported
        state.eval_losses.append([state.step, loss])
        trainer.log({"step": state.step, "eval_loss": loss})
    final = trainer.save_checkpoint(run_dir / FINAL_DIR)
    if state.first_loss is None:
        raise UsafError("every step was skipped (non-finite loss or gradient)", "lower --lr or check the data")
    hits, misses = trainer.world.sum_floats(
        [trainer.prefix[0].hits, trainer.prefix[0].misses] if trainer.prefix else [0, 0], "prefix-cache counts"
    )
    if not trainer.world.is_main:
        trainer.world.barrier("manifest")  # rank 0 writes it
        return load_verified(run_dir, RunManifest, flag="--out"), run_dir
    counts = trainer.engine.trainable_count()
    summary = RunSummary(
        model_fingerprint=model_manifest.fingerprint,
        plan_fingerprint=plan.fingerprint,
        data_fingerprint=data_fp,
        trainable_layers=list(trainer.engine.trainable_layers),
        steps=state.step,
        tokens=state.tokens,
        skipped_steps=state.skipped,
        first_loss=state.first_loss,
        final_loss=state.last_loss,
        eval_losses=state.eval_losses,
        expert_entries=counts["delta_entries"],
        router_params=counts["router_params"],
        frozen_entries=sum(int(w.frozen_indices.numel()) for w in trainer.engine.weights.values()),
        reselections=[ReselectionRecord(**r) for r in state.reselections],
        routing_warnings=state.routing_warnings,
        prefix_cache_hits=int(hits) if trainer.prefix else None,
        prefix_cache_misses=int(misses) if trainer.prefix else None,
        world_size=trainer.world.size,
        seconds=seconds,
    )
    manifest = write_manifest(
        run_dir,
        RunManifest,
        record_files(run_dir, (p for p in final.rglob("*") if p.is_file())),
        inputs=[
            InputRecord(
                role="model", kind="quantized_model", path=str(model_dir), fingerprint=model_manifest.fingerprint
            ),
            InputRecord(role="plan", kind="plan", path=str(plan_dir), fingerprint=plan.fingerprint),
            InputRecord(role="data", kind="tokens", path=str(data_file), fingerprint=data_fp),
        ],
        config=config.model_dump(mode="json"),
        environment=current_environment(
            backend=backend.name,
            device=str(backend.device),
            dtype=str(next(trainer.engine.model.parameters()).dtype).removeprefix("torch."),
            seed=config.seed,
        ),
        summary=summary,
    )
    trainer.world.barrier("manifest")
    return manifest, run_dir
