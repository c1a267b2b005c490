"""The step loop of ``usaf train`` and its whole cadence, in the order it happens.

Before each step: a stop request (Ctrl-C, torchrun's SIGTERM) ends the run at this boundary with a checkpoint;
inside the ``SCORE_BATCHES`` steps before a reselection the grow scores are collected. After each step: its
record is logged, then every ``reselect_every`` steps (not at the end) the mask is reselected from the merged
scores, every ``eval_every`` steps the held-out loss is measured, every ``save_every`` steps a checkpoint is
written. One step's mechanics are :meth:`usaf.stages.train.trainer.Trainer.step`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from usaf.config import source_of
from usaf.distributed import PeerLost, merge_scores
from usaf.engine.reselect import collect_scores, reselect, update_fraction
from usaf.errors import UsafError
from usaf.stages.progress import Progress
from usaf.stages.stop import StopRequest, note_at_stop, rerun_to_resume
from usaf.stages.train.resume import latest_checkpoint, prune_checkpoints
from usaf.units import human_bytes

SCORE_BATCHES = 4  # batches whose gradients rank grow candidates before each reselection


def run_loop(trainer: Any, steps: int, progress: Progress) -> None:
    """Train from ``trainer.state.step`` to ``steps``; a stop request saves a checkpoint, then KeyboardInterrupt."""
    progress.start("training", steps, "steps", done=trainer.state.step)
    stop = StopRequest(trainer.world)
    try:
        with stop:  # also around the save below: a repeated signal (torchrun forwards one) must not cut it short
            try:
                _steps(trainer, steps, progress, stop)
            except KeyboardInterrupt:
                _save_at_stop(trainer, progress)
                raise
    except PeerLost as e:
        last = latest_checkpoint(trainer.run_dir)
        where = f"the newest complete checkpoint is {last}" if last else "no checkpoint was written yet"
        raise UsafError(f"{e.message}; {where}", e.hint) from None
    finally:
        progress.finish()


def _save_at_stop(trainer: Any, progress: Progress) -> None:
    """A stop request's checkpoint of the steps done (with the scores collected so far) and the note saying so."""
    saved = _save(trainer)
    if trainer.collector is not None:
        trainer.collector.close()
    again = rerun_to_resume(source_of(trainer.config, "overwrite") if trainer.config.overwrite else None)
    note = f"interrupted: saved {saved} (step {trainer.state.step}); {again}"
    if not trainer.config.out:  # it finds the run by its settings; --out names it whatever changes
        note += f" (or pass --out {trainer.run_dir})"
    progress.finish()  # the bar as it stopped, then the note
    note_at_stop(progress, note)


def _save(trainer: Any) -> Any:
    """A checkpoint of the steps done, then (``--keep-checkpoints``) the older ones pruned; its path."""
    saved = trainer.save_checkpoint(trainer.checkpoint_dir())
    if trainer.config.keep_checkpoints and trainer.world.is_main:  # a stop's save too (it kept one more; review)
        prune_checkpoints(trainer.run_dir, trainer.config.keep_checkpoints, trainer.state.eval_losses)
    return saved


def final_held_out_loss(trainer: Any, progress: Progress) -> float | None:
    """:func:`held_out_loss` of the final weights, stopped as training is: a stop request during it saves a
    checkpoint of every step (the rerun resumes there and evaluates again) and raises. Outside the loop's stop
    handling before, Ctrl-C there lost every step since the last checkpoint, and the note said nothing was
    (found in review, 2026-12-07). One process checks between microbatches; torchrun's ranks, whose shares may
    differ in length, agree after the pass."""
    stop = StopRequest(trainer.world)
    with stop:
        try:
            loss = held_out_loss(trainer, progress, stop=None if trainer.world.active else stop)
            stop.check()
        except KeyboardInterrupt:
            _save_at_stop(trainer, progress)
            raise
    return loss


SHOWN_LOSS_STEPS = 20  # the progress bar's loss: the mean of the last this many steps' (one step's is noisy)
SHOWN_LOSS = f"loss ({SHOWN_LOSS_STEPS}-step mean)"


