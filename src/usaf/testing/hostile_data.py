"""Hostile token data and corpus layouts, run through the real CLI (issue 19, slice "data").

Token values and lengths: labels out of range (at the vocabulary size, -101, 2**63, a float, a boolean), files
with nothing to learn from or to score (every label -100, 1-token sequences, only position 0 labelled), lines
beyond the model's context, each through every reader of tokens: ``usaf train`` (``--data`` and
``--eval-data``), ``usaf score``, ``usaf eval --held-out`` and ``usaf tokenize``'s pre-tokenized JSONL. The
error line must name ``file:line`` (or the file, for a whole file without a target).

Corpus symbolic links: a loop, two links to one directory, a directory of links read with
``--no-follow-symlinks``, a broken link; the valid layouts finish (each real directory read once).

Wired into the catalogue by :mod:`usaf.testing.hostile`'s lead; run by ``tests/test_hostile_data.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from usaf.testing.hostile import VOCAB, Bench, Case, _score

TOKEN_VALUES = "token values and lengths"
LINKS = "corpus symbolic links"
READERS: tuple[str, ...] = (TOKEN_VALUES, LINKS)

CONTEXT = 512  # the tiny model's max_position_embeddings
IGNORE = -100
LENGTH = 24  # tokens per line of the cases' files


def ids(n: int = LENGTH, start: int = 1) -> list[int]:
    """``n`` valid token ids, none equal to its successor (so labels equal to them never look pre-shifted)."""
    return [(start + 7 * i) % (VOCAB - 1) + 1 for i in range(n)]


def line(input_ids: list[int], labels: object | None = None) -> str:
    obj = {"input_ids": input_ids} if labels is None else {"input_ids": input_ids, "labels": labels}
    return json.dumps(obj) + "\n"


def with_label(value: object, position: int = 3) -> str:
    """One line whose label at ``position`` is ``value`` (the rest: the ids themselves)."""
    labels: list[object] = list(ids())
    labels[position] = value
    return line(ids(), labels)


GOOD = line(ids())
ALL_IGNORED = line(ids(), [IGNORE] * LENGTH) * 4
ONE_TOKEN = "".join(line([5 + i]) for i in range(4))  # labels = ids, but a 1-token sequence predicts nothing
FIRST_ONLY = line(ids(), [ids()[0]] + [IGNORE] * (LENGTH - 1)) * 4  # label 0 has no earlier position to predict it
OVER_CONTEXT = GOOD + line(ids(CONTEXT + 88))  # line 2

# -- the commands ---------------------------------------------------------------------------------------


def _train(bench: Bench, case_dir: Path, data: Path, *extra: str) -> list[str]:
    return ["train", "--model", str(bench.quantized), "--data", str(data), "--out", str(case_dir / "out"),
            "--steps", "1", "--save-every", "0", *extra]  # fmt: skip


def _eval(bench: Bench, case_dir: Path, data: Path, *extra: str) -> list[str]:
    return ["eval", "--model", str(bench.quantized), "--held-out", str(data), "--out", str(case_dir / "out"),
            "--no-plots", "--no-base-cache", *extra]  # fmt: skip


def _tokenize(bench: Bench, case_dir: Path, inputs: list[Path], *extra: str) -> list[str]:
    return ["tokenize", *map(str, inputs), "--model", str(bench.model), "--seq-len", "32",
            "--out", str(case_dir / "out"), *extra]  # fmt: skip


COMMANDS: dict[str, Callable[..., list[str]]] = {
    "train": _train,
    "score": lambda bench, case_dir, data: _score(bench, case_dir, data=data),
    "eval": _eval,
}


def _tokens_case(command: str, name: str, content: str, needle: str = "bad.jsonl", **kw) -> Case:
    """``content`` as ``bad.jsonl``, read by ``command``'s ``--data`` (eval: ``--held-out``)."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        path = case_dir / "bad.jsonl"
        path.write_text(content, encoding="utf-8")
        return COMMANDS[command](bench, case_dir, path)

    return Case(TOKEN_VALUES, f"{command}: {name}", build, needle, **kw)


def _eval_data_case(name: str, content: str, needle: str = "eval.jsonl") -> Case:
    """Valid ``--data``, ``content`` as ``usaf train --eval-data``."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        path = case_dir / "eval.jsonl"
        path.write_text(content, encoding="utf-8")
        return _train(bench, case_dir, bench.tokens, "--eval-data", str(path), "--eval-every", "1")

    return Case(TOKEN_VALUES, f"train --eval-data: {name}", build, needle)


def _pretokenized_case(name: str, content: str, needle: str = "corpus.jsonl") -> Case:
    """``content`` as pre-tokenized JSONL input of ``usaf tokenize``."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        path = case_dir / "corpus.jsonl"
        path.write_text(content, encoding="utf-8")
        return _tokenize(bench, case_dir, [path])

    return Case(TOKEN_VALUES, f"tokenize: {name}", build, needle)


