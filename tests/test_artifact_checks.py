"""The consistency checks of tampered artifacts (issue 19), reader by reader: a plan's masks and ranked candidates
against its own manifest and the model, its summary against itself, its prefix store against its record, a
manifest against its fingerprint and its kind's files, a quantized tensor's ``source_dtype``.

Each check has its negative control: the untouched artifact passes it. The CLI-level catalogue of the same
inputs is tests/test_hostile_artifacts.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import invoke
from usaf.artifacts import PlanManifest, QuantizedModelManifest, load_manifest, load_verified
from usaf.artifacts.loader import edit_problem, fingerprint_problem, listing_problem
from usaf.artifacts.plan import (
    IMPORTANCE_FILE,
    MASKS_FILE,
    check_masks_fit,
    check_plan_layers,
    read_importance,
    read_masks,
)
from usaf.artifacts.prefix_store import open_store
from usaf.errors import UsafError
from usaf.quant import quantize_experts
from usaf.quant.tensor import QuantizedTensor
from usaf.testing import hostile, hostile_artifacts


@pytest.fixture
def plan(bench, tmp_path) -> Path:
    """A fresh copy of the bench's plan (scored with --cache), free to tamper with."""
    return Path(shutil.copytree(hostile_artifacts.bench_plan(bench.root), tmp_path / "plan"))


def _manifest(plan: Path) -> PlanManifest:
    return load_manifest(plan, PlanManifest)


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def _edit_summary(plan: Path, edit) -> None:
    data = json.loads((plan / "manifest.json").read_text())
    edit(data["summary"])
    (plan / "manifest.json").write_text(json.dumps(data))


# -- masks -----------------------------------------------------------------------------------------------------


def test_negative_control_read_masks_returns_the_masks_the_manifest_describes(plan):
    manifest = _manifest(plan)
    masks = read_masks(plan, manifest)
    assert set(masks) == {t.name for t in manifest.summary.tensors}
    for t in manifest.summary.tensors:
        assert torch.equal(masks[t.name], load_file(str(plan / MASKS_FILE))[t.name])
        assert masks[t.name].numel() == t.selected


def _move_one_to_the_next_expert(masks: dict, name: str, per_expert_size: int) -> None:
    """The same count, sorted and in range, but one entry of expert 0 moved to expert 1's last weight."""
    idx = masks[name]
    moved = torch.tensor([2 * per_expert_size - 1])
    if bool((idx == moved).any()):
        moved = moved - 1
    masks[name] = torch.cat([idx[1:], moved]).sort().values


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda t: t.flip(0), "is not in ascending order"),
        (lambda t: torch.cat([t[:1], t[:-1]]), "repeats an index"),
        (lambda t: t.float(), "must be a 1-D int64 tensor, got 1-D float32"),
        (lambda t: t[:-1], "holds 306 indices, the plan's manifest says 307"),
        (lambda t: torch.cat([t[:-1], torch.tensor([4 * 48 * 32])]), "holds the index 6144, outside the 6144"),
    ],
    ids=["unsorted", "duplicated", "float", "short", "out of range"],
)
def test_read_masks_names_the_file_the_tensor_and_the_problem(plan, change, expected):
    manifest = _manifest(plan)
    name = manifest.summary.tensors[0].name
    _rewrite(plan / MASKS_FILE, lambda masks: masks.__setitem__(name, change(masks[name])))
    with pytest.raises(UsafError) as caught:
        read_masks(plan, manifest)
    assert caught.value.message.startswith(f"--plan {plan / MASKS_FILE}: the mask of {name} {expected}")
    assert "re-run usaf score" in caught.value.hint


def test_read_masks_refuses_a_mask_split_over_the_experts_unlike_per_expert(plan):
    """Count, order and range all fine: only the per-expert split betrays the edit."""
    manifest = _manifest(plan)
    first = manifest.summary.tensors[0]
    _rewrite(plan / MASKS_FILE, lambda m: _move_one_to_the_next_expert(m, first.name, first.shape[1] * first.shape[2]))
    with pytest.raises(UsafError, match="splits over the experts unlike the manifest's per_expert"):
        read_masks(plan, manifest)


