"""`usaf tokenize` end to end through the real CLI, including every bad input's message and exit code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import invoke, leftovers, read_jsonl
from usaf.artifacts import TokensManifest, load_verified
from usaf.testing import build_tiny_tokenizer, stdlib_dir

STDLIB = stdlib_dir()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(path, model_max_length=1024)
    return path


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def tokenize(*args, env=None):
    return invoke("tokenize", *args, env=env)


def assert_clean_failure(result, out: Path, *needles: str) -> None:
    """One red error line naming the problem, exit 2, no output, no temporaries."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    assert not out.exists()
    if out.parent.exists():
        assert leftovers(out.parent) == []


def test_stdlib_packages_split_by_source_with_disjoint_sources(tmp_path, tok_dir):
    out = tmp_path / "tokens"
    result = tokenize(
        STDLIB / "json",
        STDLIB / "email",
        STDLIB / "textwrap.py",
        "--model",
        tok_dir,
        "--seq-len",
        128,
        "--source-depth",
        0,
        "--held-out",
        "email",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    assert "train" in result.stdout and "heldout" in result.stdout
    manifest = load_verified(out, TokensManifest)
    train, held = read_jsonl(out / "train.jsonl"), read_jsonl(out / "heldout.jsonl")
    train_sources, held_sources = {r["source"] for r in train}, {r["source"] for r in held}
    assert train_sources == {"json", "textwrap.py"} and held_sources == {"email"}
    assert manifest.summary.heldout_sources == ["email"]
    assert manifest.summary.train_sequences == len(train) and manifest.summary.heldout_sequences == len(held)
    assert manifest.summary.train_tokens == sum(len(r["input_ids"]) for r in train)
    for rows in (train, held):
        for r in rows:
            assert r["labels"] == r["input_ids"]  # plain text: unshifted, every token scored
            assert 2 <= len(r["input_ids"]) <= 128
    # All but each source's last sequence are full.
    assert sum(len(r["input_ids"]) < 128 for r in train) <= len(train_sources)
    roles = {i.role: i for i in manifest.inputs}
    assert roles["tokenizer"].fingerprint == manifest.summary.tokenizer.fingerprint
    assert manifest.config["seq_len"] == 128


def test_packing_round_trips_the_text_with_eos_separators(tmp_path, tok_dir, tokenizer):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = {"a.txt": "def alpha():\n    return 1\n" * 40, "b.txt": "class Beta:\n    pass\n" * 30}
    for name, text in texts.items():
        (corpus / name).write_text(text)
    out = tmp_path / "out"
    assert tokenize(corpus, "--model", tok_dir, "--seq-len", 64, "--source-depth", 0, "--out", out).exit_code == 0
    rows = read_jsonl(out / "train.jsonl")
    ids = [t for r in rows for t in r["input_ids"]]
    eos = tokenizer.eos_token_id
    assert ids.count(eos) == 2  # one separator after each document
    decoded = tokenizer.decode(ids, skip_special_tokens=False).split(tokenizer.eos_token)
    assert decoded[:2] == [texts["a.txt"], texts["b.txt"]]


@pytest.mark.parametrize("saved", ["truncation", "padding"])
def test_truncation_or_padding_saved_in_tokenizer_json_is_not_applied(tmp_path, tok_dir, saved):
    """Some tokenizer.json files are saved with truncation or padding on: every document was cut to the saved length,
    or padded with labelled pad tokens, in silence (found in review). The control: the plain tokenizer's tokens."""
    import shutil

    from tokenizers import Tokenizer

    changed = tmp_path / "tok"
    shutil.copytree(tok_dir, changed)
    backend = Tokenizer.from_file(str(changed / "tokenizer.json"))
    if saved == "truncation":
        backend.enable_truncation(max_length=16)
    else:
        backend.enable_padding(length=400, pad_id=0)
    backend.save(str(changed / "tokenizer.json"))
    assert json.loads((changed / "tokenizer.json").read_text())[saved] is not None
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "long.txt").write_text("def alpha():\n    return 1\n" * 40)
    (corpus / "short.txt").write_text("x = 1\n")
    tokens = {}
    for name, model in (("plain", tok_dir), (saved, changed)):
        out = tmp_path / name
        result = tokenize(corpus, "--model", model, "--seq-len", 64, "--source-depth", 0, "--out", out)
        assert result.exit_code == 0, result.output
        tokens[name] = [r["input_ids"] for r in read_jsonl(out / "train.jsonl")]
    assert tokens[saved] == tokens["plain"] and sum(map(len, tokens["plain"])) > 100


def test_stride_overlaps_and_scores_every_token_once(tmp_path, tok_dir):
    out = tmp_path / "out"
    result = tokenize(STDLIB / "textwrap.py", "--model", tok_dir, "--seq-len", 64, "--stride", 16, "--out", out)
    assert result.exit_code == 0, result.output
    rows = read_jsonl(out / "train.jsonl")
    assert len(rows) > 3
    for prev, cur in zip(rows, rows[1:]):
        assert cur["input_ids"][:16] == prev["input_ids"][-16:]
        assert cur["labels"][:16] == [-100] * 16
    scored = [t for r in rows for t, lab in zip(r["input_ids"], r["labels"]) if lab != -100]
    # Compare with no stride: the scored tokens are exactly the token stream.
    plain = tmp_path / "plain"
    assert tokenize(STDLIB / "textwrap.py", "--model", tok_dir, "--seq-len", 64, "--out", plain).exit_code == 0
    assert scored == [t for r in read_jsonl(plain / "train.jsonl") for t in r["input_ids"]]


def test_chat_jsonl_scores_assistant_turns_only(tmp_path, tok_dir, tokenizer):
    chat = tmp_path / "chat.jsonl"
    conversations = [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": "Hello there."},
            {"role": "user", "content": "Again?"},
            {"role": "assistant", "content": "Hello again."},
        ],
        [{"role": "user", "content": "Sum 2 and 2."}, {"role": "assistant", "content": "It is 4."}],
    ]
    chat.write_text(
        "".join(json.dumps({"messages": c, "source": f"conv{i}"}) + "\n" for i, c in enumerate(conversations))
    )
    out = tmp_path / "out"
    result = tokenize(chat, "--model", tok_dir, "--seq-len", 256, "--out", out)
    assert result.exit_code == 0, result.output
    rows = {r["source"]: r for r in read_jsonl(out / "train.jsonl")}
    first = rows["conv0"]
    scored = [t for t, lab in zip(first["input_ids"], first["labels"]) if lab != -100]
    text = tokenizer.decode(scored)
    assert text == "Hello there.<|im_end|>\nHello again.<|im_end|>\n"
    unscored = tokenizer.decode([t for t, lab in zip(first["input_ids"], first["labels"]) if lab == -100])
    assert "Say hello." in unscored and "Be brief." in unscored and "Hello there" not in unscored


def test_a_chat_conversation_that_fits_is_never_cut_across_sequences(tmp_path, tok_dir, tokenizer):
    """Conversations were packed as text is: one cut at a window's end trained its second part's reply without its
    question (about 1 in 20 in a reviewer's set). Each one that fits in --seq-len now lies whole in one sequence, so
    every sequence opens a conversation; the one longer than --seq-len is cut, its later sequence opening mid-way."""
    rng = __import__("random").Random(0)
    conversations = [[{"role": "user", "content": f"Question {i}: " + "why? " * rng.randrange(1, 12)},
                      {"role": "assistant", "content": "Because. " * rng.randrange(1, 12)}] for i in range(24)]
    conversations.append([{"role": "user", "content": "Long one."}, {"role": "assistant", "content": "So. " * 160}])
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    out = tmp_path / "out"
    result = tokenize(chat, "--model", tok_dir, "--seq-len", 256, "--out", out)  # conversations of 50-144 tokens
    assert result.exit_code == 0, result.output
    opener = tokenizer(tokenizer.apply_chat_template(conversations[0], tokenize=False))["input_ids"][0]
    rows = read_jsonl(out / "train.jsonl")
    mid_way = [r for r in rows if r["input_ids"][0] != opener]
    pieces = [tokenizer.decode(r["input_ids"]) for r in mid_way]
    assert pieces and all("So." in piece and "Question" not in piece for piece in pieces), pieces  # the long one's
    scored = sum(1 for r in rows for lab in r["labels"][1:] if lab != -100)
    assert scored == load_verified(out, TokensManifest).summary.train_loss_tokens


