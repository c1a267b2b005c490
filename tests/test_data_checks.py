"""Token data checks (issue 19): one reader of tokens with the same limits in every stage, files with nothing to
score refused, the sampled subsets of score and eval too, and corpus discovery through symbolic links.

The catalogue of hostile inputs (every stage, through the CLI) is tests/test_hostile_data.py; this file pins the
messages, the decisions (per file, not per line) and their negative controls.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from helpers import invoke
from usaf.artifacts import TokensManifest, load_verified
from usaf.data.corpus import discover
from usaf.data.tokens import iter_token_file, scored_targets
from usaf.errors import UsafError
from usaf.testing import hostile
from usaf.testing.hostile_data import ALL_IGNORED, GOOD, IGNORE, ids, line, repository, with_label

VOCAB = hostile.VOCAB


def write(path: Path, content: str) -> Path:
    path.write_text(content, encoding="utf-8")
    return path


def error_line(result) -> str:
    errors = [row for row in result.stderr.splitlines() if row.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, (result.exit_code, result.output)
    return errors[0]


# -- the reader -----------------------------------------------------------------------------------------


def test_scored_targets_counts_labels_after_the_first():
    assert scored_targets([5]) == 0  # a 1-token sequence predicts nothing
    assert scored_targets([5, IGNORE, IGNORE]) == 0
    assert scored_targets([IGNORE, 5, IGNORE, 6]) == 2


@pytest.mark.parametrize(
    ("label", "shown"), [(VOCAB, f"label {VOCAB} "), (-101, "label -101 "), (2**63, f"label {2**63} ")]
)
def test_a_label_out_of_range_is_named_with_file_and_line(tmp_path, label, shown):
    path = write(tmp_path / "t.jsonl", GOOD + with_label(label))
    with pytest.raises(UsafError) as caught:
        list(iter_token_file(path, vocab_size=VOCAB))
    assert caught.value.message.startswith(f"{path}:2: {shown}")
    assert f"-100 (not scored) nor a token id of the model's vocabulary (0 to {VOCAB - 1})" in caught.value.message


def test_negative_control_labels_at_the_edges_of_the_range_are_read(tmp_path):
    labels = [IGNORE, 0, *ids(21), VOCAB - 1]
    path = write(tmp_path / "t.jsonl", line([1, 2, *ids(21), 3], labels))
    (read,) = iter_token_file(path, vocab_size=VOCAB)
    assert read.labels == labels


def test_a_line_beyond_the_context_is_named(tmp_path):
    path = write(tmp_path / "t.jsonl", GOOD + line(ids(40)))
    with pytest.raises(UsafError, match=rf"{path}:2: 40 tokens, longer than the model's context of 32") as caught:
        list(iter_token_file(path, vocab_size=VOCAB, context=32))
    # a pre-tokenized line cannot be re-tokenized shorter: the hint said only that, which refused it again (review)
    assert "a pre-tokenized line goes in pieces of 32 tokens or fewer" in caught.value.hint
    assert len(list(iter_token_file(path, vocab_size=VOCAB, context=40))) == 2  # negative control: it fits 40


def test_a_negative_token_id_is_not_blamed_on_another_tokenizer(tmp_path):
    """-5 in input_ids got "the file was tokenized for another model" (found in review). The control: an id past
    the vocabulary still gets it."""
    for bad, hint in ((-5, "-100 marks a label not scored, in labels, not input_ids"),
                      (VOCAB, "the file was tokenized for another model")):  # fmt: skip
        path = write(tmp_path / "t.jsonl", GOOD + line([1, bad, 3]))
        with pytest.raises(UsafError, match=rf"{path}:2: token id {bad} is outside the model's vocabulary") as caught:
            list(iter_token_file(path, vocab_size=VOCAB))
        assert hint in caught.value.hint


def test_a_file_with_nothing_to_score_is_refused_naming_the_file(tmp_path):
    for content in (ALL_IGNORED, line([5]) * 3, line(ids(), [7] + [IGNORE] * 23)):
        path = write(tmp_path / "t.jsonl", content)
        with pytest.raises(UsafError) as caught:
            list(iter_token_file(path, vocab_size=VOCAB))
        assert caught.value.message.startswith(f"{path}: no token to learn from or to score")


def test_negative_control_lines_without_targets_among_others_are_fine(tmp_path):
    """Decided per file: three lines without a target and one with are read, all four."""
    path = write(tmp_path / "t.jsonl", ALL_IGNORED + GOOD)
    assert len(list(iter_token_file(path, vocab_size=VOCAB))) == 5
    assert list(iter_token_file(write(tmp_path / "empty.jsonl", ""), vocab_size=VOCAB)) == []  # callers name it


# -- every stage, through the CLI -------------------------------------------------------------------------


def test_train_refuses_bad_data_before_overwrite_touches_the_run_directory(bench, tmp_path):
    """With --overwrite the old run would be deleted first: the data is checked before that (fails on old code)."""
    run = tmp_path / "run"
    run.mkdir()
    keep = write(run / "notes.txt", "a run of mine")
    bad = write(tmp_path / "bad.jsonl", GOOD + with_label(VOCAB))
    result = invoke("train", "--model", bench.quantized, "--data", bad, "--out", run, "--overwrite", "--steps", 1)
    assert f"{bad}:2: label {VOCAB} is neither" in error_line(result)
    assert keep.read_text() == "a run of mine"


def test_train_refuses_a_line_beyond_the_context_even_with_seq_len(bench, tmp_path):
    """The same limit as score and eval: --seq-len cuts lines, it does not admit a file made for a longer context."""
    bad = write(tmp_path / "long.jsonl", GOOD + line(ids(600)))
    out = tmp_path / "out"
    for extra in ([], ["--seq-len", "32"]):
        result = invoke("train", "--model", bench.quantized, "--data", bad, "--out", out, "--steps", 1, *extra)
        assert f"{bad}:2: 600 tokens, longer than the model's context of 512" in error_line(result)
        assert not out.exists()


def _seed_sampling_only(count: int, lines: int, pick) -> int:
    """The first seed whose reservoir sample of ``count`` among ``lines`` is what ``pick(indices)`` wants."""
    for seed in range(200):
        rng, reservoir = random.Random(seed), []
        for seen in range(lines):
            if len(reservoir) < count:
                reservoir.append(seen)
            elif (j := rng.randrange(seen + 1)) < count:
                reservoir[j] = seen
        if pick(reservoir):
            return seed
    raise AssertionError("no such seed")


def test_score_refuses_a_calibration_sample_with_nothing_to_score(bench, tmp_path):
    data = write(tmp_path / "mixed.jsonl", GOOD + ALL_IGNORED * 5)  # line 1 alone has targets
    seed = _seed_sampling_only(2, 21, lambda picked: 0 not in picked)
    args = [*hostile._score(bench, tmp_path, data=data), "--calib-samples", "2", "--seed", str(seed)]
    message = error_line(invoke(*args))
    assert f"--data {data}: the 2 sampled sequences (--calib-samples) have no token to score" in message
    assert not (tmp_path / "out").exists()
    good_seed = _seed_sampling_only(2, 21, lambda picked: 0 in picked)  # negative control: a sample with targets
    args = [*hostile._score(bench, tmp_path, data=data), "--calib-samples", "2", "--seed", str(good_seed)]
    result = invoke(*args)
    assert result.exit_code == 0, result.output


def test_eval_refuses_a_sample_with_nothing_to_score(bench, tmp_path):
    data = write(tmp_path / "mixed.jsonl", GOOD + ALL_IGNORED * 5)
    seed = _seed_sampling_only(1, 21, lambda picked: picked != [0])
    out = tmp_path / "out"
    common = ["eval", "--model", bench.quantized, "--held-out", data, "--out", out, "--no-plots", "--no-base-cache"]
    message = error_line(invoke(*common, "--max-sequences", 1, "--seed", seed))
    assert f"--held-out {data}: the 1 sequences sampled by --max-sequences have no token to score" in message
    assert not out.exists()
    result = invoke(*common)  # negative control: the whole file has a line to score
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["rows"]


def test_tokenize_refuses_a_held_out_split_with_nothing_to_score(bench, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"input_ids": ids(), "source": "kept"}, {"input_ids": ids(), "labels": [IGNORE] * 24, "source": "held"}]
    write(corpus, "".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = ["tokenize", corpus, "--model", bench.model, "--seq-len", 32, "--out", out, "--held-out", "held"]
    assert f"{corpus}: the heldout sequences have no token to learn from or to score" in error_line(invoke(*args))
    assert not out.exists()
    rows[1]["labels"] = [IGNORE] * 12 + ids(12)  # negative control: half of it scored
    write(corpus, "".join(json.dumps(r) + "\n" for r in rows))
    result = invoke(*args)
    assert result.exit_code == 0, result.output


def test_tokenize_names_a_pretokenized_label_out_of_range(bench, tmp_path):
    corpus = write(tmp_path / "corpus.jsonl", GOOD + with_label(-7))
    out = tmp_path / "out"
    result = invoke("tokenize", corpus, "--model", bench.model, "--seq-len", 32, "--out", out)
    assert f"{corpus}:2: label -7 is neither -100" in error_line(result)
    assert not out.exists()


# -- corpus discovery through symbolic links ------------------------------------------------------------------


def _discovered(inputs: list[Path], **kw) -> list[tuple[str, str]]:
    corpus = discover(inputs, include=[], exclude=[], source_depth=1, **kw)
    return [(f.source, f.path.name) for f in corpus.files]


def test_a_directory_of_links_to_repositories_is_read_with_one_source_each(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("beta", "alpha"):
        (corpus / name).symlink_to(repository(tmp_path / "elsewhere" / name), target_is_directory=True)
    assert _discovered([corpus]) == [("corpus/alpha", "module.py"), ("corpus/beta", "module.py")]


def test_each_real_directory_and_file_is_read_once(tmp_path):
    corpus = repository(tmp_path / "corpus", "top.py")
    real = repository(corpus / "real")
    (corpus / "real" / "sub").mkdir()
    (corpus / "real" / "sub" / "up").symlink_to(corpus, target_is_directory=True)  # a loop to an ancestor
    (corpus / "alias").symlink_to(real, target_is_directory=True)  # sorts before "real": the link is the duplicate
    (corpus / "again").symlink_to(real, target_is_directory=True)
    (corpus / "copy.py").symlink_to(corpus / "top.py")  # a linked file of the same tree
    other = repository(tmp_path / "other", "far.py")
    (corpus / "far.py").symlink_to(other / "far.py")
    expected = [("corpus/far.py", "far.py"), ("corpus/real", "module.py"), ("corpus/top.py", "top.py")]
    assert sorted(_discovered([corpus])) == expected
    assert _discovered([corpus, corpus / "real"]) == _discovered([corpus])  # an input inside another: once too


def test_no_follow_symlinks_skips_and_counts_the_links(tmp_path):
    corpus = repository(tmp_path / "corpus")
    (corpus / "linked").symlink_to(repository(tmp_path / "repo"), target_is_directory=True)
    (corpus / "one.py").symlink_to(tmp_path / "repo" / "module.py")
    (corpus / "gone.py").symlink_to(tmp_path / "nowhere")
    found = discover([corpus], include=[], exclude=[], source_depth=1, follow_symlinks=False)
    assert [(f.source, f.path.name) for f in found.files] == [("corpus/module.py", "module.py")]
    assert sorted(p.name for p in found.skipped_links) == ["linked", "one.py"]
    assert [p.name for p in found.broken_links] == ["gone.py"]
    followed = discover([corpus], include=[], exclude=[], source_depth=1)  # negative control: the default follows
    names = [(f.source, f.path.name) for f in followed.files]
    assert names == [("corpus/linked", "module.py"), ("corpus/module.py", "module.py")]  # one.py: linked/ again
    assert not followed.skipped_links


def test_tokenize_follows_links_and_says_what_no_follow_skipped(bench, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("alpha", "beta"):
        (corpus / name).symlink_to(repository(tmp_path / "repos" / name), target_is_directory=True)
    (corpus / "loop").symlink_to(corpus, target_is_directory=True)
    out = tmp_path / "out"
    result = invoke("tokenize", corpus, "--model", bench.model, "--seq-len", 32, "--out", out)
    assert result.exit_code == 0, result.output
    summary = load_verified(out, TokensManifest).summary
    assert [s.source for s in summary.sources] == ["corpus/alpha", "corpus/beta"] and summary.documents == 2
    (corpus / "own.py").write_text("x = 1\n" * 40, encoding="utf-8")
    result = invoke("tokenize", corpus, "--model", bench.model, "--seq-len", 32, "--out", tmp_path / "o2",
                    "--no-follow-symlinks")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "3 symbolic links not followed (--no-follow-symlinks)" in " ".join(result.output.split())
    assert load_verified(tmp_path / "o2", TokensManifest).summary.documents == 1


def test_a_line_without_input_ids_is_named_as_such_labels_being_optional(tmp_path):
    """A line of text given as tokens was told it "needs 'input_ids' and 'labels'", though labels may be left out
    (found in review). The control: mismatched lengths still name both."""
    path = write(tmp_path / "t.jsonl", '{"text": "hello"}\n')
    with pytest.raises(UsafError, match=rf"{path}:1: no 'input_ids' \(a list of token ids; 'labels' is optional\); "
                                        r"the keys are 'text'") as caught:  # fmt: skip
        list(iter_token_file(path, vocab_size=VOCAB))
    assert "usaf tokenize" in caught.value.hint
    path = write(tmp_path / "u.jsonl", line([1, 2, 3], [1, 2]))
    with pytest.raises(UsafError, match=r"needs 'input_ids' \(and 'labels', if any\) as equal-length non-empty"):
        list(iter_token_file(path, vocab_size=VOCAB))
