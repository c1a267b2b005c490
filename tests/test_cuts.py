"""A long text encoded in pieces gives the ids of the whole (usaf.data.cuts), through usaf tokenize and per tokenizer
style: byte-level BPE (Qwen, GPT-2), SentencePiece's Metaspace with a BOS template (Mistral, Llama 3-style
processors), and the legacy Llama normalizer, which no cut can keep."""

from __future__ import annotations

import itertools
import json

import pytest

from helpers import invoke
from usaf.artifacts import TokensManifest, load_verified
from usaf.data import cuts
from usaf.testing import build_tiny_tokenizer, stdlib_dir

PIECE = 4096  # small pieces, so a test's text of ~150 KB is cut some 35 times


def long_text() -> str:
    """Real code and prose, with non-ASCII words, special tokens' strings and runs of blank lines and spaces."""
    parts = [(stdlib_dir() / name).read_text(encoding="utf-8") for name in ("argparse.py", "textwrap.py", "shlex.py")]
    extra = "\n\n\n    héllo wörld, 日本語のテキスト <|endoftext|> and <|im_start|>user\n" * 40
    return extra.join(parts)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(path)
    return path


def _sentencepiece_like(legacy: bool):
    """A BPE over Metaspace pieces with a "<s> $A" template; ``legacy``: Llama 2's Prepend + Replace normalizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<s>", "</s>"], show_progress=False)
    tok.train_from_iterator([long_text()], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    if legacy:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = None
    return tok


@pytest.fixture(scope="module")
def styles(tok_dir):
    from transformers import AutoTokenizer

    return {"byte-level": AutoTokenizer.from_pretrained(tok_dir).backend_tokenizer,
            "metaspace": _sentencepiece_like(legacy=False), "legacy": _sentencepiece_like(legacy=True)}  # fmt: skip


@pytest.mark.parametrize(("style", "cut"), [("byte-level", True), ("metaspace", True), ("legacy", False)])
def test_pieces_joined_are_the_whole_texts_ids(monkeypatch, styles, style, cut):
    monkeypatch.setattr(cuts, "PIECE_CHARS", PIECE)
    tok = styles[style]
    text = long_text()

    def encode(piece: str) -> list[int]:
        return tok.encode(piece, add_special_tokens=False).ids

    assert cuts.can_cut(encode) is cut  # the legacy normalizer's texts are not searched at all
    points = cuts.cut_points(text, encode) if cut else []
    ends = cuts.special_ends(lambda t, special: tok.encode(t, add_special_tokens=special).ids)
    assert ends == (([0], []) if style != "byte-level" else ([], []))  # the template's BOS, before
    before, after = ends
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]
    joined = before + [i for piece in pieces for i in encode(piece)] + after
    assert joined == tok.encode(text, add_special_tokens=True).ids
    if cut:
        assert len(points) > len(text) // PIECE // 2  # cut near every piece's end
        assert all(b - a >= PIECE for a, b in itertools.pairwise([0, *points]))
    else:  # every place adds a "▁" to the piece after it: no cut keeps the tokens, the text is whole
        assert not any(cuts.keeps_tokens(text, c, encode) for c in range(PIECE, PIECE + 2000, 97))


@pytest.mark.parametrize("style", ["byte-level", "metaspace"])
@pytest.mark.parametrize("checked", [True, False])
def test_the_check_is_what_keeps_the_tokens(monkeypatch, styles, style, checked):
    """Places that break the tokens (a word's start, after its space: " def" is one byte-level token, and a piece
    starting at "def" gets a Metaspace "▁") tried first: checked, the cuts fall elsewhere and the ids are the whole's;
    unchecked (the control), they differ, so the comparison above can fail."""
    import re

    monkeypatch.setattr(cuts, "PIECE_CHARS", PIECE)
    monkeypatch.setattr(cuts, "_WHITESPACE_EDGE", re.compile(r"(?<= )(?=\w)"))
    if not checked:
        monkeypatch.setattr(cuts, "keeps_tokens", lambda text, cut, encode: True)
    tok = styles[style]
    text = long_text()
    encode = lambda piece: tok.encode(piece, add_special_tokens=False).ids  # noqa: E731
    points = cuts.cut_points(text, encode)
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]
    assert len(points) > len(text) // PIECE // 2
    assert ([i for piece in pieces for i in encode(piece)] == encode(text)) is checked


def _tokenize(tmp_path, tok_dir, name, *inputs):
    out = tmp_path / name
    result = invoke("tokenize", *inputs, "--model", tok_dir, "--out", out, "--seq-len", 256)
    assert result.exit_code == 0, result.output
    return out


def test_usaf_tokenize_writes_the_same_sequences_with_long_texts_in_pieces(tmp_path, tok_dir, monkeypatch):
    """A text file and a JSONL text field (special tokens read as text in one, as specials in the other): the same
    files and summary when cut into pieces as when encoded whole; each is still one document."""
    text = long_text()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "long.txt").write_text(text, encoding="utf-8")
    (corpus / "lines.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    whole = _tokenize(tmp_path, tok_dir, "whole", corpus)
    monkeypatch.setattr(cuts, "PIECE_CHARS", PIECE)
    called = []
    real = cuts.cut_points
    monkeypatch.setattr("usaf.stages.tokenize.cut_points", lambda *a: called.append(real(*a)) or called[-1])
    pieces = _tokenize(tmp_path, tok_dir, "pieces", corpus)
    cut = [c for c in called if c]
    assert len(cut) == 2 and min(map(len, cut)) > 10  # both documents were cut
    for name in ("train.jsonl", "heldout.jsonl"):
        assert (pieces / name).read_bytes() == (whole / name).read_bytes()
    a, b = load_verified(whole, TokensManifest).summary, load_verified(pieces, TokensManifest).summary
    assert a == b and a.documents == 2


def test_a_long_text_its_tokenizer_cannot_cut_is_said_with_the_memory_it_took(tmp_path, tok_dir, monkeypatch):
    """Llama 2's normalizer prepends "▁" to every text: the text is encoded whole, as it was, and the note says why
    the run took the memory it did. The byte-level tokenizer's run of the same text (cut) says nothing of it."""
    from transformers import PreTrainedTokenizerFast

    legacy = tmp_path / "legacy"
    PreTrainedTokenizerFast(tokenizer_object=_sentencepiece_like(legacy=True), bos_token="<s>",
                            eos_token="</s>").save_pretrained(legacy)  # fmt: skip
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "long.txt").write_text(long_text(), encoding="utf-8")
    monkeypatch.setattr(cuts, "PIECE_CHARS", PIECE)
    monkeypatch.setattr("usaf.stages.tokenize.LONG_PIECE_CHARS", 8 * PIECE)
    said = []
    for model in (legacy, tok_dir):
        out = tmp_path / f"tokens-{model.name}"
        result = invoke("tokenize", corpus, "--model", model, "--out", out, "--seq-len", 256)
        assert result.exit_code == 0, result.output
        said.append(" ".join(result.output.split()))
    assert "long.txt: 1" in said[0] and "KiB of its text encoded at once, as its tokenizer changes the start of " \
        "every text it encodes, so no text of it is cut" in said[0]
    assert "MiB of memory for its encoding" in said[0]
    assert "encoded at once" not in said[1]