def test_sequences_with_no_target_are_left_out_and_said(tmp_path, tok_dir, tokenizer):
    """A chat whose prompt is longer than --seq-len packed sequences of prompt alone (every label -100): written to
    train.jsonl, each training step of them ran at loss 0.0 and pulled the run's loss means down (found in review).
    They are left out, with a note. The control: the same chat with a short prompt leaves nothing out."""
    prompt = "def f(x):\n    return x + 1\n" * 60
    for name, user, left in (("long", prompt, True), ("short", "Write f.", False)):
        chat = tmp_path / f"{name}.jsonl"
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": "It is done. " * 20}]
        chat.write_text(json.dumps({"messages": messages}) + "\n")
        out = tmp_path / name
        result = tokenize(chat, "--model", tok_dir, "--seq-len", 32, "--out", out)
        assert result.exit_code == 0, result.output
        rows = read_jsonl(out / "train.jsonl")
        assert rows and all(any(label != -100 for label in r["labels"][1:]) for r in rows)
        said = " ".join(result.stderr.split())
        assert ("with no token to learn from left out" in said) == left, said
        summary = load_verified(out, TokensManifest).summary
        assert summary.train_sequences == len(rows)


def test_a_chat_role_no_template_names_is_said(tmp_path, tok_dir):
    """A ShareGPT "gpt" turn beside real "assistant" turns was rendered and never learned from, in silence (found in
    review). Said, with a line holding it. The control: the usual roles say nothing."""
    chat = tmp_path / "chat.jsonl"
    lines = [[{"role": "user", "content": "Hi."}, {"role": "gpt", "content": "Hello."},
              {"role": "user", "content": "Sum 2 and 2."}, {"role": "assistant", "content": "It is 4."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
              {"role": "assistant", "content": "Hello."}]]  # fmt: skip
    chat.write_text("".join(json.dumps({"messages": m}) + "\n" for m in lines))
    result = tokenize(chat, "--model", tok_dir, "--out", tmp_path / "out")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0 and f"'gpt' (1 line, e.g. {chat}:1)" in said and "never learned from" in said, said
    chat.write_text(json.dumps({"messages": lines[1]}) + "\n")
    control = tokenize(chat, "--model", tok_dir, "--out", tmp_path / "control")
    assert control.exit_code == 0 and "chat roles other than" not in control.stderr, control.output


def test_a_line_holding_messages_and_text_says_which_was_read(tmp_path, tok_dir):
    """A line with both 'messages' and 'text' (a dataset that keeps the rendered conversation beside it) was read as
    chat and its 'text' dropped in silence (found in review). Said, naming the line. The control: chat alone says
    nothing of it."""
    messages = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    chat = tmp_path / "both.jsonl"
    lines = ({"messages": messages}, {"messages": messages, "text": "Hi."})
    chat.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = tokenize(chat, "--model", tok_dir, "--out", tmp_path / "out")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0, result.output
    assert f"1 JSONL line holds both 'messages' and 'text': 'messages' was read, 'text' not (e.g. {chat}:2)" in said
    chat.write_text(json.dumps({"messages": messages}) + "\n")
    control = tokenize(chat, "--model", tok_dir, "--out", tmp_path / "control")
    assert control.exit_code == 0 and "holds both" not in control.stderr, control.output


def test_original_format_pre_shifted_labels_are_detected_and_fixable(tmp_path, tok_dir, tokenizer):
    ids = tokenizer("def f(x):\n    return x + 1\n" * 4)["input_ids"][:40]
    original = tmp_path / "orig.jsonl"  # the original README's recipe: labels = chunk[1:] + [eos]
    original.write_text(json.dumps({"input_ids": ids, "labels": ids[1:] + [0]}) + "\n")
    out = tmp_path / "out"
    result = tokenize(original, "--model", tok_dir, "--out", out)
    assert_clean_failure(result, out, f"{original}:1", "pre-shifted", "--fix-shifted-labels")
    result = tokenize(original, "--model", tok_dir, "--out", out, "--fix-shifted-labels")
    assert result.exit_code == 0, result.output
    (row,) = read_jsonl(out / "train.jsonl")
    assert row["input_ids"] == ids and row["labels"] == [-100, *ids[1:]]
    assert load_verified(out, TokensManifest).summary.relabelled_shifted_lines == 1
    # Control: correctly unshifted pre-tokenized lines pass through untouched.
    fine = tmp_path / "fine.jsonl"
    fine.write_text(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
    out2 = tmp_path / "out2"
    assert tokenize(fine, "--model", tok_dir, "--out", out2).exit_code == 0
    assert read_jsonl(out2 / "train.jsonl")[0]["labels"] == ids


def test_short_pre_shifted_lines_are_unshifted_as_their_file(tmp_path, tok_dir, tokenizer):
    """Lines of 3 and 4 tokens are too short to tell alone: in a file of pre-shifted lines they were written still
    shifted, in silence (found in review). The control: short lines of an unshifted file are left as they are."""
    ids = tokenizer("def f(x):\n    return x + 1\n" * 4)["input_ids"]
    lines = [ids[:20], ids[20:24], ids[24:27], ids[27:47]]  # the short ones come before the file's second long one
    shifted = tmp_path / "shifted.jsonl"
    shifted.write_text("".join(json.dumps({"input_ids": x, "labels": x[1:] + [0]}) + "\n" for x in lines))
    out = tmp_path / "out"
    fixed = tokenize(shifted, "--model", tok_dir, "--out", out, "--fix-shifted-labels")
    assert fixed.exit_code == 0 and "nothing was relabelled" not in fixed.stderr
    rows = read_jsonl(out / "train.jsonl")
    assert [r["labels"] for r in rows] == [[-100, *x[1:]] for x in lines]
    assert load_verified(out, TokensManifest).summary.relabelled_shifted_lines == 4
    fine = tmp_path / "fine.jsonl"
    fine.write_text("".join(json.dumps({"input_ids": x, "labels": x}) + "\n" for x in lines))
    untouched = tokenize(fine, "--model", tok_dir, "--out", tmp_path / "fine", "--fix-shifted-labels")
    assert untouched.exit_code == 0 and [r["labels"] for r in read_jsonl(tmp_path / "fine" / "train.jsonl")] == lines
    # nothing to fix is said, not passed over in silence (found in review); the shifted file above relabelled
    assert "--fix-shifted-labels: no pre-tokenized line had pre-shifted labels" in untouched.stderr

    # A file of short lines only: their positions together tell (one 3-position shifted line was left shifted and
    # said to have none; found in review). Without the flag it is refused as a long line is.
    short = tmp_path / "short.jsonl"
    short.write_text("".join(json.dumps({"input_ids": x, "labels": x[1:] + [-100]}) + "\n" for x in lines[1:3]))
    assert_clean_failure(tokenize(short, "--model", tok_dir, "--out", tmp_path / "s"), tmp_path / "s", "pre-shifted")
    fixed = tokenize(short, "--model", tok_dir, "--out", tmp_path / "s", "--fix-shifted-labels")
    assert fixed.exit_code == 0 and [r["labels"] for r in read_jsonl(tmp_path / "s" / "train.jsonl")] == [
        [-100, *x[1:]] for x in lines[1:3]]  # fmt: skip
    # Too few positions in the whole file: said, not guessed, with the flag or without
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"input_ids": lines[2], "labels": lines[2][1:] + [-100]}) + "\n")
    for extra in ([], ["--fix-shifted-labels"]):
        taken = tokenize(one, "--model", tok_dir, "--out", tmp_path / f"one{len(extra)}", *extra)
        said = " ".join(taken.stderr.split())
        assert taken.exit_code == 0 and "1 pre-tokenized line too short to tell whether" in said, said
        assert "no pre-tokenized line had pre-shifted labels" not in said
    # ... but a line without labels (or labels that are its ids) is the unshifted form: nothing to tell (it was
    # said to be too short to tell; found in review)
    for record in ({"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 3], "labels": [1, 2, 3]}):
        (tmp_path / "n.jsonl").write_text(json.dumps(record) + "\n")
        taken = tokenize(tmp_path / "n.jsonl", "--model", tok_dir, "--out", tmp_path / f"n{len(record)}")
        assert taken.exit_code == 0 and "too short to tell" not in taken.stderr, taken.output


def test_stride_over_pre_tokenized_lines_alone_says_it_packs_text_only(tmp_path, tok_dir, tokenizer):
    """Pre-tokenized lines are sequences as they are: a --stride given for them alone would be recorded and do
    nothing, so it is said; with text among the inputs (the control) it packs that text, and nothing is said."""
    ids = tokenizer("def f(x):\n    return x + 1\n" * 4)["input_ids"][:24]
    lines = tmp_path / "ids.jsonl"
    lines.write_text(json.dumps({"input_ids": ids}) + "\n")
    result = tokenize(lines, "--model", tok_dir, "--seq-len", 32, "--stride", 8, "--out", tmp_path / "ids")
    assert result.exit_code == 0 and "--stride 8: every line was pre-tokenized" in result.stderr, result.output
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "def g(y):\n    return y * 2\n" * 8}) + "\n")
    mixed = tokenize(lines, text, "--model", tok_dir, "--seq-len", 32, "--stride", 8, "--out", tmp_path / "mixed")
    assert mixed.exit_code == 0 and "pre-tokenized" not in mixed.stderr, mixed.output


