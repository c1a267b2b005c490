"""``usaf tokenize``: corpus -> packed token sequences, held out by source.

Streams: documents are read one at a time and tokenized in batches of about ``BATCH_BYTES`` of
text (a long one in pieces whose tokens are the whole's: :mod:`usaf.data.cuts`), sequences are
written as soon as they are full, so memory does not grow with the corpus
(it grows with the number of sources open at once: one for directory inputs, whose files are
walked source by source; all of a JSONL corpus's sources, at most one sequence each).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from functools import partial
from pathlib import Path
from typing import Any, Literal

from usaf.artifacts import ArtifactWriter, InputRecord, current_environment, default_output, settings_workspace
from usaf.artifacts.hashing import combine, sha256_file
from usaf.artifacts.tokens import (
    HELDOUT_FILE,
    TRAIN_FILE,
    SourceCount,
    TokensManifest,
    TokensSummary,
    check_tokens_file,
)
from usaf.config import refuse_unused, source_of, was_given
from usaf.data.chat import label_chat
from usaf.data.corpus import Corpus, Document, discover, iter_documents, name_text
from usaf.data.cuts import BYTES_PER_BYTE, LONG_PIECE_CHARS, can_cut, cut_points, special_ends
from usaf.data.globs import nfc
from usaf.data.ignore import ENVIRONMENT, GITIGNORE, HIDDEN
from usaf.data.jsonl import dumps_sequence, iter_jsonl_objects
from usaf.data.packing import Sequence, SourcePacker
from usaf.data.tokenizer import load_tokenizer, max_sequence_length, tokenizer_fingerprint, tokenizer_record
from usaf.data.tokens import (
    MIN_SHIFT_EVIDENCE,
    check_token_values,
    file_looks_shifted,
    scored_targets,
    shift_evidence,
    unshift_labels,
)
from usaf.errors import UsafError
from usaf.settings.tokenize import TokenizeConfig
from usaf.stages.progress import NullProgress, Progress
from usaf.units import counted, first_few, human_bytes

BATCH_BYTES = 1 << 20  # text per encode_batch call: large enough to keep the Rust threads busy


@dataclass
class _Counts:
    split: Literal["train", "heldout"]
    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    targets: int = 0  # positions with a loss (labels 1.. not -100): what train learns from, eval scores
    untrained: int = 0  # sequences left out for having no target (a chat's prompt longer than --seq-len)


@dataclass
class _Totals:
    per_source: dict[str, _Counts] = field(default_factory=dict)
    documents: int = 0
    input_bytes: int = 0
    skipped_empty: int = 0
    relabelled: int = 0
    undecided_shift: int = 0  # pre-tokenized lines too short to tell whether pre-shifted, in files no longer
    undecodable: list[Path] = field(default_factory=list)  # text files not UTF-8, skipped or replaced (--decode-errors)
    uncut: list[tuple[str, int, str]] = field(default_factory=list)  # (document, bytes, why): a long piece, uncut
    other_roles: dict[str, list[str]] = field(default_factory=dict)  # a chat role no reply has -> lines with it
    # (field read, fields not read) -> lines holding both: 'messages' and 'text' on one line, say
    unread_fields: dict[tuple[str, tuple[str, ...]], list[str]] = field(default_factory=dict)


def _collect_sources(corpus: Corpus, config: TokenizeConfig, progress: Progress) -> list[str]:
    """Every source of the corpus (reads JSONL files once; text files' sources are known)."""
    sources = set()
    own: list[str] = []  # lines of JSONL files under a directory input that name a source of their own
    for file in corpus.files:
        if file.kind == "text":
            sources.add(file.source)
            continue
        for number, obj, _ in iter_jsonl_objects(file.path):
            value = obj.get(config.source_field, obj.get("repo", file.source))
            source = value if isinstance(value, str) else file.source
            sources.add(source)
            if file.walked and source != file.source:
                own.append(f"{file.path}:{number} is {source}")
    if own:  # held out, a directory's own source does not take them: said, not left to leak (found in review)
        progress.note(f"{counted(len(own), 'line')} of JSONL files under the directory inputs name a source of their "
                      f"own ('{config.source_field}' or 'repo'), held out or trained by it, not by their directory's "
                      f"(e.g. {own[0]}); --exclude the files to leave them out")  # fmt: skip
    return sorted(sources)


def _names(source: str, pattern: str) -> bool:
    """Whether ``--held-out pattern`` names ``source``: as a glob, or as the name itself (``app[1]``, a glob's class
    otherwise), at its end or whole; in Unicode NFC both (a name copied from macOS is NFD). Both were "matches no
    source" of a name listed in the message (found in review)."""
    source, pattern = nfc(source), nfc(pattern)
    return (source == pattern or source.endswith("/" + pattern) or fnmatch(source, pattern)
            or fnmatch(source, "*/" + pattern))  # fmt: skip


def select_heldout(
    sources: list[str],
    patterns: list[str],
    frac: float,
    seed: int,
    *,
    named: tuple[str, str] = ("--held-out", "--held-out-frac"),
) -> set[str]:
    """Held-out sources: those matching ``patterns``, or a seeded ``frac`` of them, never all. ``named``: where each
    of the two was set (a flag, ``USAF_*``, a ``--config`` table), for the messages."""
    patterns_at, frac_at = named
    if patterns:
        chosen = set()
        for pattern in patterns:
            hits = {s for s in sources if _names(s, pattern)}
            if not hits:
                shown = ", ".join(sources[:12]) + (" ..." if len(sources) > 12 else "")
                raise UsafError(f"{patterns_at} {pattern}: matches no source (sources: {shown})", "fix the pattern")
            chosen |= hits
    elif frac > 0:
        if len(sources) < 2:
            raise UsafError(
                f"{frac_at} {frac}: the corpus has only {len(sources)} source; nothing left to hold out",
                # one big file: --source-depth, which the hint offered alone, is refused for a file (found in review)
                "sources are held out whole: split a single file into several (a file given by name is one source), "
                "add sources, or for a directory raise --source-depth so that its files or subdirectories form "
                "separate sources",
            )
        count = min(len(sources) - 1, max(1, round(frac * len(sources))))
        ranked = sorted(sources, key=lambda s: hashlib.sha256(f"{seed}:{s}".encode()).hexdigest())
        chosen = set(ranked[:count])
    else:
        return set()
    if len(chosen) == len(sources):
        raise UsafError(f"{patterns_at if patterns else frac_at}: every source would be held out, leaving nothing to "
                        "train on", "hold out fewer")  # fmt: skip
    return chosen


def _text_batches(docs: Iterator[Document]) -> Iterator[list[Document]]:
    """Group consecutive plain-text documents (up to BATCH_BYTES), text files' apart from JSONL text fields' (their
    special tokens are read apart: :class:`_Tokenizer`); other documents go alone."""
    batch: list[Document] = []
    size = 0
    for doc in docs:
        if batch and (doc.text is None or batch[-1].from_jsonl != doc.from_jsonl):
            yield batch
            batch, size = [], 0
        if doc.text is None:
            yield [doc]
            continue
        batch.append(doc)
        size += doc.nbytes
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class _Tokenizer:
    """Turns documents into (ids, labels) pairs: text with EOS separators, chat, or pre-tokenized.

    A text file's ``<|endoftext|>`` or ``<|im_start|>`` is its text: code about language models holds such strings,
    and read as the special tokens they put an EOS mid-document and fake chat turns into the training text (found in
    review). So text files are encoded by a copy of the tokenizer that reads special tokens' strings as text
    (``encode_special_tokens``; a copy, as chat conversations are encoded meanwhile by the tokenizer itself). A JSONL
    text field keeps them special: it is where pre-rendered chat text goes, its markers meant.
    """

    def __init__(self, tokenizer: Any, config: TokenizeConfig, totals: _Totals) -> None:
        from tokenizers import Tokenizer  # lazy: comes with transformers

        self.hf = tokenizer
        self.fast = tokenizer.backend_tokenizer
        self.literal = Tokenizer.from_str(self.fast.to_str())  # special tokens' strings as text
        self.literal.encode_special_tokens = True
        self.eos = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)
        self.config = config
        self.totals = totals
        self.shifted_files: dict[str, bool | None] = {}  # pre-tokenized file -> pre-shifted (None: cannot tell)
        # the ids its post-processor adds around a text (a BOS): a text is encoded without them, in pieces if long
        self.ends = {jsonl: special_ends(partial(self._ids, jsonl)) for jsonl in (False, True)}
        self.cuttable = {jsonl: self.ends[jsonl] is not None and can_cut(partial(self._ids, jsonl, special=False))
                         for jsonl in (False, True)}  # fmt: skip
        self._tail: int | None = None  # the last id of the text being encoded, over its pieces

    def _encoder(self, from_jsonl: bool) -> Any:
        return self.fast if from_jsonl else self.literal

    def _ids(self, from_jsonl: bool, text: str, special: bool) -> list[int]:
        return self._encoder(from_jsonl).encode(text, add_special_tokens=special).ids

    def in_pieces(self, docs: Iterator[Document]) -> Iterator[Document]:
        """The documents, each long text cut where its tokens stay the same (:mod:`usaf.data.cuts`)."""
        for doc in docs:
            if doc.text is not None and doc.text.isspace():  # skipped as empty: not encoded, whole or cut (review)
                yield replace(doc, text="")
                continue
            cuttable = doc.text is not None and self.cuttable[doc.from_jsonl]
            cuts = cut_points(doc.text, partial(self._ids, doc.from_jsonl, special=False)) if cuttable else []
            self._record_if_long(doc, cuts)
            if not cuts:  # none for a text under two pieces
                yield doc
                continue
            bounds = [0, *cuts, len(doc.text)]
            for i, (start, end) in enumerate(itertools.pairwise(bounds)):
                nbytes = doc.nbytes * end // len(doc.text) - doc.nbytes * start // len(doc.text)  # sums to the file's
                yield replace(doc, text=doc.text[start:end], nbytes=nbytes, first=i == 0, last=end == len(doc.text))

    def _record_if_long(self, doc: Document, cuts: list[int]) -> None:
        """A text or conversation encoded at once that is long enough to take much memory, for the note at the end
        (:func:`_note_uncut`): what the run's memory went to."""
        if doc.messages is not None:  # a long one took 2 GB in silence (found in review)
            longest, why = doc.nbytes, "a chat conversation is encoded whole (its labels follow its turns)"
        elif doc.text:
            chars = max(b - a for a, b in itertools.pairwise([0, *cuts, len(doc.text)]))
            longest = doc.nbytes * chars // len(doc.text)
            why = ("no place near its pieces' ends could be cut keeping the tokenizer's tokens"
                   if self.cuttable[doc.from_jsonl] else
                   "its tokenizer adds more than a start and an end to a text, which usaf does not cut"
                   if self.ends[doc.from_jsonl] is None else
                   "its tokenizer changes the start of every text it encodes, so no text of it is cut")  # fmt: skip
        else:
            return
        if longest > LONG_PIECE_CHARS:
            self.totals.uncut.append((doc.origin, longest, why))

    def encode_texts(self, batch: list[Document]) -> list[Any] | None:
        """The slow part, run on a worker thread (the Rust tokenizer releases the GIL)."""
        if batch[0].text is None:
            return None
        special = self.ends[batch[0].from_jsonl] is None  # ends unknown: the tokenizer adds them; the text is whole
        return self._encoder(batch[0].from_jsonl).encode_batch([d.text for d in batch], add_special_tokens=special)

    def pairs(
        self, batch: list[Document], encodings: list[Any] | None
    ) -> Iterator[tuple[Document, list[int], list[int], bool]]:
        """``(document, input_ids, labels, first)`` for each non-empty document of the batch, and each piece of a long
        text that has ids (``first``: the document's first ids)."""
        if encodings is not None:
            before, after = self.ends[batch[0].from_jsonl] or ([], [])
            for doc, enc in zip(batch, encodings):
                if doc.first:
                    self._tail = None
                    if doc.last and (not doc.text or doc.text.isspace()):  # whitespace alone: not a document
                        self.totals.skipped_empty += 1
                        continue
                ids = [*before, *enc.ids] if doc.first and before else enc.ids
                if doc.last:
                    ids.extend(after)
                first = self._tail is None
                self._tail = ids[-1] if ids else self._tail  # a piece may have none (whitespace a pre-tokenizer drops)
                if doc.last and self._tail is None:  # no ids in all of it
                    self.totals.skipped_empty += 1
                    continue
                if doc.last and self._tail != self.eos:
                    ids.append(self.eos)  # document separator; learning to end a document is intended
                if ids:
                    yield doc, ids, ids, first
            return
        doc = batch[0]
        if doc.messages is not None:
            ids, labels = label_chat(self.hf, doc.messages, doc.origin)
            yield doc, [*ids, self.eos], [*labels, -100], True
            return
        yield doc, *self._pretokenized(doc), True

    def _pretokenized(self, doc: Document) -> tuple[list[int], list[int]]:
        ids, labels = doc.input_ids, doc.labels
        check_token_values(doc.origin, ids, labels, vocab_size=self.vocab_size)  # what train/score/eval will check
        if len(ids) > self.config.seq_len:
            seq_len = source_of(self.config, "seq_len")
            raise UsafError(
                f"{doc.origin}: pre-tokenized line of {len(ids)} tokens exceeds {seq_len} {self.config.seq_len}",
                f"raise {seq_len} (up to the model's maximum), split the line into pieces that fit, or give the "
                "text instead so usaf packs it",  # "raise --seq-len" past the model's maximum was refused (review)
            )
        # labels that are the ids (none given, or copied) are the unshifted form: nothing to tell ("too short to tell
        # whether the labels are pre-shifted" was said of lines without labels; found in review)
        verdict = False if labels == ids else shift_evidence(ids, labels)
        if verdict is None:  # too short to tell: as its file's other lines are (left shifted in silence; review)
            file = doc.origin.rsplit(":", 1)[0]
            if file not in self.shifted_files:
                self.shifted_files[file] = file_looks_shifted(Path(file))
            verdict = self.shifted_files[file]
            if verdict is None:  # a file of a few scored positions in all: said at the end, not guessed
                self.totals.undecided_shift += 1
        if verdict:
            if not self.config.fix_shifted_labels:
                raise UsafError(
                    f"{doc.origin}: labels are pre-shifted (labels[i] == input_ids[i+1]); a Hugging Face model "
                    "shifts again and would learn to predict the token after next",
                    "pass --fix-shifted-labels to unshift them",
                )
            labels = unshift_labels(labels)
            self.totals.relabelled += 1
        return ids, labels


