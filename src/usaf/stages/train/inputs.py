"""Everything ``usaf train`` needs, resolved and checked before any expensive work.

In order: the model, its tokenizer and context, the data, the plan when one is given (read and verified once),
the run directory (``--out``; else the workspace's unfinished run this same command would continue, else a new
one) and its state (finished, to resume, another run's, to overwrite), the memory budget, the run's length and
reselection cadence, and only then a plan from the workspace or one scored on the fly; last, whether the run
directory holds this run's checkpoints to resume from. Nothing here loads the model's weights.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from usaf.artifacts import (
    PlanManifest,
    QuantizedModelManifest,
    RunManifest,
    default_output,
    load_verified,
    settings_workspace,
)
from usaf.artifacts.lock import OutputLock
from usaf.artifacts.outputs import (
    check_not_an_input,
    found_at,
    own_entries,
    refuse_unless_replaceable,
    remove_usaf_made,
)
from usaf.artifacts.run import PLAN_DIR, SETTINGS_FILE, read_run_settings, run_settings_text
from usaf.artifacts.workspace import (
    check_plan_model,
    resolve_data,
    resolve_model,
    resolve_plan,
    unfinished_outputs,
)
from usaf.artifacts.writer import ArtifactWriter, remove_stale_temporaries_inside, write_text_atomic
from usaf.config import flag_name, refuse_unused, source_of, was_given
from usaf.data.dataset import TokenDataset
from usaf.data.seen import TrainingTokens, found_in_training
from usaf.data.tokenizer import load_tokenizer, max_sequence_length, tokenizer_fingerprint
from usaf.distributed import SAME_INPUTS, World, world
from usaf.engine.reselect import update_fraction
from usaf.errors import UsafError
from usaf.families import load_model_config, resolve_family
from usaf.families.modules import has_load_balancing_loss
from usaf.families.routing import dense_router_grad_refusal
from usaf.settings import SELECTION_FIELDS
from usaf.settings.fields import DEFAULT_TARGETS, EXPERTS_ONLY, parse_targets
from usaf.settings.train import DEFAULT_LR
from usaf.stages import score
from usaf.stages.lr_test import recorded_measured
from usaf.stages.progress import NullProgress, Progress
from usaf.stages.score_resume import ScoreProgress, finished_there, run_identity, same_run
from usaf.stages.train.budget import apply_budget
from usaf.stages.train.config import TrainConfig
from usaf.stages.train.resume import latest_checkpoint
from usaf.units import counted

DEFAULT_RESELECT_EVERY = 50


@dataclass(frozen=True)
class TrainInputs:
    """A run's inputs, all checked: what :func:`usaf.stages.train.run` builds the engine and the loop from."""

    config: TrainConfig  # with the memory planner's choices (--vram/--ram) filled in
    model_dir: Path
    model: QuantizedModelManifest
    tokenizer: Any
    data_file: Path
    data_fingerprint: str
    data: Any  # TokenDataset
    eval_data: Any  # TokenDataset or None
    run_dir: Path
    plan_dir: Path
    plan: PlanManifest
    steps: int
    reselect_every: int  # 0: a static mask
    per_step: int  # the global batch, in sequences
    settings_record: dict  # what a resumed run must share with this one (run-settings.json)
    resume_from: Path | None  # this run's newest checkpoint, when the directory holds one
    lr_source: str  # where config.lr came from: "--lr", "USAF_LR", "the plan's lr test", ...

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id


@contextlib.contextmanager
def resolved_inputs(config: TrainConfig, backend: Any, world: World, progress: Progress) -> Iterator[TrainInputs]:
    """:func:`resolve_inputs`, with the run directory locked (rank 0) until the block ends, however it ends."""
    with contextlib.ExitStack() as held:
        yield resolve_inputs(config, backend, world, progress, held)


