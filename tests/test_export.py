"""`usaf export`: merged Hugging Face directories (dequantized base or --base original) and deltas, for every family.

Each family gets one tiny run made through the real CLI (tokenize → score → train, layer 2 and its router
trained with one RigL reselection). The exported directory must load with plain transformers and
reproduce the engine's logits with the change applied; with --base, every tensor the change does not
touch must be the original's bytes and the touched ones original + delta exactly at the delta's positions.
"""

from __future__ import annotations

import json
import re
import shutil
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import FAMILIES, TRANSFORMERS_V5
from helpers import invoke, leftovers
from helpers_engine import every_target
from helpers_export import engine_logits, export, hf_logits, ids_for
from helpers_trained import tokenize, train_run
from usaf.artifacts import DeltaManifest, HfExportManifest, QuantizedModelManifest, RunManifest, load_verified
from usaf.artifacts.run import load_trained_change
from usaf.errors import UsafError
from usaf.families import load_model_config, read_checkpoint, resolve_family
from usaf.testing.hostile import _resign

NUM_LAYERS = 3  # layer 2 trains (deepseek_v3: layer 0 dense, 1-2 MoE)


@pytest.fixture(scope="module")
def trained(quantized, tiny_model, tmp_path_factory):
    """``trained(family) -> (source dir, quantized dir, run dir)``, built once per module."""
    root = tmp_path_factory.mktemp("export")
    cache: dict[str, tuple] = {}
    tokens: list = []

    def get(family: str):
        if family not in cache:
            qdir = quantized(family, num_layers=NUM_LAYERS, tokenizer=True)
            if not tokens:  # one tokenizer for every tiny model: tokenize once
                tokens.append(tokenize(qdir, root / "tokens"))
            targets = ",".join(every_target(resolve_family(load_model_config(qdir))))  # the linear targets too
            run = train_run(qdir, tokens[0], root / family, targets=targets)
            cache[family] = (tiny_model(family, num_layers=NUM_LAYERS, tokenizer=True), qdir, run)
        return cache[family]

    return get


def hf_state(path):
    """transformers' own loading of ``path``, as a state dict in usaf's names (4.x: experts seen fused)."""
    from transformers import AutoModelForCausalLM

    from usaf.families import load_model_config, resolve_family
    from usaf.families.modules import usaf_state_dict

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return usaf_state_dict(model, resolve_family(load_model_config(path)))