def skipped_note(corpus: Corpus) -> str:
    """`` (3 binary files, 2 symbolic links (--no-follow-symlinks) skipped)``, or "" when nothing was skipped."""
    parts = []
    if corpus.skipped_binary:
        parts.append(counted(len(corpus.skipped_binary), "binary file"))
    if corpus.skipped_wide:
        parts.append(counted(len(corpus.skipped_wide), "UTF-16/UTF-32 text file") + " (convert to UTF-8)")
    if corpus.skipped_special:
        parts.append(counted(len(corpus.skipped_special), "special file") + " (pipe, socket or device)")
    if corpus.skipped_links:
        parts.append(counted(len(corpus.skipped_links), "symbolic link") + " (--no-follow-symlinks)")
    if corpus.broken_links:
        parts.append(counted(len(corpus.broken_links), "broken symbolic link"))
    if corpus.skipped_usaf:
        parts.append(counted(len(corpus.skipped_usaf), "usaf output"))
    if corpus.skipped_default:
        skipped = sum(len(paths) for paths in corpus.skipped_default.values())
        parts.append(counted(skipped, "hidden, environment or git-ignored path") + " (--all-files reads them)")
    said = [f"{', '.join(parts)} skipped"] if parts else []
    if corpus.filtered_out:
        said.append(f"{counted(len(corpus.filtered_out), 'file')} left out by --include/--exclude")
    return f" ({'; '.join(said)})" if said else ""