def test_check_masks_fit_compares_names_and_shapes_with_the_model(plan):
    manifest = _manifest(plan)
    masks = read_masks(plan, manifest)
    shapes = {t.name: tuple(t.shape) for t in manifest.summary.tensors}
    check_masks_fit(plan, manifest, masks, shapes)  # negative control: the model the plan was made for
    name = manifest.summary.tensors[0].name
    bigger = {**shapes, name: (8, *shapes[name][1:])}
    with pytest.raises(
        UsafError, match=rf"manifest.json: {name} has shape \[4, 48, 32\], the model's is \[8, 48, 32\]"
    ):
        check_masks_fit(plan, manifest, masks, bigger)
    with pytest.raises(UsafError, match="no mask for x, a tensor of the layers the plan trains"):
        check_masks_fit(plan, manifest, masks, {**shapes, "x": (1, 1, 1)})
    with pytest.raises(UsafError, match=f"a mask for {name}, which is no trainable tensor"):
        check_masks_fit(plan, manifest, masks, {n: s for n, s in shapes.items() if n != name})


def test_check_plan_layers_refuses_a_layer_without_experts(plan):
    manifest = _manifest(plan)
    check_plan_layers(plan, manifest, [0, 1])  # negative control
    with pytest.raises(
        UsafError, match=r"trains layer 1, which is no MoE layer of the model \(its MoE layers: \[0\]\)"
    ):
        check_plan_layers(plan, manifest, [0])


# -- ranked candidates (importance.safetensors) -------------------------------------------------------------


def test_negative_control_read_importance_returns_every_tensors_candidates(plan):
    manifest = _manifest(plan)
    ranked = read_importance(plan, manifest)
    assert set(ranked) == {t.name for t in manifest.summary.tensors}
    for t in manifest.summary.tensors:
        indices, scores = ranked[t.name]
        assert indices.numel() == scores.numel() == t.candidates
        assert indices.unique().numel() == t.candidates  # in rank order, distinct


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d, n: d.__setitem__(f"{n}.scores", d[f"{n}.scores"] * float("nan")), "scores must be"),
        (lambda d, n: d.__setitem__(f"{n}.scores", d[f"{n}.scores"][:-1]), "scores must be"),
        (lambda d, n: d.__setitem__(f"{n}.scores", d[f"{n}.scores"].long()), "scores must be"),
        (lambda d, n: d.__setitem__(f"{n}.indices", d[f"{n}.indices"] + 10**6), "outside the"),
        (lambda d, n: d.__setitem__(f"{n}.indices", d[f"{n}.indices"][:-1]), "holds"),
        (lambda d, n: d.pop(f"{n}.scores"), "no "),
        (lambda d, n: d.__setitem__("stray.indices", d[f"{n}.indices"].clone()), "holds stray.indices"),
    ],
    ids=["NaN scores", "short scores", "integer scores", "indices out of range", "short indices", "no scores",
         "a stray tensor"],
)  # fmt: skip
def test_read_importance_refuses_a_tampered_file(plan, edit, expected):
    manifest = _manifest(plan)
    name = manifest.summary.tensors[-1].name
    _rewrite(plan / IMPORTANCE_FILE, lambda d: edit(d, name))
    with pytest.raises(UsafError) as caught:
        read_importance(plan, manifest)
    assert caught.value.message.startswith(f"--plan {plan / IMPORTANCE_FILE}: ")
    assert expected in caught.value.message


