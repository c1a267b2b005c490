"""Hostile cases for tampered and inconsistent artifacts (issue 19): every file edited as an attacker or a broken
tool would, the manifest re-signed to match (:func:`usaf.testing.hostile._resign`), so that only the readers'
own checks stand between the edit and a silent wrong run.

- plan files (``usaf train --plan``): masks out of range, negative, unsorted, duplicated, float, 2-D, empty,
  missing or extra; a masks file whose header lies; a summary that disagrees with its masks or with the model;
- prefix store (``usaf train --plan`` of a plan scored with ``--cache``): ``prefix_states.bin`` truncated or
  padded, ``prefix_index.json`` broken or disagreeing with the plan's manifest;
- quantized model consistency (``usaf score``/``train``/``eval``): base tensors of the wrong shape or unknown
  to the model, an unknown ``source_dtype``, a ``config.json`` that no longer matches the manifest, a manifest
  that lists no files, a shard the manifest does not cover; ``usaf inspect --verify`` of a manifest whose
  fingerprint no longer matches its files.
"""

from __future__ import annotations

import functools
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from usaf.artifacts.plan import MASKS_FILE
from usaf.artifacts.prefix_store import INDEX_FILE, STATES_FILE
from usaf.cli.app import app
from usaf.families import load_model_config, resolve_family
from usaf.testing.hostile import Bench, Case, _copy_quantized, _double_experts, _resign, _score

PLAN = "plan files"
PREFIX = "plan prefix store"
QUANTIZED = "quantized model consistency"

READERS: tuple[str, ...] = (PLAN, PREFIX, QUANTIZED)


# -- the valid plan every plan case starts from --------------------------------------------------------------


def bench_plan(root: Path) -> Path:
    """A plan (with a prefix store: ``--cache``) of the bench under ``root``, scored once, copied by every case."""
    return _scored_plan(Path(root))


@functools.cache
def _scored_plan(root: Path) -> Path:
    out = root / "artifacts-plan"
    if not (out / "manifest.json").is_file():
        args = ["score", "--model", str(root / "quantized"), "--data", str(root / "tokens.jsonl"), "--out", str(out),
                "--frac", "0.05", "--calib-samples", "4", "--no-stability", "--cache",
                "--lr-test"]  # fmt: skip
        result = CliRunner().invoke(app, args)
        if result.exit_code != 0:
            raise RuntimeError(f"scoring the bench's plan failed: {result.output[-2000:]}")
    return out


def train_args(bench: Bench, case_dir: Path, *, plan: Path | None = None, model: Path | None = None) -> list[str]:
    args = ["train", "--model", str(model or bench.quantized), "--data", str(bench.tokens), "--steps", "1",
            "--out", str(case_dir / "out")]  # fmt: skip
    return [*args, "--plan", str(plan)] if plan is not None else args


def _summary(plan: Path) -> dict:
    return json.loads((plan / "manifest.json").read_text(encoding="utf-8"))["summary"]


def _edit_manifest(plan: Path, edit: Callable[[dict], None]) -> None:
    path = plan / "manifest.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


def _plan_case(
    name: str, tamper: Callable[[Path], None], *, needle: str = MASKS_FILE, reader: str = PLAN, verify: bool = False
) -> Case:
    """``tamper(plan_dir)`` edits a copy of the bench's plan; the manifest is re-signed; read by ``usaf train``."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        plan = Path(shutil.copytree(bench_plan(bench.root), case_dir / "plan"))
        tamper(plan)
        if not verify:
            _resign(plan)
            return train_args(bench, case_dir, plan=plan)
        return ["inspect", "--verify", str(plan)]

    return Case(reader, name, build, needle)


# -- plan tampering helpers -----------------------------------------------------------------------------------


def _masks(edit: Callable[[dict[str, torch.Tensor], list[str]], None]) -> Callable[[Path], None]:
    """Rewrite ``masks.safetensors`` through ``edit(masks, names)`` (``names``: the manifest's tensors, in order)."""

    def tamper(plan: Path) -> None:
        masks = load_file(str(plan / MASKS_FILE))
        edit(masks, [t["name"] for t in _summary(plan)["tensors"]])
        save_file({k: v.contiguous() for k, v in masks.items()}, str(plan / MASKS_FILE))

    return tamper


def _first(change: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path], None]:
    def edit(masks: dict, names: list[str]) -> None:
        masks[names[0]] = change(masks[names[0]])

    return _masks(edit)