def report_skipped_files(corpus: Corpus, progress: Progress) -> None:
    """Say what under a directory input was not read (links not followed or broken, special files, UTF-16 text): a
    directory of them skipped in silence looks like an empty corpus. tokenize and eval's raw-text inputs say it."""
    if corpus.skipped_links:
        progress.note(
            f"{counted(len(corpus.skipped_links), 'symbolic link')} not followed (--no-follow-symlinks), e.g. "
            f"{corpus.skipped_links[0]}; drop the flag to read them"
        )
    if corpus.broken_links:
        broken = counted(len(corpus.broken_links), "broken symbolic link")
        progress.note(f"{broken} skipped, e.g. {corpus.broken_links[0]}")
    if corpus.skipped_special:
        special = counted(len(corpus.skipped_special), "special file")
        progress.note(f"{special} (pipe, socket or device) skipped, e.g. {corpus.skipped_special[0]}")
    if corpus.repeated_inputs:
        progress.note(f"{counted(len(corpus.repeated_inputs), 'input')} already given by an earlier input, read once: "
                      f"{first_few(corpus.repeated_inputs)}")  # fmt: skip
    if corpus.skipped_wide:  # the user's text, not a binary: named, with the way to read it
        wide = counted(len(corpus.skipped_wide), "UTF-16 or UTF-32 text file")
        progress.note(f"{wide} skipped, e.g. {corpus.skipped_wide[0]}: usaf reads UTF-8; convert them (iconv -t UTF-8)")


