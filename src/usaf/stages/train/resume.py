"""A run's checkpoints from the trainer's side: what goes into one, how a resumed run takes it back.

A checkpoint holds everything a resumed run needs to continue *exactly*: the active deltas and the frozen
cumulative record, router masters, the optimizer state (moments and per-entry step counts), the step,
counters, reselection history, torch's RNG state and, inside a scoring window, every rank's partial grow
scores. The data order is a pure function of (seed, step), so it needs no saving. Its files are
:mod:`usaf.artifacts.run`'s (:class:`~usaf.artifacts.run.Checkpoint`).

:func:`restore` checks what a checkpoint's files hold against this run: the routers' names and shapes, the
state's counters, and the optimizer state (its structure, sizes and finite moments); a checkpoint that does
not fit is refused naming the file, never a traceback from deep inside (and the run then stops).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from usaf.artifacts.run import (
    OPTIMIZER_FILE,
    ROUTERS_FILE,
    STATE_FILE,
    Checkpoint,
    DeltaRecord,
    checkpoint_dirs,
    step_of,
)
from usaf.backends.cpu import thread_count
from usaf.engine.reselect import collect_scores, cumulative_delta
from usaf.engine.scores import ScoreAccumulator, merge
from usaf.errors import UsafError
from usaf.stages.train.trainer import TrainState


def checkpoint_of(trainer: Any, scores_by_rank: list[dict | None]) -> Checkpoint:
    """The trainer's whole state as a checkpoint (CPU tensors); ``scores_by_rank``: every rank's grow scores."""
    deltas = {}
    for name, weight in trainer.engine.weights.items():
        active = None
        if weight.delta is not None:
            active = (weight.delta.indices.cpu(), weight.delta.values.detach().cpu())
        idx, val = cumulative_delta(weight)
        deltas[name] = DeltaRecord(
            active, (weight.frozen_indices.cpu(), weight.frozen_values.cpu()), (idx.cpu(), val.cpu())
        )
    collecting = trainer.collector is not None  # inside a scoring window: the grow scores so far, per rank
    return Checkpoint(
        deltas=deltas,
        routers={n: p.detach().cpu() for n, p in trainer.engine.routers.items()},
        state=vars(trainer.state),
        optimizer=trainer.optimizer.state_dict(),
        schedule=trainer.schedule.state_dict(),
        rng=torch.get_rng_state(),
        scores=scores_by_rank[0] if collecting else None,
        scores_by_rank=scores_by_rank if collecting and trainer.world.active else None,
        loss_scale=trainer.scaler.state_dict() if trainer.scaler is not None else None,
    )


def recorded_threads(checkpoint: Path) -> int | None:
    """The torch threads the run that wrote ``checkpoint`` started with on the CPU (its ``state.json``), or None:
    read before the engine is built, so a resume computes at that count from its first operation. A state that
    does not say (an older usaf's, another device's, or unreadable: its full read refuses it later) gives None."""
    try:
        return thread_count(json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8")).get("threads"))
    except (OSError, ValueError, AttributeError):
        return None

_HINT = "move the damaged checkpoint out of the run directory (the rerun resumes from the newest one left), or pass " \
    "--overwrite to start again"


def restore(trainer: Any, checkpoint: Checkpoint, directory: Path) -> None:
    """Put ``checkpoint`` into the trainer, whose engine is fresh (nothing trained or folded yet)."""
    state = _train_state(checkpoint.state, directory / STATE_FILE)
    _check_routers(trainer.engine.routers, checkpoint.routers, directory / ROUTERS_FILE)
    records = checkpoint.deltas
    selection = {n: records[n].active[0] for n in trainer.engine.weights if n in records and records[n].active}
    values = {n: records[n].active[1] for n in selection}
    trainer.engine.set_deltas(selection, values)
    for name, weight in trainer.engine.weights.items():
        if weight.frozen_indices.numel():
            raise RuntimeError("a checkpoint is restored into a fresh engine only")
        frozen = records[name].frozen if name in records else None
        if frozen is None:
            raise UsafError(f"resuming from {directory}: malformed delta for {name}", _HINT)
        if frozen[0].numel():  # dropped-and-kept deltas: back into the record and the resident base
            weight.fold(*frozen)
    with torch.no_grad():
        for name, master in trainer.engine.routers.items():
            master.copy_(checkpoint.routers[name])
    with _refused(directory / OPTIMIZER_FILE):
        trainer.optimizer = trainer._new_optimizer()
        trainer.optimizer.load_state_dict(checkpoint.optimizer)
        _check_schedule(checkpoint.schedule)
        trainer.schedule.load_state_dict(checkpoint.schedule)
        _check_rng(checkpoint.rng)
        torch.set_rng_state(checkpoint.rng)
        if trainer.scaler is not None and checkpoint.loss_scale is not None:
            trainer.scaler.load_state_dict(checkpoint.loss_scale)
        if checkpoint.scores is not None:
            _restore_scores(trainer, checkpoint.scores_by_rank or [checkpoint.scores])
    trainer.state = state
    trainer.resumed_world_size = state.world_size  # the processes it trained on until now, said where they differ
    same_world = trainer.state.world_size == trainer.world.size
    if trainer.state.microbatch is not None and same_world:  # an out-of-memory retry before the checkpoint
        trainer.microbatch, trainer.grad_accum = trainer.state.microbatch, trainer.state.grad_accum
    trainer.state.world_size = trainer.world.size


@contextlib.contextmanager
def _refused(path: Path) -> Iterator[None]:
    """What a file's optimizer state does not fit, as one error naming the file.

    The state is read from a file a user may have replaced: a valid pickle of another structure, tensors of
    other sizes. The loaders check what they can (``check_state_dict``); whatever else breaks on such a
    value while it is loaded is the file's fault, not a bug, so it is answered the same way.
    """
    try:
        yield
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as e:
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UsafError(f"resuming from {path}: not the optimizer state of this run ({detail})", _HINT) from None


def _check_rng(rng: Any) -> None:
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.dim() != 1:
        what = f"{rng.dtype} of shape {tuple(rng.shape)}" if isinstance(rng, torch.Tensor) else type(rng).__name__
        raise ValueError(f"its rng is not torch's RNG state (a 1-D uint8 tensor) but {what}")


_SCHEDULE_KEYS = ("warmup_steps", "total_steps", "min_lr_ratio", "peak_lr", "last_step")


def _check_schedule(schedule: Any) -> None:
    """The learning-rate schedule's state: its keys, each a number (``last_step`` None before the first step)."""
    if not isinstance(schedule, dict) or (missing := [k for k in _SCHEDULE_KEYS if k not in schedule]):
        raise ValueError(f"its schedule lacks {missing if isinstance(schedule, dict) else list(_SCHEDULE_KEYS)}")
    for key in _SCHEDULE_KEYS:
        value = schedule[key]
        if value is None and key == "last_step":
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"its schedule's {key} {value!r} is not a number")


