"""A catalogue of hostile and broken inputs, one per way a file can be wrong, run through the real CLI.

Each :class:`Case` writes one malformed input (a tokens JSONL line, a manifest, ``experts_q4.pt``, a
safetensors file, a ``--config`` TOML file, a model directory) and names the command that reads it.
:func:`run_case` runs that command in-process (Typer's runner, the same code path as ``usaf``) and
records how it was answered. A case passes when the command

- exits 2 with exactly one ``error:`` line that names the file (``Case.needle``), or finishes
  normally where the input is odd but valid (``Case.may_pass``);
- leaves no output artifact and no temporaries beside it;
- ran no code from the input (the pickles here would create ``Case.marker`` if they ran).

Used by ``tests/test_hostile_inputs.py`` (every case) and ``scripts/fuzz_readers.py`` (every case,
the results as JSON for docs/RELIABILITY.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import shutil
import struct
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from typer.testing import CliRunner

from usaf.artifacts.checksums import write_record
from usaf.artifacts.hashing import combine, sha256_file
from usaf.artifacts.loader import load_manifest
from usaf.artifacts.manifest import manifest_checksum
from usaf.artifacts.run import CHECKPOINT_FILES, SUMS_FILE
from usaf.cli.app import app
from usaf.errors import UsafError
from usaf.stages.quantize import QuantizeConfig
from usaf.stages.quantize import run as quantize
from usaf.testing import build_tiny_model

TOKENS = "tokens JSONL"
TEXT = "text JSONL (tokenize)"
MANIFEST = "manifest.json"
EXPERTS = "experts_q4.pt"
SAFETENSORS = "safetensors"
TOML = "TOML config"
MODEL = "model directory"

READERS = (TOKENS, TEXT, MANIFEST, EXPERTS, SAFETENSORS, TOML, MODEL)
VOCAB = 512  # the tiny tokenizer's


@dataclass
class Bench:
    """Valid inputs every case starts from: a tiny model, its quantization, a tokens file."""

    root: Path
    model: Path
    quantized: Path
    tokens: Path

    @classmethod
    def build(cls, root: Path) -> Bench:
        root = Path(root)
        model = build_tiny_model("qwen3_moe", root / "model", tokenizer=True)
        _, quantized = quantize(QuantizeConfig(model=str(model), out=root / "quantized", method="rtn", group_size=8))
        rng = random.Random(0)
        tokens = root / "tokens.jsonl"
        with tokens.open("w", encoding="utf-8") as f:
            for _ in range(8):
                ids = [rng.randrange(1, VOCAB) for _ in range(24)]
                f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
        return cls(root, model, quantized, tokens)


@dataclass(frozen=True)
class Case:
    reader: str
    name: str
    build: Callable[[Bench, Path], list[str]]  # writes the input under the case directory; returns CLI args
    needle: str  # the error line must contain it (the file's name)
    may_pass: bool = False  # odd but valid: a normal finish is a correct answer too
    unsafe: bool = False  # an attempt to run code or read outside a directory
    note: str = ""  # why a may_pass case is accepted
    after: Callable[[Path], list[str]] | None = None  # more checks of what the command left (the case directory)
    env: dict[str, str] | None = None  # environment variables set for the command (USAF_*), restored after
    # the environment the command runs in, when the input is not a file (a disk that refuses a write)
    during: Callable[[Path], contextlib.AbstractContextManager] | None = None


@dataclass
class Outcome:
    reader: str
    case: str
    answer: str  # "refused (exit 2)", "accepted", or "CRASH ..." / "BAD ..." when the case fails
    ok: bool
    exit_code: int
    message: str = ""
    unsafe: bool = False
    problems: list[str] = field(default_factory=list)
    note: str = ""


# -- writing malformed files ------------------------------------------------------------------------


def _resign(artifact: Path) -> None:
    """Rewrite an artifact's manifest so its sizes, hashes and own checksum match again (a consistent forgery)."""
    path = artifact / "manifest.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    for record in data["files"]:
        file = artifact / record["path"]
        if file.is_file():
            record["bytes"], record["sha256"] = file.stat().st_size, sha256_file(file)
    data["fingerprint"] = combine((r["path"], r["sha256"]) for r in data["files"])
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
    try:
        manifest = load_manifest(artifact)
    except UsafError:
        return  # a forgery the loader refuses before its checksum is looked at
    data["manifest_sha256"] = manifest_checksum(manifest, as_read=True)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def resign_checkpoint(checkpoint: Path) -> None:
    """Rewrite a checkpoint's ``checksums.json`` so it matches the files again (a consistent forgery: what the checks
    behind the checksums see)."""
    files = {name: checkpoint / name for name in CHECKPOINT_FILES if name != SUMS_FILE}
    write_record(checkpoint / SUMS_FILE, {name: path for name, path in files.items() if path.is_file()})