def test_settings_of_directory_or_jsonl_inputs_without_any_are_refused_not_ignored(tmp_path, tok_dir, tokenizer):
    """--source-depth names the sources of files under a directory input (--all-files and --no-follow-symlinks
    decide its walk), --text-field/--source-field fields of JSONL lines, --decode-errors what a text file becomes:
    over inputs without any they were accepted and unused (found in review). From USAF_* a note; over JSONL
    lines that are all pre-tokenized, --text-field is said after. Controls: a directory takes --source-depth, JSONL
    text lines --text-field, and nothing is said."""
    text = STDLIB / "shlex.py"
    for given, needle in ((("--source-depth", 0), "--source-depth 0: no input is a directory"),
                          (("--text-field", "body"), "--text-field body: no input is a JSONL file"),
                          (("--source-field", "repo"), "--source-field repo: no input is a JSONL file"),
                          (("--all-files",), "--all-files: no input is a directory"),
                          (("--no-follow-symlinks",), "--no-follow-symlinks: no input is a directory")):  # fmt: skip
        out = tmp_path / f"flag{given[0]}"
        assert_clean_failure(tokenize(text, "--model", tok_dir, *given, "--out", out), out, needle)
    noted = tokenize(text, "--model", tok_dir, "--out", tmp_path / "env", env={"USAF_SOURCE_DEPTH": "0"})
    assert noted.exit_code == 0 and "USAF_SOURCE_DEPTH 0: no input is a directory" in noted.stderr, noted.output

    ids = tokenizer("def f(x):\n    return x + 1\n" * 4)["input_ids"][:24]
    pre = tmp_path / "ids.jsonl"
    pre.write_text(json.dumps({"input_ids": ids}) + "\n")
    said = tokenize(pre, "--model", tok_dir, "--text-field", "body", "--out", tmp_path / "ids")
    assert said.exit_code == 0 and "--text-field body: no JSONL line was read by it" in said.stderr, said.output
    out = tmp_path / "decode"  # JSONL must be UTF-8 whatever --decode-errors says: it decides only text files
    assert_clean_failure(tokenize(pre, "--model", tok_dir, "--decode-errors", "replace", "--out", out), out,
                         "--decode-errors replace: no input is a text file")  # fmt: skip

    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"body": "def g(y):\n    return y * 2\n" * 8}) + "\n")
    read = tokenize(pre, texts, "--model", tok_dir, "--text-field", "body", "--out", tmp_path / "read")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("a = 1\n" * 40)
    walked = tokenize(corpus, "--model", tok_dir, "--source-depth", 0, "--all-files", "--no-follow-symlinks",
                      "--decode-errors", "replace", "--out", tmp_path / "walked")  # fmt: skip
    for result in (read, walked):
        assert result.exit_code == 0 and "no input is" not in result.stderr, result.output
    assert "was read by it" not in read.stderr


def test_held_out_fraction_is_seeded_and_disjoint(tmp_path, tok_dir):
    outs = []
    for seed in (1, 1, 2):
        out = tmp_path / f"out{len(outs)}"
        result = tokenize(
            STDLIB / "json",
            STDLIB / "textwrap.py",
            STDLIB / "string.py",
            STDLIB / "shlex.py",
            "--model",
            tok_dir,
            "--source-depth",
            0,
            "--held-out-frac",
            0.5,
            "--seed",
            seed,
            "--seq-len",
            64,
            "--out",
            out,
        )
        assert result.exit_code == 0, result.output
        outs.append(load_verified(out, TokensManifest).summary)
    assert outs[0].heldout_sources == outs[1].heldout_sources and len(outs[0].heldout_sources) == 2
    train = {c.source for c in outs[0].sources if c.split == "train"}
    assert train.isdisjoint(outs[0].heldout_sources) and len(train) == 2


def test_a_held_out_fraction_far_from_the_tokens_share_is_said(tmp_path, tok_dir):
    """--held-out-frac counts sources: a tiny source held out is a tiny held-out set, and tokenize says so; sources of
    one size (the control) get no note."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "big.py").write_text((STDLIB / "textwrap.py").read_text())
    (corpus / "tiny.py").write_text("x = 1\n")
    notes = {}
    for name, inputs in (("uneven", [corpus]), ("even", [STDLIB / "textwrap.py", STDLIB / "shlex.py"])):
        held = 0.5
        out = tmp_path / name
        for seed in range(8):  # the seed that holds out the tiny source (or, for the control, any)
            result = tokenize(*inputs, "--model", tok_dir, "--held-out-frac", held, "--seed", seed, "--seq-len", 64,
                              "--out", out, "--overwrite")  # fmt: skip
            assert result.exit_code == 0, result.output
            summary = load_verified(out, TokensManifest).summary
            if name == "even" or summary.heldout_sources == ["corpus/tiny.py"]:
                break
        notes[name] = " ".join(result.stderr.split())
    assert "--held-out-frac 0.5 held out 1 of 2 sources but" in notes["uneven"] and "differ in size" in notes["uneven"]
    assert "differ in size" not in notes["even"]


def test_a_fraction_under_one_whole_source_is_said_as_such_with_flags_that_apply(tmp_path, tok_dir):
    """Four sources of one size and --held-out-frac 0.05: one whole source (25 %) is held out. The note blamed the
    sources' sizes and offered another --seed (which holds out another quarter) and --source-depth (refused for a
    file input; found in review). It names the cause and offers only what applies."""
    import json as _json

    data = tmp_path / "data.jsonl"
    text = (STDLIB / "textwrap.py").read_text()[:4000]
    data.write_text("".join(_json.dumps({"text": text, "source": f"s{i}"}) + "\n" for i in range(4)))
    result = tokenize(data, "--model", tok_dir, "--held-out-frac", 0.05, "--seq-len", 64, "--out", tmp_path / "o")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert "--held-out-frac 0.05 held out 1 of 4 sources" in said and "at least one whole source is held out" in said
    assert "differ in size" not in said and "--source-depth" not in said and "--seed" not in said


def test_a_tiny_source_drawn_among_many_is_said_as_sizes_not_as_too_large_a_share(tmp_path, tok_dir):
    """Ten sources, one of a single line, --held-out-frac 0.02: one source (10 %) held out, but when it is the tiny
    one the tokens held out are far fewer than asked, and the note told how to get a smaller set (found in
    review). It says the sizes differ and offers another seed."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = (STDLIB / "textwrap.py").read_text()[:3000]
    for i in range(9):
        (corpus / f"m{i}.py").write_text(text)
    (corpus / "tiny.py").write_text("x = 1\n")
    for seed in range(40):
        out = tmp_path / f"o{seed}"
        result = tokenize(corpus, "--model", tok_dir, "--held-out-frac", 0.02, "--seed", seed, "--seq-len", 64,
                          "--out", out)  # fmt: skip
        assert result.exit_code == 0, result.output
        if load_verified(out, TokensManifest).summary.heldout_sources == ["corpus/tiny.py"]:
            break
    else:
        pytest.fail("no seed held out the tiny source")
    said = " ".join(result.stderr.split())
    assert "held out 1 of 10 sources but" in said and "the sources differ in size" in said and "--seed" in said
    assert "smaller held-out set" not in said