# -- the plan's summary ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda s: s.__setitem__("trainable_layers", [1, 1]), "trainable_layers must be distinct"),
        (lambda s: s.__setitem__("trainable_layers", [-1, 1]), "trainable_layers must be distinct"),
        (lambda s: s["tensors"].append(s["tensors"][0]), "each trainable tensor once"),
        (lambda s: s["tensors"][0].__setitem__("per_expert", [307]), "per_expert must be 4 counts"),
        (lambda s: s["tensors"][0].__setitem__("shape", [4, 48]), "shape must be 3 positive sizes"),
        (lambda s: s["tensors"][0].__setitem__("selected", 10**9), "is not between 1 and the tensor's 6144"),
    ],
    ids=["layers repeated", "negative layer", "tensor twice", "per_expert length", "2-D shape", "selected too many"],
)
def test_a_plan_summary_that_disagrees_with_itself_is_refused_on_reading(plan, edit, expected):
    _edit_summary(plan, edit)
    with pytest.raises(UsafError) as caught:
        load_manifest(plan, PlanManifest, flag="--plan")
    assert f"{plan / 'manifest.json'}: invalid manifest at 'summary'" in caught.value.message
    assert expected in caught.value.message


# -- manifests: their kind's files, their fingerprint -------------------------------------------------------


def test_negative_control_a_reordered_listing_keeps_its_fingerprint(bench, tmp_path):
    model = hostile._copy_quantized(bench, tmp_path)
    data = json.loads((model / "manifest.json").read_text())
    data["files"].reverse()  # the fingerprint does not depend on the order
    (model / "manifest.json").write_text(json.dumps(data))
    manifest = load_manifest(model, QuantizedModelManifest, flag="--model")
    assert fingerprint_problem(manifest) is None and listing_problem(manifest) is None
    assert "edited after usaf wrote it" in edit_problem(manifest)  # the manifest's own checksum sees any edit


