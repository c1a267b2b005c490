"""usaf.artifacts.checksums: the sha256 records of files kept to be read back before a manifest exists."""

from __future__ import annotations

from usaf.artifacts.checksums import doubt, seal, sidecar, unmatched, write_record


def test_a_record_matches_its_files_and_names_an_edited_one(tmp_path):
    (tmp_path / "a").write_bytes(b"one")
    (tmp_path / "b").write_bytes(b"two")
    write_record(tmp_path / "sums.json", {"a": tmp_path / "a", "b": tmp_path / "b"})
    assert unmatched(tmp_path, ["a", "b"], tmp_path / "sums.json") == []
    (tmp_path / "b").write_bytes(b"twO")  # same size: what a size check passes
    assert unmatched(tmp_path, ["a", "b"], tmp_path / "sums.json") == ["b"]
    assert unmatched(tmp_path, ["a", "c"], tmp_path / "sums.json") == ["c"]  # not recorded
    (tmp_path / "a").unlink()
    assert unmatched(tmp_path, ["a"], tmp_path / "sums.json") == ["a"]  # recorded, gone


def test_no_record_is_none_and_a_damaged_record_trusts_nothing(tmp_path):
    (tmp_path / "a").write_bytes(b"one")
    assert unmatched(tmp_path, ["a"], tmp_path / "sums.json") is None  # a usaf from before records
    for text in ("{", "[]", '{"a": 1}'):
        (tmp_path / "sums.json").write_text(text)
        assert unmatched(tmp_path, ["a"], tmp_path / "sums.json") == ["a"], text


def test_a_sealed_file_is_intact_until_its_bytes_change_and_a_temporary_seals_under_its_final_name(tmp_path):
    path = tmp_path / "layer-00001.pt"
    tmp = tmp_path / "layer-00001.tmp"
    tmp.write_bytes(b"quantized")
    assert doubt(path) == "no checksum"  # absent, no sidecar
    seal(path, written_at=tmp)
    assert sidecar(path).name == "layer-00001.pt.sha256"
    assert doubt(path) == "its sha256 is not the one recorded"  # the sidecar, the file not yet there
    tmp.rename(path)
    assert doubt(path) is None
    path.write_bytes(b"quantizeD")
    assert doubt(path) == "its sha256 is not the one recorded"
    path.write_bytes(b"quantized")
    sidecar(path).unlink()
    assert doubt(path) == "no checksum"  # not vouched for