_REASONS = {HIDDEN: "hidden", ENVIRONMENT: "environment", GITIGNORE: "ignored by git"}


def report_json_read_as_text(corpus: Corpus, progress: Progress) -> None:
    """A ``.json`` file given by name is plain text to usaf: a ``data.json`` of JSON Lines trained on its JSON syntax
    in silence (found in review). Said, with the rename that reads its records. Under a directory a ``.json`` is a
    project's file (package.json), read as its text without a word."""
    named = [file.path for file in corpus.files if not file.walked and file.path.suffix.lower() == ".json"]
    if named:
        progress.note(f"{first_few(named)}: a .json file is read as plain text, JSON syntax and all; records (text, "
                      "messages, input_ids) are read from JSON Lines files: name it .jsonl if it holds one object a "
                      "line")  # fmt: skip


def report_skipped_by_default(corpus: Corpus, progress: Progress) -> None:
    """Say what the walk left out by default and how to read it (a repository's .venv read as the user's code
    would dwarf it; left out in silence, a file the user wanted would look lost), and usaf's own outputs."""
    if corpus.skipped_usaf:
        progress.note(f"skipped {counted(len(corpus.skipped_usaf), 'usaf output')} under the directory inputs "
                      f"({first_few(corpus.skipped_usaf)}): usaf's tokens, models, plans and runs are never read as "
                      "text")  # fmt: skip
    if not corpus.skipped_default:
        return
    parts = []
    for reason, label in _REASONS.items():
        paths = corpus.skipped_default.get(reason, [])
        if paths:
            parts.append(f"{len(paths)} {label} ({first_few(p.name for p in paths)})")
    progress.note(f"skipped under the directory inputs: {'; '.join(parts)}; --all-files reads them")