def _copy_quantized(bench: Bench, case_dir: Path) -> Path:
    return Path(shutil.copytree(bench.quantized, case_dir / "quantized"))


def _score(bench: Bench, case_dir: Path, *, model: Path | None = None, data: Path | None = None) -> list[str]:
    return [
        "score", "--model", str(model or bench.quantized), "--data", str(data or bench.tokens),
        "--out", str(case_dir / "out"), "--frac", "0.05", "--calib-samples", "4", "--no-stability",
    ]  # fmt: skip


class _RunsCode:
    """A pickle payload: if unpickled with full pickle, it creates ``marker`` (proof that code ran)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def marker_of(case_dir: Path) -> Path:
    return case_dir / "CODE-RAN"


def _safetensors_bytes(header: object, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _valid_header() -> tuple[dict, bytes]:
    return {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}, bytes(16)


# -- the catalogue ----------------------------------------------------------------------------------


def _tokens_case(name: str, content: bytes, **kw) -> Case:
    def build(bench: Bench, case_dir: Path) -> list[str]:
        path = case_dir / "bad.jsonl"
        path.write_bytes(content)
        return _score(bench, case_dir, data=path)

    return Case(TOKENS, name, build, "bad.jsonl", **kw)


def _line(obj: object) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def tokens_cases() -> list[Case]:
    ids = list(range(1, 25))
    return [
        _tokens_case("not JSON (cut mid-line)", b'{"input_ids": [1, 2\n'),
        _tokens_case("a JSON array, not an object", _line(ids)),
        _tokens_case("a JSON string", _line("hello")),
        _tokens_case("a JSON null", b"null\n"),
        _tokens_case("no input_ids", _line({"labels": ids})),
        _tokens_case("input_ids a string", _line({"input_ids": "1 2 3"})),
        _tokens_case("input_ids a dict", _line({"input_ids": {"0": 1}})),
        _tokens_case("float ids", _line({"input_ids": [1.5, 2.0, 3.0]})),
        _tokens_case("boolean ids", _line({"input_ids": [True, False, True]})),
        _tokens_case("nested lists as ids", _line({"input_ids": [[1], [2]]})),
        _tokens_case("negative id", _line({"input_ids": [5, -1, 7]})),
        _tokens_case("id beyond the vocabulary", _line({"input_ids": [5, VOCAB, 7]})),
        _tokens_case("id of 2**70", _line({"input_ids": [5, 2**70, 7]})),
        _tokens_case("NaN as ids", b'{"input_ids": NaN}\n'),
        _tokens_case("labels shorter than ids", _line({"input_ids": ids, "labels": ids[:-1]})),
        _tokens_case("labels not a list", _line({"input_ids": ids, "labels": 3})),
        _tokens_case("empty lists", _line({"input_ids": [], "labels": []})),
        _tokens_case("pre-shifted labels", _line({"input_ids": ids, "labels": ids[1:] + [0]})),
        _tokens_case("invalid UTF-8", b'{"input_ids": [1, 2], "source": "\xff\xfe"}\n'),
        _tokens_case("NUL bytes", b'{"input_ids": [1, 2]}\x00\x00\n'),
        _tokens_case("nested 100000 deep", b"[" * 100_000 + b"]" * 100_000 + b"\n"),
        _tokens_case(
            "a 4 MB line with an id beyond the vocabulary at its end", _line({"input_ids": [7] * 700_000 + [VOCAB]})
        ),
        _tokens_case(
            "a 1 MB line of 200000 valid ids (beyond the model's context)", _line({"input_ids": [7, 8] * 100_000})
        ),
        _tokens_case("good lines, then a broken one at line 5", _line({"input_ids": ids}) * 4 + b"{oops\n"),
        _tokens_case("empty file", b""),
        _tokens_case("blank lines only", b"\n \n\t\n"),
        _tokens_case("UTF-8 byte-order mark", b"\xef\xbb\xbf" + _line({"input_ids": ids}), may_pass=True),
        _tokens_case(
            "duplicate keys (the last wins)", b'{"input_ids": [1,2,3,4,5,6], "input_ids": [1,2]}\n' * 4, may_pass=True
        ),  # fmt: skip
    ]


def _text_case(name: str, content: bytes, **kw) -> Case:
    def build(bench: Bench, case_dir: Path) -> list[str]:
        path = case_dir / "corpus.jsonl"
        path.write_bytes(content)
        return ["tokenize", str(path), "--model", str(bench.model), "--seq-len", "32", "--out", str(case_dir / "out")]

    return Case(TEXT, name, build, "corpus.jsonl", **kw)


def text_cases() -> list[Case]:
    return [
        _text_case("not JSON", b'{"text": "abc\n'),
        _text_case("an array line", b'["text"]\n'),
        _text_case("text is a number", b'{"text": 5}\n'),
        _text_case("messages not a list", b'{"messages": "hi"}\n'),
        _text_case("a message without content", b'{"messages": [{"role": "user"}]}\n'),
        _text_case("neither text nor messages", b'{"body": "x"}\n'),
        _text_case("invalid UTF-8", b'{"text": "\xc3\x28"}\n'),
        _text_case("nested 100000 deep", b"[" * 100_000 + b"]" * 100_000 + b"\n"),
    ]


def _manifest_case(
    name: str, mutate: Callable[[dict], object], *, needle: str = "manifest", verify: bool = False, **kw
) -> Case:
    """``mutate(manifest_dict)`` returns the new manifest (a dict, or bytes to write verbatim).

    Read by ``usaf score --model`` (or ``usaf inspect --verify`` with ``verify``).
    """

    def build(bench: Bench, case_dir: Path) -> list[str]:
        artifact = _copy_quantized(bench, case_dir)
        data = json.loads((artifact / "manifest.json").read_text(encoding="utf-8"))
        new = mutate(data)
        raw = new if isinstance(new, bytes) else json.dumps(new if new is not None else data).encode()
        (artifact / "manifest.json").write_bytes(raw)
        return ["inspect", "--verify", str(artifact)] if verify else _score(bench, case_dir, model=artifact)

    return Case(MANIFEST, name, build, needle, **kw)


def _set(path: str, value: object) -> Callable[[dict], dict]:
    def mutate(data: dict) -> dict:
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return data

    return mutate


_DELETE = object()
_SIZES_ONLY = (
    "consumers check that every listed file is present and of its size, not its sha256 (hashing a 15 GB "
    "experts file at every load would cost minutes); usaf inspect --verify checks the hashes"
)


def manifest_cases() -> list[Case]:
    def add_escape(target: str) -> Callable[[dict], dict]:
        def mutate(data: dict) -> dict:
            data["files"].append({"path": target, "bytes": 1, "sha256": "0" * 64})
            return data

        return mutate

    return [
        _manifest_case("cut in half", lambda d: json.dumps(d).encode()[: len(json.dumps(d)) // 2]),
        _manifest_case("empty file", lambda d: b""),
        _manifest_case("a JSON list", lambda d: [d]),
        _manifest_case("invalid UTF-8", lambda d: b'{"kind": "\xff"}'),
        _manifest_case("nested 100000 deep", lambda d: b"[" * 100_000 + b"]" * 100_000),
        _manifest_case("no kind", _set("kind", _DELETE)),
        _manifest_case("another kind (tokens)", _set("kind", "tokens")),
        _manifest_case("an unknown kind", _set("kind", "weights_of_doom")),
        _manifest_case("schema version from the future", _set("schema_version", 99)),
        _manifest_case("schema version 0", _set("schema_version", 0)),
        _manifest_case("schema version a string", _set("schema_version", "1")),
        _manifest_case("no fingerprint", _set("fingerprint", _DELETE)),
        _manifest_case("an extra top-level field", _set("surprise", 1)),
        _manifest_case("created_at not a date", _set("created_at", "yesterday")),
        _manifest_case("summary a list", _set("summary", [])),
        _manifest_case("summary missing a field", _set("summary.moe_layers", _DELETE)),
        _manifest_case(
            "a file size of 1e400",
            lambda d: json.dumps(_set("files.0.bytes", "BIG")(d)).replace('"BIG"', "1e400").encode(),
        ),
        _manifest_case(  # the files are not re-hashed, but the fingerprint no longer combines the listed sha256
            "a file's sha256 changed (read by usaf score)", _set("files.0.sha256", "0" * 64), needle="fingerprint"
        ),
        _manifest_case(
            "a file's sha256 changed (usaf inspect --verify)",
            _set("files.0.sha256", "0" * 64),
            needle="sha256",
            verify=True,
        ),
        _manifest_case(
            "a file's size changed (usaf inspect --verify)", _set("files.0.bytes", 1), needle="bytes", verify=True
        ),
        _manifest_case(
            "a listed path '../x' (usaf inspect --verify)", _set("files.0.path", "../x"), verify=True, unsafe=True
        ),
        _manifest_case("a file's size changed", _set("files.0.bytes", 1), needle="manifest says 1 (modified: grown)"),
        _manifest_case("a listed file missing", add_escape("nothing-here.bin"), needle="missing"),
        _manifest_case("a listed path '../../outside'", add_escape("../../outside"), unsafe=True),
        _manifest_case("a listed absolute path /etc/passwd", add_escape("/etc/passwd"), unsafe=True),
        _manifest_case("a listed path with a backslash", add_escape("..\\..\\x"), unsafe=True),
    ]


def _experts_case(
    name: str, write: Callable[[Path, Path], None], *, resign: bool = True, verify: bool = False, **kw
) -> Case:
    """``write(experts_path, case_dir)`` replaces ``experts_q4.pt``; the manifest is re-signed to match.

    Read by ``usaf score --model`` (or ``usaf inspect --verify`` with ``verify``).
    """

    def build(bench: Bench, case_dir: Path) -> list[str]:
        artifact = _copy_quantized(bench, case_dir)
        write(artifact / "experts_q4.pt", case_dir)
        if resign:
            _resign(artifact)
        return ["inspect", "--verify", str(artifact)] if verify else _score(bench, case_dir, model=artifact)

    return Case(EXPERTS, name, build, "experts_q4.pt", **kw)


def _edit_experts(edit: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    def write(path: Path, case_dir: Path) -> None:
        data = torch.load(path, weights_only=True)
        new = edit(data)
        torch.save(data if new is None else new, path)

    return write


def _first_entry(data: dict) -> dict:
    return data[sorted(data)[0]]


def experts_cases() -> list[Case]:
    def truncate(fraction: float) -> Callable[[Path, Path], None]:
        return lambda path, _: path.write_bytes(path.read_bytes()[: int(path.stat().st_size * fraction)])

    def raw_pickle(protocol: int) -> Callable[[Path, Path], None]:  # a plain pickle, as the pre-zip torch format
        return lambda path, case_dir: path.write_bytes(pickle.dumps({"x": _RunsCode(marker_of(case_dir))}, protocol))

    def zip_pickle(path: Path, case_dir: Path) -> None:  # torch.save's zip format with a code-running object
        torch.save({"x": _RunsCode(marker_of(case_dir))}, path)

    def pickle_in_place(path: Path, case_dir: Path) -> None:
        # the real archive with its data.pkl swapped for one that calls os.makedirs
        with zipfile.ZipFile(path) as src:
            items = [(i, src.read(i.filename)) for i in src.infolist()]
        with zipfile.ZipFile(path, "w") as dst:
            for info, raw in items:
                if info.filename.endswith("data.pkl"):
                    raw = pickle.dumps(_RunsCode(marker_of(case_dir)), protocol=2)
                dst.writestr(info, raw)

    def flip_byte(path: Path, _: Path) -> None:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))

    def symlink_out(path: Path, case_dir: Path) -> None:
        outside = case_dir / "outside.pt"
        shutil.copyfile(path, outside)
        path.unlink()
        path.symlink_to(outside)

    def set_key(key: str, value: Callable[[dict], object]) -> Callable[[dict], None]:
        def edit(data: dict) -> None:
            entry = _first_entry(data)
            entry[key] = value(entry)

        return edit

    return [
        _experts_case("cut to half", truncate(0.5)),
        _experts_case("cut to 100 bytes", truncate(100 / 10**9)),
        _experts_case("empty", truncate(0.0)),
        _experts_case("random bytes", lambda p, _: p.write_bytes(random.Random(1).randbytes(4096))),
        _experts_case("a zip without torch records", lambda p, _: zipfile.ZipFile(p, "w").close()),
        _experts_case("a plain pickle (protocol 5) that runs code", raw_pickle(5), unsafe=True),
        _experts_case("a plain pickle (protocol 2) that runs code", raw_pickle(2), unsafe=True),
        _experts_case("torch.save of an object that runs code", zip_pickle, unsafe=True),
        _experts_case("the real archive with a code-running data.pkl", pickle_in_place, unsafe=True),
        _experts_case("a tensor instead of a dict", lambda p, _: torch.save(torch.zeros(3), p)),
        _experts_case("a layer's entry missing", _edit_experts(lambda d: d.pop(sorted(d)[0]))),
        _experts_case("an entry not a dict", _edit_experts(lambda d: d.__setitem__(sorted(d)[0], 5))),
        _experts_case("an entry with an extra key", _edit_experts(set_key("extra", lambda e: 1))),
        _experts_case("codes cut short", _edit_experts(set_key("codes", lambda e: e["codes"][:-1]))),
        _experts_case("codes as float32", _edit_experts(set_key("codes", lambda e: e["codes"].float()))),
        _experts_case("scales with inf", _edit_experts(set_key("scale", lambda e: e["scale"] * float("inf")))),
        _experts_case("shape a string", _edit_experts(set_key("shape", lambda e: "8x8"))),
        _experts_case("nbits 5", _edit_experts(set_key("nbits", lambda e: 5))),
        _experts_case("shape of another model (E doubled, codes to match)", _edit_experts(_double_experts)),
        _experts_case(
            "one byte flipped, manifest untouched (read by usaf score)",
            flip_byte,
            resign=False,
            may_pass=True,
            note=_SIZES_ONLY,
        ),
        _experts_case(
            "one byte flipped, manifest untouched (usaf inspect --verify)", flip_byte, resign=False, verify=True
        ),
        _experts_case("truncated, manifest untouched", truncate(0.5), resign=False),
        _experts_case("a symlink to a file outside the artifact", symlink_out, resign=False, unsafe=True),
    ]


def _double_experts(data: dict) -> None:
    """Every entry claims twice the experts, with codes and scales repeated to match (a consistent foreign file)."""
    for entry in data.values():
        for key in ("codes", "scale", "zero"):
            entry[key] = torch.cat([entry[key], entry[key]])
        entry["shape"] = [entry["shape"][0] * 2, *entry["shape"][1:]]


def _source_shard_case(name: str, content: Callable[[bytes], bytes], **kw) -> Case:
    """A source model whose ``model.safetensors`` is replaced; read by ``usaf quantize``."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        model = Path(shutil.copytree(bench.model, case_dir / "model"))
        shard = model / "model.safetensors"
        shard.write_bytes(content(shard.read_bytes()))
        return ["quantize", str(model), "--method", "rtn", "--group-size", "8", "--out", str(case_dir / "out")]

    return Case(SAFETENSORS, f"source shard: {name}", build, "model.safetensors", **kw)