def _with(index: int, value: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def change(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[index] = value
        return t

    return change


def _numel(plan: Path) -> int:
    first = _summary(plan)["tensors"][0]
    return int(torch.tensor(first["shape"]).prod())


def _out_of_range(plan: Path) -> None:
    _first(_with(-1, _numel(plan)))(plan)


def _summary_edit(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda plan: _edit_manifest(plan, lambda d: edit(d["summary"]))


def _drop_tensor_everywhere(plan: Path) -> None:
    """The last tensor gone from the masks and the manifest, its counts adjusted: consistent, but one fewer."""
    last = _summary(plan)["tensors"][-1]
    _masks(lambda masks, names: masks.pop(last["name"]))(plan)

    def edit(s: dict) -> None:
        s["tensors"] = s["tensors"][:-1]
        s["expert_entries"] -= last["selected"]
        s["trainable_params"] -= last["selected"]

    _summary_edit(edit)(plan)


def _untrained_layer(plan: Path) -> None:
    """A mask (and manifest entry) for layer 0's gate_up, a layer the plan does not train."""
    inputs = json.loads((plan / "manifest.json").read_text(encoding="utf-8"))["inputs"]
    model = Path(next(i["path"] for i in inputs if i["role"] == "model"))
    name = resolve_family(load_model_config(model)).gate_up_name(0)
    first = _summary(plan)["tensors"][0]
    _masks(lambda masks, names: masks.__setitem__(name, masks[names[0]].clone()))(plan)

    def edit(s: dict) -> None:
        s["tensors"].append({**first, "name": name, "layer": 0})
        s["expert_entries"] += first["selected"]
        s["trainable_params"] += first["selected"]

    _summary_edit(edit)(plan)


def _empty_everywhere(plan: Path) -> None:
    _first(lambda t: t[:0])(plan)

    def edit(s: dict) -> None:
        first = s["tensors"][0]
        s["expert_entries"] -= first["selected"]
        s["trainable_params"] -= first["selected"]
        first.update(selected=0, budget=0, per_expert=[0] * len(first["per_expert"]))

    _summary_edit(edit)(plan)


def _doubled_shape(plan: Path) -> None:
    """The first tensor's shape claims twice the experts (its indices still fit): a plan of another model."""

    def edit(s: dict) -> None:
        first = s["tensors"][0]
        first["shape"][0] *= 2
        first["per_expert"] = first["per_expert"] + [0] * len(first["per_expert"])

    _summary_edit(edit)(plan)


def _header(edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def tamper(plan: Path) -> None:
        path = plan / MASKS_FILE
        path.write_bytes(edit(path.read_bytes()))

    return tamper


def _header_past_end(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw) + 100) + raw[8:]


def _offsets_past_end(raw: bytes) -> bytes:
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    name = next(k for k in sorted(header) if k != "__metadata__")
    header[name]["data_offsets"] = [0, 10**9]
    new = json.dumps(header).encode()
    return struct.pack("<Q", len(new)) + new + raw[8 + length :]


def _unlist_files(plan: Path) -> None:
    _edit_manifest(plan, lambda d: d.__setitem__("files", []))


def _forge_fingerprint(plan: Path) -> None:
    _edit_manifest(plan, lambda d: d.__setitem__("fingerprint", "0" * 64))


def plan_cases() -> list[Case]:
    def model_fingerprint(s: dict) -> None:
        s["model_fingerprint"] = "f" * 64

    def layers(value: list[int]) -> Callable[[dict], None]:
        return lambda s: s.__setitem__("trainable_layers", value)

    def per_expert_off(s: dict) -> None:
        s["tensors"][0]["per_expert"][0] += 1

    def lr_test_lr(value: object) -> Callable[[dict], None]:
        return lambda s: s["lr_test"].__setitem__("lr", value)  # the bench's plan is scored with the lr test

    def counts_off(key: str) -> Callable[[dict], None]:
        return lambda s: s.__setitem__(key, s[key] + 1)

    return [
        _plan_case("a mask index equal to the tensor's size", _out_of_range),
        _plan_case("a mask index of 2**40", _first(_with(-1, 2**40))),
        _plan_case("a negative mask index", _first(_with(0, -1))),
        _plan_case("mask indices unsorted", _first(lambda t: t.flip(0))),
        _plan_case("a duplicated mask index", _first(lambda t: torch.cat([t[:1], t[:-1]]))),
        _plan_case("float mask indices", _first(lambda t: t.double() + 0.5)),
        _plan_case("int32 mask indices", _first(lambda t: t.int())),
        _plan_case("boolean mask", _first(lambda t: torch.ones_like(t, dtype=torch.bool))),
        _plan_case("a 2-D mask", _first(lambda t: t[: t.numel() // 2 * 2].reshape(2, -1))),
        _plan_case("an empty mask (the manifest still counts it)", _first(lambda t: t[:0])),
        _plan_case("an empty mask, the manifest saying 0 too", _empty_everywhere, needle="manifest"),
        _plan_case("one index fewer than the manifest says", _first(lambda t: t[:-1])),
        _plan_case("a tensor's mask missing", _masks(lambda masks, names: masks.pop(names[-1]))),
        _plan_case("a mask for a tensor the manifest does not list", _masks(
            lambda masks, names: masks.__setitem__(names[0] + "_extra", masks[names[0]].clone()))),
        _plan_case("a tensor gone from masks and manifest alike (fewer weights than the layer has)",
                   _drop_tensor_everywhere),
        _plan_case("a mask for a layer the plan does not train", _untrained_layer, needle="manifest"),
        _plan_case("a tensor's shape is another model's", _doubled_shape, needle="manifest"),
        _plan_case("expert_entries disagrees with the tensors", _summary_edit(counts_off("expert_entries")),
                   needle="manifest"),
        _plan_case("trainable_params disagrees with its parts", _summary_edit(counts_off("trainable_params")),
                   needle="manifest"),
        _plan_case("per_expert does not add up to selected", _summary_edit(per_expert_off), needle="manifest"),
        _plan_case("trainable_layers names a layer the model lacks", _summary_edit(layers([1, 7])),
                   needle="manifest"),
        _plan_case("trainable_layers empty", _summary_edit(layers([])), needle="manifest"),
        *(_plan_case(f"the lr test's lr {what}", _summary_edit(lr_test_lr(value)), needle="manifest")
          for what, value in (("NaN", float("nan")), ("negative", -0.01), ("a string", "fast"),
                              ("none of its candidates", 7e-3))),
        _plan_case("made for a model of the same name, another fingerprint", _summary_edit(model_fingerprint),
                   needle="fingerprint"),
        _plan_case("masks header length past the file's end", _header(_header_past_end)),
        _plan_case("masks data offsets past the file's end", _header(_offsets_past_end)),
        _plan_case("masks file cut in half", _header(lambda raw: raw[: len(raw) // 2])),
        _plan_case("masks file empty", _header(lambda raw: b"")),
        _plan_case("masks file not safetensors", _header(lambda raw: b"PK\x03\x04" + raw[4:])),
        _plan_case("a manifest listing no files", _unlist_files, needle="manifest"),
        _plan_case("inspect --verify: fingerprint no longer matches the files", _forge_fingerprint,
                   needle="fingerprint", verify=True),
    ]  # fmt: skip


# -- the prefix store ------------------------------------------------------------------------------------------


def _index_edit(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    """Rewrite ``prefix_index.json`` through ``edit(index)`` (returns bytes to write verbatim, or None)."""

    def tamper(plan: Path) -> None:
        path = plan / INDEX_FILE
        index = json.loads(path.read_text(encoding="utf-8"))
        new = edit(index)
        path.write_bytes(new if isinstance(new, bytes) else json.dumps(index).encode())

    return tamper


def _first_entry(edit: Callable[[list], None]) -> Callable[[Path], None]:
    return _index_edit(lambda index: edit(index["entries"][sorted(index["entries"])[0]]))


def _states(edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def tamper(plan: Path) -> None:
        path = plan / STATES_FILE
        path.write_bytes(edit(path.read_bytes()))

    return tamper


def _store_gone(plan: Path) -> None:
    (plan / STATES_FILE).unlink()
    (plan / INDEX_FILE).unlink()
    _edit_manifest(plan, lambda d: d.__setitem__("files", [f for f in d["files"]
                                                           if f["path"] not in (STATES_FILE, INDEX_FILE)]))  # fmt: skip


def _drop_entry(index: dict) -> None:
    index["entries"].pop(sorted(index["entries"])[0])


def _set_at(position: int, value: object) -> Callable[[list], None]:
    return lambda entry: entry.__setitem__(position, value)


def prefix_cases() -> list[Case]:
    def case(name: str, tamper: Callable[[Path], None], needle: str) -> Case:
        return _plan_case(name, tamper, needle=needle, reader=PREFIX)

    def narrower(entry: list) -> None:
        entry[1] = [entry[1][0], entry[1][1] // 2]  # the same tokens, half as wide (inside the file still)

    return [
        case("prefix_states.bin cut in half", _states(lambda raw: raw[: len(raw) // 2]), STATES_FILE),
        case("prefix_states.bin with bytes appended", _states(lambda raw: raw + bytes(64)), STATES_FILE),
        case("prefix_index.json not JSON", _index_edit(lambda index: b'{"entries": {'), INDEX_FILE),
        case("prefix_index.json a JSON list", _index_edit(lambda index: b"[]"), INDEX_FILE),
        case("prefix_index.json without entries", _index_edit(lambda index: index.pop("entries")), INDEX_FILE),
        case("an entry's offset past the states file", _first_entry(_set_at(0, 10**9)), INDEX_FILE),
        case("an entry's offset negative", _first_entry(_set_at(0, -8)), INDEX_FILE),
        case("an entry's dtype unknown", _first_entry(_set_at(2, "float99")), INDEX_FILE),
        case("an entry of 3 dimensions", _first_entry(lambda e: e.__setitem__(1, [1, *e[1]])), INDEX_FILE),
        case("an entry of another hidden size", _first_entry(narrower), INDEX_FILE),
        case("an entry malformed (a number)", _index_edit(
            lambda index: index["entries"].__setitem__(sorted(index["entries"])[0], 5)), INDEX_FILE),
        case("fewer entries than the manifest says", _index_edit(_drop_entry), INDEX_FILE),
        case("the store gone, the manifest still recording it", _store_gone, "prefix"),
    ]  # fmt: skip


# -- the quantized model --------------------------------------------------------------------------------------


def _quantized_case(name: str, tamper: Callable[[Path], None], needle: str, command: str = "score") -> Case:
    """``tamper(quantized_dir)`` edits a copy of the bench's quantized model, the manifest is re-signed; read by
    ``command`` (score, train, eval, or inspect --verify: then the manifest is left as tampered)."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        model = _copy_quantized(bench, case_dir)
        tamper(model)
        if command == "verify":
            return ["inspect", "--verify", str(model)]
        _resign(model)
        if command == "train":
            return train_args(bench, case_dir, model=model)
        if command == "eval":
            # --workspace: eval's cache of the base model's losses stays in the case directory
            return ["eval", "--model", str(model), "--data", str(bench.tokens), "--bootstrap", "100",
                    "--out", str(case_dir / "out"), "--workspace", str(case_dir)]  # fmt: skip
        return _score(bench, case_dir, model=model)

    return Case(QUANTIZED, name, build, needle)


def _base_shard(model: Path) -> Path:
    return next(model.glob("base-*.safetensors"))


def _edit_base(edit: Callable[[dict[str, torch.Tensor], object], None]) -> Callable[[Path], None]:
    """Rewrite the base shard through ``edit(tensors, family_spec)``."""

    def tamper(model: Path) -> None:
        shard = _base_shard(model)
        tensors = load_file(str(shard))
        edit(tensors, resolve_family(load_model_config(model)))
        save_file(tensors, str(shard))

    return tamper


def _router_rows(tensors: dict, spec) -> None:
    name = spec.router_weight_name(spec.moe_layers[-1])
    tensors[name] = torch.cat([tensors[name], tensors[name][:1]])  # one expert more than the model has


def _router_transposed(tensors: dict, spec) -> None:
    name = spec.router_weight_name(spec.moe_layers[0])
    tensors[name] = tensors[name].t().contiguous()


def _router_as_integers(tensors: dict, spec) -> None:
    name = spec.router_weight_name(spec.moe_layers[0])
    tensors[name] = (tensors[name] * 100).round().to(torch.int64)


def _another_expert_count(model: Path) -> None:
    """Config, experts and routers all of twice the experts, consistent with each other; only the manifest's
    summary still says what was quantized."""
    _config(lambda c: c.__setitem__("num_local_experts", c["num_local_experts"] * 2))(model)
    _experts(_double_experts)(model)

    def routers(tensors: dict, spec) -> None:
        for layer in spec.moe_layers:
            name = spec.router_weight_name(layer)
            tensors[name] = torch.cat([tensors[name], tensors[name]])

    _edit_base(routers)(model)


def _foreign_tensor(tensors: dict, spec) -> None:
    tensors[spec.layer_prefix(99) + ".extra.weight"] = torch.zeros(2, 2)


def _experts(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def tamper(model: Path) -> None:
        path = model / "experts_q4.pt"
        data = torch.load(path, weights_only=True)
        edit(data)
        torch.save(data, path)

    return tamper


def _source_dtype(value: str) -> Callable[[Path], None]:
    def edit(data: dict) -> None:
        for entry in data.values():
            entry["source_dtype"] = value

    return _experts(edit)


def _config(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def tamper(model: Path) -> None:
        path = model / "config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        edit(config)
        path.write_text(json.dumps(config, indent=2), encoding="utf-8")

    return tamper


def _manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda model: _edit_manifest(model, edit)


def _unlisted_shard(model: Path) -> None:
    """The index points every tensor at a copy of the shard that the manifest does not list (re-signing leaves
    it unlisted): a file that could be swapped unnoticed."""
    shard = _base_shard(model)
    extra = shard.with_name("base-unlisted.safetensors")
    shutil.copyfile(shard, extra)
    index_path = model / "base.safetensors.index.json"
    index = json.loads(index_path.read_text(encoding="utf-8"))
    index["weight_map"] = {name: extra.name for name in index["weight_map"]}
    index_path.write_text(json.dumps(index), encoding="utf-8")


def quantized_cases() -> list[Case]:
    def model_type(config: dict) -> None:
        config["model_type"] = "olmoe"

    def fewer_layers(config: dict) -> None:
        config["num_hidden_layers"] -= 1

    def more_layers(config: dict) -> None:
        config["num_hidden_layers"] += 1

    def moe_layers(d: dict) -> None:
        d["summary"]["moe_layers"] = d["summary"]["moe_layers"][:1]

    return [
        _quantized_case("a router with one expert too many", _edit_base(_router_rows), "base-"),
        _quantized_case("a router transposed", _edit_base(_router_transposed), "base-", "eval"),
        _quantized_case("a base tensor the model does not have", _edit_base(_foreign_tensor), "base-"),
        _quantized_case("a router stored as integers", _edit_base(_router_as_integers), "base-"),
        _quantized_case("config, experts and routers all of another expert count", _another_expert_count,
                        "experts_q4.pt"),
        _quantized_case("an unknown source_dtype", _source_dtype("bfloat17"), "source_dtype"),
        _quantized_case("source_dtype an integer type", _source_dtype("int8"), "source_dtype"),
        _quantized_case("source_dtype a torch attribute, not a dtype", _source_dtype("Tensor"), "source_dtype"),
        _quantized_case("config.json's model_type changed", _config(model_type), "config.json"),
        _quantized_case("config.json with a layer fewer", _config(fewer_layers), "config.json", "eval"),
        _quantized_case("config.json with a layer more", _config(more_layers), "config.json"),
        _quantized_case("the manifest's moe_layers changed", _manifest(moe_layers), "config.json"),
        _quantized_case("a manifest listing no files", _manifest(lambda d: d.__setitem__("files", [])), "manifest"),
        _quantized_case("a manifest listing no files (usaf train)", _manifest(lambda d: d.__setitem__("files", [])),
                        "manifest", "train"),
        _quantized_case("a manifest leaving out config.json (usaf eval)", _manifest(
            lambda d: d.__setitem__("files", [f for f in d["files"] if f["path"] != "config.json"])), "config.json",
            "eval"),
        _quantized_case("a base shard the manifest does not list", _unlisted_shard, "manifest"),
        _quantized_case("inspect --verify: fingerprint no longer matches the files",
                        _manifest(lambda d: d.__setitem__("fingerprint", "0" * 64)), "fingerprint", "verify"),
    ]  # fmt: skip


def cases() -> list[Case]:
    return [*plan_cases(), *prefix_cases(), *quantized_cases()]