def _note_uneven_heldout(config: TokenizeConfig, summary: TokensSummary, progress: Progress) -> None:
    """``--held-out-frac`` holds out a fraction of the *sources*: where sources differ in size the tokens held out
    can be far from it (a repository's root at depth 1 held out a 49-token MANIFEST.in for 0.1). Say so."""
    if not config.held_out_frac:
        return
    share = summary.heldout_tokens / max(summary.train_tokens + summary.heldout_tokens, 1)
    if config.held_out_frac / 3 <= share <= 3 * config.held_out_frac:
        return
    held = sum(1 for c in summary.sources if c.split == "heldout")
    deeper = ", or a larger --source-depth" if any(Path(p).is_dir() for p in config.inputs) else ""  # refused else
    # too large because the fraction asks for less than one whole source (too small: a small source drawn)
    if share > config.held_out_frac and held / len(summary.sources) > 3 * config.held_out_frac:
        why = (f"at least one whole source is held out, and one is {100 / len(summary.sources):.2g} % of the "
               f"sources; for a smaller held-out set pass --held-out SOURCE{deeper}, or more sources")
    else:  # the sources' share is near the fraction: their sizes differ (another seed draws others)
        why = (f"the sources differ in size; for a held-out set of about that share pass --held-out SOURCE ..., "
               f"another --seed{deeper}")
    progress.note(
        f"--held-out-frac {config.held_out_frac:g} held out {held} of {len(summary.sources)} sources but "
        f"{100 * share:.2g} % of the tokens ({summary.heldout_tokens:,}): {why}"
    )


def _refuse_nothing_to_score(config: TokenizeConfig, totals: _Totals) -> None:
    """A split of sequences without one position to score is refused: train would run at loss 0 on it, eval
    would report nothing. Sequences without targets among others are left out (:func:`_note_untrained`)."""
    for split in ("train", "heldout"):
        counts = [c for c in totals.per_source.values() if c.split == split]
        if sum(c.sequences + c.untrained for c in counts) and not sum(c.targets for c in counts):
            raise UsafError(
                f"{', '.join(map(str, config.inputs))}: the {split} sequences have no token to learn from or to "
                "score (every label is -100, or every sequence is 1 token long)",
                "give text, chats with assistant turns, or pre-tokenized lines whose labels are not all -100",
            )


def _note_untrained(totals: _Totals, progress: Progress) -> None:
    """Sequences with no target left out, said: they were written, and a training step of them ran at loss 0.0,
    its Adam update moving the weights anyway, and pulled the run's loss means down (found in review)."""
    counts = list(totals.per_source.values())
    if left := sum(c.untrained for c in counts):
        sources = [name for name, c in totals.per_source.items() if c.untrained]
        progress.note(f"{counted(left, 'sequence')} with no token to learn from left out (every label -100: a chat "
                      f"prompt longer than --seq-len, say), of {first_few(sources)}")  # fmt: skip


def _refuse_unused_input_settings(config: TokenizeConfig, corpus: Corpus, progress: Progress) -> None:
    """Settings of directory, text or JSONL inputs given where there are none: accepted and unused (found in
    review)."""
    if not any(path.is_dir() for path in config.inputs):
        refuse_unused(config, "source_depth", "no input is a directory (it names the sources of the files under one)",
                      "drop it: a file given by name is its own source", progress.note)  # fmt: skip
        refuse_unused(config, "all_files", "no input is a directory (it reads what a directory's walk skips)",
                      "drop it: a file given by name is read", progress.note)  # fmt: skip
        refuse_unused(config, "follow_symlinks", "no input is a directory (it decides the links met under one)",
                      "drop it: a file given by name is read, link or not", progress.note)  # fmt: skip
    if not any(file.kind == "text" for file in corpus.files):
        refuse_unused(config, "decode_errors", "no input is a text file (it decides what an undecodable text file "
                      "becomes; JSONL must be UTF-8)", "drop it", progress.note)  # fmt: skip
    if not any(file.kind == "jsonl" for file in corpus.files):
        for field in ("text_field", "source_field"):
            refuse_unused(config, field, "no input is a JSONL file (it names a field of JSONL lines)", "drop it",
                          progress.note)  # fmt: skip


def _corpus_fingerprint(corpus: Corpus) -> str:
    files = enumerate(corpus.files)
    return combine((f"{f.source}|{name_text(f.path.name)}|{i}", sha256_file(f.path)) for i, f in files)