def resolve_inputs(
    config: TrainConfig, backend: Any, world: World, progress: Progress, held: contextlib.ExitStack
) -> TrainInputs:
    """Resolve and check every input of the run (scoring a plan on the fly when there is none); ``held`` keeps
    the run directory's lock."""
    for dropped, decider in config._dropped.items():  # meant for every command, not against this artifact
        progress.note(f"{dropped}: not used, {decider} decides it")
    if config.resume and config.out is not None:
        _check_resumable(config, Path(config.out))
        config = with_recorded_settings(config, config.out, world, progress)
    model_dir, model_manifest = resolve_model(config, progress)
    _check_dense_router_grad(config, model_dir)
    _check_aux_loss(config, model_dir)
    if not config.router:
        refuse_unused(config, "router_lr", "no router is trained (--no-router)", "drop it, or train the routers",
                      progress.note)  # fmt: skip
    tokenizer = load_tokenizer(str(model_dir), flag="--model")
    context = _check_seq_len(config.seq_len, str(model_dir), tokenizer, source_of(config, "seq_len"))
    tokenizer_fp = tokenizer_fingerprint(tokenizer)
    started = {} if config.overwrite or config.out is None else _started_with(config.out)
    data_file, data_fp = resolve_data(config, tokenizer_fp, progress, prefer=started.get("data_fingerprint"))
    # Read before the run directory is touched: with --overwrite, bad data must not cost the run it replaces.
    data = TokenDataset(data_file, vocab_size=len(tokenizer), context=context, cut=config.seq_len)
    if len(data) == 0:
        raise UsafError(f"--data {data_file}: no sequences", "tokenize some text first")
    if config.seq_len is not None and config.seq_len > data.longest and world.is_main:  # said, not silent (review)
        progress.note(f"{source_of(config, 'seq_len')} {config.seq_len} cuts nothing: the longest sequence of --data "
                      f"{data_file} has {data.longest} tokens (tokenize with --seq-len {config.seq_len} to train on "
                      "longer ones); the run is planned for its longest")  # fmt: skip
    elif data.cut_tokens and world.is_main:  # 75 % of every sequence dropped without a word (found in review)
        progress.note(f"{source_of(config, 'seq_len')} {config.seq_len} cuts {data.cut_tokens:,} of the "
                      f"{data.tokens:,} tokens of --data {data_file} ({data.cut_tokens / data.tokens:.0%}): each "
                      f"sequence trains on its first {config.seq_len} (tokenize with --seq-len {config.seq_len} to "
                      "train on all of them, in more sequences)")  # fmt: skip
    eval_data = _eval_data(config, tokenizer, tokenizer_fp, context, progress)
    if eval_data is not None and world.is_main:  # a note: rank 0's (every rank read the whole data again)
        _say_eval_overlap(eval_data, TrainingTokens(data_file, len(data)), len(tokenizer), context, progress)
    elif world.is_main and not config.resume:
        _say_no_held_out_loss(data_file, progress)
    model = (model_dir, model_manifest.fingerprint)
    given = None if config.plan is None else resolve_plan(config.plan, config.workspace, model, progress)
    source = config.data if config.data is not None else data_file.parent
    settler = _Settler(model, backend, world, data, data_fp, source, given)
    # Every refusal of the settings before --overwrite deletes the run there: a command refused for its length,
    # reselection or memory budget destroyed the run it was to replace (found in review). Notes come with the settle.
    _, steps, _ = settler.budgeted(config, settler.plan_before_run(config), NullProgress())
    if given is not None:
        _check_plan_uses(config, given[1], NullProgress())
    world.refuse_unless_same({"--model": model_manifest.fingerprint, "--data": data_fp, "steps": steps,
                              "--plan": given[1].fingerprint if given else None}, SAME_INPUTS)  # fmt: skip
    out = config.out or _unfinished_run(config, settler, progress) or _new_run_dir(config, model_dir, world)
    run_dir = _check_run_dir(config, out, model_dir, data_file, world, held)
    settled = settler.settle(config, run_dir, progress)
    world.refuse_unless_same({"--plan": settled.plan.fingerprint, "steps": settled.steps}, SAME_INPUTS)  # a found one
    config, record = settled.config, settled.record
    resume_from = _resume_point(run_dir, record, world, latest_checkpoint)
    if resume_from is not None:  # the microbatch the run started with stays recorded (other_split compares, in run)
        record = {**record, "microbatch": _started_with(run_dir).get("microbatch", record["microbatch"])}
    if resume_from is None and settled.plan_dir == run_dir / PLAN_DIR:  # scored on the fly into this run: its
        _record_settings(run_dir, record, world)  # settings now, so the same command finds it if stopped before a step
    return TrainInputs(
        config=config,
        model_dir=model_dir,
        model=model_manifest,
        tokenizer=tokenizer,
        data_file=data_file,
        data_fingerprint=data_fp,
        data=data,
        eval_data=eval_data,
        run_dir=run_dir,
        plan_dir=settled.plan_dir,
        plan=settled.plan,
        steps=settled.steps,
        reselect_every=settled.reselect_every,
        per_step=config.microbatch * config.grad_accum * world.size,
        settings_record=record,
        resume_from=resume_from,
        lr_source=settled.lr_source,
    )


def _check_dense_router_grad(config: TrainConfig, model_dir: Path) -> None:
    """``--dense-router-grad`` is refused for a family whose router scores usaf cannot compute."""
    if not config.dense_router_grad:
        return
    refusal = dense_router_grad_refusal(resolve_family(load_model_config(model_dir)))
    if refusal is not None:
        raise UsafError(f"--dense-router-grad: {refusal}", "drop --dense-router-grad")


def _check_aux_loss(config: TrainConfig, model_dir: Path) -> None:
    """``--aux-loss-coef`` is refused for a family with no load-balancing loss (DeepSeek-V3 balances its experts
    with its routing bias): the run scored its plan, loaded the model and crashed at its first step with a
    traceback (found in review)."""
    if config.aux_loss_coef == 0:
        return
    model_type = resolve_family(load_model_config(model_dir)).model_type
    if not has_load_balancing_loss(model_type):
        raise UsafError(
            f"{source_of(config, 'aux_loss_coef')} {config.aux_loss_coef:g}: {model_type} has no load-balancing loss "
            "(it balances its experts with its routing bias)",
            "drop it (--z-loss-coef keeps the routers' logits small on every family)",
        )


def with_lr(config: TrainConfig, plan: PlanManifest) -> tuple[TrainConfig, str]:
    """``config`` with the deltas' lr filled in, and where it came from: ``--lr`` (or ``USAF_LR``, a TOML key) as
    given, else the one the plan's lr test chose, else ``DEFAULT_LR`` (a plan scored with ``--no-lr-test``, or by
    an older usaf). The filled-in lr is in the run's settings record, so a resumed run uses the same."""
    if config.lr is not None:
        if "lr" in config._from_record:
            return config, f"the interrupted run's {SETTINGS_FILE}"
        return config, source_of(config, "lr")
    test = plan.summary.lr_test
    if test is None:
        return config.model_copy(update={"lr": DEFAULT_LR}), "the default: the plan has no lr test"
    source = "the plan's lr test"  # what it measured, said where it is not this run's choice (found in review):
    if not recorded_measured(test):
        source += ", a fallback: every probe diverged (pass a smaller --lr if the loss rises)"
    scored_router = plan.config.get("router", True)  # the probes trained the routers, or not
    if scored_router != config.router:
        source += (
            f", which ran with{'' if scored_router else 'out'} the routers training, and this run trains "
            f"{'none' if scored_router else 'them'} (pass --lr to choose)"
        )
    return config.model_copy(update={"lr": test.lr}), source


def with_selection(config: TrainConfig, plan: PlanManifest) -> TrainConfig:
    """``config`` with the selection settings the plan was scored with (``--frac``, ``--calib-samples``,
    ``--statistic``, ...): with ``--plan`` the run's manifest and settings record held the defaults (64, grad,
    per-tensor) for a plan scored with others (found in review). Train reads none of them once it has a plan."""
    scored = {name: plan.config[name] for name in SELECTION_FIELDS if name in plan.config}
    return config.model_copy(update=scored)


