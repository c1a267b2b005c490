"""TokenDataset (usaf.data.dataset) reads its file through the handle it validated: a file put at the path later
(``usaf tokenize --overwrite`` of the tokens a run trains on) is not what it reads. Reopened by path, a run crashed at
its next read, or trained on the new file's lines at the old, unchecked offsets (found in review)."""

from __future__ import annotations

import json
import os

import pytest

from usaf.data import dataset as dataset_module
from usaf.data.dataset import TokenDataset
from usaf.errors import UsafError

VOCAB = 64


def write_rows(path, rows: list[list[int]]) -> None:
    path.write_text("".join(json.dumps({"input_ids": row, "labels": row}) + "\n" for row in rows))


def test_a_file_replaced_at_the_path_is_not_what_the_dataset_reads(tmp_path):
    path = tmp_path / "train.jsonl"
    old = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    write_rows(path, old)
    data = TokenDataset(path, vocab_size=VOCAB)
    replacement = tmp_path / "new.jsonl"
    write_rows(replacement, [[10, 11], [12, 13, 14, 15, 16, 17, 18], [19, 20, 21]])
    os.replace(replacement, path)  # as an artifact replaced by --overwrite: a new file at the same path
    assert [data[i].input_ids for i in range(len(data))] == old
    # control: the path does hold other lines now, so the reads above were not of an unchanged file
    assert TokenDataset(path, vocab_size=VOCAB)[0].input_ids == [10, 11]
    data.close()


def test_a_file_changed_while_it_was_validated_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "train.jsonl"
    write_rows(path, [[1, 2, 3], [4, 5, 6]])
    validate = dataset_module.iter_token_file

    def validated_then_replaced(*args, **kwargs):
        yield from validate(*args, **kwargs)
        replacement = tmp_path / "new.jsonl"
        write_rows(replacement, [[7, 8, 9]])
        os.replace(replacement, path)

    monkeypatch.setattr(dataset_module, "iter_token_file", validated_then_replaced)
    with pytest.raises(UsafError, match="changed while it was read"):
        TokenDataset(path, vocab_size=VOCAB)
    monkeypatch.setattr(dataset_module, "iter_token_file", validate)  # control: unchanged, it is taken
    assert len(TokenDataset(path, vocab_size=VOCAB)) == 1


def test_the_run_is_planned_for_the_longest_line_cut_to_seq_len(tmp_path):
    """train planned memory (and its prefix companies) for the longest of the first 256 lines, or for --seq-len as
    given: a longer line further on was missed, and a --seq-len above every line was planned for though it cut
    nothing (found in review). Now the whole file's longest line, cut to --seq-len."""
    from types import SimpleNamespace

    from usaf.stages.train.budget import data_seq_len

    path = tmp_path / "train.jsonl"
    write_rows(path, [[1, 2, 3]] * 300 + [list(range(1, 11))])  # the longest line past the first 256
    data = TokenDataset(path, vocab_size=VOCAB)
    assert data.longest == 10 and max(len(data[i].input_ids) for i in range(256)) == 3  # the control: the sample's
    assert data_seq_len(SimpleNamespace(seq_len=None), data) == 10
    assert data_seq_len(SimpleNamespace(seq_len=64), data) == 10  # cuts nothing
    assert data_seq_len(SimpleNamespace(seq_len=4), data) == 4
    data.close()
