"""A run's checkpoints from the trainer's side: what goes into one, how a resumed run takes it back.

A checkpoint holds everything a resumed run needs to continue *exactly*: the active deltas and the frozen
cumulative record, router masters, the optimizer state (moments and per-entry step counts), the step,
counters, reselection history, torch's RNG state and, inside a scoring window, every rank's partial grow
scores. The data order is a pure function of (seed, step), so it needs no saving. Its files are
:mod:`usaf.artifacts.run`'s (:class:`~usaf.artifacts.run.Checkpoint`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from usaf.artifacts.run import CHECKPOINTS_DIR, STATE_FILE, Checkpoint, DeltaRecord
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


def restore(trainer: Any, checkpoint: Checkpoint, directory: Path) -> None:
    """Put ``checkpoint`` into the trainer, whose engine is fresh (nothing trained or folded yet)."""
    records = checkpoint.deltas
    selection = {n: records[n].active[0] for n in trainer.engine.weights if n in records and records[n].active}
    values = {n: records[n].active[1] for n in selection}
    trainer.engine.set_deltas(selection, values)
    for name, weight in trainer.engine.weights.items():
        if weight.frozen_indices.numel():
            raise RuntimeError("a checkpoint is restored into a fresh engine only")
        frozen = records[name].frozen if name in records else None
        if frozen is None:
            raise UsafError(f"--resume {directory}: malformed delta for {name}", "resume from an earlier one")
        if frozen[0].numel():  # dropped-and-kept deltas: back into the record and the resident base
            weight.fold(*frozen)
    with torch.no_grad():
        for name, master in trainer.engine.routers.items():
            master.copy_(checkpoint.routers[name])
    trainer.optimizer = trainer._new_optimizer()
    trainer.optimizer.load_state_dict(checkpoint.optimizer)
    trainer.schedule.load_state_dict(checkpoint.schedule)
    torch.set_rng_state(checkpoint.rng)
    trainer.state = TrainState(**checkpoint.state)
    same_world = trainer.state.world_size == trainer.world.size
    if trainer.state.microbatch is not None and same_world:  # an out-of-memory retry before the checkpoint
        trainer.microbatch, trainer.grad_accum = trainer.state.microbatch, trainer.state.grad_accum
    trainer.state.world_size = trainer.world.size
    if trainer.scaler is not None and checkpoint.loss_scale is not None:
        trainer.scaler.load_state_dict(checkpoint.loss_scale)
    if checkpoint.scores is not None:
        _restore_scores(trainer, checkpoint.scores_by_rank or [checkpoint.scores])


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


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest complete checkpoint (its state file is written last), or None."""
    directory = run_dir / CHECKPOINTS_DIR
    if not directory.is_dir():
        return None
    complete = sorted(p for p in directory.glob("step-*") if not p.name.endswith(".tmp") and (p / STATE_FILE).is_file())
    return complete[-1] if complete else None
