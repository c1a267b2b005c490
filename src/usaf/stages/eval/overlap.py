"""Held-out sequences that the evaluated run trained on: counted and said, so a "held-out" number is honest.

A user who trained on ``usaf tokenize my-repo`` and then runs ``usaf eval --held-out my-repo`` gets sequences
packed exactly as in training (the same packer, the same default length and sources): the report's held-out
perplexity would then measure the fit to the training text and read as generalization. Eval looks for the
run's training tokens (a finished run's manifest names them and their fingerprint, an unfinished run's
``run-settings.json`` records both) and counts the held-out
sequences found there verbatim (the same token ids). Text packed differently (another ``--seq-len``) is not
found this way; the count is a floor, and said to be one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from usaf.artifacts import DeltaManifest, RunManifest, TokensManifest, find_artifacts, load_verified
from usaf.artifacts.hashing import sha256_file
from usaf.artifacts.loader import read_manifest_json
from usaf.artifacts.manifest import MANIFEST_NAME
from usaf.artifacts.run import SETTINGS_FILE, load_trained_change
from usaf.artifacts.tokens import TRAIN_FILE
from usaf.data.seen import TrainingTokens, sequence_digest, training_digests
from usaf.errors import UsafError
from usaf.stages.eval.inputs import HELD_OUT, EvalInput
from usaf.stages.progress import Progress


@dataclass(frozen=True)
class Overlap:
    """Held-out sequences found in the run's training tokens (``training``), in all and per held-out input."""

    training: Path
    found: int
    held_out: int
    per_input: dict[str, int]  # held-out input path -> its sequences found


@dataclass(frozen=True)
class RunData:
    """What the run that made a change trained on, as it recorded it."""

    run_dir: Path
    fingerprint: str  # a tokens directory's manifest fingerprint, or a tokens JSONL's sha256
    paths: list[Path]  # where it read them, where recorded (--data as given, or the train.jsonl it found)


def run_data(change) -> RunData | None:
    """The training data of the run behind ``change``: a finished run's manifest names it, an unfinished run's (or a
    checkpoint's of either) ``run-settings.json`` records its fingerprint and ``--data``; a delta's, the run it was
    exported from, where that is still there as it was. None otherwise (or no change)."""
    if change is None:
        return None
    return _run_data_at(change.source, follow_delta=True)