def run(config: TokenizeConfig, *, progress: Progress | None = None) -> tuple[TokensManifest, Path]:
    """Tokenize, pack and split the corpus; returns the manifest and the artifact's path."""
    progress = progress or NullProgress()
    # named where it was set: "--model tm: no such directory" of a --config table's model (found in review)
    tokenizer = load_tokenizer(config.model, trust_remote_code=config.trust_remote_code,
                               flag=source_of(config, "model"))  # fmt: skip
    limit = max_sequence_length(config.model, tokenizer)
    if limit is not None and config.seq_len > limit:
        raise UsafError(f"{source_of(config, 'seq_len')} {config.seq_len} exceeds the model's maximum of {limit} "
                        "tokens", f"lower it to {limit} or less")  # fmt: skip

    corpus = discover(
        config.inputs,
        include=config.include,
        exclude=config.exclude,
        source_depth=config.source_depth,
        follow_symlinks=config.follow_symlinks,
        all_files=config.all_files,
    )
    report_skipped_files(corpus, progress)
    report_skipped_by_default(corpus, progress)
    report_json_read_as_text(corpus, progress)
    if corpus.named_filtered_out:
        filters = " and ".join(f"{source_of(config, name)} {' '.join(getattr(config, name))}"
                               for name in ("include", "exclude") if getattr(config, name))  # fmt: skip
        progress.note(f"{counted(len(corpus.named_filtered_out), 'input')} given by name left out by {filters} "
                      f"({first_few(corpus.named_filtered_out)}): a file named is filtered as the files under a "
                      "directory are")  # fmt: skip
    if corpus.unmatched_patterns:  # a no-op in silence (found in review)
        progress.note(f"{', '.join(corpus.unmatched_patterns)}: matched no file or directory (a pattern with / matches "
                      "from the input's top, or from its name: src/*.py, repo/src/*.py; one without, any name at "
                      "any depth: *.py, tests)")  # fmt: skip
    if not corpus.files:
        raise UsafError(
            f"empty corpus: no text or JSONL files in {', '.join(map(str, config.inputs))}{skipped_note(corpus)}",
            # the filter first: --all-files was offered where --include had left out every file (found in review)
            "check --include/--exclude (a pattern with / matches from the input's top: src/*.py)"
            if corpus.filtered_out
            else "drop --no-follow-symlinks to read the linked files"
            if corpus.skipped_links
            else "pass --all-files to read them"
            if corpus.skipped_default
            else "convert the UTF-16/UTF-32 files to UTF-8 (iconv -t UTF-8)"
            if corpus.skipped_wide
            else "check the paths and --include/--exclude",
        )
    _refuse_unused_input_settings(config, corpus, progress)
    fingerprint = tokenizer_fingerprint(tokenizer)
    for file in corpus.files:  # a tokens artifact's file given by name: its ids are another tokenizer's, or these
        if file.kind == "jsonl":
            check_tokens_file(file.path, fingerprint, flag="INPUTS")
    if not config.held_out_frac:  # the seed draws the held-out fraction, and nothing else
        refuse_unused(config, "seed", "only --held-out-frac draws with it, and none is asked for",
                      "drop --seed, or pass --held-out-frac F", progress.note)  # fmt: skip
    heldout: set[str] = set()
    if config.held_out or config.held_out_frac:
        sources = _collect_sources(corpus, config, progress)
        named = (source_of(config, "held_out"), source_of(config, "held_out_frac"))
        heldout = select_heldout(sources, config.held_out, config.held_out_frac, config.seed, named=named)

    out = config.out or default_output(settings_workspace(config), "tokens", config.inputs[0].resolve().name)
    totals = _Totals()
    inputs = {"INPUTS": config.inputs, "--model": config.model}  # --out may not replace or mix with them
    with ArtifactWriter(out, kinds=(TokensManifest.KIND,), overwrite=config.overwrite, inputs=inputs,
                        defaulted=config.out is None) as art:
        with (
            (art.dir / TRAIN_FILE).open("w", encoding="utf-8") as train,
            (art.dir / HELDOUT_FILE).open("w", encoding="utf-8") as held,
        ):
            writers = {"train": train, "heldout": held}

            def emit(seq: Sequence) -> None:
                counts = totals.per_source[seq.source]
                if not scored_targets(seq.labels):  # trained at loss 0, and counted in the run's loss means (review)
                    counts.untrained += 1
                    return
                counts.sequences += 1
                counts.tokens += len(seq.input_ids)
                counts.loss_tokens += seq.loss_tokens
                counts.targets += scored_targets(seq.labels)
                writers[counts.split].write(dumps_sequence(seq.input_ids, seq.labels, seq.source))

            _tokenize_corpus(corpus, config, tokenizer, heldout, totals, emit, progress)

        _refuse_nothing_to_score(config, totals)
        _note_untrained(totals, progress)
        if totals.documents == 0 or not any(c.sequences for c in totals.per_source.values()):
            raise UsafError(
                f"empty corpus: {counted(len(corpus.files), 'file')} held no text (empty documents: "
                f"{totals.skipped_empty}, "
                f"not UTF-8 and skipped: {_skipped_undecodable(config, totals)})",
                "check the inputs",
            )
        summary = _summary(config, tokenizer, corpus, heldout, totals)
        if summary.train_sequences == 0:
            raise UsafError(
                "no training sequences: every sequence came from a held-out source", "hold out fewer sources"
            )
        if heldout and summary.heldout_sequences == 0:  # asked for, and exit 0 with an empty split (found in review)
            raise UsafError(
                f"no held-out sequences: the held-out sources ({first_few(sorted(heldout))}) hold no text (empty, or "
                "skipped files)",
                "hold out other sources (--held-out NAME), or another --seed for --held-out-frac",
            )
        _note_uneven_heldout(config, summary, progress)
        manifest = art.commit(
            TokensManifest,
            inputs=[
                InputRecord(
                    role="tokenizer",
                    kind="tokenizer",
                    path=config.model,
                    fingerprint=summary.tokenizer.fingerprint,
                ),
                InputRecord(
                    role="corpus",
                    kind="files",
                    path=";".join(str(p.absolute()) for p in config.inputs),  # as usaf's write_manifest records
                    fingerprint=_corpus_fingerprint(corpus),
                ),
            ],
            config=config.model_dump(mode="json"),
            environment=current_environment(seed=config.seed),
            summary=summary,
        )
    return manifest, art.target