def _header_of(raw: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _rewrite_header(edit: Callable[[dict], None]) -> Callable[[bytes], bytes]:
    def content(raw: bytes) -> bytes:
        header, data = _header_of(raw)
        edit(header)
        return _safetensors_bytes(header, data)

    return content


def _first_tensor(header: dict) -> dict:
    return header[next(k for k in sorted(header) if k != "__metadata__")]


def _base_shard_case(name: str, content: Callable[[bytes], bytes], **kw) -> Case:
    """A quantized model whose non-expert shard is replaced (manifest re-signed); read by ``usaf score``."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        artifact = _copy_quantized(bench, case_dir)
        shard = next(artifact.glob("base-*.safetensors"))
        shard.write_bytes(content(shard.read_bytes()))
        _resign(artifact)
        return _score(bench, case_dir, model=artifact)

    return Case(SAFETENSORS, f"quantized base shard: {name}", build, "base-", **kw)


def safetensors_cases() -> list[Case]:
    def with_index(target: str) -> Case:
        def build(bench: Bench, case_dir: Path) -> list[str]:
            model = Path(shutil.copytree(bench.model, case_dir / "model"))
            header, _ = _header_of((model / "model.safetensors").read_bytes())
            weight_map = {name: target for name in header if name != "__metadata__"}
            (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
            (case_dir / "outside.safetensors").write_bytes((model / "model.safetensors").read_bytes())
            return ["quantize", str(model), "--method", "rtn", "--group-size", "8", "--out", str(case_dir / "out")]

        return Case(SAFETENSORS, f"source index naming {target!r}", build, "index", unsafe=True)

    def base_index_escape(bench: Bench, case_dir: Path) -> list[str]:
        artifact = _copy_quantized(bench, case_dir)
        index = artifact / "base.safetensors.index.json"
        data = json.loads(index.read_text())
        data["weight_map"] = {name: "../outside.safetensors" for name in data["weight_map"]}
        index.write_text(json.dumps(data))
        shutil.copyfile(next(artifact.glob("base-*.safetensors")), case_dir / "outside.safetensors")
        _resign(artifact)
        return _score(bench, case_dir, model=artifact)

    def set_first(key: str, value: object) -> Callable[[bytes], bytes]:
        return _rewrite_header(lambda h: _first_tensor(h).__setitem__(key, value))

    return [
        _source_shard_case("cut in half", lambda raw: raw[: len(raw) // 2]),
        _source_shard_case("empty", lambda raw: b""),
        _source_shard_case("5 bytes", lambda raw: raw[:5]),
        _source_shard_case("header length 2**63", lambda raw: struct.pack("<Q", 2**63) + raw[8:]),
        _source_shard_case("header length beyond the file", lambda raw: struct.pack("<Q", len(raw)) + raw[8:]),
        _source_shard_case("header not JSON", lambda raw: _safetensors_bytes(b"{not json", raw[8:])),
        _source_shard_case("header a JSON list", lambda raw: _safetensors_bytes([1, 2])),
        _source_shard_case("header invalid UTF-8", lambda raw: _safetensors_bytes(b'{"\xff": 1}')),
        _source_shard_case(
            "a tensor without data_offsets", _rewrite_header(lambda h: _first_tensor(h).pop("data_offsets"))
        ),
        _source_shard_case("offsets beyond the file", set_first("data_offsets", [0, 10**12])),
        _source_shard_case("offsets reversed", set_first("data_offsets", [16, 0])),
        _source_shard_case("negative offsets", set_first("data_offsets", [-16, 0])),
        _source_shard_case("an unknown dtype", set_first("dtype", "F99")),
        _source_shard_case("shape disagreeing with its bytes", set_first("shape", [3, 3])),
        _source_shard_case("shape a string", set_first("shape", "2x2")),
        _source_shard_case("a tensor entry that is a number", _rewrite_header(lambda h: h.__setitem__("w", 5))),
        _base_shard_case("cut in half", lambda raw: raw[: len(raw) // 2]),
        _base_shard_case("offsets beyond the file", set_first("data_offsets", [0, 10**12])),
        _base_shard_case("shape disagreeing with its bytes", set_first("shape", [3, 3])),
        _base_shard_case("header not JSON", lambda raw: _safetensors_bytes(b"{not json", raw[8:])),
        with_index("../outside.safetensors"),
        with_index("/etc/passwd"),
        Case(
            SAFETENSORS,
            "quantized base index naming '../outside.safetensors'",
            base_index_escape,
            "escapes",
            unsafe=True,
        ),  # fmt: skip
    ]


def _toml_case(name: str, content: bytes | None, *, as_dir: bool = False, needle: str = "settings.toml", **kw) -> Case:
    def build(bench: Bench, case_dir: Path) -> list[str]:
        path = case_dir / "settings.toml"
        if as_dir:
            path.mkdir()
        elif content is not None:
            path.write_bytes(content)
        corpus = case_dir / "corpus.txt"
        corpus.write_text("def f(x):\n    return x + 1\n" * 40, encoding="utf-8")
        return ["tokenize", str(corpus), "--model", str(bench.model), "--config", str(path), "--out",
                str(case_dir / "out")]  # fmt: skip

    return Case(TOML, name, build, needle, **kw)


def toml_cases() -> list[Case]:
    return [
        _toml_case("not TOML", b"[tokenize\nseq_len = 3\n"),
        _toml_case("invalid UTF-8", b'[tokenize]\nsplit = "\xff"\n'),
        _toml_case("NUL byte", b"[tokenize]\nseq_len = 3\x00\n"),
        _toml_case("an unknown key", b"[tokenize]\nsequence_length = 32\n"),
        _toml_case("a string for an int", b'[tokenize]\nseq_len = "long"\n'),
        _toml_case("a negative int", b"[tokenize]\nseq_len = -5\n"),
        # checked against the model after resolving: named where it was set, the file's table (the flag before)
        _toml_case("an int of 10**30", b"[tokenize]\nseq_len = 1000000000000000000000000000000\n"),
        _toml_case("a float for an int", b"[tokenize]\nseq_len = 32.5\n"),
        _toml_case("an array for an int", b"[tokenize]\nseq_len = [32]\n"),
        _toml_case("a date for an int", b"[tokenize]\nseq_len = 1979-05-27\n"),
        _toml_case("a nested table for an int", b"[tokenize.seq_len]\nx = 1\n"),
        _toml_case("[tokenize] not a table", b"tokenize = 5\n"),
        _toml_case("[defaults] not a table", b"defaults = [1, 2]\n"),
        _toml_case("a duplicate key", b"[tokenize]\nseq_len = 32\nseq_len = 64\n"),
        _toml_case("a directory, not a file", b"", as_dir=True),
        _toml_case("no such file", None),
        _toml_case("empty file", b"", may_pass=True),
        _toml_case("only other commands' tables", b"[train]\nsteps = 3\n", may_pass=True),
    ]


def _model_case(name: str, prepare: Callable[[Path, Path], None], args: Callable[[Path, Path], list[str]], needle: str,
                **kw) -> Case:  # fmt: skip
    def build(bench: Bench, case_dir: Path) -> list[str]:
        model = Path(shutil.copytree(bench.model, case_dir / "model"))
        prepare(model, case_dir)
        return args(model, case_dir)

    return Case(MODEL, name, build, needle, **kw)


def model_cases() -> list[Case]:
    def quantize_args(model: Path, case_dir: Path) -> list[str]:
        return ["quantize", str(model), "--method", "rtn", "--group-size", "8", "--out", str(case_dir / "out")]

    def tokenize_args(model: Path, case_dir: Path) -> list[str]:
        corpus = case_dir / "corpus.txt"
        corpus.write_text("x = 1\n" * 50, encoding="utf-8")
        return ["tokenize", str(corpus), "--model", str(model), "--out", str(case_dir / "out")]

    def remote_code_tokenizer(model: Path, case_dir: Path) -> None:
        # a tokenizer whose class lives in the repository's own Python file (runs only with trust_remote_code)
        (model / "tokenization_evil.py").write_text(f"import os\nos.makedirs({str(marker_of(case_dir))!r})\n")
        config = json.loads((model / "tokenizer_config.json").read_text())
        config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
        config["tokenizer_class"] = "EvilTokenizer"
        (model / "tokenizer_config.json").write_text(json.dumps(config))
        (model / "tokenizer.json").unlink()

    def only_bin(model: Path, case_dir: Path) -> None:
        (model / "model.safetensors").unlink()
        (model / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCode(marker_of(case_dir))))

    def config_not_json(model: Path, _: Path) -> None:
        (model / "config.json").write_text("{model_type: qwen3_moe")

    def config_remote_code(model: Path, case_dir: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        config["model_type"] = "evil_moe"
        config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"}
        (model / "configuration_evil.py").write_text(f"import os\nos.makedirs({str(marker_of(case_dir))!r})\n")
        (model / "config.json").write_text(json.dumps(config))

    return [
        _model_case(
            "a tokenizer that needs its own Python code", remote_code_tokenizer, tokenize_args, "auto_map", unsafe=True
        ),  # fmt: skip
        _model_case(
            "weights only as a pickle (pytorch_model.bin)", only_bin, quantize_args, "pytorch_model.bin", unsafe=True
        ),
        _model_case(
            # refused as a model type transformers does not know: its code is never imported (the message names
            # the type, not the file)
            "config.json with code of its own (auto_map)",
            config_remote_code,
            quantize_args,
            "model_type=evil_moe",
            unsafe=True,
        ),  # fmt: skip
        _model_case("config.json not JSON", config_not_json, quantize_args, "config.json"),
    ]


def base_cases() -> list[Case]:
    """This module's cases: one reader of one file format each (tests/test_hostile_inputs.py)."""
    return [*tokens_cases(), *text_cases(), *manifest_cases(), *experts_cases(), *safetensors_cases(),
            *toml_cases(), *model_cases()]  # fmt: skip


# Catalogues of their own, each a module with READERS and cases() and a test file running them.
CATALOGUES = ("hostile_outputs", "hostile_artifacts", "hostile_settings", "hostile_data", "hostile_exporteval",
              "hostile_disk")  # fmt: skip


def catalogues() -> list[Any]:
    # lazy: each catalogue imports this module for Bench and Case
    import importlib

    return [importlib.import_module(f"usaf.testing.{name}") for name in CATALOGUES]


def all_readers() -> tuple[str, ...]:
    return READERS + tuple(reader for module in catalogues() for reader in module.READERS)


def all_cases() -> list[Case]:
    """Every hostile input of every catalogue (scripts/fuzz_readers.py, docs/RELIABILITY.md)."""
    return [*base_cases(), *(case for module in catalogues() for case in module.cases())]


# -- running a case ---------------------------------------------------------------------------------


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".usaf-tmp-" in p.name or ".usaf-old-" in p.name)