def _check_run_dir(
    config: TrainConfig, run_dir: Path, model_dir: Path, data_file: Path, world: World, held: contextlib.ExitStack
) -> Path:
    """The run directory (``--out``, else the workspace's), locked by rank 0 for the run: never an input, never a
    directory usaf did not make; a finished run is replaced only with ``--overwrite``; refused when there is nothing
    to resume."""
    own_plan = run_dir / PLAN_DIR  # the plan this run scored on the fly: inside it by design
    plan = None if config.plan is None or _real(config.plan) == _real(own_plan) else config.plan
    inputs = {"--model": model_dir, "--data": [config.data, data_file], "--eval-data": config.eval_data, "--plan": plan}
    check_not_an_input(run_dir, "--out", inputs, defaulted=config.out is None)
    if plan is None and config.plan is not None and config.overwrite:  # --overwrite would delete it with the run
        raise UsafError(f"--plan {config.plan} lies inside --out {run_dir}, which --overwrite deletes before training "
                        "(the plan with it)", "copy the plan elsewhere and pass that --plan, or drop --plan to score "
                        "anew, or drop --overwrite to resume the run")  # fmt: skip

    def lock() -> None:  # one run per directory; a refusal raised on every rank (rank 1 waited at a barrier for a
        held.enter_context(OutputLock(run_dir, flag="--out"))  # rank 0 that had left, and reported a peer died)

    world.decided_by_main(lock, "the run directory's lock")
    _check_existing_run(run_dir, config, world)
    return run_dir


def _new_run_dir(config: TrainConfig, model_dir: Path, world: World) -> Path:
    """A new default run directory, named by rank 0 (another rank's clock may have passed the next second)."""
    return world.decided_by_main(lambda: default_output(settings_workspace(config), "run", model_dir.name),
                                 "the run directory's name")  # fmt: skip


def _check_resumable(config: TrainConfig, run_dir: Path) -> None:
    """``--resume`` of an ``--out`` that holds no run to resume, refused before any input is looked for: in a
    workspace of several models, a mistyped --out, or an export's, was answered "--model: not given, and the
    workspace holds 'quantized_model' artifacts of 3 different origins" (found in review). A finished run is said
    as before (:func:`_check_existing_run`), with the flags that decide what is done with it."""
    given = source_of(config, "resume")
    found = found_at(run_dir)
    if found.state in ("absent", "empty") or (found.state == "usaf" and found.kind is None):
        raise UsafError(f"--out {run_dir}: nothing to resume there ({given})", f"drop {given} to start a new run")
    if found.kind != RunManifest.KIND:
        raise UsafError(f"--out {run_dir}: {found.what}, no run to resume ({given})",
                        f"pass the --out of the interrupted run, or drop {given} to start a new run")  # fmt: skip


def _check_existing_run(run_dir: Path, config: TrainConfig, world: World) -> None:
    found = found_at(run_dir)
    # links, files, another command's output: refused whatever the flags
    refuse_unless_replaceable(run_dir, found, "--out", overwrite=True, overwrite_flag="--overwrite",
                              kinds=(RunManifest.KIND,),  # added files: where the run would be replaced, or the
                              replacing=config.overwrite or (run_dir / "manifest.json").is_file())  # flag offered
    if config.overwrite and world.is_main:
        remove_usaf_made(run_dir, "--out", kinds=(RunManifest.KIND,))
    world.barrier("overwrite")
    found = found_at(run_dir)
    if (run_dir / "manifest.json").is_file():
        what = "a finished run" if found.what == "a usaf run artifact" else found.what
        raise UsafError(f"--out {run_dir}: {what} is there", "pass another --out, or --overwrite to replace it")
    # An empty directory (or one of only a kill's lock and temporaries) holds no run: --resume there started a new
    # run in silence (found in review), where the user meant another directory.
    if config.resume and (not run_dir.exists() or not own_entries(run_dir)):
        given = source_of(config, "resume")  # USAF_RESUME=1 or a --config table too: "drop --resume" named no flag
        if config.out is None:  # the new default: the workspace held no unfinished run of this command
            raise UsafError(f"{given}: no interrupted run of this command in {run_dir.parent}",
                            f"pass its --out, or drop {given} to start a new run")  # fmt: skip
        raise UsafError(f"--out {run_dir}: nothing to resume there ({given})", f"drop {given} to start a new run")


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _say_eval_overlap(eval_data: Any, training: Any, vocab_size: int, context: int | None, progress: Progress) -> None:
    """A note when held-out sequences are training sequences (the same token ids): their loss measures the fit."""
    sequences = (eval_data[i].input_ids for i in range(len(eval_data)))
    found = found_in_training(sequences, training, vocab_size=vocab_size, context=context, progress=progress)
    if found:
        progress.note(f"--eval-data {eval_data.path}: {found:,} of its {len(eval_data):,} sequences are training "
                      f"sequences of --data {training.path}: for them the held-out loss measures the fit to the "
                      "training text, not generalization (hold sources out at tokenize: --held-out, --held-out-frac; "
                      "a tokens directory as --eval-data uses its heldout.jsonl; the same text in several sources, a "
                      "shared header or licence, is on both sides of any split: deduplicate it)")  # fmt: skip


def _say_no_held_out_loss(data_file: Path, progress: Progress) -> None:
    """A run of a tokens artifact with a held-out split, measuring none: said, with the flags. Its summary's only
    figure was the training loss, and the warning of a rising held-out loss was off, in silence (found in review)."""
    heldout = data_file.with_name("heldout.jsonl")
    if data_file.name != "train.jsonl" or not heldout.is_file():
        return
    with heldout.open("rb") as f:
        sequences = sum(1 for line in f if line.strip())
    if sequences:
        progress.note(f"no held-out loss is measured while training, nor a rising one warned of: --eval-data "
                      f"{heldout.parent} --eval-every N measures its {counted(sequences, 'held-out sequence')} every N "
                      "steps (usaf eval measures them after the run)")  # fmt: skip


def _eval_data(config: TrainConfig, tokenizer: Any, tokenizer_fp: str, context: int | None, progress: Progress) -> Any:
    if config.eval_data is None:
        if config.eval_every > 0:
            refuse_unused(config, "eval_every", "no --eval-data, so no held-out loss to compute",
                          "pass --eval-data (a tokens directory uses its heldout.jsonl), or drop it",
                          progress.note)  # fmt: skip
        return None
    given = config.model_copy(update={"data": config.eval_data})
    eval_file, _ = resolve_data(given, tokenizer_fp, progress, flag="--eval-data")
    if config.eval_data.is_dir():  # a tokens directory: its held-out split (a file named is read as named)
        eval_file = eval_file.with_name("heldout.jsonl")
    data = TokenDataset(eval_file, vocab_size=len(tokenizer), context=context, cut=config.seq_len)
    if len(data) == 0:  # else the run would report no held-out loss, without a word
        raise UsafError(
            f"--eval-data {eval_file}: no sequences",
            "tokenize with --held-out SOURCE for a held-out split, or drop --eval-data",
        )
    return data