def runs() -> str:
    """Runs of one character longer than a window (BPE chunks a run from its start) at odd places: spaces, a rule of
    dashes, digits, blank lines; with code between them (found in review: a cut inside a run changed a token)."""
    code = (stdlib_dir() / "shlex.py").read_text(encoding="utf-8")[:30_000]
    return ("x = 1" + " " * 20_011 + "\n# " + "-" * 30_007 + "\n" + code + "9" * 25_013 + "\n" * 24_999 + code
            + "=" * 40_001)  # fmt: skip


@pytest.mark.parametrize(("style", "starts"), [("byte-level", 2), ("metaspace", 2), ("byte-level", 1)])
def test_a_cut_inside_a_run_of_one_character_is_refused_at_two_window_starts(monkeypatch, styles, style, starts):
    """With one window start (the control), some cut inside a run kept the window's tokens by being in step with it,
    and the document's changed (byte-level BPE, whose merges chunk runs); at two starts one apart, none does."""
    monkeypatch.setattr(cuts, "PIECE_CHARS", PIECE)
    if starts == 1:
        def one_start(text, cut, encode):
            left, right = text[max(0, cut - cuts.WINDOW) : cut], text[cut : cut + cuts.WINDOW]
            return encode(left) + encode(right) == encode(left + right)

        monkeypatch.setattr(cuts, "keeps_tokens", one_start)
    tok = styles[style]
    text = runs()
    encode = lambda piece: tok.encode(piece, add_special_tokens=False).ids  # noqa: E731
    points = cuts.cut_points(text, encode)
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *points, len(text)])]
    assert len(points) > 10
    assert ([i for piece in pieces for i in encode(piece)] == encode(text)) is (starts == 2)


def test_whitespace_alone_is_skipped_and_a_last_piece_without_ids_ends_its_document(tmp_path, tok_dir, monkeypatch):
    """A long text of whitespace alone was cut and packed into sequences (a short one is skipped as empty), and a long
    text whose last piece had no ids (a pre-tokenizer that drops whitespace) crashed with an IndexError (found in
    review). Both now give what encoding whole gives: the control, the same corpus with no cuts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "[SEP]": 1, "a": 2, "b": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    word_dir = tmp_path / "words"
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="[SEP]", unk_token="[UNK]").save_pretrained(word_dir)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "blank.txt").write_text(" \n" * 30_000, encoding="utf-8")
    (corpus / "ends-blank.txt").write_text("a b\n" * 5_000 + "\n" * 30_000, encoding="utf-8")
    (corpus / "code.txt").write_text("a b a\n" * 50, encoding="utf-8")
    outs = {}
    for piece in (10**9, PIECE):
        monkeypatch.setattr(cuts, "PIECE_CHARS", piece)
        for name, model in (("words", word_dir), ("bytes", tok_dir)):
            out = tmp_path / f"{name}-{piece}"
            result = invoke("tokenize", corpus, "--model", model, "--out", out, "--seq-len", 64, "--source-depth", 1)
            assert result.exit_code == 0, result.output
            summary = load_verified(out, TokensManifest).summary
            outs[name, piece] = ((out / "train.jsonl").read_bytes(), summary)
    for name in ("words", "bytes"):
        assert outs[name, PIECE] == outs[name, 10**9]
        assert outs[name, PIECE][1].documents == 2 and outs[name, PIECE][1].skipped_empty_documents == 1


def test_a_long_chat_conversation_is_said_with_the_memory_it_took(tmp_path, tok_dir, monkeypatch):
    """A conversation is encoded whole (its labels follow its turns): a long one took 2 GB with nothing said."""
    monkeypatch.setattr("usaf.stages.tokenize.LONG_PIECE_CHARS", 8 * PIECE)
    lines = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": long_text()}, {"role": "assistant", "content": "ok"}]
    lines.write_text(json.dumps({"messages": turns}) + "\n", encoding="utf-8")
    result = invoke("tokenize", lines, "--model", tok_dir, "--out", tmp_path / "tokens", "--seq-len", 256)
    said = " ".join(result.output.split())
    assert result.exit_code == 0 and "of its text encoded at once, as a chat conversation is encoded whole" in said