def test_binary_files_are_skipped_and_counted_and_globs_filter(tmp_path, tok_dir):
    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / "pkg" / "a.py").write_text("x = 1\n" * 50)
    (corpus / "pkg" / "b.md").write_text("# title\n" * 50)
    (corpus / "pkg" / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    (corpus / ".git").mkdir()
    (corpus / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    out = tmp_path / "out"
    result = tokenize(corpus, "--model", tok_dir, "--exclude", "*.md", "--seq-len", 32, "--out", out)
    assert result.exit_code == 0, result.output
    summary = load_verified(out, TokensManifest).summary
    assert summary.skipped_binary_files == 1 and summary.documents == 1
    assert [c.source for c in summary.sources] == ["corpus/pkg"]
    assert "1 binary file skipped" in result.stdout  # one, not "1 binary files"
    out2 = tmp_path / "out2"
    assert tokenize(corpus, "--model", tok_dir, "--include", "*.md", "--out", out2).exit_code == 0
    assert load_verified(out2, TokensManifest).summary.documents == 1


def test_default_output_goes_to_the_workspace(tmp_path, tok_dir):
    result = tokenize(STDLIB / "textwrap.py", "--model", tok_dir, "--workspace", tmp_path, "--json")
    assert result.exit_code == 0, result.output
    path = Path(json.loads(result.stdout)["path"])
    assert path.parent == tmp_path / "tokens" and path.name.endswith("-textwrap.py")


def test_settings_come_from_env_and_config_file(tmp_path, tok_dir):
    config = tmp_path / "usaf.toml"
    config.write_text(f"[tokenize]\nseq_len = 48\nmodel = '{tok_dir}'\n")
    out = tmp_path / "out"
    result = tokenize(STDLIB / "textwrap.py", "--config", config, "--out", out, env={"USAF_STRIDE": "8"})
    assert result.exit_code == 0, result.output
    manifest = load_verified(out, TokensManifest)
    assert (manifest.config["seq_len"], manifest.config["stride"]) == (48, 8)
    out2 = tmp_path / "out2"
    result = tokenize(
        STDLIB / "textwrap.py", "--config", config, "--seq-len", 40, "--out", out2, env={"USAF_SEQ_LEN": "44"}
    )
    assert load_verified(out2, TokensManifest).config["seq_len"] == 40  # the flag wins


# ---- bad input: one clear line, exit 2, nothing written ----------------------------------------


def test_inputs_given_as_relative_paths_are_recorded_by_their_absolute_ones(tmp_path, tok_dir, monkeypatch):
    """"tiny", "data" recorded as given named nothing once the manifest was read from another directory (found in
    review). The control: a hub id, no path on this machine, is kept as given (usaf.artifacts.writer._absolute)."""
    from usaf.artifacts.manifest import InputRecord
    from usaf.artifacts.writer import _absolute

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.py").write_text("a = 1\n" * 40)
    shutil.copytree(tok_dir, tmp_path / "tok")
    monkeypatch.chdir(tmp_path)
    assert tokenize("data", "--model", "tok", "--out", "toks").exit_code == 0
    recorded = {i.role: i.path for i in load_verified(tmp_path / "toks", TokensManifest).inputs}
    assert recorded == {"tokenizer": str(tmp_path / "tok"), "corpus": str(tmp_path / "data")}
    hub = InputRecord(role="model", kind="hf_model", path="Qwen/Qwen3-30B-A3B", fingerprint="f")
    assert _absolute(hub) == hub


def test_missing_path(tmp_path, tok_dir):
    out = tmp_path / "out"
    assert_clean_failure(tokenize(tmp_path / "nope", "--model", tok_dir, "--out", out), out, "nope", "no such file")
    if hasattr(os, "mkfifo"):  # a pipe was walked as a directory: "not a directory", hint "fix its permissions"
        os.mkfifo(tmp_path / "pipe.txt")
        assert_clean_failure(tokenize(tmp_path / "pipe.txt", "--model", tok_dir, "--out", out), out,
                             "pipe.txt: not a file or directory (a pipe, socket or device)")  # fmt: skip


def test_empty_corpus(tmp_path, tok_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    assert_clean_failure(tokenize(empty, "--model", tok_dir, "--out", out), out, "empty corpus")
    (empty / "blob.bin").write_bytes(b"\x00" * 10)
    assert_clean_failure(tokenize(empty, "--model", tok_dir, "--out", out), out, "1 binary file skipped")
    (empty / "blank.txt").write_text("   \n\n")
    assert_clean_failure(tokenize(empty, "--model", tok_dir, "--out", out), out, "empty corpus")


def test_a_held_out_split_that_comes_out_empty_is_refused(tmp_path, tok_dir):
    """An empty __init__.py held out gave exit 0 and a 0-line heldout.jsonl (found in review); the control holds
    out a source with text."""
    corpus = tmp_path / "pkg"
    corpus.mkdir()
    (corpus / "a.py").write_text("a = 1\n" * 40)
    (corpus / "__init__.py").write_text("")
    (corpus / "c.py").write_text("c = 2\n" * 40)
    out = tmp_path / "out"
    args = [corpus, "--model", tok_dir, "--out", out]
    assert_clean_failure(tokenize(*args, "--held-out", "__init__.py"), out, "no held-out sequences", "__init__.py")
    assert tokenize(*args, "--held-out", "c.py").exit_code == 0
    assert load_verified(out, TokensManifest).summary.heldout_sequences > 0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_pipe_under_a_directory_input_is_skipped_and_said(tmp_path, tok_dir):
    """It was skipped in silence (found in review); the control: alone in the directory, it is named in the empty
    corpus's line."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    os.mkfifo(corpus / "events.txt")
    out = tmp_path / "out"
    assert_clean_failure(tokenize(corpus, "--model", tok_dir, "--out", out), out,
                         "(1 special file (pipe, socket or device) skipped)")  # fmt: skip
    (corpus / "a.py").write_text("a = 1\n" * 40)
    result = tokenize(corpus, "--model", tok_dir, "--out", out)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0 and f"1 special file (pipe, socket or device) skipped, e.g. {corpus / 'events.txt'}" \
        in said, said


def test_an_input_given_twice_or_under_another_is_read_once_and_said(tmp_path, tok_dir):
    """The same file twice, or a directory and a file under it: read once, in silence (found in review). The control:
    two other files are both read, with no note."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("a = 1\n" * 40)
    (corpus / "b.py").write_text("b = 2\n" * 40)
    cases = [((corpus / "a.py", corpus / "a.py"), 1, "a.py"), ((corpus, corpus / "b.py"), 2, "b.py"),
             ((corpus / "a.py", corpus / "b.py"), 2, None)]  # fmt: skip
    for i, (inputs, documents, again) in enumerate(cases):
        out = tmp_path / f"out{i}"
        result = tokenize(*inputs, "--model", tok_dir, "--out", out)
        assert result.exit_code == 0, result.output
        assert load_verified(out, TokensManifest).summary.documents == documents
        said = " ".join(result.stderr.split())
        if again is None:
            assert "already given" not in said, said
        else:
            assert f"1 input already given by an earlier input, read once: {corpus / again}" in said, said


def test_utf16_text_is_named_as_such_not_skipped_as_binary(tmp_path, tok_dir):
    """UTF-16 text has NUL bytes: given by name it was "empty corpus ... (1 binary file skipped)" with a hint about
    --include (found in review); under a directory it was counted as binary. The control: a binary file still is."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "notes.txt").write_text("hello world\n" * 20, encoding="utf-16")
    out = tmp_path / "out"
    assert_clean_failure(tokenize(corpus / "notes.txt", "--model", tok_dir, "--out", out), out,
                         "notes.txt: UTF-16 text; usaf reads UTF-8", "iconv -f UTF-16 -t UTF-8")  # fmt: skip
    (corpus / "blob.bin").write_bytes(b"\x00" * 10)
    assert_clean_failure(tokenize(corpus, "--model", tok_dir, "--out", out), out,
                         "(1 binary file, 1 UTF-16/UTF-32 text file (convert to UTF-8) skipped)",
                         "convert the UTF-16/UTF-32 files to UTF-8")  # fmt: skip
    (corpus / "a.py").write_text("a = 1\n" * 40)
    result = tokenize(corpus, "--model", tok_dir, "--out", out)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0 and f"1 UTF-16 or UTF-32 text file skipped, e.g. {corpus / 'notes.txt'}" in said
    # the artifact records it too: its manifest said nothing was skipped (found in review)
    summary = json.loads((out / "manifest.json").read_text())["summary"]
    assert summary["skipped_wide_files"] == 1 and summary["skipped_binary_files"] == 1
    assert "1 UTF-16/UTF-32 file skipped" in " ".join(result.stdout.split())


def test_undecodable_file(tmp_path, tok_dir):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("fine text\n" * 20)
    (corpus / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1") * 20)
    out = tmp_path / "out"
    assert_clean_failure(
        tokenize(corpus, "--model", tok_dir, "--out", out), out, "latin1.txt", "not UTF-8", "--decode-errors"
    )
    skipped = tokenize(corpus, "--model", tok_dir, "--out", out, "--decode-errors", "skip")
    assert skipped.exit_code == 0 and "1 file not UTF-8, skipped (--decode-errors skip)" in skipped.stderr
    summary = load_verified(out, TokensManifest).summary
    assert (summary.documents, summary.skipped_undecodable_files) == (1, 1)
    out2 = tmp_path / "out2"
    replaced = tokenize(corpus, "--model", tok_dir, "--out", out2, "--decode-errors", "replace")
    assert replaced.exit_code == 0, replaced.output
    said = " ".join(replaced.stderr.split())
    assert "1 file not UTF-8, read with their undecodable bytes replaced by U+FFFD (--decode-errors replace)" in said
    summary = load_verified(out2, TokensManifest).summary
    assert (summary.documents, summary.skipped_undecodable_files, summary.replaced_undecodable_files) == (2, 0, 1)


@pytest.mark.parametrize(
    ("line", "needles"),
    [
        ("[1, 2, 3]", ["bad.jsonl:2", "a JSON list, not an object"]),
        ('{"text": "ok"', ["bad.jsonl:2", "not valid JSON", "at the end of the line: cut short?"]),  # "column 1"
        ('{"text": "a\tb"}', ["bad.jsonl:2", "(Invalid control character at column 12)"]),  # said "at at" (review)
        (
            '{"body": "no text field", "id": 3}',
            ["bad.jsonl:2", "no 'text' field", "keys: body, id", "--text-field"],
        ),
        ('{"text": 42}', ["bad.jsonl:2", "'text' is an integer, not a string"]),
        ('{"messages": [{"role": "user"}]}', ["bad.jsonl:2", "'messages' must be"]),
        ('{"input_ids": [1, 2], "labels": [1]}', ["bad.jsonl:2", "equal-length"]),
        ('{"input_ids": [1, 99999]}', ["bad.jsonl:2", "token id 99999 is outside"]),
        ('{"text": "hello \\ud800 world"}', ["bad.jsonl:2", "lone surrogate"]),  # tracebacks until found in review
        ('{"text": "ok", "source": "a\\udc80"}', ["bad.jsonl:2", "lone surrogate"]),
        ('{"messages": [{"role": "user", "content": "\\ud800"}]}', ["bad.jsonl:2", "lone surrogate"]),
    ],
)
def test_malformed_jsonl_lines_name_file_and_line(tmp_path, tok_dir, line, needles):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a good first line"}\n' + line + "\n")
    out = tmp_path / "out"
    assert_clean_failure(tokenize(bad, "--model", tok_dir, "--out", out), out, *needles)


def test_seq_len_beyond_the_model_maximum(tmp_path, tok_dir):
    out = tmp_path / "out"
    assert_clean_failure(
        tokenize(STDLIB / "textwrap.py", "--model", tok_dir, "--seq-len", 4096, "--out", out),
        out,
        "--seq-len 4096",
        "maximum of 1024",
    )
    model_dir = tmp_path / "model"  # a model's config.json wins over the tokenizer's own limit
    build_tiny_tokenizer(model_dir, model_max_length=100_000)
    (model_dir / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    assert_clean_failure(
        tokenize(STDLIB / "textwrap.py", "--model", model_dir, "--seq-len", 512, "--out", out),
        out,
        "maximum of 256",
    )


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--seq-len", "0"], ["--seq-len = 0", "greater than or equal to 2"]),
        (["--seq-len", "64", "--stride", "64"], ["--stride 64 must be smaller than --seq-len 64"]),
        (["--held-out", "nosuchpkg"], ["--held-out nosuchpkg: matches no source"]),
        (["--held-out-frac", "1.5"], ["--held-out-frac = 1.5"]),
        (["--decode-errors", "ignore"], ["--decode-errors = 'ignore'"]),
    ],
)
def test_bad_values(tmp_path, tok_dir, args, needles):
    out = tmp_path / "out"
    result = tokenize(STDLIB / "json", "--model", tok_dir, "--out", out, *args)
    assert_clean_failure(result, out, *needles)


def test_missing_model_and_bad_model(tmp_path):
    out = tmp_path / "out"
    assert_clean_failure(tokenize(STDLIB / "json", "--out", out), out, "--model is required")
    assert_clean_failure(
        tokenize(STDLIB / "json", "--model", tmp_path / "nomodel", "--out", out),
        out,
        "--model",
        "no such directory",
    )
    (tmp_path / "emptymodel").mkdir()
    assert_clean_failure(
        tokenize(STDLIB / "json", "--model", tmp_path / "emptymodel", "--out", out),
        out,
        "no tokenizer files",
    )
    # a config.json alone: transformers would make a one-token tokenizer of it
    (tmp_path / "configonly").mkdir()
    (tmp_path / "configonly" / "config.json").write_text('{"model_type": "qwen3_moe"}')
    assert_clean_failure(
        tokenize(STDLIB / "json", "--model", tmp_path / "configonly", "--out", out),
        out,
        "no tokenizer files",
    )


def test_existing_output_is_not_clobbered(tmp_path, tok_dir):
    out = tmp_path / "out"
    assert tokenize(STDLIB / "textwrap.py", "--model", tok_dir, "--out", out).exit_code == 0
    before = (out / "manifest.json").read_text()
    result = tokenize(STDLIB / "string.py", "--model", tok_dir, "--out", out)
    assert result.exit_code == 2 and "already exists" in result.stderr and "--overwrite" in result.stderr
    assert (out / "manifest.json").read_text() == before
    assert tokenize(STDLIB / "string.py", "--model", tok_dir, "--out", out, "--overwrite").exit_code == 0
    assert load_verified(out, TokensManifest).summary.sources[0].source == "string.py"


def test_ctrl_c_leaves_no_partial_output(tmp_path, tok_dir, monkeypatch):
    from usaf.cli import progress

    def interrupt(self, amount, **counters):
        raise KeyboardInterrupt

    monkeypatch.setattr(progress.RichProgress, "advance", interrupt)
    out = tmp_path / "out"
    result = tokenize(STDLIB / "json", "--model", tok_dir, "--out", out)
    assert result.exit_code == 130 and "interrupted" in result.stderr
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_local_tokenizer_directory_is_never_looked_up_on_the_hub(tmp_path, tok_dir, monkeypatch):
    """A relative --model tok (a tokenizer without config.json) was looked up as a hub repository of that name, and
    hf_hub_download would fetch a config when online (found in review). The control: a hub id is read from the
    cache only."""
    import huggingface_hub

    from usaf.data.tokenizer import model_max_positions

    calls = []

    def download(repo, filename, **kwargs):
        calls.append((repo, kwargs))
        raise OSError("not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.chdir(tok_dir.parent)
    assert model_max_positions(tok_dir.name) is None and calls == []
    assert model_max_positions("org/some-model") is None
    assert calls == [("org/some-model", {"local_files_only": True})]


def test_inputs_of_the_same_name_stay_separate_sources(tmp_path, tok_dir):
    """pA/src and pB/src were one source 'src' (their text packed together, a held-out split impossible; found in
    review). The control: inputs of different names keep their names as they were."""
    for project in ("pA", "pB"):
        (tmp_path / project / "src").mkdir(parents=True)
        (tmp_path / project / "src" / "main.py").write_text(f"name = {project!r}\n" * 40)
    (tmp_path / "pA" / "lib").mkdir()
    (tmp_path / "pA" / "lib" / "util.py").write_text("u = 1\n" * 40)
    out = tmp_path / "out"
    result = tokenize(tmp_path / "pA" / "src", tmp_path / "pB" / "src", "--model", tok_dir, "--source-depth", 0,
                      "--held-out-frac", 0.5, "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = load_verified(out, TokensManifest).summary
    assert sorted(s.source for s in summary.sources) == ["pA/src", "pB/src"] and summary.heldout_sequences > 0
    control = tokenize(tmp_path / "pA" / "src", tmp_path / "pA" / "lib", "--model", tok_dir, "--out", tmp_path / "c")
    assert control.exit_code == 0, control.output
    names = sorted(s.source for s in load_verified(tmp_path / "c", TokensManifest).summary.sources)
    assert names == ["lib/util.py", "src/main.py"]


def test_a_value_refused_after_the_settings_are_read_is_named_where_it_was_set(tmp_path, tok_dir):
    """A --seq-len from USAF_SEQ_LEN past the model's maximum, a held_out from a --config table matching no source,
    and a --workspace that is a file were each refused naming a flag never given (--seq-len, --held-out, and an
    --out made from the workspace; found in review), as was a USAF_WORKSPACE that is a file (--workspace). The
    control: from the flags, the flags are named."""
    text = tmp_path / "a.txt"
    text.write_text("x = 1\n" * 40)
    toml = tmp_path / "d.toml"
    toml.write_text('[tokenize]\nheld_out = ["zzz"]\n')
    (tmp_path / "wsfile").write_text("")
    cases = [
        ((), {"USAF_SEQ_LEN": "100000"}, "error: USAF_SEQ_LEN 100000 exceeds the model's maximum"),
        (("--seq-len", 100000), None, "error: --seq-len 100000 exceeds the model's maximum"),
        (("--config", toml), None, f"error: --config {toml} [tokenize] held_out zzz: matches no source"),
        (("--held-out", "zzz"), None, "error: --held-out zzz: matches no source"),
        (("--workspace", tmp_path / "wsfile"), None, f"error: --workspace {tmp_path / 'wsfile'}: not a directory"),
        ((), {"USAF_WORKSPACE": str(tmp_path / "wsfile")}, f"error: USAF_WORKSPACE {tmp_path / 'wsfile'}: not a"),
    ]
    for args, env, said in cases:
        result = tokenize(text, "--model", tok_dir, *args, env=env)
        assert result.exit_code == 2 and said in " ".join(result.stderr.split()), (args, result.output)


def test_a_refused_tokenize_leaves_none_of_the_directories_it_made(tmp_path, tok_dir):
    """A malformed JSONL refused after the output's lock was taken left --out deep/er/out's parents, and an empty
    workspace folder, behind (found in review). The control: a tokenize that succeeds keeps them, its output in them;
    a directory that existed before stays."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "broken\n')
    (tmp_path / "there").mkdir()
    for where in (("--out", tmp_path / "deep" / "er" / "out"), ("--workspace", tmp_path / "ws" / "a"),
                  ("--out", tmp_path / "there" / "new" / "out")):  # fmt: skip
        result = tokenize(bad, "--model", tok_dir, *where)
        assert result.exit_code == 2 and "not valid JSON" in " ".join(result.stderr.split()), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "there"]
    assert list((tmp_path / "there").iterdir()) == []
    good = tmp_path / "good.txt"
    good.write_text("x = 1\n" * 40)
    assert tokenize(good, "--model", tok_dir, "--out", tmp_path / "deep" / "er" / "out").exit_code == 0
    assert (tmp_path / "deep" / "er" / "out" / "manifest.json").is_file()


def test_a_file_name_that_is_not_utf8_is_a_source_with_its_bytes_escaped(tmp_path, tok_dir):
    """A Latin-1 file name under a directory input crashed tokenize at its first write, with a traceback (the name, held
    as surrogate escapes, cannot be written as UTF-8; found in review). Its source name shows the byte escaped, and
    --held-out takes it by that name. The control: a UTF-8 name is kept as it is."""
    root = tmp_path / "corpus"
    root.mkdir()
    latin1 = os.fsdecode(b"caf\xe9.py")  # '\udce9' in Python
    (root / latin1).write_text("x = 1\n" * 40)
    (root / "caf\u00e9s.py").write_text("y = 2\n" * 40)
    out = tmp_path / "out"
    result = tokenize(root, "--model", tok_dir, "--held-out", "caf\\xe9*", "--out", out)
    assert result.exit_code == 0, result.output
    summary = load_verified(out, TokensManifest).summary
    split = {s.source: s.split for s in summary.sources}
    assert split == {"corpus/caf\\xe9.py": "heldout", "corpus/caf\u00e9s.py": "train"}, split
    assert {line["source"] for line in read_jsonl(out / "heldout.jsonl")} == {"corpus/caf\\xe9.py"}


def test_an_argument_that_is_not_utf8_is_refused_in_one_line(tmp_path, tok_dir):
    """Given by name, such a file reached the manifest's record of the inputs and crashed there. usaf refuses any
    argument that is not UTF-8, naming it escaped, before it runs. The control: the same file under a UTF-8 name is
    tokenized."""
    latin1 = tmp_path / os.fsdecode(b"caf\xe9.py")
    latin1.write_text("x = 1\n" * 40)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "usaf", "tokenize", str(latin1), "--model", str(tok_dir), "--out", str(out)]
    refused = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=300)
    assert refused.returncode == 2, refused.stderr
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("error: ") and "caf\\xe9.py: not UTF-8 text" in lines[0], refused.stderr
    assert "Traceback" not in refused.stderr and not out.exists() and os.listdir(tmp_path) == [latin1.name]
    latin1.rename(tmp_path / "cafe.py")
    command[4] = str(tmp_path / "cafe.py")
    taken = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert taken.returncode == 0, taken.stderr