def _length(config: TrainConfig, sequences: int, world: World, progress: Progress) -> tuple[int, int]:
    """The run's steps and its reselection interval."""
    per_step = config.microbatch * config.grad_accum * world.size  # the global batch, in sequences
    if per_step > sequences:  # one step would train some sequences twice; --microbatch 10**12 hung (found in review)
        processes = f" × {world.size} processes" if world.size > 1 else ""
        raise UsafError(
            f"a step of {per_step:,} sequences ({source_of(config, 'microbatch')} {config.microbatch} × "
            f"{source_of(config, 'grad_accum')} {config.grad_accum}{processes}) is more than the data's {sequences:,}",
            "lower --microbatch or --grad-accum, or tokenize more data",
        )
    steps = config.steps or max(1, math.ceil((config.epochs or 1.0) * sequences / per_step))
    _note_topped_up(config, steps, sequences, per_step, progress)
    if config.steps is None and config.epochs is None and steps < FEW_STEPS:  # a 4 KB corpus trained 1 step, unsaid
        progress.note(f"one epoch (the default) of {sequences:,} sequences is {counted(steps, 'step')}: little "
                      "training; --epochs N or --steps N trains longer (--eval-data shows when it stops helping)")
    if config.epochs is not None and config.epochs * sequences < per_step:  # rounded up to one step in silence
        progress.note(f"{source_of(config, 'epochs')} {config.epochs:g} is {config.epochs * sequences / per_step:.2g} "
                      f"of a step of {per_step} sequences on this data: 1 step is trained")  # fmt: skip
    if config.save_every and config.save_every > steps and was_given(config, "save_every"):  # said like eval_every's
        progress.note(f"{source_of(config, 'save_every')} {config.save_every}: past the run's {counted(steps, 'step')}"
                      ", so no checkpoint before final/ (Ctrl-C still saves one)")  # fmt: skip
    every = _reselect_every(config, steps, progress)
    if every == 0:
        refuse_unused(config, "reselect_fraction", "this run's mask is static, so nothing is reselected",
                      "drop it, or pass --reselect-every N for RigL reselection every N steps",
                      progress.note)  # fmt: skip
    if config.eval_data is not None and config.eval_every >= steps:  # else it measured what 0 does (found in review)
        refuse_unused(config, "eval_every", f"the run has {steps} steps, so no held-out loss between the one at "
                      "its start and the one at its end (every run with --eval-data measures both)",
                      f"lower it below {steps}, or drop it", progress.note)  # fmt: skip
    return steps, every


FEW_STEPS = 10  # a default epoch shorter than this is said: the data is small for one epoch to train much (review)


def _note_topped_up(config: TrainConfig, steps: int, sequences: int, per_step: int, progress: Progress) -> None:
    """Whole epochs whose sequences a step's size does not divide: the last step takes the rest from the next
    epoch's order, so a few sequences train once more than the others. Said, not silent (found in review)."""
    epochs = config.epochs or 1.0
    if config.steps is not None or epochs != int(epochs):
        return
    extra = steps * per_step - int(epochs) * sequences
    if extra > 0:
        given = f"{source_of(config, 'epochs')} {epochs:g}" if config.epochs else "one epoch (the default)"
        progress.note(f"{given} of {sequences:,} sequences at {per_step} a step: {steps:,} steps, the last one filled "
                      f"with {counted(extra, 'sequence')} of the next epoch's order (trained once more)")  # fmt: skip


def _reselect_every(config: TrainConfig, steps: int, progress: Progress) -> int:
    """``--reselect-every`` as given, by default 50; a static mask (0) where no reselection would replace anything.

    The share replaced decays to 0 at 75 % of the run (:func:`usaf.engine.reselect.update_fraction`), so an interval
    reaching that far reselected nothing while paying for the scores each cycle collects: the default for a run of
    51-66 steps, or ``--reselect-every 10`` of 12 (found in review). Such an interval given by flag is refused."""
    requested = config.reselect_every
    if requested is not None and requested > steps:
        raise UsafError(
            f"--reselect-every {requested} exceeds the run's {steps} steps", "lower it, or pass 0 for a static mask"
        )
    every = DEFAULT_RESELECT_EVERY if requested is None else requested
    if every and not config.reselect_fraction:  # nothing is ever replaced: named, not --reselect-every (review)
        return _static(config, "reselect_fraction", f"{config.reselect_fraction:g}: no reselection replaces anything",
                       "pass a fraction above 0, or --reselect-every 0 for a static mask", progress)  # fmt: skip
    if every == 0 or (every < steps and update_fraction(every, steps, config.reselect_fraction) > 0):
        return every
    if requested is None:
        progress.note(f"a {steps}-step run is too short for a reselection every {every}: static mask")
        return 0
    return _static(config, "reselect_every", f"{every}: no reselection of this {steps}-step run would replace "
                   f"anything (the share replaced, --reselect-fraction {config.reselect_fraction:g} at first, is 0 "
                   f"from step {math.ceil(0.75 * steps)}, 75 % of the run)", "lower it, or pass 0 for a static mask",
                   progress)  # fmt: skip


def _static(config: TrainConfig, field: str, problem: str, remedy: str, progress: Progress) -> int:
    """A reselection that would replace nothing, because of ``field``: refused where its flag gave it, else said,
    and the mask static (0). Its default was refused too, for a run of 67-69 steps with the plan's largest tensor
    (found in review): the default is said as such."""
    source = source_of(config, field)
    said = f"{source} {problem}"
    if source == flag_name(field) and was_given(config, field):
        raise UsafError(said, remedy)
    progress.note(f"{'' if was_given(config, field) else 'the default '}{said}: static mask")
    return 0