def test_a_manifest_whose_fingerprint_is_not_its_files_is_refused_by_every_consumer(bench, tmp_path):
    model = hostile._copy_quantized(bench, tmp_path)
    data = json.loads((model / "manifest.json").read_text())
    data["fingerprint"] = "ab" * 32
    (model / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(UsafError) as caught:
        load_verified(model, QuantizedModelManifest, flag="--model", hashes=False)
    assert caught.value.message.startswith(f"--model {model / 'manifest.json'}: its fingerprint abababababababab "
                                           f"does not match the sha256 of the files it lists")  # fmt: skip


def test_a_manifest_missing_a_file_its_kind_always_holds_is_refused(bench, tmp_path):
    model = hostile._copy_quantized(bench, tmp_path)
    data = json.loads((model / "manifest.json").read_text())
    data["files"] = [f for f in data["files"] if f["path"] != "experts_q4.pt"]
    (model / "manifest.json").write_text(json.dumps(data))
    hostile._resign(model)
    with pytest.raises(UsafError, match="does not list experts_q4.pt, which every 'quantized_model' artifact holds"):
        load_verified(model, QuantizedModelManifest, flag="--model", hashes=False)



def test_an_edited_manifest_is_refused_by_its_consumer_and_by_inspect_verify(bench, plan, tmp_path):
    """The files' hashes do not cover the manifest itself: a plan whose lr was edited passed every check and train ran
    at it; an edited delta summary made export blame the model (found in review)."""
    path = plan / "manifest.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data, indent=4, sort_keys=True))  # the control: a manifest laid out anew says the same
    assert load_verified(plan, PlanManifest, flag="--plan").summary.lr_test.lr == data["summary"]["lr_test"]["lr"]
    assert invoke("inspect", "--verify", plan).exit_code == 0
    data["summary"]["lr_test"]["lr"] *= 10  # a valid value, which no check of the plan's own can tell from the real one
    path.write_text(json.dumps(data))
    trained = invoke(*hostile_artifacts.train_args(bench, tmp_path, plan=plan))
    assert trained.exit_code == 2
    assert f"error: --plan {path}: edited after usaf wrote it (what it says no longer matches its manifest_sha256 " \
        in trained.output  # fmt: skip
    assert not (tmp_path / "out").exists()
    verified = invoke("inspect", "--verify", plan, "--json")
    assert verified.exit_code == 2 and "edited after usaf wrote it" in json.loads(verified.stdout)["problems"][0][
        "problem"]  # fmt: skip


def test_a_manifest_an_older_usaf_wrote_has_no_checksum_and_is_read_as_before(plan):
    """Older manifests have no manifest_sha256: they load, and inspect --verify says their own content is unchecked."""
    data = json.loads((plan / "manifest.json").read_text())
    assert len(data.pop("manifest_sha256")) == 64
    (plan / "manifest.json").write_text(json.dumps(data))
    assert load_verified(plan, PlanManifest, flag="--plan").manifest_sha256 is None
    verified = invoke("inspect", "--verify", plan)
    assert verified.exit_code == 0
    assert "has no checksum of its own (an older usaf wrote it)" in " ".join(verified.output.split())


def test_a_manifest_made_before_a_field_was_added_still_verifies_and_an_edit_of_it_does_not(bench, tmp_path):
    """A field added to a manifest with a default (the tokens' skipped_wide_files) made every tokens artifact made
    before it "edited after usaf wrote it": the checksum counted the default the file never held (found in review).
    An older file (stamped as usaf stamped it then, without the field) reads as it was; an edit still does not."""
    from usaf.artifacts import TokensManifest
    from usaf.artifacts.manifest import manifest_checksum

    tokens = tmp_path / "tokens"
    (tmp_path / "a.py").write_text("print('hello')\n" * 50)
    assert invoke("tokenize", tmp_path / "a.py", "--model", bench.model, "--out", tokens).exit_code == 0
    path = tokens / "manifest.json"
    data = json.loads(path.read_text())
    assert data["summary"].pop("skipped_wide_files") == 0  # as an older usaf wrote it
    older = TokensManifest.model_validate({k: v for k, v in data.items() if k != "manifest_sha256"})
    stamped = json.loads(older.model_dump_json(exclude_unset=True))  # the fields it had, stamped as written then
    data["manifest_sha256"] = manifest_checksum(older, as_read=True)  # as_read: the fields it was given
    assert "skipped_wide_files" not in stamped["summary"]
    path.write_text(json.dumps(data))
    assert load_verified(tokens, TokensManifest, flag="--data").summary.skipped_wide_files == 0
    data["summary"]["documents"] += 1  # the control: an edit of what it does hold
    path.write_text(json.dumps(data))
    with pytest.raises(UsafError, match="edited after usaf wrote it"):
        load_verified(tokens, TokensManifest, flag="--data")


# -- the prefix store ----------------------------------------------------------------------------------------


def test_negative_control_open_store_opens_the_store_the_plan_records(plan):
    record = _manifest(plan).summary.prefix_cache
    store = open_store(plan, record, hidden_size=32)
    assert store is not None and len(store) == record.samples == 8
    assert open_store(plan, None) is None  # a plan without --cache: the files, if any, are not consulted


def test_open_store_checks_the_states_against_the_model_and_the_record(plan):
    record = _manifest(plan).summary.prefix_cache
    with pytest.raises(UsafError, match="is 32 wide, the model's hidden size is 64"):
        open_store(plan, record, hidden_size=64)
    with pytest.raises(UsafError, match="is torch.float32, the plan's manifest records float16"):
        open_store(plan, record.model_copy(update={"dtype": "float16"}))
    with pytest.raises(UsafError, match="states entering layer 1, the plan's manifest records layer 0"):
        open_store(plan, record.model_copy(update={"start": 0}))
    with pytest.raises(UsafError, match=r"prefix_states.bin: 24,576 bytes, the plan's manifest records 1"):
        open_store(plan, record.model_copy(update={"bytes": 1}))


# -- a quantized tensor's source dtype -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_negative_control_a_floating_source_dtype_is_accepted(dtype):
    d = quantize_experts(torch.randn(2, 4, 8), nbits=4, group_size=8, method="rtn").to_dict()
    assert QuantizedTensor.from_dict({**d, "source_dtype": dtype}).source_dtype == dtype


@pytest.mark.parametrize("dtype", ["int8", "bool", "uint8", "Tensor", "float99"])
def test_a_source_dtype_that_is_no_floating_point_dtype_is_refused(dtype):
    d = quantize_experts(torch.randn(2, 4, 8), nbits=4, group_size=8, method="rtn").to_dict()
    with pytest.raises(ValueError, match=f"source_dtype must name a floating-point torch dtype, got '{dtype}'"):
        QuantizedTensor.from_dict({**d, "source_dtype": dtype}, name="w")
