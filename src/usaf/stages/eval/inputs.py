"""What ``usaf eval`` evaluates: sequences from tokens artifacts, tokens JSONL, or raw text tokenized on the fly.

Each ``--data`` / ``--held-out`` path becomes a list of :class:`EvalSequence` tagged with its set and
source. A tokens directory gives its ``train.jsonl`` for ``--data`` and its ``heldout.jsonl`` for
``--held-out``; a JSONL file whose first line has ``input_ids`` is read as tokens; anything else (text
files, directories, JSONL of text or chat) goes through ``usaf tokenize``'s own discovery, sources and
packing (``usaf.stages.tokenize.pack_corpus``), so held-out text is cut the way training text was.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from usaf.artifacts import TokensManifest, load_verified
from usaf.artifacts.hashing import sha256_file
from usaf.artifacts.loader import holds_artifacts
from usaf.artifacts.tokens import HELDOUT_FILE, TRAIN_FILE, check_tokenizer, check_tokens_file
from usaf.data.corpus import JSONL_SUFFIXES, discover
from usaf.data.jsonl import iter_jsonl_objects
from usaf.data.packing import IGNORE_INDEX
from usaf.data.tokens import iter_token_file
from usaf.errors import UsafError
from usaf.stages.progress import Progress
from usaf.stages.tokenize import (
    TokenizeConfig,
    pack_corpus,
    report_json_read_as_text,
    report_skipped_by_default,
    report_skipped_files,
    skipped_note,
)

DATA, HELD_OUT = "data", "held-out"  # the two sets, named after their flags
FLAGS = {DATA: "--data", HELD_OUT: "--held-out"}


@dataclass(frozen=True)
class EvalSequence:
    set: str
    source: str
    input_ids: list[int]
    labels: list[int]  # unshifted (Hugging Face convention); -100 = not scored

    @property
    def scored(self) -> int:
        """Tokens with a loss: label positions 1.. (position 0 predicts nothing) not -100."""
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


@dataclass(frozen=True)
class EvalInput:
    set: str
    path: Path
    kind: str  # "tokens" (artifact), "tokens-jsonl", "text"
    fingerprint: str
    sequences: list[EvalSequence]
    sampled_from: int | None = None  # the sequences the input holds, where a sample of them is evaluated

    @property
    def flag(self) -> str:
        return FLAGS[self.set]


@dataclass(frozen=True)
class TextSettings:
    """How raw text is packed: ``usaf tokenize``'s settings of the same names."""

    model: str
    seq_len: int
    source_depth: int
    text_field: str
    source_field: str
    all_files: bool = False  # directories: read what they skip by default too (usaf.data.ignore)
    given: dict[str, str] = field(default_factory=dict)  # the JSONL settings set: name -> where (for tokenize's notes)


def _is_usaf_artifact(directory: Path) -> bool:
    """A directory with usaf's ``manifest.json`` (or a damaged one, which loading names); a web app's or a browser
    extension's own ``manifest.json`` makes its directory text to read, as usaf tokenize reads it."""
    try:
        data = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True
    return not isinstance(data, dict) or "usaf_version" in data or "kind" in data


def read_input(
    path: Path,
    set_name: str,
    *,
    tokenizer: Any,
    tokenizer_fingerprint: str,
    context: int | None,
    text: TextSettings,
    max_sequences: int | None,
    seed: int,
    progress: Progress,
    sampled_by: str = "--max-sequences",
    named: str | None = None,
) -> EvalInput:
    """One ``--data``/``--held-out`` path as sequences, validated (vocabulary, length, non-empty): all of them, or a
    seeded sample of ``max_sequences`` (``sampled_by``: what asked for it, for the messages; ``named``: where the
    path was set, a ``--config`` table or ``USAF_*``, where not on the command line)."""
    flag = named or FLAGS[set_name]
    if not path.exists():
        raise UsafError(f"{flag} {path}: no such file or directory", "pass a tokens directory, JSONL or text files")
    vocab = len(tokenizer)
    if path.is_dir() and _is_usaf_artifact(path):
        manifest = load_verified(path, TokensManifest, flag=flag)
        check_tokenizer(path, manifest, tokenizer_fingerprint, flag=flag)
        file = path / (TRAIN_FILE if set_name == DATA else HELDOUT_FILE)
        lines = _token_lines(file, set_name, vocab, context)
        kind, fingerprint = "tokens", manifest.fingerprint
    elif path.is_file() and _is_tokens_jsonl(path):
        check_tokens_file(path, tokenizer_fingerprint, flag=flag)
        lines = _token_lines(path, set_name, vocab, context)
        kind, fingerprint = "tokens-jsonl", sha256_file(path)
    else:
        lines = iter(_pack_text(path, set_name, tokenizer, text, progress))
        kind, fingerprint = "text", ""
    held = 0
    if max_sequences:
        sequences, held = _sample(lines, max_sequences, seed)
    else:
        sequences = list(lines)
    if not sequences:
        where = file if kind == "tokens" else path
        raise UsafError(
            f"{flag} {where}: holds no sequences",
            "tokenize with --held-out SOURCE for a held-out split" if kind == "tokens" else "pass a non-empty input",
        )
    if not any(s.scored for s in sequences):  # a tokens file has some (its reader checks): not this sample or text
        where = file if kind == "tokens" else path
        which = f"the {len(sequences)} sequences sampled by {sampled_by}" if max_sequences else "its sequences"
        raise UsafError(
            f"{flag} {where}: {which} have no token to score (labels all -100, or 1-token sequences): the report "
            "would be empty",
            "raise --max-sequences or drop it" if max_sequences else "pass text or tokens with scored labels",
        )
    if unscored := sum(1 for s in sequences if not s.scored):  # left out of every row: said (found in review)
        progress.note(f"{flag} {path}: {unscored:,} of its {len(sequences):,} sequences have no token to score "
                      "(labels all -100, or 1 token long): they are in no row of the report")  # fmt: skip
    if kind == "text":  # what was evaluated is the packed text: fingerprint that
        fingerprint = sequences_fingerprint(sequences)
    # absolute: the report names it wherever it is read from (a relative path named nothing there; found in review)
    sampled_from = held if held > len(sequences) else None
    return EvalInput(set_name, Path(os.path.abspath(path)), kind, fingerprint, sequences, sampled_from)


