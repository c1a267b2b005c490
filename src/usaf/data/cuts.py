"""Cutting a long document into pieces that tokenize as the whole does.

A tokenizer's ``Encoding`` of one document holds, for every token, its id, offsets, string and masks: about 160 bytes
of memory per byte of text (3.4 GB for a 20 MB file, docs/BENCHMARKS.md "Tokenizing one long file"). So a document
longer than two pieces is encoded in pieces of about :data:`PIECE_CHARS` characters, and the packer, which streams,
never holds more than a piece's encoding.

A cut may only fall where the tokenizer has a boundary of its own, else the tokens beside it change (byte-level BPE
keeps a word's leading space with it; SentencePiece's Metaspace puts a "▁" before every separately encoded text that
does not start with a space). So every cut is checked: the text around it, :data:`WINDOW` characters each side,
encoded whole gives the same ids as its two sides encoded apart and joined, at two window starts (a pre-token
longer than the window, a run of one character, is tokenized from wherever it starts: :func:`keeps_tokens`). Past
such runs, pre-tokenization and normalization look at a few characters, so a cut that keeps the window's tokens
keeps the whole document's. Tried first: the end of a
word before a space and the start of a line; then any place. Where no place near a piece's end passes, the piece
grows. A tokenizer that no place in an ordinary text suits (Llama 2's normalizer prepends "▁" to every text it
encodes) is found once, from a probe (:func:`can_cut`), and its texts stay whole; ``usaf tokenize`` says so where a
piece encoded at once is large.
"""

from __future__ import annotations

import re
from collections.abc import Callable

PIECE_CHARS = 1 << 18  # ~256 KB of text: an encoding of ~45 MB, several to a batch for the Rust threads
WINDOW = 2048  # characters each side of a cut whose tokens are compared
EDGE_TRIES = 32  # whitespace edges checked near a piece's end
ANY_TRIES = 8  # then places one after another (a text without whitespace there: minified code, a run of one character)
LONG_PIECE_CHARS = 8 * PIECE_CHARS  # a piece that long (uncut) is said: ~350 MB of memory while encoded
BYTES_PER_BYTE = 160  # an encoding's memory per byte of text (measured: docs/BENCHMARKS.md "Tokenizing one long file")
_WHITESPACE_EDGE = re.compile(r"(?<=\S)(?=\s)|(?<=\n)(?=\S)")  # a word's end before a space; a line's start
_PROBE = "def first(values):\n    return values[0]  # the one before\n\nSome prose, with words and 12 digits.\n"

Encode = Callable[[str], list[int]]  # text -> ids, no special tokens added


def can_cut(encode: Encode) -> bool:
    """Whether any whitespace edge of an ordinary text keeps this tokenizer's tokens. None does where every separately
    encoded text is changed at its start (Llama 2's normalizer prepends "▁"): its texts stay whole, unsearched."""
    return any(keeps_tokens(_PROBE, m.start(), encode) for m in _WHITESPACE_EDGE.finditer(_PROBE, 1))


def cut_points(text: str, encode: Encode) -> list[int]:
    """Where to cut ``text`` (for a tokenizer :func:`can_cut` accepts): ascending offsets, each at least
    :data:`PIECE_CHARS` after the last (empty: encode it whole). Every piece but the last is about PIECE_CHARS long, or
    longer where no place near its end keeps the tokens; the last is under two pieces."""
    cuts: list[int] = []
    target = PIECE_CHARS
    while len(text) - target > PIECE_CHARS:
        cut = _checked_cut(text, target, encode)
        if cut is None:
            target += PIECE_CHARS  # no place near here: this piece grows by one more
            continue
        cuts.append(cut)
        target = cut + PIECE_CHARS
    return cuts


def keeps_tokens(text: str, cut: int, encode: Encode) -> bool:
    """Whether cutting ``text`` at ``cut`` keeps its tokens: the window around it, encoded whole and in two parts.

    At two window starts one character apart. A pre-token longer than the window (a run of one character, which BPE
    chunks from the run's start; digits grouped in threes) is tokenized from wherever the window starts, so a cut
    inside it kept the window's tokens where that start happened to be in step with the cut, and changed the
    document's: 600 K spaces, cut at a place whose window was 2,048 spaces, a multiple of the 16-space token (found
    in review). A start one character on cannot be in step with any period above one as well."""
    right = text[cut : cut + WINDOW]
    right_ids = encode(right)
    for start in sorted({max(0, cut - WINDOW), max(0, cut - WINDOW + 1)}):
        left = text[start:cut]
        if encode(left) + right_ids != encode(left + right):
            return False
    return True


def _checked_cut(text: str, target: int, encode: Encode) -> int | None:
    """The first place at or after ``target`` that keeps the tokens: whitespace edges first, then any place."""
    end = min(len(text), target + PIECE_CHARS // 4)
    edges = (m.start() for m in _WHITESPACE_EDGE.finditer(text, target, end))
    for tried, cut in enumerate(edges):
        if tried == EDGE_TRIES:
            break
        if keeps_tokens(text, cut, encode):
            return cut
    return next((cut for cut in range(target, min(end, target + ANY_TRIES)) if keeps_tokens(text, cut, encode)), None)


def special_ends(encode_with: Callable[[str, bool], list[int]]) -> tuple[list[int], list[int]] | None:
    """The ids the tokenizer's post-processor puts before and after a text (a BOS; an EOS), from a probe: pieces are
    encoded without them, the first piece given the ones before, the last the ones after. None where the probe's ids
    are not ``before + bare + after`` (a post-processor that does more): such a tokenizer's documents stay whole."""
    probe = "usaf\nprobe"
    bare, full = encode_with(probe, False), encode_with(probe, True)
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return full[:start], full[start + len(bare) :]
    return None