def test_a_flag_value_that_is_not_utf8_is_refused_naming_the_flag():
    """``--out o\\xe9`` was refused as "o\\xe9", no flag named, with a hint to pass the directory holding it, which
    is for inputs (found in review). The flag is named in both spellings; a switch before an input is not taken for
    its flag (the control), nor is a UTF-8 argument refused."""
    from usaf.cli.app import _refuse_undecodable
    from usaf.errors import UsafError

    name = os.fsdecode(b"o\xe9")
    for arguments in (["tokenize", "b.py", "--out", name], ["tokenize", "b.py", f"--out={name}"]):
        with pytest.raises(UsafError) as caught:
            _refuse_undecodable(arguments)
        assert caught.value.message.startswith("--out o\\xe9: not UTF-8 text"), caught.value.message
        assert "the directory that holds it" not in caught.value.hint
    with pytest.raises(UsafError) as caught:
        _refuse_undecodable(["tokenize", "--overwrite", name, "--model", "m"])
    assert caught.value.message.startswith("o\\xe9: not UTF-8 text") and "directory that holds it" in caught.value.hint
    _refuse_undecodable(["tokenize", "--overwrite", "café.py", "--out", "o"])

def test_exclude_prunes_a_directory_only_where_it_excludes_all_of_it_and_jsonl_is_any_case(tmp_path, tok_dir):
    """--exclude 'a/?' pruned a/ whole, a/xy.py too, which the pattern does not match; an upper-case .JSONL file
    was read as plain text, its JSON tokenized (both found in review). The control: 'a/*' prunes a/."""
    from usaf.data.corpus import discover

    root = tmp_path / "px"
    for rel in ("a/x", "a/xy.py", "b/keep.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")

    def found(pattern: str) -> list[str]:
        corpus = discover([root], include=[], exclude=[pattern], source_depth=1)
        return sorted(f.path.relative_to(root).as_posix() for f in corpus.files)

    assert found("a/?") == ["a/xy.py", "b/keep.py"]
    assert found("a/*") == ["b/keep.py"]
    upper = tmp_path / "upper.JSONL"
    upper.write_text(json.dumps({"text": "def f():\n    return 1\n"}) + "\n")
    out = tmp_path / "out"
    assert tokenize(upper, "--model", tok_dir, "--out", out).exit_code == 0
    assert load_verified(out, TokensManifest).summary.sources[0].source == "upper.JSONL"
    (row,) = read_jsonl(out / "train.jsonl")
    assert b'"text"' not in json.dumps(row).encode() and row["input_ids"]  # the text, not the JSON line