def run_case(bench: Bench, case: Case, case_dir: Path) -> Outcome:
    """Write the case's input, run its command in-process, and judge the answer."""
    case_dir.mkdir(parents=True, exist_ok=True)
    args = case.build(bench, case_dir)
    with case.during(case_dir) if case.during is not None else contextlib.nullcontext():
        result = CliRunner().invoke(app, args, env=case.env)
    stderr = result.stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    message = errors[0].removeprefix("error: ") if errors else ""
    problems = []
    if result.exit_code == 2:
        answer = "refused (exit 2)"
        if len(errors) != 1:
            problems.append(f"{len(errors)} error lines")
        if case.needle.lower() not in message.lower():
            problems.append(f"the message does not name {case.needle!r}")
        if "Traceback" in stderr:
            problems.append("a traceback without --verbose")
    elif result.exit_code == 0 and case.may_pass:
        answer = "accepted (valid input)"
    elif result.exit_code == 0:
        answer = "BAD: accepted"
        problems.append("accepted a broken input")
    else:
        exc = result.exception
        answer = f"CRASH: {type(exc).__name__}" if exc is not None else f"BAD: exit {result.exit_code}"
        message = str(exc)[:300] if exc is not None else stderr[-300:]
        problems.append(answer)
    out = case_dir / "out"
    if result.exit_code != 0 and out.exists():
        problems.append("an output directory was left")
    if temps := _temporaries(case_dir):
        problems.append(f"temporaries left: {temps}")
    if marker_of(case_dir).exists():
        problems.append("CODE FROM THE INPUT RAN")
    if case.after is not None:
        problems += case.after(case_dir)
    return Outcome(
        case.reader, case.name, answer, not problems, result.exit_code, message, case.unsafe, problems, case.note
    )


def run_all(root: Path, cases: list[Case] | None = None, *, progress: Callable[[Outcome], None] | None = None):
    """Build a bench under ``root`` and run every case; returns the outcomes (as dicts)."""
    bench = Bench.build(Path(root) / "bench")
    outcomes = []
    for number, case in enumerate(cases if cases is not None else all_cases()):
        outcome = run_case(bench, case, Path(root) / f"case-{number:03d}")
        outcomes.append(asdict(outcome))
        if progress is not None:
            progress(outcome)
    return outcomes