def reselection_acting(config: TrainConfig, plan: PlanManifest, steps: int, every: int, progress: Progress) -> int:
    """``every``, or a static mask (0) where no reselection of the run would replace one weight of the plan's largest
    tensor: each replaces ``round(share × its active weights)``, and a share decayed near 0 by the first one (``--steps
    100 --reselect-every 74``) replaced none while its scores were collected (found in review)."""
    largest = max((t.selected for t in plan.summary.tensors), default=0)
    shares = [update_fraction(step, steps, config.reselect_fraction) for step in range(every, steps, every or steps)]
    if not every or any(round(share * largest) >= 1 for share in shares):
        return every
    if round(config.reselect_fraction * largest) < 1:  # under one weight at its start: the fraction, not the interval
        return _static(config, "reselect_fraction", f"{config.reselect_fraction:g}: no reselection would replace one "
                       f"weight (the plan's largest tensor trains {largest:,}, and the share replaced only decays "
                       "from this)", f"raise it above {1 / (2 * largest):.2g}, or pass --reselect-every 0 for a "
                       "static mask", progress)  # fmt: skip  (--reselect-every was blamed; found in review)
    return _static(config, "reselect_every", f"{every}: no reselection of this {steps}-step run would replace one "
                   f"weight (the plan's largest tensor trains {largest:,}; the share replaced decays from "
                   f"{config.reselect_fraction:g} at step 0 to 0 at step {math.ceil(0.75 * steps)})",
                   "lower it, or pass 0 for a static mask", progress)  # fmt: skip


def _check_plan_uses(config: TrainConfig, plan: PlanManifest, progress: Progress) -> None:
    """Settings the plan leaves nothing to act on (each accepted and unused before; found in review):
    ``--prefix-cache-gib`` for a plan that trains from layer 0 (no frozen layer runs before the trained ones), the
    router losses where no router trains and no trained weight lies before a trained layer's router (one trained
    layer, targets after its router: the experts, shared or dense)."""
    summary = plan.summary
    if summary.trainable_layers[0] == 0:
        refuse_unused(config, "prefix_cache_gib", "the plan trains from layer 0, so no frozen prefix to cache",
                      "drop it (a plan scored with --train-from N > 0 has a frozen prefix)", progress.note)  # fmt: skip
    before_a_router = len(summary.trainable_layers) > 1 or "attention" in parse_targets(summary.targets or EXPERTS_ONLY)
    if not config.router and not before_a_router:
        for field in ("aux_loss_coef", "z_loss_coef"):
            refuse_unused(config, field, "no router trains (--no-router) and no trained weight lies before one",
                          "drop it, or train the routers", progress.note)  # fmt: skip


def _check_seq_len(seq_len: int | None, model: str, tokenizer: Any, source: str) -> int | None:
    """The model's context (``None`` when unknown), refusing a ``--seq-len`` (from ``source``) beyond it.

    Every line of the data must fit it too, ``--seq-len`` or not: score and eval refuse the same file, and a
    file tokenized for a longer context is for another model (re-tokenizing cuts it where packing would).
    """
    limit = max_sequence_length(model, tokenizer)
    if seq_len is not None and limit is not None and seq_len > limit:
        raise UsafError(f"{source} {seq_len} exceeds the model's context ({limit} tokens)", f"use at most {limit}")
    return limit


@dataclass(frozen=True)
class _Settled:
    """What the plan decides: the run's settings with the budget's and the plan's choices, its length, the record."""

    config: TrainConfig
    plan_dir: Path
    plan: PlanManifest
    steps: int
    reselect_every: int
    lr_source: str
    record: dict  # run-settings.json


@dataclass(frozen=True)
class _Settler:
    """The plan, the memory budget and the run's length for a run directory, from what does not depend on it."""

    model: tuple[Path, str]  # the quantized model's directory and fingerprint
    backend: Any
    world: World
    data: Any  # TokenDataset
    data_fingerprint: str
    source: Path  # the data as score reads it: --data, else the tokens directory found
    given: tuple[Path, PlanManifest] | None  # --plan, read and verified

    def budgeted(self, config: TrainConfig, plan: PlanManifest | None, progress: Progress) -> tuple:
        """``config`` with the planner's settings (``--vram``/``--ram``), the run's steps and its reselection."""
        summary = plan.summary if plan is not None else None
        budgeted = apply_budget(config, self.model[0], self.backend, self.data, summary, progress)
        return budgeted, *_length(budgeted, len(self.data), self.world, progress)

    def settle(
        self, config: TrainConfig, run_dir: Path, progress: Progress, *, score_now: bool = True
    ) -> _Settled | None:
        """The run in ``run_dir``: ``--plan``, else the plan scored into it by an earlier start, else the workspace's
        newest for this model, else (``score_now``) one scored now into it; None when there is no plan and not
        ``score_now``."""
        wanted = self.selection_given(config, run_dir)
        found = self.given or _found_plan(self.model, run_dir, config.workspace, progress, wanted,
                                          self.data_fingerprint)  # fmt: skip
        if found is None and not score_now:
            return None
        # The budget after the plan is found: planned without one, it counted scoring on the fly and chose a
        # --train-from, said, for a run whose workspace plan decides both (found in review); before scoring on the fly
        budgeted, steps, reselect_every = self.budgeted(config, found[1] if found else None, progress)
        plan_dir, plan = found or _score_on_the_fly(self.score_settings(budgeted, run_dir), run_dir, progress, wanted)
        if self.given is not None and (other := _data_difference(plan, self.data_fingerprint)):
            progress.note(f"--plan {plan_dir}: scored with {other[0]}: its masks and lr were chosen on those")
        _check_plan_uses(budgeted, plan, progress)
        reselect_every = reselection_acting(budgeted, plan, steps, reselect_every, progress)
        config, lr_source = with_lr(with_selection(budgeted, plan), plan)
        record = _settings_fingerprint(config, self.model[1], plan, self.data_fingerprint, self.world)
        record[LR_FROM_PLAN] = budgeted.lr is None  # --resume takes it from the plan again, and says so (review)
        # the dtype "auto" resolved to here: a bf16 GPU run resumed where only the CPU is seen went on in fp32, in
        # silence (found in review); recorded by runs started since, compared where recorded
        record["compute_dtype"] = str(self.backend.compute_dtype(config.dtype)).removeprefix("torch.")
        # the inputs as found (not compared: their fingerprints are), for --resume to take them again from anywhere
        record |= {"model": str(_real(self.model[0])), "data": str(_real(Path(self.source))),
                   "plan": str(_real(plan_dir))}  # fmt: skip
        return _Settled(config, plan_dir, plan, steps, reselect_every, lr_source, record)

    def score_settings(self, config: TrainConfig, run_dir: Path) -> score.ScoreConfig:
        """What train scores a plan with when it has none: into RUN/plan, with the settings score shares."""
        options = (*SELECTION_FIELDS, "router", "device", "dtype", "seed", "stream_experts")  # scored as it trains
        settings = score.ScoreConfig(
            model=self.model[0],
            data=self.source,
            out=run_dir / PLAN_DIR,
            microbatch=config.microbatch,
            stability=False,
            lr_test=config.lr is None,  # an lr given to train makes the test's choice moot
            **{name: getattr(config, name) for name in options},
        )
        settings._into_run = True  # RUN/plan is open to this score alone
        return settings

    def plan_before_run(self, config: TrainConfig) -> PlanManifest | None:
        """For the checks made before the run directory is known: ``--plan``, else the workspace's plan a run would
        take (not one scored into a run), else None. Budgeted without the workspace's plan, a ``--ram`` run counted
        scoring on the fly that it would not do, and could be refused for it (found in review)."""
        if self.given is not None:
            return self.given[1]
        wanted = self.selection_given(config, Path(config.out or "run"))
        found = resolve_plan(None, config.workspace, self.model, NullProgress(), outside=config.out,
                             differences=_not_this_runs(wanted, self.data_fingerprint))  # fmt: skip
        return found[1] if found else None

    def selection_given(self, config: TrainConfig, run_dir: Path) -> dict[str, Any]:
        """The selection settings given (a flag, ``USAF_*``, ``--config``, a legacy variable: whatever scoring on the
        fly would honour), as the plan it scores would record them: a plan scored with others is not this run's.
        Empty with ``--plan``, which refuses them from a flag or ``[train]`` and drops the others. (The memory budget
        fills only settings not given, so these do not depend on it.)"""
        if self.given is not None:
            return {}
        recorded = self.score_settings(config, run_dir).model_dump(mode="json")
        return {name: recorded[name] for name in SELECTION_FIELDS if was_given(config, name)}

    def scores_into(self, config: TrainConfig, run_dir: Path) -> dict | None:
        """The identity score records (score-settings.json) for the plan this run would score into ``run_dir``; None
        when the run would not score (a plan given or in the workspace)."""
        if self.given is not None:
            return None
        wanted = self.selection_given(config, run_dir)
        if _found_plan(self.model, run_dir, config.workspace, NullProgress(), wanted, self.data_fingerprint):
            return None
        budgeted = self.budgeted(config, None, NullProgress())[0]
        return run_identity(self.score_settings(budgeted, run_dir), model_fingerprint=self.model[1],
                            data_fingerprint=self.data_fingerprint, backend=self.backend,
                            processes=self.world.size)  # fmt: skip