def _is_tokens_jsonl(path: Path) -> bool:
    """A ``.jsonl`` file whose first object holds ``input_ids`` (an empty one counts: it is reported empty)."""
    if not path.name.lower().endswith(JSONL_SUFFIXES):
        return False
    for _, obj, _ in iter_jsonl_objects(path):
        return "input_ids" in obj
    return True


def _token_lines(file: Path, set_name: str, vocab: int, context: int | None) -> Iterator[EvalSequence]:
    for line in iter_token_file(file, vocab_size=vocab, context=context):
        yield EvalSequence(set_name, line.source, line.input_ids, line.labels)


def _pack_text(path: Path, set_name: str, tokenizer: Any, text: TextSettings, progress: Progress) -> list[EvalSequence]:
    flag = FLAGS[set_name]
    corpus = discover([path], include=[], exclude=[], source_depth=text.source_depth, all_files=text.all_files)
    # a workspace's tokens/: its artifacts were skipped as text, and "check the path" said little; refused before
    # the notes, which said "skipped 1 usaf output" of it first (found in review)
    inside = holds_artifacts(path, flag, (TokensManifest.KIND,)) if not corpus.files and path.is_dir() else None
    if inside is not None:
        raise inside
    report_skipped_files(corpus, progress)  # UTF-16 text, pipes, links: said as tokenize says them (review)
    report_skipped_by_default(corpus, progress)
    report_json_read_as_text(corpus, progress)
    if not corpus.files:
        raise UsafError(f"{flag} {path}: no text or JSONL files{skipped_note(corpus)}", "check the path")
    config = TokenizeConfig(
        inputs=[path],
        model=text.model,
        seq_len=text.seq_len,
        source_depth=text.source_depth,
        text_field=text.text_field,
        source_field=text.source_field,
        decode_errors="replace",  # eval reports on what it can read; one odd byte should not stop it
    )
    config._sources = dict(text.given)  # a --text-field/--source-field no line has is said, as tokenize says it
    return [
        EvalSequence(set_name, s.source, s.input_ids, s.labels)
        for s in pack_corpus(corpus, config, tokenizer, progress)
    ]


def _sample(items: Iterable[EvalSequence], count: int, seed: int) -> tuple[list[EvalSequence], int]:
    """``count`` items uniformly at random in one pass (reservoir), kept in input order; and how many there were."""
    rng = random.Random(seed)
    reservoir: list[tuple[int, EvalSequence]] = []
    seen = 0
    for seen, item in enumerate(items, start=1):
        if len(reservoir) < count:
            reservoir.append((seen, item))
        elif (j := rng.randrange(seen)) < count:
            reservoir[j] = (seen, item)
    return [item for _, item in sorted(reservoir, key=lambda pair: pair[0])], seen


def sequences_fingerprint(sequences: Iterable[EvalSequence]) -> str:
    """sha256 over what is evaluated: each sequence's set, source, ids and labels, in order."""
    digest = hashlib.sha256()
    for s in sequences:
        digest.update(json.dumps([s.set, s.source, s.input_ids, s.labels], separators=(",", ":")).encode())
        digest.update(b"\n")
    return digest.hexdigest()
