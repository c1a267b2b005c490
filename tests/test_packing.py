"""The packer against a plain reference implementation, for many document sizes and strides."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from usaf.data.packing import IGNORE_INDEX, SourcePacker
from usaf.data.tokens import labels_look_shifted, unshift_labels


def reference_windows(stream: list[int], seq_len: int, stride: int) -> list[tuple[list[int], list[int]]]:
    """Windows starting every seq_len - stride tokens; overlap unscored; a final partial window if it adds tokens."""
    out, step, start = [], seq_len - stride, 0
    while True:
        window = stream[start : start + seq_len]
        labels = list(window)
        if start > 0:
            labels[:stride] = [IGNORE_INDEX] * min(stride, len(labels))
        new_tokens = len(window) - (stride if start > 0 else 0)
        if len(window) < 2 or new_tokens <= 0:
            break
        out.append((window, labels))
        if start + seq_len >= len(stream):
            break
        start += step
    return out


@pytest.mark.parametrize("seq_len,stride", [(8, 0), (8, 3), (16, 15), (5, 1)])
def test_packer_matches_reference(seq_len, stride):
    rng = random.Random(seq_len * 100 + stride)
    for _ in range(30):
        docs = [[rng.randrange(1, 50) for _ in range(rng.randrange(1, 40))] for _ in range(rng.randrange(1, 6))]
        packer = SourcePacker("s", seq_len, stride)
        got = []
        for doc in docs:
            got += [(s.input_ids, s.labels) for s in packer.add(doc, doc)]
        if (last := packer.flush()) is not None:
            got.append((last.input_ids, last.labels))
        stream = [t for d in docs for t in d]
        assert got == reference_windows(stream, seq_len, stride)
        scored = [t for ids, labels in got for t, lab in zip(ids, labels) if lab != IGNORE_INDEX]
        # Every token is labelled in exactly one window; a lone final token (nothing could predict
        # it inside a window of its own) is the only thing dropped.
        assert scored == stream[: len(scored)] and len(stream) - len(scored) <= 1


@pytest.mark.parametrize("seq_len,stride", [(8, 0), (8, 3), (16, 15), (12, 0)])
def test_whole_documents_that_fit_are_never_cut(seq_len, stride):
    """``add_whole`` (chat conversations): each document that fits in a window lies in one window, whole; every token
    is still scored once. The control: ``add`` cuts some of the same documents at a window's end."""
    rng = random.Random(seq_len * 100 + stride)
    cut_by_add = 0
    for _ in range(30):
        sizes = [rng.randrange(2, 2 * seq_len) for _ in range(rng.randrange(2, 8))]
        docs = [[rng.randrange(1, 50) for _ in range(size)] for size in sizes]
        for add in ("add_whole", "add"):
            packer = SourcePacker("s", seq_len, stride)
            windows = []
            for doc in docs:
                windows += getattr(packer, add)(doc, doc)
            windows += packer.close()
            whole = [any(_holds(w.input_ids, doc) for w in windows) for doc in docs if len(doc) <= seq_len]
            if add == "add_whole":
                assert all(whole), (docs, [w.input_ids for w in windows])
                scored = Counter(t for w in windows for t, lab in zip(w.input_ids, w.labels) if lab != IGNORE_INDEX)
                stream = Counter(t for d in docs for t in d)
                # every token scored once (the order is the windows'); a cut document's lone last token may be lost
                assert not scored - stream and (stream - scored).total() <= len(docs)
                assert all(2 <= len(w.input_ids) <= seq_len for w in windows)
            else:
                cut_by_add += not all(whole)
    if stride < seq_len // 2:  # windows a token apart hold every short document whole, cut or not
        assert cut_by_add > 0


def test_whole_documents_fill_their_windows():
    """Best fit over open windows fills them: conversations of 10-100 % of a window, 3,000 of them. The control:
    closing a window at the first document that does not fit (a reference here) pads far more."""
    rng = random.Random(0)
    docs = [[1] * max(2, int(512 * rng.uniform(0.1, 1.0))) for _ in range(3000)]
    packer = SourcePacker("s", 512)
    windows = [w for doc in docs for w in packer.add_whole(doc, doc)] + packer.close()
    tokens = sum(map(len, docs))
    greedy, used = 1, 0
    for doc in docs:
        greedy, used = (greedy, used + len(doc)) if used + len(doc) <= 512 else (greedy + 1, len(doc))
    assert tokens / (512 * len(windows)) > 0.93 and tokens / (512 * greedy) < 0.8, (len(windows), greedy)


def _holds(window: list[int], doc: list[int]) -> bool:
    return any(window[i : i + len(doc)] == doc for i in range(len(window) - len(doc) + 1))


def test_bad_stride_is_rejected():
    with pytest.raises(ValueError):
        SourcePacker("s", 8, 8)


def test_shift_detection_and_its_negative_control():
    ids = list(range(10, 40))
    assert labels_look_shifted(ids, ids[1:] + [0])
    assert not labels_look_shifted(ids, ids)  # control: unshifted
    assert not labels_look_shifted(ids, [IGNORE_INDEX] * len(ids))  # nothing scored: no evidence
    repeated = [5] * 30  # runs of one token match both ways: not evidence of a shift
    assert not labels_look_shifted(repeated, repeated)
    assert unshift_labels(ids[1:] + [0])[1:] == ids[1:]