def _found_plan(
    model: tuple[Path, str],
    run_dir: Path,
    workspace: Path | None,
    progress: Progress,
    wanted: dict[str, Any],
    data_fingerprint: str,
) -> tuple[Path, PlanManifest] | None:
    """Without ``--plan``: the one scored into RUN/plan by an earlier start, else the workspace's newest plan for
    this model scored on this data (``data_fingerprint``) with the selection settings given (``wanted``; not one
    inside another run), else None.

    A plan scored with other selection settings than those given is never taken: the plan decides the masks, so
    the given ``--frac`` (say) would be ignored; nor one scored on other data, whose masks and lr were chosen on that
    (it was taken in silence, its prefix store said to hold every training sequence; found in review). RUN/plan is
    this run's own: one with others is refused."""
    if (run_dir / PLAN_DIR / "manifest.json").is_file():  # scored on the fly by an earlier, interrupted start
        path = run_dir / PLAN_DIR
        manifest = load_verified(path, PlanManifest, flag="--plan")
        check_plan_model(path, manifest, model)
        differences = _selection_differences(manifest, wanted)
        if differences:
            raise UsafError(
                f"--out {run_dir}: its plan ({path}) was scored with {'; '.join(differences)}",
                "give the settings it was scored with, or another --out (--overwrite replaces the run)",
            )
        return path, manifest
    started = _started_with(run_dir)  # an interrupted run: the plan it started with before any newer one
    return resolve_plan(None, workspace, model, progress, outside=run_dir, prefer=started.get("plan_fingerprint"),
                        differences=_not_this_runs(wanted, data_fingerprint))  # fmt: skip


def _not_this_runs(wanted: dict[str, Any], data_fingerprint: str) -> Callable[[PlanManifest], list[str]]:
    """What makes a workspace plan not this run's: selection settings other than those given, or other data."""
    return lambda plan: _selection_differences(plan, wanted) + _data_difference(plan, data_fingerprint)


def _data_difference(plan: PlanManifest, data_fingerprint: str) -> list[str]:
    """The plan's data where it is not this run's, in a user's words; empty where it is."""
    scored_on = plan.summary.tokens_fingerprint
    if scored_on == data_fingerprint:
        return []
    return [f"other tokens (fingerprint {scored_on[:16]}) than --data's ({data_fingerprint[:16]})"]


def _selection_differences(plan: PlanManifest, wanted: dict[str, Any]) -> list[str]:
    """The given selection settings a plan was scored without, in a user's words (``--frac 0.01, not 0.05``). A
    setting the plan left at its default counts as the value that default chose (its summary's frac and targets): a
    plan of frac 0.1 by default was "scored with --frac the default, not 0.1 (given)" and scored again (review)."""
    recorded = dict(plan.config)
    chosen = {"frac": plan.summary.frac, "targets": plan.summary.targets}
    return [f"{flag_name(name)} {_shown(recorded.get(name))}, not {_shown(value)} (given)"
            for name, value in wanted.items()
            if recorded.get(name) != value and not _same_choice(name, chosen.get(name), value)]  # fmt: skip


def _same_choice(name: str, chosen: Any, given: Any) -> bool:
    """Whether ``given`` asks for what the plan's default chose (``chosen``: its summary's value; None: unknown)."""
    if chosen is None or given is None:
        return False
    if name == "targets":
        return set(parse_targets(given)) == set(parse_targets(chosen))
    return chosen == given