def test_a_seed_without_a_held_out_fraction_is_refused_not_ignored(tmp_path, tok_dir, monkeypatch):
    """--seed draws --held-out-frac's sources and nothing else: alone it was accepted and did nothing (found in
    review); from USAF_SEED (train's and eval's too) a note. The control: with --held-out-frac it is taken."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a", "b", "c"):
        (corpus / f"{name}.py").write_text(f"{name} = 1\n" * 40)
    args = [corpus, "--model", tok_dir]
    assert_clean_failure(tokenize(*args, "--seed", 3, "--out", tmp_path / "o1"), tmp_path / "o1",
                         "--seed 3: only --held-out-frac draws with it")  # fmt: skip
    assert tokenize(*args, "--seed", 3, "--held-out-frac", 0.3, "--out", tmp_path / "o2").exit_code == 0
    monkeypatch.setenv("USAF_SEED", "3")
    noted = tokenize(*args, "--out", tmp_path / "o3")
    assert noted.exit_code == 0 and "USAF_SEED 3: only --held-out-frac draws with it" in noted.stderr, noted.output


def test_usaf_outputs_under_a_directory_input_are_never_read_and_one_given_is_refused(tmp_path, tok_dir):
    """The workspace defaults to the current directory: `usaf tokenize .` read the earlier tokens' train.jsonl and
    heldout.jsonl back as pre-tokenized lines (held-out sequences into train) and every manifest.json as text
    (found in review). usaf's outputs are skipped whatever --all-files says, and said; a web app's own
    manifest.json (no usaf record) is the user's text, read as before (the control)."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "a.py").write_text((STDLIB / "textwrap.py").read_text())
    (project / "web").mkdir()
    (project / "web" / "manifest.json").write_text('{"name": "my app", "start_url": "/"}\n')
    first = tokenize(project / "src", "--model", tok_dir, "--seq-len", 64, "--workspace", project, "--json")
    assert first.exit_code == 0, first.output
    earlier = Path(json.loads(first.stdout)["path"])
    assert earlier.parent == project / "tokens"
    cache = project / "cache" / "eval-base" / "k"  # an eval's base-pass cache entry, as eval saves one
    import torch

    from usaf.stages.eval import cache as eval_cache
    from usaf.stages.eval.passes import PassResult

    eval_cache.save(
        cache, "k", {}, PassResult(torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.int64), {}, 1, 0.0)
    )

    for flags in ([], ["--all-files"]):
        out = tmp_path / f"again{len(flags)}"
        result = tokenize(project, "--model", tok_dir, "--seq-len", 64, "--out", out, *flags)
        assert result.exit_code == 0, result.output
        assert "skipped 2 usaf outputs under the directory inputs" in " ".join(result.stderr.split())
        summary = load_verified(out, TokensManifest).summary
        assert summary.documents == 2  # src/a.py and web/manifest.json; nothing of tokens/ or the eval cache
        assert {s.source for s in summary.sources} == {"project/src", "project/web"}

    out = tmp_path / "out"
    result = tokenize(earlier, "--model", tok_dir, "--seq-len", 64, "--out", out)
    assert_clean_failure(result, out, f"{earlier}: a usaf tokens artifact, not text to tokenize", "--data")


