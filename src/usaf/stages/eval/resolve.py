"""Which model, checkpoint and sequences ``usaf eval`` evaluates: flags first, then the workspace's newest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from usaf.artifacts import (
    TokensManifest,
    load_verified,
    pick_latest,
)
from usaf.artifacts.outputs import manifest_kind
from usaf.artifacts.tokens import TRAIN_FILE
from usaf.artifacts.workspace import resolve_model
from usaf.config import flag_name, refuse_unused, source_of
from usaf.data.corpus import JSONL_SUFFIXES
from usaf.data.tokenizer import tokenizer_fingerprint
from usaf.errors import UsafError
from usaf.stages.change import (
    check_change,
    given_change,
    model_of_change,
    newest_run,
    unfinished_note,
    unfinished_runs,
)
from usaf.stages.eval.inputs import DATA, HELD_OUT, EvalInput, TextSettings, read_input
from usaf.stages.eval.overlap import run_data, training_tokens
from usaf.stages.progress import Progress

DEFAULT_SEQ_LEN = 512  # raw text packing: usaf tokenize's default (capped by the model's context)
TEXT_FLAGS = ("seq_len", "source_depth", "text_field", "source_field")  # settings of raw-text inputs only
# Sequences of a training split evaluated when eval picks the run's tokens itself (not given --data/--held-out): the
# whole split is most of a user's data, run twice. The figure behind it: docs/BENCHMARKS.md, "A sample of the
# training split".
TRAINING_SAMPLE = 512


def model_and_change(config: Any, workspace: Path, progress: Progress) -> tuple[Path, Any, Any]:
    """The quantized model and the change to evaluate (``None``: base only); refuses a foreign checkpoint.

    No ``--model`` and no ``--checkpoint``: the workspace's newest finished run and the model it was trained on, as
    export and generate take them (the newest model first refused to choose between models of two origins, where
    they took the newest run; found in review); the base model alone where there is no run. ``--checkpoint``
    alone: the newest model it was trained on. ``--model`` alone: base only.
    """
    change = given_change(config.checkpoint, progress) if config.checkpoint is not None else None
    if config.model is None and change is None:
        change = newest_run(workspace, progress)
    if config.model is not None or change is None:
        model_dir, manifest = resolve_model(config, progress)
    else:
        named = "--checkpoint" if config.checkpoint is not None else "the run"
        model_dir, manifest = model_of_change(workspace, change, named, progress)
    if config.model is None and change is None and (unfinished := unfinished_runs(workspace, manifest.fingerprint)):
        progress.note(f"no finished run for this model, so the base model alone: {unfinished_note(unfinished[0])}; "
                      f"--checkpoint {unfinished[0].path} evaluates it")  # base alone, and why (found in review)
    if change is not None:  # export's and generate's checks: its model, tensors, indices and routers
        check_change(change, manifest, model_dir)
    return model_dir, manifest, change


def _refuse_repeated(named: str, paths: list[Path]) -> None:
    """One path given twice in a set (``--held-out T --held-out T/``): its sequences counted twice in the set's pooled
    row, whose interval was then too narrow (found in review)."""
    seen: dict[Path, Path] = {}
    for path in paths:
        real = Path(path).resolve()
        if real in seen:
            shown = f"{seen[real]}" + (f" and {path}" if str(path) != str(seen[real]) else "")
            raise UsafError(
                f"{named} {shown}: the same input given twice; its sequences would count twice "
                "in the pooled row",
                "give each input once",
            )
        seen[real] = Path(path)


def _refuse_a_copy(named: str, item: EvalInput, earlier: list[EvalInput]) -> None:
    """The same sequences under another name in a set (a copied file): as a path given twice, counted twice in the
    pooled row, whose interval was too narrow (found in review; the paths differed, so the check above passed)."""
    for other in earlier:
        if other.fingerprint == item.fingerprint:
            raise UsafError(
                f"{named} {other.path} and {item.path}: the same sequences (one fingerprint); they would count twice "
                "in the pooled row",
                "give each input once",
            )


def read_inputs(
    config: Any, workspace: Path, model_dir: Path, change: Any, tokenizer: Any, context: int | None, progress: Progress
) -> list[EvalInput]:
    """Every ``--data``/``--held-out`` path read into sequences (the workspace's tokens when neither is given).

    Raw-text settings (``--seq-len`` ...) given without a raw-text input are refused, not ignored.
    """
    tok_fp = tokenizer_fingerprint(tokenizer)
    data, held_out = list(config.data), list(config.held_out)
    picked = not data and not held_out  # the run's tokens, chosen here: their training split is sampled
    if picked:
        data, held_out = default_tokens(workspace, change, tok_fp, progress)
    if context is not None and config.seq_len is not None and config.seq_len > context:
        raise UsafError(
            f"--seq-len {config.seq_len} exceeds the model's context of {context} tokens (max_position_embeddings)",
            f"pass --seq-len {context} or less",
        )
    text = TextSettings(
        model=str(model_dir),
        seq_len=config.seq_len or min(DEFAULT_SEQ_LEN, context or DEFAULT_SEQ_LEN),
        source_depth=1 if config.source_depth is None else config.source_depth,
        text_field=config.text_field or "text",
        source_field=config.source_field or "source",
        all_files=config.all_files,
        given={name: source_of(config, name) for name in ("text_field", "source_field") if getattr(config, name)},
    )
    inputs = []
    for set_name, paths in ((DATA, data), (HELD_OUT, held_out)):
        # where the paths were set ([defaults] held_out, a tokenize glob elsewhere, was named --held-out; review)
        named = None if picked else source_of(config, "data" if set_name == DATA else "held_out")
        _refuse_repeated(named or f"--{set_name}", paths)
        for path in paths:
            sample, sampled_by = config.max_sequences, "--max-sequences"
            if picked and set_name == DATA and sample is None:
                sample, sampled_by = TRAINING_SAMPLE, "eval's default sample of a training split"
            item = read_input(
                path,
                set_name,
                tokenizer=tokenizer,
                tokenizer_fingerprint=tok_fp,
                context=context,
                text=text,
                max_sequences=sample,
                seed=config.seed,
                progress=progress,
                sampled_by=sampled_by,
                named=named,
            )
            if sample != config.max_sequences and item.sampled_from is not None:
                progress.note(_training_sample_note(item, held_out))
            _refuse_a_copy(named or f"--{set_name}", item, [i for i in inputs if i.set == set_name])
            inputs.append(item)
    raw = [item.path for item in inputs if item.kind == "text"]
    if not raw:
        _unused_text_settings(config, progress)
    else:
        _unused_by_the_raw_inputs(config, raw, progress)
    return inputs


def _training_sample_note(item: EvalInput, held_out: list[Path]) -> str:
    both = f" --held-out {held_out[0]}" if held_out else ""
    return (f"--data: a seeded sample of {len(item.sequences):,} of the {item.sampled_from:,} training sequences (what "
            f"the run fits; the interval says how close the whole split is): --data {item.path}{both} evaluates "
            "all of them, --max-sequences N another sample")  # fmt: skip


def _unused_by_the_raw_inputs(config: Any, raw: list[Path], progress: Progress) -> None:
    """Raw-text settings that none of the raw-text inputs reads: a directory's (--source-depth, --all-files) over
    files alone, JSONL fields over text files alone. Accepted and unused before (found in review)."""
    directories = any(path.is_dir() for path in raw)
    jsonl = directories or any(path.name.lower().endswith(JSONL_SUFFIXES) for path in raw)  # a directory may hold some
    for name, read in (("source_depth", directories), ("all_files", directories), ("text_field", jsonl),
                       ("source_field", jsonl)):  # fmt: skip
        if not read and getattr(config, name) not in (None, False):
            what = "a directory" if name in ("source_depth", "all_files") else "a JSONL file"
            refuse_unused(config, name, f"no raw-text input is {what}", "drop it", progress.note)


def _unused_text_settings(config: Any, progress: Progress) -> None:
    """Raw-text settings where every input is tokenized: refused from their flags, a note from ``USAF_*`` or
    ``--config`` (``USAF_SEQ_LEN``, ``[defaults] seq_len`` are meant for tokenize and train too)."""
    refused = []
    for name in (*TEXT_FLAGS, "all_files"):
        value = getattr(config, name)
        if value is None or value is False:  # not given (a switch: off is its default)
            continue
        source = source_of(config, name)
        if source == flag_name(name):
            refused.append(source)
        else:
            progress.note(f"{source} {value}: a setting of raw-text inputs, unused (every input is tokenized)")
    if refused:
        raise UsafError(
            f"{', '.join(refused)}: settings of raw-text inputs, but every input is already tokenized",
            "drop them, or pass text files/directories or JSONL of text",
        )


def default_tokens(workspace: Path, change, tok_fp: str, progress: Progress) -> tuple[list[Path], list[Path]]:
    """No --data/--held-out: the tokens the change's run trained on (finished or not, or one of its checkpoints, or
    the run a delta was exported from) where they are found, else the newest for this tokenizer."""
    data = run_data(change)
    trained = data.fingerprint if data is not None else None
    try:
        found = pick_latest(
            workspace,
            TokensManifest,
            flag="--data",
            accept=lambda m: m.summary.tokenizer.fingerprint == tok_fp and trained in (None, m.fingerprint),
            wanted=" the run trained on" if trained else " made with this model's tokenizer",
        )
    except UsafError:  # not in the workspace: where the run read them, a JSONL file too (refused; found in review)
        training = training_tokens(change, workspace)[0] if data is not None else None
        if training is None:
            raise
        return _the_run_tokens(training.path, progress)
    if change is not None and data is None:
        progress.note(f"--checkpoint {change.source} records no training data (a delta whose run is not where it "
                      "was exported from): the tokens below are the newest for this tokenizer, not known to be what "
                      "it trained on")  # fmt: skip
    return _split_of(found.path, found.manifest.summary.heldout_sequences, progress, base_only=change is None)


def _the_run_tokens(train_file: Path, progress: Progress) -> tuple[list[Path], list[Path]]:
    """The tokens the run trained on (``train_file``): their directory with its held-out split, or the JSONL file it
    was given alone."""
    directory = train_file.parent
    if train_file.name == TRAIN_FILE and manifest_kind(directory) == TokensManifest.KIND:
        manifest = load_verified(directory, TokensManifest, flag="--data", hashes=False)
        return _split_of(directory, manifest.summary.heldout_sequences, progress)
    progress.note(f"using {train_file}, the JSONL the run trained on, as --data; it has no held-out split, so this "
                  "measures the fit to the training text, not generalization (pass --held-out for one)")  # fmt: skip
    return [train_file], []


def _split_of(
    tokens: Path, heldout_sequences: int, progress: Progress, *, base_only: bool = False
) -> tuple[list[Path], list[Path]]:
    """``tokens`` as --data, and as --held-out where they have a held-out split; said. ``base_only``: no run is
    evaluated, so no fit to its training text to warn of (it was warned of; found in review)."""
    if heldout_sequences:
        progress.note(f"using the tokens {tokens} (train.jsonl as --data, heldout.jsonl as --held-out)")
        return [tokens], [tokens]
    if base_only:
        progress.note(f"using the tokens {tokens} (train.jsonl as --data; they have no held-out split)")
        return [tokens], []
    progress.note(
        f"using the tokens {tokens} (train.jsonl as --data); they have no held-out split, so this measures the "
        "fit to the training text, not generalization (tokenize with --held-out or --held-out-frac for one)"
    )
    return [tokens], []