def _score_on_the_fly(
    settings: score.ScoreConfig, run_dir: Path, progress: Progress, wanted: dict[str, Any]
) -> tuple[Path, PlanManifest]:
    interrupted = ArtifactWriter.partial_dir(run_dir / PLAN_DIR)  # a score stopped here: resumed by score.run
    if run_dir.exists() and any(name != interrupted.name for name in own_entries(run_dir)):  # a kill's lock: ignored
        raise UsafError(
            f"--out {run_dir}: holds another run (other settings or inputs)",
            "pass another --out, or --overwrite to replace it",
        )
    if not interrupted.is_dir():  # else score says it resumes (this said it scored anew, then that; found in review)
        # "for this model" read as none at all after "not using the plan ...: scored with other tokens" (review)
        which = "scored with the selection given" if wanted else "for this model and these tokens"
        progress.note(f"no --plan and none in the workspace {which}: scoring now into {run_dir / PLAN_DIR}")
    world().barrier("run directory check")  # every rank has looked before rank 0 creates it
    made = world().is_main and not run_dir.exists()
    if world().is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    try:
        manifest, path = score.run(settings, progress=progress)
    except BaseException:
        kept = (run_dir / PLAN_DIR).exists() or interrupted.exists()  # the plan, or score's work that resumes
        if made and found_at(run_dir).state in ("empty", "usaf") and not kept:
            shutil.rmtree(run_dir, ignore_errors=True)  # the empty directory made just now: a failure leaves nothing
        raise
    return path, manifest


def _unfinished_run(config: TrainConfig, settler: _Settler, progress: Progress) -> Path | None:
    """Without ``--out``: the workspace's newest unfinished run that this same command would continue (rank 0
    looks; every rank takes its answer). A default run directory is named by its start time, so without this a
    rerun would start over in a new one."""

    def look() -> Path | None:
        for candidate in unfinished_outputs(settings_workspace(config), "run", settler.model[0].name):
            if _in_use(candidate):
                continue
            if _continues(candidate, config, settler):
                return candidate
            if _settings_edited(candidate):  # passed over in silence, a new run started (found in review)
                progress.note(f"not resuming the unfinished run {candidate}: its {SETTINGS_FILE} changed since usaf "
                              "wrote it (put back what was edited and rerun to continue that run)")  # fmt: skip
        return None

    found = settler.world.decided_by_main(look, "the unfinished run")
    if found is not None:
        progress.note(f"resuming the unfinished run {found} (no --out given)")
    return found


def _in_use(run_dir: Path) -> bool:
    """Whether another process holds ``run_dir``'s lock: the same command started twice at once runs twice."""
    try:
        OutputLock(run_dir).acquire().release()
    except UsafError:
        return True
    return False


def _settings_edited(run_dir: Path) -> bool:
    """Whether ``run_dir``'s recorded settings were edited after usaf wrote them (:func:`read_run_settings`)."""
    try:
        read_run_settings(run_dir / SETTINGS_FILE)
    except UsafError:
        return True
    return False


def _continues(candidate: Path, config: TrainConfig, settler: _Settler) -> bool:
    """Whether ``candidate`` holds this command's run: its recorded settings equal this run's there, or it holds
    only this run's plan stopped while scoring (its saved work, or the plan finished but for its rename), with
    score's recorded settings equal to what this run scores with."""
    try:
        saved = candidate / SETTINGS_FILE
        if saved.is_file():
            settled = settler.settle(config, candidate, NullProgress(), score_now=False)
            return settled is not None and not run_differences(read_run_settings(saved), settled.record)
        partial = ArtifactWriter.partial_dir(candidate / PLAN_DIR)
        if own_entries(candidate) != [partial.name]:
            return False
        identity = settler.scores_into(config, candidate)
        if identity is None:
            return False
        # its saved work, or a plan finished there but for its rename
        return same_run(ScoreProgress(partial, NullProgress()).recorded_identity(), identity) or finished_there(
            partial, identity
        )
    except (UsafError, OSError):  # a plan in it broken or for another model, a directory gone: not this run
        return False


def _record_settings(run_dir: Path, record: dict, world: World) -> None:
    world.barrier("settings check")  # every rank has read the old settings before rank 0 writes the new
    if world.is_main:
        write_text_atomic(run_dir / SETTINGS_FILE, run_settings_text(record))  # all or nothing
    world.barrier("run settings")


def _settings_fingerprint(config: TrainConfig, model_fp: str, plan: PlanManifest, data_fp: str, world: World) -> dict:
    """What a resumed run must share with the interrupted one.

    The split of a step's sequences into processes and microbatches is left out: only the global batch
    (microbatch × grad-accum × processes) decides which sequences a step trains on, so a run may resume
    with another world size or microbatch as long as that product is the same.
    """
    skip = {
        "resume",
        "overwrite",
        "out",
        "workspace",
        "dist_backend",
        "stream_experts",
        "microbatch",
        "grad_accum",
        "vram",
        "ram",
        "prefix_cache_gib",
        "deterministic",
    }  # where things live, how a batch is split and in which order a GPU sums: not the result
    keep = config.model_dump(mode="json", exclude=skip)
    if not config.dense_router_grad:  # recorded when on: a run directory from before the option still resumes
        del keep["dense_router_grad"]
    if keep["targets"] is None:  # not given: spelled as the fixed default was before it followed the model (the plan's
        keep["targets"] = ",".join(DEFAULT_TARGETS)  # fingerprint pins what trains), so a run from then still resumes
    if config.eval_data is not None:  # as a real path: a relative one did not resume from another directory (review)
        keep["eval_data"] = str(_real(Path(config.eval_data)))
    global_batch = config.microbatch * config.grad_accum * world.size
    return {**keep, "global_batch": global_batch, "microbatch": config.microbatch, "model_fingerprint": model_fp,
            "plan_fingerprint": plan.fingerprint, "data_fingerprint": data_fp}  # fmt: skip


LR_FROM_PLAN = "lr_from_plan"  # in the record: the lr was not given, but the plan's (or the default where it has none)

# recorded, not settings to take back: what the record derives (fingerprints, the global batch) or resolves, and the
# device, chosen before the record is read (a run is compared by its compute dtype, not by how the device was named)
_NOT_TAKEN = frozenset({"global_batch", "compute_dtype", "model_fingerprint", "plan_fingerprint", "data_fingerprint",
                        "device"})  # fmt: skip