def raw_tensors(path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a checkpoint as (dtype, shape, raw bytes)."""
    out = {}
    for name, info in read_checkpoint(path).items():
        with safe_open(str(path / info.file), framework="pt") as f:
            t = f.get_tensor(name)
        out[name] = (info.dtype, list(info.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_dequantized_export_reloads_with_the_engines_logits(family, trained, tmp_path):
    source, qdir, run = trained(family)
    out = tmp_path / "hf"
    printed = export("--model", qdir, "--checkpoint", run, "--out", out)
    manifest = load_verified(out, HfExportManifest)
    assert printed["kind"] == "hf_export" and manifest.summary.base == "dequantized"
    change = load_trained_change(run)
    s = manifest.summary
    assert s.expert_entries == change.expert_entries > 0 and s.router_tensors == len(change.routers) > 0
    assert s.verify is not None and s.verify.max_abs_diff <= s.verify.tolerance
    # train's summary names the count export applies: its other two (active, dropped-and-kept) overlap where a
    # dropped entry grew back, and a reviewer could not reconcile them with export's (found in review)
    trained_summary = load_verified(run, RunManifest).summary
    assert trained_summary.changed_entries == s.expert_entries
    assert trained_summary.frozen_entries > 0 and trained_summary.expert_entries != s.expert_entries  # RigL ran
    # the family's own on-disk names and shapes, as its save_pretrained wrote the tiny source
    shapes = {n: i.shape for n, i in read_checkpoint(out).items()}
    assert shapes == {n: i.shape for n, i in read_checkpoint(source).items()}
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "config.json").read_bytes() == (source / "config.json").read_bytes()  # verbatim
    # independently of the stage's own check: plain transformers == engine with the change applied
    ids = ids_for(qdir)
    exported = hf_logits(out, ids)
    torch.testing.assert_close(exported, engine_logits(qdir, change, ids), rtol=0, atol=2e-5)
    untrained = engine_logits(qdir, None, ids)
    assert (exported - untrained).abs().max() > 1e-3  # negative control: the change is in the export


def stored(param: torch.Tensor, transposed: bool) -> torch.Tensor:
    """An in-memory expert tensor in the stored (E, O, I) orientation the deltas index, flattened (a linear
    target's (O, I) weight is already in it)."""
    if param.dim() == 2:
        return param.contiguous().view(-1)
    return (param.transpose(1, 2) if transposed else param).contiguous().view(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_onto_the_original_changes_exactly_the_trained_entries(family, trained, tmp_path):

    source, qdir, run = trained(family)
    out = tmp_path / "hf"
    export("--model", qdir, "--checkpoint", run, "--out", out, "--base", source)
    summary = load_verified(out, HfExportManifest).summary
    assert summary.base == "original" and summary.verify.reference == "original+change"
    assert summary.verify.max_abs_diff <= summary.verify.tolerance
    change = load_trained_change(run)
    spec = resolve_family(json.loads((source / "config.json").read_text()))

    # on disk: every tensor outside the trained layer's experts and router is the original's bytes
    original, written = raw_tensors(source), raw_tensors(out)
    assert {n: v[:2] for n, v in written.items()} == {n: v[:2] for n, v in original.items()}
    trained_prefixes = tuple(f"{spec.experts_prefix(layer)}." for layer in change.trainable_layers)
    routers = {spec.disk.to_disk(n) for n in change.routers}
    linear = {spec.disk.to_disk(n) for n in change.deltas if n.endswith(".weight")}  # attention / shared targets
    assert linear, "the fixture trains linear targets too"
    assert summary.expert_tensors_changed == len(change.deltas) > len(linear)  # counts every target's tensors
    touched = [n for n in original if original[n][2] != written[n][2]]
    assert set(linear) <= set(touched)
    assert all(n in routers | linear or spec.disk.to_memory(n).startswith(trained_prefixes) for n in touched)

    # in memory (transformers' own loading): original + delta at the delta's positions, nothing else moved
    before, after = hf_state(source), hf_state(out)
    for name, (indices, values) in change.deltas.items():
        old, new = stored(before[name], spec.layout.transposed), stored(after[name], spec.layout.transposed)
        assert torch.equal(new[indices], old[indices] + values)  # fp32 source: one exact fp32 sum
        outside = torch.ones_like(old, dtype=torch.bool)
        outside[indices] = False
        assert torch.equal(new[outside], old[outside])
    for name, weight in change.routers.items():
        assert torch.equal(after[name], weight)
    others = [n for n in before if n not in change.deltas and n not in change.routers]
    assert others and all(torch.equal(before[n], after[n]) for n in others)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_delta_applied_later_writes_the_same_directory(family, trained, tmp_path):
    _, qdir, run = trained(family)
    direct, delta, later = tmp_path / "direct", tmp_path / "delta", tmp_path / "later"
    export("--model", qdir, "--checkpoint", run, "--out", direct, "--no-verify")
    printed = export("--model", qdir, "--checkpoint", run, "--out", delta, "--format", "delta")
    assert printed["kind"] == "delta"
    summary = load_verified(delta, DeltaManifest).summary
    change = load_trained_change(run)
    assert summary.expert_entries == change.expert_entries and summary.router_tensors == len(change.routers)
    assert summary.model_fingerprint == load_verified(qdir, QuantizedModelManifest).fingerprint
    assert sum(f.stat().st_size for f in delta.iterdir()) < sum(f.stat().st_size for f in direct.iterdir()) / 5
    # the delta read back is the run's change, bit for bit
    back = load_trained_change(delta)
    assert back.fingerprint == change.fingerprint and back.trainable_layers == change.trainable_layers
    for name, (indices, values) in change.deltas.items():
        assert torch.equal(back.deltas[name][0], indices) and torch.equal(back.deltas[name][1], values)
    export("--model", qdir, "--checkpoint", delta, "--out", later, "--no-verify")
    files = sorted(p.name for p in direct.iterdir() if p.name != "manifest.json")
    assert files == sorted(p.name for p in later.iterdir() if p.name != "manifest.json")
    for name in files:
        assert (direct / name).read_bytes() == (later / name).read_bytes(), name
    # a delta edited after export is refused (its manifest hashes every file)
    data = bytearray((delta / "deltas.safetensors").read_bytes())
    data[-1] ^= 1
    (delta / "deltas.safetensors").write_bytes(bytes(data))
    result = invoke("export", "--model", qdir, "--checkpoint", delta, "--out", tmp_path / "again")
    assert result.exit_code == 2 and "--checkpoint" in result.output and "damaged" in result.output


def test_dtype_override_and_small_shards(trained, tmp_path):
    """Shards over --max-shard-gib (a layer's experts are written whole) went over it in silence (found in
    review): a note counts them, and only them."""
    source, qdir, run = trained("qwen3_moe")
    out = tmp_path / "bf16"
    args = ("--model", qdir, "--checkpoint", run, "--dtype", "bfloat16", "--max-shard-gib", 0.00001)
    # 10 KiB: the ~600 KiB model in many shards, a layer's experts (its largest unit) alone over it
    result = invoke("export", *args, "--out", out)
    assert result.exit_code == 0, result.output
    summary = load_verified(out, HfExportManifest).summary
    assert len(summary.shards) > 2
    limit = 0.00001 * 2**30
    surely_over = [s for s in summary.shards if s.bytes > limit + 2**12]  # the file's header is not the limit's
    maybe_over = [s for s in summary.shards if s.bytes > limit]
    assert surely_over, "no shard went over the limit: the note is untested"
    said = re.search(r"--max-shard-gib 1e-05: (\d+) of the (\d+) shards are larger", " ".join(result.stderr.split()))
    assert said is not None, result.stderr
    assert len(surely_over) <= int(said[1]) <= len(maybe_over) and int(said[2]) == len(summary.shards)
    assert {info.dtype for info in read_checkpoint(out).values()} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in summary.shards}
    v = summary.verify  # the same weights built in memory: exact; against the engine: bf16's measured rounding
    assert v.max_abs_diff == 0.0 and v.rounding_rms > 0 and v.change_effect_tolerance >= 2 * v.rounding_rms
    # onto the original, the reference rounds as the writer does: the same weights, the same logits
    onto = tmp_path / "bf16-base"
    export("--model", qdir, "--checkpoint", run, "--out", onto, "--dtype", "bfloat16", "--base", source)
    verified = load_verified(onto, HfExportManifest).summary.verify
    assert verified.max_abs_diff == 0.0 and verified.change_max_abs_effect > 1e-2


def test_tensor_files_are_as_readable_as_the_json_beside_them(trained, tmp_path):
    """safetensors >= 0.8 made every tensor file 0600 (its temporary's mode); a team's export must be readable."""
    _, qdir, run = trained("qwen3_moe")
    out = tmp_path / "e"
    export("--model", qdir, "--checkpoint", run, "--out", out)
    for directory in (qdir, run, out):
        expected = stat.S_IMODE((directory / "manifest.json").stat().st_mode)
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.rglob("*.safetensors")}
        assert modes and set(modes.values()) == {expected}, (directory.name, oct(expected), modes)


def mxfp4_gpt_oss(source, out):
    """``source`` (a tiny gpt-oss) with its gate_up experts re-encoded as MXFP4 blocks/scales, as hub releases ship."""
    from safetensors.torch import load_file, save_file

    spec = resolve_family(json.loads((source / "config.json").read_text()))
    e, h, i2 = spec.gate_up_shape  # [E, H, 2I]; H = 32 = one MXFP4 block (down_proj's I = 24 stays plain)
    gen = torch.Generator().manual_seed(3)
    tensors = load_file(source / "model.safetensors")
    for layer in spec.moe_layers:
        codes = torch.randint(0, 16, (e, i2, h), generator=gen)  # FP4 codes of [E, 2I, H]
        exps = torch.randint(-8, -4, (e, i2, h // 32), generator=gen)  # weights of a few 1e-2, like the rest
        name = spec.gate_up_name(layer)
        del tensors[name]
        tensors[name + "_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).reshape(e, i2, 1, 16)
        tensors[name + "_scales"] = (exps + 127).to(torch.uint8)  # E8M0: biased exponent
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for f in source.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.mark.skipif(
    not TRANSFORMERS_V5,
    reason="transformers 4.57 cannot load this hand-made, partly MXFP4 checkpoint (the tiny down_proj width 24 "
    "is no multiple of 32, so only gate_up is MXFP4); real gpt-oss checkpoints are MXFP4 throughout",
)
def test_mxfp4_original_is_written_decoded(tiny_model, tmp_path):
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize

    source = mxfp4_gpt_oss(tiny_model("gpt_oss", num_layers=NUM_LAYERS, tokenizer=True), tmp_path / "mxfp4")
    _, qdir = quantize(QuantizeConfig(model=str(source), out=tmp_path / "q", method="rtn", group_size=8))
    run = train_run(qdir, tokenize(qdir, tmp_path / "tokens"), tmp_path)
    out = tmp_path / "hf"
    export("--model", qdir, "--checkpoint", run, "--out", out, "--base", source)
    summary = load_verified(out, HfExportManifest).summary
    assert summary.verify.max_abs_diff == 0.0  # vs transformers' own MXFP4 decoding + the change
    assert any("MXFP4" in n for n in summary.notes) and any("quantization_config" in n for n in summary.notes)
    written = read_checkpoint(out)
    assert not [n for n in written if n.endswith(("_blocks", "_scales"))]
    name = "model.layers.0.mlp.experts.gate_up_proj"  # an untrained layer: decoded, exactly
    assert written[name].dtype == "BF16"
    assert torch.equal(hf_state(out)[name], hf_state(source)[name])  # == transformers' own MXFP4 decoding
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_shards_are_written_one_at_a_time(trained, tmp_path, monkeypatch):
    """Streaming: a shard is saved before the next shard's first unit is produced."""
    import safetensors.torch

    from usaf.stages import export_sources

    _, qdir, run = trained("mixtral")
    events: list[str] = []
    produce = export_sources.QuantizedSource.produce
    save = safetensors.torch.save_file
    monkeypatch.setattr(
        export_sources.QuantizedSource, "produce", lambda self, u: events.append("p") or produce(self, u)
    )
    monkeypatch.setattr(safetensors.torch, "save_file", lambda t, p, **kw: events.append("s") or save(t, p, **kw))
    export("--model", qdir, "--checkpoint", run, "--out", tmp_path / "hf", "--max-shard-gib", 0.0001, "--no-verify")
    trace = "".join(events)
    shards = trace.count("s")
    assert shards > 2 and trace.endswith("s") and "ss" not in trace  # produce* save, produce* save, ...


def test_verification_failure_leaves_nothing(trained, tmp_path, monkeypatch):
    from usaf.stages import export_sources

    _, qdir, run = trained("qwen3_moe")
    # a writer bug: the deltas never reach the tensors (the counts still add up)
    monkeypatch.setattr(export_sources, "merge_delta", lambda memory, *a, **k: memory.float())
    out = tmp_path / "hf"
    result = invoke("export", "--model", qdir, "--checkpoint", run, "--out", out)
    assert result.exit_code == 2 and "verification failed" in result.output and "logits differ" in result.output
    assert not out.exists() and not leftovers(tmp_path)


def test_without_model_or_checkpoint_the_newest_run_and_its_model_are_taken(trained, tiny_model, tmp_path):
    """README and --help: export takes the workspace's newest run and the model it was trained on. It took the newest
    model instead, and refused where a model was quantized after the run ("no run trained on this model"; found in
    review). The control: with --model the newer one, the search for its runs still refuses."""
    source, qdir, run = trained("qwen3_moe")
    ws = tmp_path / "ws"
    shutil.copytree(qdir, ws / "quantized_model" / "first")
    shutil.copytree(run, ws / "run" / "r1")
    newer = ws / "quantized_model" / "newer"
    assert invoke("quantize", tiny_model("mixtral"), "--method", "rtn", "--out", newer).exit_code == 0
    out = tmp_path / "out"
    result = invoke("export", "--workspace", ws, "--out", out, "--no-verify")
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert f"using the run {ws / 'run' / 'r1'} (newest in the workspace)" in said, said
    assert f"using the quantized model {ws / 'quantized_model' / 'first'}" in said, said
    refused = invoke("export", "--workspace", ws, "--model", newer, "--out", tmp_path / "out2", "--no-verify")
    assert refused.exit_code == 2 and "trained on this model" in " ".join(refused.stderr.split()), refused.output



def test_checkpoint_alone_away_from_the_model_takes_the_model_its_run_recorded(trained, tmp_path):
    """``--checkpoint RUN`` from a workspace without the model was refused ("no 'quantized_model' artifact") while the
    run's manifest named the model it was trained on (found in review). The controls: a recorded path that no longer
    holds a model, or holds another, gives the refusal as before."""
    _, qdir, run = trained("qwen3_moe")
    _, other_q, _ = trained("mixtral")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = invoke("export", "--checkpoint", run, "--workspace", elsewhere, "--out", tmp_path / "d",
                    "--format", "delta")  # fmt: skip
    assert result.exit_code == 0, result.output
    said = " ".join(result.stderr.split())
    assert f"using the quantized model {qdir} (the one the change was trained on, as its run recorded it; " in said
    assert load_verified(tmp_path / "d", DeltaManifest).inputs[0].path == str(qdir)
    for recorded in (tmp_path / "gone", other_q):
        copy = shutil.copytree(run, tmp_path / f"run-{recorded.name}")
        manifest = json.loads((copy / "manifest.json").read_text())
        for each in manifest["inputs"]:
            if each["role"] == "model":
                each["path"] = str(recorded)
        (copy / "manifest.json").write_text(json.dumps(manifest))
        _resign(copy)
        refused = invoke("export", "--checkpoint", copy, "--workspace", elsewhere, "--out", tmp_path / "o",
                         "--format", "delta")  # fmt: skip
        assert refused.exit_code == 2, refused.output
        refusal = " ".join(refused.stderr.split())
        assert "--model: not given, and no 'quantized_model' artifact that the change" in refusal, refusal
        assert not (tmp_path / "o").exists()

def test_bad_inputs_exit_2_and_leave_nothing(trained, tiny_model, tmp_path):
    source, qdir, run = trained("qwen3_moe")
    other_source, other_q, other_run = trained("mixtral")
    out = tmp_path / "out"

    def refused(*args, expect: tuple[str, ...]):
        result = invoke("export", *args)
        assert result.exit_code == 2, result.output
        for fragment in expect:
            assert fragment in result.output, (fragment, result.output)
        assert not out.exists() and not leftovers(tmp_path)

    plan = run.parent / "plan"  # an artifact of another kind
    refused("--model", qdir, "--checkpoint", plan, "--out", out, expect=("--checkpoint", "'plan' artifact"))
    (tmp_path / "empty").mkdir()
    refused(
        "--model", qdir, "--checkpoint", tmp_path / "empty", "--out", out, expect=("--checkpoint", "not a usaf run")
    )
    q_fp = load_verified(qdir, QuantizedModelManifest).fingerprint
    other_fp = load_trained_change(other_run).model_fingerprint
    refused("--model", qdir, "--checkpoint", other_run, "--out", out, expect=("--checkpoint", q_fp[:16], other_fp[:16]))
    other_source_fp = load_verified(other_q, QuantizedModelManifest).summary.source.fingerprint
    source_fp = load_verified(qdir, QuantizedModelManifest).summary.source.fingerprint
    refused(
        "--model", qdir, "--checkpoint", run, "--out", out, "--base", other_source,
        expect=("--base", other_source_fp[:16], source_fp[:16]),
    )  # fmt: skip
    # same architecture, other weights: the fingerprint matches, the tensors do not
    lookalike = tiny_model("qwen3_moe", num_layers=NUM_LAYERS, tokenizer=True, seed=1)
    refused("--model", qdir, "--checkpoint", run, "--out", out, "--base", lookalike, expect=("--base", "differs"))
    refused("--model", qdir, "--checkpoint", run, "--out", out, "--format", "onnx", expect=("--format",))
    refused("--model", qdir, "--checkpoint", run, "--out", out, "--format", "delta", "--base", source,
            expect=("--base applies to --format hf only; drop it",))  # fmt: skip  (one flag: "apply", review)
    refused("--model", qdir, "--checkpoint", run, "--out", out, "--format", "delta", "--base", source, "--dtype",
            "bfloat16", expect=("apply to --format hf only; drop them",))  # fmt: skip
    refused("--model", qdir, "--checkpoint", run, "--out", out, "--format", "delta", "--device", "cpu",
            expect=("--device", "--format hf"))  # fmt: skip
    refused("--model", qdir, "--checkpoint", run, "--out", out, "--no-verify", "--device", "cpu",
            expect=("--device", "--no-verify skips"))  # fmt: skip
    # a directory of the user's at --out is refused (and left as it was) with or without --overwrite ...
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for flags in ([], ["--overwrite"]):
        result = invoke("export", "--model", qdir, "--checkpoint", run, "--out", out, "--no-verify", *flags)
        assert result.exit_code == 2 and "a directory usaf did not make" in result.output, result.output
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # ... while an export of usaf's own is replaced only with --overwrite
    (out / "keep.txt").unlink()
    export("--model", qdir, "--checkpoint", run, "--out", out, "--no-verify")
    result = invoke("export", "--model", qdir, "--checkpoint", run, "--out", out, "--no-verify")
    assert result.exit_code == 2 and "already exists there" in result.output and "--overwrite" in result.output
    export("--model", qdir, "--checkpoint", run, "--out", out, "--no-verify", "--overwrite")
    assert (out / "manifest.json").is_file()


def _poke_first_byte(model_dir, name: str) -> None:
    """Flip one bit of tensor ``name``'s bytes in place: its file's header, so the model's fingerprint, unchanged."""
    info = read_checkpoint(model_dir)[name]
    path = model_dir / info.file
    raw = bytearray(path.read_bytes())
    header_length = int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8 : 8 + header_length])[name]["data_offsets"][0]
    raw[8 + header_length + begin] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("which", ["trained", "untrained"])
def test_a_base_differing_only_in_its_experts_is_refused(trained, tmp_path, which):
    """export --base compared the original's fingerprint, routers, small tensors and the trained layers' non-expert
    tensors, never its experts: a base differing only there (another sparse fine-tune of the same model, saved the
    same way) was exported under the change (found in review). Quantize records each MoE layer's digest of its
    on-disk experts; export checks the original's as it reads them, the copied layers' too."""
    from usaf.families import map_checkpoint

    source, qdir, run = trained("qwen3_moe")
    quantized = load_verified(qdir, QuantizedModelManifest).summary
    assert sorted(quantized.expert_digests) == quantized.moe_layers  # every MoE layer recorded
    plan = map_checkpoint(source, resolve_family(load_model_config(source)))
    trained_layers = load_trained_change(run).trainable_layers
    layer = [n for n in quantized.moe_layers if (n in trained_layers) == (which == "trained")][0]
    lookalike = tmp_path / "lookalike"
    shutil.copytree(source, lookalike)
    control = export("--model", qdir, "--checkpoint", run, "--out", tmp_path / "control", "--base", lookalike,
                     "--no-verify")  # fmt: skip
    assert not any("were not compared" in note for note in control["summary"]["notes"])  # the note's control
    _poke_first_byte(lookalike, plan.expert_layer(layer).source_names[0])

    out = tmp_path / "out"
    result = invoke("export", "--model", qdir, "--checkpoint", run, "--out", out, "--base", lookalike, "--no-verify")
    assert result.exit_code == 2, result.output
    assert f"--base {lookalike}: its experts of layer {layer} differ" in result.output
    assert not out.exists() and not leftovers(tmp_path)


def test_a_model_quantized_without_expert_digests_exports_with_a_note(trained, tmp_path, monkeypatch):
    """A model quantized before the digests were recorded: its experts cannot be compared, and the export says so."""
    from usaf.stages import export_base

    source, qdir, run = trained("qwen3_moe")
    real = export_base.ExpertDigests
    monkeypatch.setattr(export_base, "ExpertDigests", lambda base, recorded: real(base, {}))
    printed = export("--model", qdir, "--checkpoint", run, "--out", tmp_path / "out", "--base", source, "--no-verify")
    assert any("were not compared" in note for note in printed["summary"]["notes"]), printed


def test_workspace_defaults_pick_the_model_of_the_change(trained, tmp_path):
    _, qdir, run = trained("olmoe")
    workspace = tmp_path / "ws"
    shutil.copytree(qdir, workspace / "quantized_model" / "q")
    printed = export("--checkpoint", run, "--workspace", workspace, "--format", "delta")
    assert printed["path"].startswith(str(workspace / "delta"))
    assert printed["inputs"][0]["path"] == str(workspace / "quantized_model" / "q")


def test_settings_from_shared_sources_and_the_delta_read_back(trained, tmp_path, monkeypatch):
    """Found in review: export read USAF_DTYPE, train's compute dtype ('auto' failed every export, 'float16' wrote
    one in fp16); --device was checked against --no-verify from flags only, and USAF_DEVICE=cuda refused an export
    that runs nothing on a device; --max-shard-gib 1e300 overflowed; the delta's read-back skipped its routers."""
    import usaf.stages.export as stage
    from usaf.artifacts import delta

    _, qdir, run = trained("qwen3_moe")
    args = ["export", "--model", qdir, "--checkpoint", run]
    monkeypatch.setenv("USAF_DTYPE", "auto")
    monkeypatch.setenv("USAF_DEVICE", "cuda")  # no CUDA here: it must not be resolved without verification
    shared = invoke(*args, "--no-verify", "--out", tmp_path / "shared")
    assert shared.exit_code == 0, shared.output
    assert load_verified(tmp_path / "shared", HfExportManifest).summary.dtype == "original"
    monkeypatch.delenv("USAF_DTYPE")
    monkeypatch.delenv("USAF_DEVICE")
    config = tmp_path / "usaf.toml"
    config.write_text("[export]\nverify = false\n")
    refused = invoke(*args, "--config", config, "--device", "cpu", "--out", tmp_path / "device")
    assert refused.exit_code == 2 and "which --no-verify skips (--config" in " ".join(refused.stderr.split()), (
        refused.output)  # fmt: skip
    huge = invoke(*args, "--max-shard-gib", 1e300, "--out", tmp_path / "huge")
    assert huge.exit_code == 2 and "--max-shard-gib" in huge.stderr, huge.output

    real = delta.write_delta_files

    def an_extra_router(directory, change):
        real(directory, change)
        routers = load_file(str(directory / delta.ROUTERS_FILE))
        save_file({**routers, "model.layers.0.mlp.gate.weight": torch.zeros(1)}, str(directory / delta.ROUTERS_FILE))

    monkeypatch.setattr(stage, "write_delta_files", an_extra_router)
    wrong = invoke(*args, "--format", "delta", "--out", tmp_path / "delta")
    assert wrong.exit_code == 2 and "do not hold exactly the change" in wrong.stderr, wrong.output
    monkeypatch.setattr(stage, "write_delta_files", real)  # the control
    assert invoke(*args, "--format", "delta", "--out", tmp_path / "delta").exit_code == 0


def test_a_verification_that_cannot_fit_is_refused_before_anything_is_written(trained, tmp_path, monkeypatch):
    """Verification reloads the export in fp32 (~122 GB at Qwen3-30B-A3B): a 32 GB machine was killed by the OS
    after writing every shard (found in review). The control: --no-verify writes it."""
    from usaf.backends.cpu import CpuBackend

    _, qdir, run = trained("qwen3_moe")
    monkeypatch.setattr(CpuBackend, "free_memory", lambda self: 1000)
    args = ["export", "--model", qdir, "--checkpoint", run]
    refused = invoke(*args, "--out", tmp_path / "verified")
    assert refused.exit_code == 2 and "--verify reloads the export in fp32" in refused.stderr, refused.output
    assert not (tmp_path / "verified").exists() and not leftovers(tmp_path)
    assert invoke(*args, "--no-verify", "--out", tmp_path / "unchecked").exit_code == 0


def test_base_as_a_hub_id_is_the_snapshot_quantized_or_the_cache_never_the_network(trained, tmp_path, monkeypatch):
    """--base HUB_ID downloaded when online (a newer revision, then refused for its fingerprint, while the snapshot
    quantized was still cached), and --out was not checked against the directory it resolved to (found in review).
    """
    import huggingface_hub

    from usaf.stages.export_base import resolve_base

    source, qdir, run = trained("qwen3_moe")
    manifest = load_verified(qdir, QuantizedModelManifest)
    hub_source = manifest.summary.source.model_copy(update={"model": "org/tiny"})
    manifest = manifest.model_copy(update={"summary": manifest.summary.model_copy(update={"source": hub_source})})
    spec, change = resolve_family(load_model_config(qdir)), load_trained_change(run)
    calls = []

    def snapshot_download(repo, **kwargs):
        calls.append((repo, kwargs.get("local_files_only")))
        raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_base("org/tiny", spec, manifest, qdir, change).dir == source.resolve() and calls == []
    cached = r"--base org/other: no such directory, and as a hub id not in the local Hugging Face cache \(download"
    with pytest.raises(UsafError, match=cached):
        resolve_base("org/other", spec, manifest, qdir, change)
    assert calls == [("org/other", True)]


def test_out_inside_the_base_given_by_path_is_refused(trained, tmp_path):
    source, qdir, run = trained("qwen3_moe")
    result = invoke("export", "--model", qdir, "--checkpoint", run, "--base", source, "--out", source / "merged")
    assert result.exit_code == 2 and "lies inside the input --base" in result.stderr, result.output
    assert not (source / "merged").exists()


def test_delta_entries_the_output_dtype_rounds_away_are_counted_and_said(bench, tmp_path):
    """Written in bf16, a delta under half its weight's bf16 step vanishes: the export said "N delta entries applied"
    and verified, the logits' check blind at that size (found in review: 2-3 % of the demo's entries). Counted and
    said now; fp32 keeps them (the control), as do deltas of a size bf16 can hold."""
    from usaf.testing import hostile_exporteval

    tiny = hostile_exporteval.write_delta(
        bench, tmp_path / "tiny", hostile_exporteval._deltas(lambda i, v: (i, v * 1e-7))
    )
    large = hostile_exporteval.write_delta(bench, tmp_path / "large")
    common = ["--model", bench.quantized, "--no-verify"]
    summaries = {}
    below_fp32 = hostile_exporteval.write_delta(
        bench, tmp_path / "below", hostile_exporteval._deltas(lambda i, v: (i, v * 1e-30))
    )
    for name, delta, dtype in (("tiny-bf16", tiny, "bfloat16"), ("tiny-f32", tiny, "float32"),
                               ("large-bf16", large, "bfloat16"), ("below-f32", below_fp32, "float32")):  # fmt: skip
        out = tmp_path / name
        summaries[name] = export(*common, "--checkpoint", delta, "--dtype", dtype, "--out", out)["summary"]
    said = [n for n in summaries["tiny-bf16"]["notes"] if "round away" in n]
    assert summaries["tiny-bf16"]["expert_entries_rounded_away"] == 3 and said and "3 of the 3 delta entries" in said[0]
    assert "--dtype float32 writes it whole" in said[0]
    # in float32 already, that advice was false (found in review): too small for float32 itself, and said so
    said = [n for n in summaries["below-f32"]["notes"] if "round away" in n]
    assert said and "below float32's own step" in said[0] and "--dtype float32" not in said[0], said
    # config.json's dtype is said where it changed, not where it already was the one written (found in review)
    config_dtype = json.loads((bench.quantized / "config.json").read_text()).get("dtype")
    assert config_dtype == "float32"  # so the float32 export is the case that changes nothing
    for name, dtype in (("tiny-bf16", "bfloat16"), ("tiny-f32", "float32")):
        changed = any(n.startswith("config.json: dtype set to") for n in summaries[name]["notes"])
        assert changed is (config_dtype != dtype), (name, config_dtype, summaries[name]["notes"])
    for name in ("tiny-f32", "large-bf16"):
        assert summaries[name]["expert_entries_rounded_away"] == 0, name
        assert not any("round away" in n for n in summaries[name]["notes"]), name


def test_the_rounding_note_gives_a_small_share_as_under_a_tenth_of_a_percent():
    """42 of 196,602 entries rounded away were said "(0.0%)", as if none (found in review). The control: a share of a
    percent or more keeps its digit."""
    import torch

    from usaf.stages.export_sources import Counts, ExportSource

    def note(away: int, entries: int) -> str:
        source = object.__new__(type("Source", (ExportSource,), {"produce": None}))  # the note alone, no model
        source.counts = Counts(expert_entries=entries, entries_rounded_away=away, trained_l1=1.0)
        source.written = {"w": torch.bfloat16}
        return source.rounding_note()

    assert "42 of the 196,602 delta entries (under 0.1%) round away" in note(42, 196_602)
    assert "(2.0%) round away" in note(2, 100)


def test_the_rounding_note_counts_trained_router_weights_rounded_away():
    """45 of the demo's 2,048 trained router weights came out unchanged in bf16, and the note named delta entries
    alone (found in review). Counted apart, with the entries or alone. The control: none rounded away, no note."""
    import torch

    from usaf.stages.export_sources import Counts, ExportSource

    def note(**counts: int) -> str | None:
        source = object.__new__(type("Source", (ExportSource,), {"produce": None}))
        source.counts = Counts(expert_entries=100, trained_l1=1.0, router_weights_changed=2048, **counts)
        source.written = {"w": torch.bfloat16}
        return source.rounding_note()

    both = note(entries_rounded_away=2, router_weights_rounded_away=45)
    assert "2 of the 100 delta entries (2.0%) round away in the output dtype" in both
    assert "; so do 45 of the 2,048 trained router weights" in both and "--dtype float32 writes it whole" in both
    alone = note(router_weights_rounded_away=45)
    assert alone.startswith("45 of the 2,048 trained router weights round away") and "--dtype float32" in alone
    assert note() is None


def test_trained_router_weights_rounded_away_in_bf16_are_counted():
    """The count itself: a trained router weight whose change is under half its bf16 step is written as the original
    value. The control: a change of a whole step is kept."""
    import types

    import torch

    from usaf.stages.export_sources import Counts, ExportSource

    original = torch.ones(2, 4, dtype=torch.bfloat16)
    trained = original.float().clone()
    trained[0, 0] += 1e-4  # under half of bf16's step at 1.0 (2**-8)
    trained[1, 1] += 2**-7  # a whole step: kept
    source = object.__new__(type("Source", (ExportSource,), {"produce": None}))
    source.counts, source.written = Counts(), {}
    source.change = types.SimpleNamespace(routers={"r": trained})
    source.out_dtype = lambda dtype: dtype
    out = source.router("r", original)
    assert out.dtype == torch.bfloat16 and out[1, 1] != original[1, 1]
    assert (source.counts.router_weights_changed, source.counts.router_weights_rounded_away) == (2, 1)