def token_value_cases() -> list[Case]:
    at_vocab, below, huge = with_label(VOCAB), with_label(-101), with_label(2**63)
    some_scored = ALL_IGNORED + GOOD  # one line of four has targets: the file as a whole does
    return [
        _tokens_case("train", "a label equal to the vocabulary size", at_vocab, "bad.jsonl:1"),
        _tokens_case("train", "label -101", below, "bad.jsonl:1"),
        _tokens_case("train", "label 2**63", huge, "bad.jsonl:1"),
        _tokens_case("train", "a float label", with_label(4.0), "bad.jsonl:1"),
        _tokens_case("train", "a boolean label", with_label(True), "bad.jsonl:1"),
        _tokens_case("train", "every label -100", ALL_IGNORED),
        _tokens_case("train", "1-token sequences only", ONE_TOKEN),
        _tokens_case("train", "only position 0 labelled (it predicts nothing)", FIRST_ONLY),
        _tokens_case("train", "a line longer than the model's context", OVER_CONTEXT, "bad.jsonl:2"),
        _eval_data_case("a label beyond the vocabulary", with_label(VOCAB + 5), "eval.jsonl:1"),
        _eval_data_case("every label -100", ALL_IGNORED),
        _eval_data_case("an empty file", ""),
        _tokens_case("score", "a label equal to the vocabulary size", at_vocab, "bad.jsonl:1"),
        _tokens_case("score", "label -101", below, "bad.jsonl:1"),
        _tokens_case("score", "every label -100", ALL_IGNORED),
        _tokens_case("score", "1-token sequences only", ONE_TOKEN),
        _tokens_case("score", "a line longer than the model's context", OVER_CONTEXT, "bad.jsonl:2"),
        _tokens_case(
            "score",
            "three lines of four without a target",
            some_scored,
            may_pass=True,
            note="decided per file: lines without a target are fine among lines with some",
        ),
        _tokens_case("eval", "a label equal to the vocabulary size", at_vocab, "bad.jsonl:1"),
        _tokens_case("eval", "label -101", below, "bad.jsonl:1"),
        _tokens_case("eval", "label 2**63", huge, "bad.jsonl:1"),
        _tokens_case("eval", "every label -100", ALL_IGNORED),
        _tokens_case("eval", "1-token sequences only", ONE_TOKEN),
        _tokens_case("eval", "a line longer than the model's context", OVER_CONTEXT, "bad.jsonl:2"),
        _pretokenized_case("a label equal to the vocabulary size", at_vocab, "corpus.jsonl:1"),
        _pretokenized_case("label -101", below, "corpus.jsonl:1"),
        _pretokenized_case("label 2**63", huge, "corpus.jsonl:1"),
        _pretokenized_case("every label -100", ALL_IGNORED),
        _pretokenized_case("1-token lines only", ONE_TOKEN),
    ]


# -- symbolic links in a corpus -------------------------------------------------------------------------

TEXT = "def f(x):\n    return x + 1\n" * 40


def repository(path: Path, name: str = "module.py") -> Path:
    """A directory holding one text file (a repository, as far as tokenize cares)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(TEXT, encoding="utf-8")
    return path


def _links_case(name: str, layout: Callable[[Path], Path], needle: str, *extra: str, **kw) -> Case:
    """``layout(case_dir)`` builds a corpus and returns the directory given to ``usaf tokenize``."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        return _tokenize(bench, case_dir, [layout(case_dir)], *extra)

    return Case(LINKS, name, build, needle, **kw)


def links_to_repositories(case_dir: Path) -> Path:
    """The common layout: ``corpus/<name>`` are links to repositories kept elsewhere."""
    corpus = case_dir / "corpus"
    corpus.mkdir()
    for name in ("alpha", "beta"):
        (corpus / name).symlink_to(repository(case_dir / "repos" / name), target_is_directory=True)
    return corpus


def loop_to_ancestor(case_dir: Path) -> Path:
    corpus = repository(case_dir / "corpus")
    (corpus / "sub").mkdir()
    (corpus / "sub" / "up").symlink_to(corpus, target_is_directory=True)  # corpus/sub/up/sub/up/...
    return corpus


def two_links_to_one(case_dir: Path) -> Path:
    corpus = case_dir / "corpus"
    corpus.mkdir()
    repo = repository(case_dir / "repos" / "alpha")
    for name in ("first", "second"):
        (corpus / name).symlink_to(repo, target_is_directory=True)
    return corpus


def broken_link_only(case_dir: Path) -> Path:
    corpus = case_dir / "corpus"
    corpus.mkdir()
    (corpus / "gone.py").symlink_to(case_dir / "nowhere.py")
    return corpus


def linked_file_only(case_dir: Path) -> Path:
    corpus = case_dir / "corpus"
    corpus.mkdir()
    repository(case_dir / "elsewhere")
    (corpus / "module.py").symlink_to(case_dir / "elsewhere" / "module.py")
    return corpus


def links_cases() -> list[Case]:
    read_once = "each real directory is read once, whatever links lead to it"
    return [
        _links_case(
            "a directory of links to repositories",
            links_to_repositories,
            "",
            may_pass=True,
            note="links are followed by default",
        ),  # fmt: skip
        _links_case("a link to an ancestor (a loop)", loop_to_ancestor, "", may_pass=True, note=read_once),
        _links_case("two links to one directory", two_links_to_one, "", may_pass=True, note=read_once),
        _links_case(
            "a directory of links to repositories, with --no-follow-symlinks",
            links_to_repositories,
            "2 symbolic links (--no-follow-symlinks) skipped",
            "--no-follow-symlinks",
        ),
        _links_case(
            "a linked file only, with --no-follow-symlinks",
            linked_file_only,
            "1 symbolic link (--no-follow-symlinks) skipped",
            "--no-follow-symlinks",
        ),
        _links_case("a broken link only", broken_link_only, "1 broken symbolic link skipped"),
    ]


def cases() -> list[Case]:
    return [*token_value_cases(), *links_cases()]