def with_recorded_settings(config: TrainConfig, run_dir: Path, world: World, progress: Progress) -> TrainConfig:
    """``--resume`` alone continues the run in ``run_dir`` with the settings its ``run-settings.json`` records, each
    one not given on the command line, ``USAF_*`` or ``--config`` (those given are compared with the record as
    always). The help said "continue the interrupted run in --out" and every setting had to be given again; a
    missing one was "holds another run" (found in review). Nothing recorded (no run there): as given."""
    record = _started_with(run_dir)
    fields = TrainConfig.model_fields
    taken: dict[str, Any] = {}
    for name, value in record.items():
        if name in _NOT_TAKEN or name not in fields or was_given(config, name):
            continue
        if name == "lr" and record.get(LR_FROM_PLAN) is True:  # the same plan's lr test gives it again, said as
            continue  # such: the run's manifest called it "the interrupted run's run-settings.json" (found in review)
        try:
            taken[name] = TypeAdapter(fields[name].annotation).validate_python(value)
        except ValueError:  # an edited record: the comparison names what differs
            continue
    if "grad_accum" not in taken and not was_given(config, "grad_accum") and "global_batch" in record:
        per_step = taken.get("microbatch", config.microbatch) * world.size  # the global batch decides the steps
        if isinstance(record["global_batch"], int) and record["global_batch"] % per_step == 0:
            taken["grad_accum"] = record["global_batch"] // per_step
    if taken:
        progress.note(f"--resume: the {len(taken)} settings not given are those recorded in {run_dir / SETTINGS_FILE}")
    resumed = config.model_copy(update=taken)
    resumed._from_record = frozenset(taken)
    return resumed


def other_split(ran_at: int | None, now: int, given: int) -> str | None:
    """The note for a resume whose microbatches are not those the run trained with until now (``ran_at``: its
    checkpoint's, an out-of-memory retry's, else the one it started with; None: a run started before 2026-12-06):
    it continues, but not as the run would have. Exact only at the same microbatch: each forward's sums, and RigL's
    grow scores (a sum over the microbatches of each one's gradient magnitude), depend on it; a resume at another one
    was said to be exact and reselected other weights (found in review). ``now``: what this start computes,
    ``given``: ``--microbatch`` (a checkpoint's out-of-memory choice overrides it)."""
    if given != now:
        return f"--microbatch {given}: the run goes on at its checkpoint's {now} (an out-of-memory retry chose it)"
    if ran_at is None or ran_at == now:
        return None
    return (
        f"--microbatch {now}: the run trained at {ran_at} until now. The same sequences a step, but each step's "
        "sums and RigL's grow scores (summed over microbatches) are other ones, so the result differs from an "
        f"uninterrupted run's (--microbatch {ran_at} continues it exactly)"
    )


def _resume_point(run_dir: Path, record: dict, world: World, latest_checkpoint) -> Path | None:
    """This run's newest checkpoint when ``run_dir`` holds this run; refused when it holds another's."""
    if run_dir.exists() and world.is_main:
        remove_stale_temporaries_inside(run_dir)  # e.g. run-settings.json of a start killed while writing it
    world.barrier("stale temporaries")
    if not run_dir.exists():
        return None
    previous = run_dir / SETTINGS_FILE
    differences = run_differences(read_run_settings(previous), record) if previous.is_file() else ["no settings"]
    if not differences:
        return latest_checkpoint(run_dir)
    if any(name != PLAN_DIR for name in own_entries(run_dir)):  # a stale lock or temporary is no run's
        shown = "; ".join(differences[:4]) + ("; ..." if len(differences) > 4 else "")
        raise UsafError(
            f"--out {run_dir}: holds another run (other settings or inputs: {shown})",
            "give the settings and inputs it was started with to resume it (an input replaced since, as a plan "
            "scored again with --overwrite, cannot be given again), another --out, or --overwrite to replace it",
        )
    return None


# Recorded, not compared on resume: the inputs' paths (their fingerprints pin what they hold: a path spelled
# relative or absolute refused the same run; found in review), when checkpoints and held-out losses are written
# (nothing trained depends on them), and the microbatch (another one at the same global batch resumes, with a note:
# other_split).
RESUME_IGNORES = frozenset({"model", "data", "plan", "save_every", "eval_every", "keep_checkpoints", "microbatch",
                            LR_FROM_PLAN})  # fmt: skip
RECORDED_SINCE = frozenset({"compute_dtype"})  # 2026-12-06


def run_differences(previous: Any, record: dict) -> list[str]:
    """What keeps an interrupted run's recorded settings (``previous``) from being this run's, in words; empty
    where this run continues it. The held-out data (no fingerprint) is compared by its real path; what a run
    started by an older usaf did not record (:data:`RECORDED_SINCE`) is not compared."""
    if not isinstance(previous, dict):
        return [f"its {SETTINGS_FILE} is unreadable"]
    differences = []
    for key in sorted((set(previous) | set(record)) - RESUME_IGNORES):
        if key in RECORDED_SINCE and key not in previous:
            continue
        if key in ("device", "dtype") and "compute_dtype" in previous:  # compared as resolved: --device cpu, auto
            continue  # and USAF_DEVICE=cpu are one device, --dtype float32 and auto on it one dtype (found in review)
        if key in SELECTION_FIELDS and previous.get("plan_fingerprint") == record.get("plan_fingerprint"):
            continue  # the same plan, the same selection (a run started before with_selection recorded defaults)
        was, now = previous.get(key), record.get(key)
        same_place = isinstance(was, str) and isinstance(now, str) and _real(Path(was)) == _real(Path(now))
        if key == "eval_data" and same_place:
            continue
        if was != now:
            differences.append(_difference(key, was, now))
    return differences


# the record's keys that are no flag, in a user's words
_RECORD_WORDS = {"model_fingerprint": "the quantized model", "plan_fingerprint": "the plan",
                 "data_fingerprint": "the tokens", "compute_dtype": "the compute dtype",
                 "global_batch": "sequences per step (--microbatch × --grad-accum × processes)"}  # fmt: skip


def _difference(key: str, was: Any, now: Any) -> str:
    """One difference in a user's words: ``--reselect-every 50, not the default`` (it said ``reselect_every 50, not
    None``; found in review), ``the plan a1b2..., not c3d4...``."""
    if key.endswith("_fingerprint"):
        was, now = (str(v)[:16] if v is not None else None for v in (was, now))
    return f"{_RECORD_WORDS.get(key) or flag_name(key)} {_shown(was)}, not {_shown(now)}"


def _shown(value: Any) -> str:
    return "the default" if value is None else str(value)


def _started_with(run_dir: Path) -> dict:
    """The settings record of the run interrupted in ``run_dir`` (empty where none is readable): the plan and tokens
    it started with are taken again, whatever newer ones appeared in the workspace since (found in review)."""
    record = read_run_settings(run_dir / SETTINGS_FILE)
    return record if isinstance(record, dict) else {}