def _train_state(state: Any, path: Path) -> TrainState:
    """The trainer's counters from ``state.json``: only its fields, and whole-number counters from 0."""
    if not isinstance(state, dict):
        raise UsafError(f"resuming from {path}: not the state usaf writes (a JSON object)", _HINT)
    unknown = sorted(set(state) - {f.name for f in dataclasses.fields(TrainState)})
    if unknown:
        raise UsafError(f"resuming from {path}: not the state usaf writes (unknown keys {unknown})", _HINT)
    for key in ("step", "tokens", "skipped", "world_size", "microbatch", "grad_accum", "company_size"):
        value = state.get(key, 0)
        optional = key in ("microbatch", "grad_accum", "company_size") and value is None
        if not optional and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise UsafError(f"resuming from {path}: {key} {value!r} is not a count (a whole number from 0)", _HINT)
    threads = state.get("threads")
    if threads is not None and thread_count(threads) is None:
        raise UsafError(f"resuming from {path}: threads {threads!r} is not a thread count (a whole number from 1)",
                        _HINT)  # fmt: skip
    if state.get("company_size") == 0:  # sequences per company (usaf.stages.train.companies): at least one
        raise UsafError(f"resuming from {path}: company_size 0 is not a number of sequences (1 or more)", _HINT)
    return TrainState(**state)


def _check_routers(masters: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], path: Path) -> None:
    """The checkpoint's routers are this run's: the same names, each of its router's shape."""
    missing, extra = sorted(set(masters) - set(saved)), sorted(set(saved) - set(masters))
    if missing or extra:
        parts = [f"{what} {names[:3]}" for what, names in (("missing", missing), ("not this run's", extra)) if names]
        raise UsafError(f"resuming from {path}: routers {'; '.join(parts)}", _HINT)
    for name, master in masters.items():
        if tuple(saved[name].shape) != tuple(master.shape):
            raise UsafError(
                f"resuming from {path}: router {name} has shape {tuple(saved[name].shape)}, the model's is "
                f"{tuple(master.shape)}",
                _HINT,
            )


def _restore_scores(trainer: Any, by_rank: list[dict]) -> None:
    """Grow scores saved inside a scoring window: each rank its own when the world size is the same;
    otherwise rank 0 takes all of them merged (the same sums) and the others start empty."""
    trainer.collector = collect_scores(trainer.engine)
    if len(by_rank) == trainer.world.size:
        mine = by_rank[trainer.world.rank]
    elif trainer.world.is_main:
        mine = {name: merge([ScoreAccumulator.from_state_dict(s[name]) for s in by_rank]).state_dict()
                for name in by_rank[0]}  # fmt: skip
    else:
        return
    for name, acc in trainer.collector.accumulators.items():
        acc.load_state_dict(mine[name])


def prune_checkpoints(run_dir: Path, keep: int, eval_losses: list) -> list[Path]:
    """Delete the run's complete checkpoints but the newest ``keep`` and the one whose held-out loss is the lowest
    measured at a checkpoint (the overfit warning names it where it is the lowest of all); the deleted. Called once a
    new checkpoint is whole, so the newest (what a resume takes) is never one of them. Every checkpoint was kept: 33
    of them were 168 of a run's 174 MB (found in review). Only complete ``step-N`` directories are touched."""
    done = checkpoint_dirs(run_dir, flag="--out")
    losses = {int(step): float(loss) for step, loss in eval_losses if loss is not None and math.isfinite(loss)}
    # the lowest of the checkpoints measured: the lowest of all, where no checkpoint holds it (step 0, a step between
    # saves), kept none (found in review)
    steps = [step_of(d, flag="--out") for d in done]
    measured = [(losses[step], step) for step in steps if step in losses]
    best = min(measured)[1] if measured else None
    # a link put there by hand is not usaf's to delete (rmtree refuses one: it would have ended the run)
    old = [d for d, step in list(zip(done, steps))[:-keep] if step != best and not d.is_symlink()]
    for directory in old:
        shutil.rmtree(directory)
    return old


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest complete checkpoint (by step number; its state file is written last), or None."""
    done = checkpoint_dirs(run_dir, flag="--out")
    return done[-1] if done else None