def _steps(trainer: Any, steps: int, progress: Progress, stop: StopRequest) -> None:
    first, tokens_before = trainer.state.step, trainer.state.tokens  # a resumed run's: the rate counts this start's
    # named so: a resumed bar's tokens beside the run's step count read as the run's (found in review)
    counted = "tokens" if first == 0 else "tokens since the resume"
    recent: deque[float] = deque(maxlen=SHOWN_LOSS_STEPS)  # since this start: display only, not resumed
    while trainer.state.step < steps:
        stop.check()
        step, every, config = trainer.state.step, trainer.reselect_every, trainer.config
        # Grow candidates are ranked by the gradients of the last SCORE_BATCHES steps before a reselection.
        if every and trainer.collector is None and collecting(step, every, steps, config.reselect_fraction):
            trainer.collector = collect_scores(trainer.engine)
        record = trainer.step()
        trainer.log(record)
        _report(trainer, record, progress, first_step=step == first)
        done = trainer.state.step
        if every and done % every == 0 and done < steps:
            _reselect(trainer, steps)
        if config.eval_every and done % config.eval_every == 0:
            loss = held_out_loss(trainer, progress, within=True)
            if loss is not None:
                trainer.state.eval_losses.append([done, loss])
                trainer.log({"step": done, "eval_loss": loss})
        if config.save_every and done % config.save_every == 0:
            _save(trainer)
        if not record.get("skipped", False):
            recent.append(record["loss"])
        shown = {SHOWN_LOSS: sum(recent) / len(recent)} if recent else {}
        progress.advance(1, **{counted: trainer.state.tokens - tokens_before}, **shown)


def held_out_loss(
    trainer: Any, progress: Progress, *, within: bool = False, stop: StopRequest | None = None
) -> float | None:
    """The held-out loss of the weights now, shown as it runs (minutes at a real model's size, in silence before;
    found in review): a phase of its own before and after training, a note ``within`` the training bar (a phase
    would end it). None without held-out data. ``stop``: checked (this process alone) after each microbatch."""
    if trainer.eval_data is None:
        return None
    step = trainer.state.step
    if within:
        progress.note(f"step {step}: held-out loss over {len(trainer.eval_data):,} sequences")
        loss = trainer.evaluate()
    else:
        share = f" (this process's share of {len(trainer.eval_data):,})" if trainer.world.active else ""
        progress.start(f"held-out loss at step {step}{share}", trainer.eval_share(), "sequences")

        def done(sequences: int) -> None:
            progress.advance(sequences)
            if stop is not None:
                stop.check(alone=True)

        try:
            loss = trainer.evaluate(on_batch=done)
        finally:
            progress.finish()
    if loss is not None:
        progress.note(f"step {step}: held-out loss {loss:.4f}")
    return loss


def collecting(step: int, every: int, steps: int, fraction: float) -> bool:
    """Whether step ``step`` (0-based) is one of the batches that rank candidates for the next reselection: not for
    one that replaces nothing (from 75 % of the run; its collection was paid for nothing, found in review)."""
    position = (step % every) + 1  # 1..every within the current cycle
    cycle_end = (step // every + 1) * every
    return position > every - SCORE_BATCHES and cycle_end < steps and update_fraction(cycle_end, steps, fraction) > 0


def _reselect(trainer: Any, steps: int) -> None:
    """Drop and grow at the cycle's end, from the grow scores every rank collected (merged: the same everywhere)."""
    done = trainer.state.step
    fraction = update_fraction(done, steps, trainer.config.reselect_fraction)
    scores, trainer.collector = trainer.collector, None
    if scores is None:
        return
    scores.close()  # sinks off: the accumulators stay readable
    if fraction > 0:
        merged = merge_scores(scores.accumulators, trainer.world)
        report = reselect(trainer.engine, trainer.optimizer, merged, fraction)
        trainer.log({"reselection": trainer.record_reselection(done, report)})


def _report(trainer: Any, record: dict, progress: Progress, *, first_step: bool) -> None:
    if first_step:  # activations are measured by the first training forward: the full account
        cache = trainer.prefix[0] if trainer.prefix else None
        memory = trainer.engine.memory(optimizer=trainer.optimizer, cache=cache)
        # the parts usaf accounts for, then what the process holds: the parts' 0.60 GiB were read as the total where
        # the process held 1.05 GiB (the framework, the allocator's pools; found in review)
        now = trainer._memory_now()
        device = f", the device's peak {human_bytes(now['device_peak'])}" if "device_peak" in now else ""
        progress.note(f"memory after the first step: {memory_parts(memory)}; the whole process holds "
                      f"{human_bytes(now['rss'])} of host memory (RSS){device}")  # fmt: skip
    for note in record.get("notes", []):
        progress.note(note)
    for warning in record.get("routing_warnings", []):
        progress.note(f"warning: {warning}")


def memory_parts(memory: dict[str, int]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {human_bytes(v)}" for k, v in memory.items() if v)