GPT_OSS_LIKE = (  # gpt-oss's turn ends: <|return|> for the last reply, <|end|> for every earlier turn
    "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}"
    "{%- if m.role == 'assistant' and loop.last %}<|return|>{% else %}<|end|>{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}"
)
INCONSISTENT = (  # every reply in a header first: no prefix render, and no marker's surroundings, are the whole's
    "{{ messages | map(attribute='content') | join('|') }}\n"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
)


@pytest.mark.parametrize(
    "template, scored",
    [
        ("qwen3", ["hello friend<|im_end|>\n<think>\n\n</think>\n\nok sure<|im_end|>\n",
                   "<think>\n\n</think>\n\nhello friend<|im_end|>\n"]),
        (GPT_OSS_LIKE, ["hello friendok sure<|return|>", "hello friend<|return|>"]),
        (None, ["hello friend<|im_end|>\nok sure<|im_end|>\n", "hello friend<|im_end|>\n"]),  # ChatML: the control
    ],
    ids=["qwen3", "gpt-oss-like", "chatml"],
)  # fmt: skip
def test_chat_templates_that_render_turns_by_their_place_label_every_reply(tmp_path, tok_dir, template, scored):
    """Qwen3's template gives the last reply an empty <think> block that earlier replies lose: rendering prefixes
    never matched, and every conversation with two replies was refused for the flagship family (found in review).
    The replies are found in the whole render by a marker in their place; the end-of-turn text follows each reply
    where the whole render has it (gpt-oss's earlier turns end with <|end|>, not the <|return|> a last reply has)."""
    from transformers import AutoTokenizer

    model = tmp_path / "tok"
    shutil.copytree(tok_dir, model)
    if template is not None:
        text = (
            (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
            if template == "qwen3"
            else template
        )
        hf = AutoTokenizer.from_pretrained(model)
        hf.chat_template = text
        hf.save_pretrained(model)
    chat = tmp_path / "chat.jsonl"
    two = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello friend"},
           {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok sure"}]  # fmt: skip
    chat.write_text(
        json.dumps({"messages": two, "source": "two"})
        + "\n"
        + json.dumps({"messages": two[:2], "source": "one"})
        + "\n"
    )
    out = tmp_path / "out"
    result = tokenize(chat, "--model", model, "--seq-len", 256, "--out", out)
    assert result.exit_code == 0, result.output
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = {r["source"]: r for r in read_jsonl(out / "train.jsonl")}
    for source, expected in zip(("two", "one"), scored):
        row = rows[source]
        assert tokenizer.decode([t for t, lab in zip(row["input_ids"], row["labels"]) if lab != -100]) == expected

    hf = AutoTokenizer.from_pretrained(model)  # a template that fits neither way is refused, not mislabelled
    hf.chat_template = INCONSISTENT
    hf.save_pretrained(model)
    result = tokenize(chat, "--model", model, "--seq-len", 256, "--out", out.with_name("refused"))
    assert_clean_failure(
        result, out.with_name("refused"), "chat.jsonl:1: the tokenizer's chat template does not render"
    )


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_leave_no_partial_output(tmp_path, tok_dir, name):
    """kill, a scheduler, a container stop (SIGTERM) or a closed terminal (SIGHUP) ended tokenize where it stood, its
    half-written temporary output left where no later run of another output removes it (found in review). They stop
    it as Ctrl-C does: nothing left, the shell's status for the signal."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    command = [sys.executable, "-m", "usaf", "tokenize", STDLIB, "--model", tok_dir, "--out", out]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not leftovers(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # until its temporary output exists
    assert proc.poll() is None and leftovers(tmp_path), "tokenize ended before it could be stopped"
    time.sleep(0.5)  # inside the writing
    proc.send_signal(getattr(signal, name))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + getattr(signal, name), stderr
    assert f"stopped by {name}" in stderr
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("what", ["directory", "file"])
def test_a_directory_or_file_it_may_not_read_is_refused_naming_it(tmp_path, tok_dir, monkeypatch, what):
    """A directory the walk may not list was dropped in silence, its files with it; a file it may not read was called
    a disk error with "pass a path you may write to" (found in review). (As root nothing is unreadable: the refusal
    is the OS's, simulated.) The control: the same tree, readable, is read whole."""
    import os

    corpus = tmp_path / "corpus"
    (corpus / "locked").mkdir(parents=True)
    (corpus / "a.py").write_text("a = 1\n" * 40)
    (corpus / "locked" / "b.py").write_text("b = 2\n" * 40)
    done = tokenize(corpus, "--model", tok_dir, "--out", tmp_path / "control")
    assert done.exit_code == 0 and load_verified(tmp_path / "control", TokensManifest).summary.documents == 2
    denied = corpus / "locked" if what == "directory" else corpus / "locked" / "b.py"
    if what == "directory":
        real = os.scandir
        monkeypatch.setattr(os, "scandir", lambda path=".": _denied(path) if Path(path) == denied else real(path))
    else:
        real_open = Path.open
        monkeypatch.setattr(
            Path, "open", lambda self, *a, **k: _denied(self) if self == denied else real_open(self, *a, **k)
        )
    out = tmp_path / "out"
    assert_clean_failure(tokenize(corpus, "--model", tok_dir, "--out", out), out,
                         f"{denied}: cannot be read (Permission denied)", "--exclude")  # fmt: skip


def _denied(path):
    raise PermissionError(13, "Permission denied", str(path))


def test_ndjson_is_read_as_jsonl_and_a_byte_order_mark_is_no_text(tmp_path, tok_dir, tokenizer):
    """Line-delimited JSON named .ndjson was tokenized as plain text, JSON syntax and all, every label on; a text
    file opening with a UTF-8 byte-order mark trained on three byte tokens of it (found in review). The controls:
    the same conversation as .jsonl, the same text without the mark."""
    conversation = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]}
    rows = {}
    for suffix in (".jsonl", ".ndjson"):
        chat = tmp_path / f"chat{suffix}"
        chat.write_text(json.dumps(conversation) + "\n")
        out = tmp_path / f"out{suffix}"
        assert tokenize(chat, "--model", tok_dir, "--out", out).exit_code == 0
        (rows[suffix],) = read_jsonl(out / "train.jsonl")
    assert rows[".ndjson"]["input_ids"] == rows[".jsonl"]["input_ids"]
    assert rows[".ndjson"]["labels"] == rows[".jsonl"]["labels"] and -100 in rows[".ndjson"]["labels"]

    text = "def f(x):\n    return x\n" * 8
    for name, data in (("plain", text.encode()), ("bom", b"\xef\xbb\xbf" + text.encode())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.py").write_bytes(data)
        assert tokenize(tmp_path / name / "a.py", "--model", tok_dir, "--out", tmp_path / f"t-{name}").exit_code == 0
    (plain,), (bom,) = read_jsonl(tmp_path / "t-plain" / "train.jsonl"), read_jsonl(tmp_path / "t-bom" / "train.jsonl")
    assert bom["input_ids"] == plain["input_ids"] and tokenizer.decode(bom["input_ids"]).startswith("def f(x)")


def test_a_jsonl_file_under_a_directory_input_is_named_with_its_way_out(tmp_path, tok_dir):
    """A repository's .jsonl fixture stopped tokenize with a hint of --text-field alone; lines of one naming their own
    source escaped their directory's held-out split in silence (found in review). Both are said now. The control: a
    JSONL file named by itself gets the hint it had, and lines without a source of their own are said nothing of."""
    repo = tmp_path / "repo"
    for package in ("pkgA", "pkgB"):
        (repo / package).mkdir(parents=True)
        (repo / package / "mod.py").write_text(f"# {package}\n" + "x = 1\n" * 40)
    fixture = repo / "pkgB" / "records.jsonl"
    fixture.write_text(json.dumps({"id": 1, "value": "x"}) + "\n")
    out = tmp_path / "out"
    result = tokenize(repo, "--model", tok_dir, "--out", out)
    assert_clean_failure(result, out, "records.jsonl:1: no 'text' field", "--exclude 'records.jsonl'")
    named = tokenize(fixture, "--model", tok_dir, "--out", out)
    assert_clean_failure(named, out, "records.jsonl:1: no 'text' field")
    assert "--exclude" not in named.stderr

    fixture.write_text(json.dumps({"text": "fixture text " * 20, "source": "other/thing"}) + "\n")
    result = tokenize(repo, "--model", tok_dir, "--held-out", "pkgB", "--out", out)
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert "1 line of JSONL files under the directory inputs name a source of their own" in said
    assert f"{fixture}:1 is other/thing" in said
    fixture.write_text(json.dumps({"text": "fixture text " * 20}) + "\n")
    result = tokenize(repo, "--model", tok_dir, "--held-out", "pkgB", "--out", tmp_path / "control")
    assert result.exit_code == 0 and "a source of their own" not in result.stderr, result.output


def test_special_tokens_strings_in_a_text_file_are_text_and_in_a_jsonl_text_field_special(tmp_path, tok_dir, tokenizer):
    """A text file's "<|endoftext|>" was read as the EOS token, "<|im_start|>" as a chat turn: code about language
    models put EOS mid-document and fake turns into the training text (found in review). In a JSONL text field,
    where pre-rendered chat text goes, they stay special (the control)."""
    text = 'EOS = "<|endoftext|>"\nTURN = "<|im_start|>user"\n' * 4
    special = {tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>")}
    (tmp_path / "code.py").write_text(text)
    (tmp_path / "rendered.jsonl").write_text(json.dumps({"text": text}) + "\n")
    ids = {}
    for name in ("code.py", "rendered.jsonl"):
        out = tmp_path / f"out-{name}"
        assert tokenize(tmp_path / name, "--model", tok_dir, "--out", out).exit_code == 0
        (row,) = read_jsonl(out / "train.jsonl")
        ids[name] = row["input_ids"]
    assert not special & set(ids["code.py"][:-1]) and ids["code.py"][-1] == tokenizer.eos_token_id  # the separator
    assert tokenizer.decode(ids["code.py"][:-1]) == text
    assert special <= set(ids["rendered.jsonl"][:-1])


def test_a_source_field_no_line_has_is_said(tmp_path, tok_dir):
    """--source-field NAME that no JSONL line has was accepted and unused, every line falling back to 'repo' or its
    file's name in silence (found in review; eval's raw JSONL alike). The control: a field the lines have."""
    lines = tmp_path / "lines.jsonl"
    lines.write_text("".join(json.dumps({"text": f"line {i} " * 30, "origin": f"o{i % 2}"}) + "\n" for i in range(4)))
    said = tokenize(lines, "--model", tok_dir, "--source-field", "nosuch", "--out", tmp_path / "said")
    assert said.exit_code == 0, said.output
    assert "--source-field nosuch: no JSONL line has it" in " ".join(said.stderr.split())
    read = tokenize(lines, "--model", tok_dir, "--source-field", "origin", "--out", tmp_path / "read")
    assert read.exit_code == 0 and "no JSONL line has it" not in read.stderr, read.output
    assert {s.source for s in load_verified(tmp_path / "read", TokensManifest).summary.sources} == {"o0", "o1"}


@pytest.mark.parametrize("stride", [None, 16])
def test_loss_tokens_count_the_positions_the_loss_is_taken_at(tmp_path, tok_dir, stride):
    """The summary's loss tokens counted every label not -100, the sequence's first too, whose token nothing before
    it predicts (found in review: 4,978 loss tokens of 4,978 tokens in 312 sequences). Each sequence's count is what
    training and eval score (labels 1.. not -100), recounted here from the files; the stride's masked heads
    included."""
    out = tmp_path / "out"
    result = tokenize(STDLIB / "textwrap.py", "--model", tok_dir, "--seq-len", 64, "--out", out,
                      *(("--stride", stride) if stride else ()))  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = read_jsonl(out / "train.jsonl")
    scored = sum(sum(1 for label in r["labels"][1:] if label != -100) for r in rows)
    summary = load_verified(out, TokensManifest).summary
    assert summary.train_loss_tokens == scored
    assert sum(c.loss_tokens for c in summary.sources if c.split == "train") == scored
    assert summary.train_loss_tokens < summary.train_tokens  # control: not every token, as it was counted
    assert f"{scored:,}" in result.stdout


def test_an_input_named_and_left_out_by_include_or_exclude_is_said(tmp_path, tok_dir):
    """A JSONL named beside a .py under --include '*.py' was left out in silence, the output named after it; alone it
    was "no text or JSONL files in a.jsonl" (found in review). The control: without the filter, nothing is said."""
    (tmp_path / "a.jsonl").write_text('{"text": "hello world"}\n')
    (tmp_path / "b.py").write_text("x = 1\n" * 20)
    both = tokenize(tmp_path / "a.jsonl", tmp_path / "b.py", "--model", tok_dir, "--include", "*.py",
                    "--out", tmp_path / "t1")  # fmt: skip
    said = " ".join(both.stderr.split())
    named = f"1 input given by name left out by --include *.py ({tmp_path / 'a.jsonl'})"
    assert both.exit_code == 0 and named in said, both.output
    alone = tokenize(tmp_path / "a.jsonl", "--model", tok_dir, "--exclude", "*.jsonl", "--out", tmp_path / "t2")
    assert alone.exit_code == 2
    assert "(1 file left out by --include/--exclude)" in " ".join(alone.stderr.split()), alone.output
    plain = tokenize(tmp_path / "a.jsonl", tmp_path / "b.py", "--model", tok_dir, "--out", tmp_path / "t3")
    assert plain.exit_code == 0 and "left out by" not in plain.stderr


def test_a_json_file_named_is_said_to_be_read_as_text(tmp_path, tok_dir):
    """lines.json holding JSON Lines was trained on as text, JSON syntax and all, in silence (found in review). The
    controls: the same lines as .jsonl are records, and a .json under a directory input (a project's package.json)
    is its text without a word."""
    line = '{"text": "hello world, a record"}\n'
    (tmp_path / "lines.json").write_text(line * 3)
    (tmp_path / "lines.jsonl").write_text(line * 3)
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "package.json").write_text('{"name": "app"}\n')
    (tmp_path / "project" / "main.py").write_text("x = 1\n" * 20)
    named = tokenize(tmp_path / "lines.json", "--model", tok_dir, "--out", tmp_path / "t1")
    assert named.exit_code == 0
    assert "lines.json: a .json file is read as plain text, JSON syntax and all" in " ".join(named.stderr.split())
    for control in (tmp_path / "lines.jsonl", tmp_path / "project"):
        result = tokenize(control, "--model", tok_dir, "--out", tmp_path / f"t-{control.name}")
        assert result.exit_code == 0 and ".json file is read as plain text" not in result.stderr, result.output


def test_a_pretokenized_line_past_seq_len_gets_a_hint_that_does_not_go_in_a_circle(tmp_path, tok_dir):
    """"raise --seq-len", then past the model's maximum "lower it": no way on for a line longer than the model takes
    (found in review). The hint names splitting the line and the text; the control: a line that fits is read."""
    (tmp_path / "l.jsonl").write_text(json.dumps({"input_ids": [7] * 600}) + "\n")
    result = tokenize(tmp_path / "l.jsonl", "--model", tok_dir, "--seq-len", 512, "--out", tmp_path / "t")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "pre-tokenized line of 600 tokens exceeds --seq-len 512" in said, result.output
    assert "split the line into pieces that fit, or give the text instead" in said
    fits = tokenize(tmp_path / "l.jsonl", "--model", tok_dir, "--seq-len", 600, "--out", tmp_path / "t2")
    assert fits.exit_code == 0, fits.output


def test_a_relative_workspace_gives_outputs_named_in_full(tmp_path, tok_dir, monkeypatch):
    """With a relative USAF_WORKSPACE the outputs were printed relative (``tokens → ws/tokens/...``) beside absolute
    paths elsewhere (found in review). The control: the output is where the relative workspace says."""
    (tmp_path / "a.py").write_text("x = 1\n" * 20)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    for env, args, name in (({"USAF_WORKSPACE": "ws"}, (), "ws"), (None, ("--workspace", "ws2"), "ws2"),
                            (None, ("--workspace", "sub/../ws3"), "ws3")):  # fmt: skip  (the .. was kept; review)
        result = tokenize("a.py", "--model", tok_dir, *args, env=env)
        said = " ".join(result.stdout.split() + result.stderr.split())
        where = tmp_path / name / "tokens"
        assert result.exit_code == 0 and f"tokens → {where}/" in said, said
        assert len(list(where.iterdir())) == 1


def test_a_held_out_fraction_of_a_single_file_says_to_split_it(tmp_path, tok_dir):
    """One big file and --held-out-frac: the hint offered --source-depth alone, which is refused for a file, a dead
    end (found in review). It says sources are held out whole and to split the file. The control: two files split."""
    result = tokenize(STDLIB / "textwrap.py", "--model", tok_dir, "--held-out-frac", 0.1, "--out", tmp_path / "one")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "the corpus has only 1 source; nothing left to hold out" in said, said
    assert "split a single file into several (a file given by name is one source)" in said
    assert not (tmp_path / "one").exists()
    two = tokenize(STDLIB / "textwrap.py", STDLIB / "shlex.py", "--model", tok_dir, "--held-out-frac", 0.5, "--out",
                   tmp_path / "two")  # fmt: skip
    assert two.exit_code == 0, two.output