def _run_data_at(source: Path, *, follow_delta: bool) -> RunData | None:
    for run_dir in (source, source.parent.parent):  # the run itself, or one of its checkpoints/step-N
        if (run_dir / MANIFEST_NAME).is_file():
            if read_manifest_json(run_dir, flag="--checkpoint").get("kind") != RunManifest.KIND:  # a delta
                run = _exported_from(run_dir) if follow_delta and run_dir == source else None
                return None if run is None else _run_data_at(run, follow_delta=False)
            manifest = load_verified(run_dir, RunManifest, flag="--checkpoint", hashes=False)
            recorded = [Path(i.path) for i in manifest.inputs if i.role == "data"]
            return RunData(run_dir, manifest.summary.data_fingerprint, recorded)
        try:
            record = json.loads((run_dir / SETTINGS_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or not isinstance(record.get("data_fingerprint"), str):
            continue
        given = record.get("data")
        return RunData(run_dir, record["data_fingerprint"], [Path(given)] if isinstance(given, str) else [])
    return None


def _exported_from(delta: Path) -> Path | None:
    """The run (or checkpoint) a delta was exported from, where it still holds the same change; else None. A delta
    records no training data of its own: its held-out check was skipped in silence (found in review)."""
    try:
        manifest = load_verified(delta, DeltaManifest, flag="--checkpoint", hashes=False)
    except UsafError:
        return None
    for record in manifest.inputs:
        source = Path(record.path)
        if record.role != "change" or not source.is_dir():
            continue
        try:
            if load_trained_change(source).fingerprint == record.fingerprint:
                return source
        except UsafError:  # gone, damaged, or something else now
            return None
    return None


def training_tokens(change, workspace: Path) -> tuple[TrainingTokens | None, str | None]:
    """``(the run's training tokens, None)``, or ``(None, why not)``; ``(None, None)`` where there is no change."""
    if change is None:
        return None, None
    data = run_data(change)
    if data is None:
        if (change.source / MANIFEST_NAME).is_file():  # a delta: where a run's manifest is, its data is recorded
            return None, (f"the delta {change.source} records no training data, and the run it was exported from is "
                          "not where it was, holding the same change")  # fmt: skip
        return None, f"{change.source} records no training data (no run-settings.json)"
    wanted, recorded = data.fingerprint, data.paths
    for path in recorded:  # where it ran: a tokens directory (given, or the one whose train.jsonl it found)
        for directory in (path, path.parent):
            if (found := _tokens_at(directory, wanted)) is not None:
                return found, None
    for path in recorded:  # a JSONL file given as --data, fingerprinted by its bytes (a tokens directory's file too)
        if path.is_file() and sha256_file(path) == wanted:
            return TrainingTokens(path, None), None
    for found_tokens in find_artifacts(workspace, TokensManifest):  # searched only when the recorded places fail
        if (found := _tokens_at(found_tokens.path, wanted)) is not None:
            return found, None
    return None, f"the tokens it trained on (fingerprint {wanted[:16]}) are not in the workspace or where it ran"


def _tokens_at(directory: Path, fingerprint: str) -> TrainingTokens | None:
    """``directory``'s train.jsonl where it is a tokens artifact of that fingerprint."""
    if not (directory / MANIFEST_NAME).is_file() or not (directory / TRAIN_FILE).is_file():
        return None
    try:
        tokens = load_verified(directory, TokensManifest, flag="--checkpoint", hashes=False)
    except UsafError:
        return None
    return (
        TrainingTokens(directory / TRAIN_FILE, tokens.summary.train_sequences)
        if tokens.fingerprint == fingerprint
        else None
    )


def held_out_overlap(
    inputs: list[EvalInput], training: TrainingTokens, *, vocab_size: int, context: int | None, progress: Progress
) -> Overlap:
    """Count the held-out inputs' sequences whose token ids are a line of the ``training`` tokens."""
    wanted: dict[bytes, list[str]] = {}
    held = [item for item in inputs if item.set == HELD_OUT]
    for item in held:
        for sequence in item.sequences:
            wanted.setdefault(sequence_digest(sequence.input_ids), []).append(str(item.path))
    per_input = {str(item.path): 0 for item in held}
    for digest in training_digests(training, vocab_size, context, progress):
        for path in wanted.pop(digest, []):  # popped: each held-out sequence counts once
            per_input[path] += 1
    return Overlap(training.path, sum(per_input.values()), sum(len(item.sequences) for item in held), per_input)


def overlap_note(overlap: Overlap, packed_here: list[Path] | None = None) -> str | None:
    """The warning for the report and the console when held-out sequences overlap; where none does but eval packed
    some held-out text itself (``packed_here``), what the 0 means: a source the run trained on, given as text, packed
    at another length, read as "0 in training" with no word (found in review). Otherwise None."""
    if not overlap.found:
        if not packed_here:
            return None
        return (f"0 of the {overlap.held_out:,} held-out sequences are in the run's training data ({overlap.training})"
                f"; the text eval packed itself ({', '.join(map(str, packed_here))}) is found there only where it was "
                "packed as the training tokens were (their --seq-len and sources): text the run trained on, packed "
                "otherwise, is not found")  # fmt: skip
    inputs = ", ".join(f"{path}: {n:,}" for path, n in overlap.per_input.items() if n)
    return (
        f"{overlap.found:,} of the {overlap.held_out:,} held-out sequences ({inputs}) are in the run's training data "
        f"({overlap.training}): for them the held-out perplexity measures the fit to the training text, not "
        "generalization (hold sources out at tokenize: --held-out, --held-out-frac; the same text in several "
        "sources, a shared header or licence, is on both sides of any split: deduplicate it)"
    )
