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

    points = cuts.cut_points(text, encode)
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
        assert points == []


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


def test_a_long_text_no_place_could_cut_is_said_with_the_memory_it_took(tmp_path, tok_dir, monkeypatch):
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
        result = invoke("tokenize", corpus, "--model", model, "--out", tmp_path / f"tokens-{model.name}", "--seq-len", 256)
        assert result.exit_code == 0, result.output
        said.append(" ".join(result.output.split()))
    assert "long.txt: 1" in said[0] and "KiB of its text encoded at once, as no place near its pieces' ends" in said[0]
    assert "MiB of memory for its encoding" in said[0]
    assert "encoded at once" not in said[1]