# the roles chat templates know; only "assistant" turns are learned from
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _note_other_roles(totals: _Totals, progress: Progress) -> None:
    """Chat roles no template names (ShareGPT's "gpt" and "human", a typo): rendered as the template renders them and
    never learned from, in silence (found in review). Said, with a line holding each."""
    if not totals.other_roles:
        return
    shown = "; ".join(f"'{role}' ({counted(len(lines), 'line')}, e.g. {lines[0]})"
                      for role, lines in sorted(totals.other_roles.items()))  # fmt: skip
    progress.note(f"chat roles other than {', '.join(sorted(CHAT_ROLES))}: {shown}; rendered by the chat template and "
                  "never learned from (only 'assistant' replies are): rename them if they are replies")  # fmt: skip


def _note_uncut(totals: _Totals, progress: Progress) -> None:
    """The longest piece of text encoded at once, where it is long: the memory a run took is explained."""
    if not totals.uncut:
        return
    origin, nbytes, why = max(totals.uncut, key=lambda u: u[1])
    more = f"; {counted(len(totals.uncut) - 1, 'other document')} too" if len(totals.uncut) > 1 else ""
    progress.note(f"{origin}: {human_bytes(nbytes)} of its text encoded at once, as {why} (about "
                  f"{human_bytes(nbytes * BYTES_PER_BYTE)} of memory for its encoding){more}")  # fmt: skip


def _note_unread_fields(totals: _Totals, progress: Progress) -> None:
    """Lines holding two of 'input_ids', 'messages' and the text field are read by the first: said, with which."""
    for (read, unread), origins in totals.unread_fields.items():
        others = " and ".join(f"'{name}'" for name in unread)
        hold = "holds" if len(origins) == 1 else "hold"
        progress.note(f"{counted(len(origins), 'JSONL line')} {hold} both '{read}' and {others}: '{read}' was read, "
                      f"{others} not (e.g. {origins[0]}); remove the field you do not want read")  # fmt: skip


def _skipped_undecodable(config: TokenizeConfig, totals: _Totals) -> int:
    """Text files skipped as not UTF-8 (``--decode-errors skip``; with ``replace`` they are read)."""
    return len(totals.undecodable) if config.decode_errors == "skip" else 0


def pack_corpus(corpus: Corpus, config: TokenizeConfig, tokenizer: Any, progress: Progress) -> list[Sequence]:
    """Tokenize and pack ``corpus`` exactly as :func:`run` does, returning the sequences (no split, no files).

    ``usaf eval`` uses it for raw-text inputs, so text it evaluates is packed like text it trained on.
    """
    sequences: list[Sequence] = []
    _tokenize_corpus(corpus, config, tokenizer, set(), _Totals(), sequences.append, progress)
    return sequences


