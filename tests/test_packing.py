"""The packer against a plain reference implementation, for many document sizes and strides."""

from __future__ import annotations

import random

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