def _tokenize_corpus(
    corpus: Corpus,
    config: TokenizeConfig,
    tokenizer: Any,
    heldout: set[str],
    totals: _Totals,
    emit: Any,
    progress: Progress,
) -> None:
    encoder = _Tokenizer(tokenizer, config, totals)
    packers: dict[str, SourcePacker] = {}
    tokens_seen = 0
    previous: Document | None = None
    text_seen = False  # a line of text, which --stride packs (pre-tokenized lines are sequences as they are)
    text_field_read = False  # a JSONL line's text, from --text-field (not its input_ids or messages)
    source_field_read = False  # a JSONL line's source, from --source-field

    def process(batch: list[Document], encodings: list[Any] | None) -> None:
        nonlocal tokens_seen, previous, text_seen, text_field_read, source_field_read
        for doc, ids, labels, first in encoder.pairs(batch, encodings):
            # A directory walk visits sources one after another: close the finished one now,
            # so memory holds one source's partial sequence, not every source's.
            if previous is not None and previous.source != doc.source and not previous.from_jsonl:
                finished = packers.pop(previous.source, None)
                for last in finished.close() if finished is not None else []:
                    emit(last)
            previous = doc
            source_field_read |= doc.source_from_field
            if doc.unread_fields:
                read = "input_ids" if doc.input_ids is not None else "messages" if doc.messages else config.text_field
                totals.unread_fields.setdefault((read, doc.unread_fields), []).append(doc.origin)
            for role in {m["role"] for m in doc.messages or ()} - CHAT_ROLES:
                totals.other_roles.setdefault(role, []).append(doc.origin)
            counts = totals.per_source.setdefault(doc.source, _Counts("heldout" if doc.source in heldout else "train"))
            totals.documents += first  # a long text's later pieces are the same document
            counts.documents += first
            if doc.input_ids is not None:  # pre-tokenized lines are sequences already
                emit(Sequence(ids, labels, doc.source))
            else:
                text_seen = True
                text_field_read |= doc.from_jsonl and doc.text is not None
                packer = packers.setdefault(doc.source, SourcePacker(doc.source, config.seq_len, config.stride))
                add = packer.add_whole if doc.messages is not None else packer.add
                for seq in add(ids, labels):
                    emit(seq)
            tokens_seen += len(ids)
        batch_bytes = sum(d.nbytes for d in batch)
        totals.input_bytes += batch_bytes
        progress.advance(batch_bytes, tokens=tokens_seen)

    documents = (
        doc
        for file in corpus.files
        for doc in iter_documents(
            file,
            text_field=config.text_field,
            source_field=config.source_field,
            decode_errors=config.decode_errors,
            on_undecodable=totals.undecodable.append,
        )
    )
    progress.start("tokenizing", corpus.total_bytes, "bytes")
    # Pipeline: the worker encodes batch k+1 while this thread packs and writes batch k.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="usaf-encode") as pool:
        pending: tuple[list[Document], Future] | None = None
        for batch in _text_batches(encoder.in_pieces(documents)):
            future = pool.submit(encoder.encode_texts, batch)
            if pending is not None:
                process(pending[0], pending[1].result())
            pending = (batch, future)
        if pending is not None:
            process(pending[0], pending[1].result())
    for packer in packers.values():
        for last in packer.close():
            emit(last)
    progress.finish()
    _note_uncut(totals, progress)
    _note_other_roles(totals, progress)
    _note_unread_fields(totals, progress)
    if totals.undecodable:  # skipped or replaced as asked, never in silence (eval replaced in silence; review)
        done = ("skipped" if config.decode_errors == "skip" else "read with their undecodable bytes replaced by "
                "U+FFFD") + (f" ({source_of(config, 'decode_errors')} {config.decode_errors})"
                             if was_given(config, "decode_errors") else "")  # fmt: skip
        progress.note(f"{counted(len(totals.undecodable), 'file')} not UTF-8, {done}, e.g. {totals.undecodable[0]}")
    if not text_field_read and was_given(config, "text_field") and any(f.kind == "jsonl" for f in corpus.files):
        progress.note(f"{source_of(config, 'text_field')} {config.text_field}: no JSONL line was read by it (each held "
                      "input_ids or messages)")  # fmt: skip
    if not source_field_read and was_given(config, "source_field") and any(f.kind == "jsonl" for f in corpus.files):
        progress.note(f"{source_of(config, 'source_field')} {config.source_field}: no JSONL line has it; their sources "
                      "are their 'repo' fields or their files' names")  # fmt: skip
    if totals.undecided_shift:
        progress.note(f"{counted(totals.undecided_shift, 'pre-tokenized line')} too short to tell whether the labels "
                      f"are pre-shifted (under {MIN_SHIFT_EVIDENCE} scored positions in the whole file): taken as "
                      "they are; check them, or give their text instead")  # fmt: skip
    elif config.fix_shifted_labels and not totals.relabelled:  # else accepted and doing nothing (found in review)
        progress.note(f"{source_of(config, 'fix_shifted_labels')}: no pre-tokenized line had pre-shifted labels; "
                      "nothing was relabelled")  # fmt: skip
    if not text_seen and totals.documents and was_given(config, "stride"):  # else accepted and doing nothing
        progress.note(f"{source_of(config, 'stride')} {config.stride}: every line was pre-tokenized (input_ids), "
                      "each taken as a sequence as it is; the stride packs text only")  # fmt: skip


def _summary(
    config: TokenizeConfig, tokenizer: Any, corpus: Corpus, heldout: set[str], totals: _Totals
) -> TokensSummary:
    by_split: Counter[str] = Counter()
    sources = []
    for name in sorted(totals.per_source):
        c = totals.per_source[name]
        sources.append(
            SourceCount(
                source=name,
                split=c.split,
                documents=c.documents,
                sequences=c.sequences,
                tokens=c.tokens,
                loss_tokens=c.loss_tokens,
            )
        )
        by_split[f"{c.split}_sequences"] += c.sequences
        by_split[f"{c.split}_tokens"] += c.tokens
        by_split[f"{c.split}_loss_tokens"] += c.loss_tokens
    return TokensSummary(
        tokenizer=tokenizer_record(config.model, tokenizer),
        seq_len=config.seq_len,
        stride=config.stride,
        train_sequences=by_split["train_sequences"],
        heldout_sequences=by_split["heldout_sequences"],
        train_tokens=by_split["train_tokens"],
        heldout_tokens=by_split["heldout_tokens"],
        train_loss_tokens=by_split["train_loss_tokens"],
        heldout_loss_tokens=by_split["heldout_loss_tokens"],
        documents=totals.documents,
        input_bytes=totals.input_bytes,
        skipped_binary_files=len(corpus.skipped_binary),
        skipped_by_default={reason: len(paths) for reason, paths in corpus.skipped_default.items()},
        skipped_empty_documents=totals.skipped_empty,
        skipped_undecodable_files=_skipped_undecodable(config, totals),
        skipped_wide_files=len(corpus.skipped_wide),
        replaced_undecodable_files=len(totals.undecodable) - _skipped_undecodable(config, totals),
        relabelled_shifted_lines=totals.relabelled,
        heldout_sources=sorted(heldout),
        sources=sources,
    )
