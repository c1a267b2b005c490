"""`usaf quantize` end to end: every family, weights_only loading, equivalence with transformers' own
fused tensors, resume after interruption, and every bad input's message and exit code."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import FAMILIES
from helpers import invoke, leftovers
from usaf.artifacts import QuantizedModelManifest, load_verified
from usaf.families import load_model_config, resolve_family
from usaf.families.convert import gate_up_halves
from usaf.quant import QuantizedTensor, dequantize
from usaf.testing import stdlib_dir

# 4-bit min-max / HQQ on random-normal weights with group 8..32: ~0.08-0.12 relative error.
MAX_REL_ERROR_4BIT = 0.2


def quantize(*args, env=None):
    return invoke("quantize", *args, env=env)


def assert_clean_failure(result, out: Path, *needles: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)
    assert not out.exists()
    assert not any(p.name.endswith(".usaf-partial") for p in out.parent.iterdir()), list(out.parent.iterdir())
    assert leftovers(out.parent) == []


def load_experts(out: Path) -> dict[str, QuantizedTensor]:
    raw = torch.load(out / "experts_q4.pt", weights_only=True)
    return {name: QuantizedTensor.from_dict(entry, name=name) for name, entry in raw.items()}


def base_tensors(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / "base.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for file in sorted(set(index.values())):
        with safe_open(str(out / file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    assert set(tensors) == set(index)
    return tensors


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_matches_transformers_fused_tensors(family, tiny_model, loaded_model, model_state, tmp_path):
    from usaf.families.modules import usaf_view

    source = tiny_model(family, tokenizer=True)
    out = tmp_path / "q"
    result = quantize(source, "--out", out, "--method", "rtn", "--group-size", "8")
    assert result.exit_code == 0, result.output
    manifest = load_verified(out, QuantizedModelManifest)
    spec = resolve_family(load_model_config(source))
    # usaf's names (transformers 4.x: the per-expert weights as the fused tensors)
    state = model_state(family, tokenizer=True)
    param_shapes = {n: tuple(p.shape) for n, p in loaded_model(family, tokenizer=True).named_parameters()}
    params = {n: state[n] for n in usaf_view(spec, param_shapes)}
    buffers = {n: t for n, t in state.items() if n not in params}
    experts = load_experts(out)
    assert set(experts) == {n for i in spec.moe_layers for n in (spec.gate_up_name(i), spec.down_name(i))}
    for name, q in experts.items():
        reference = params[name].detach().float()
        restored = dequantize(q)
        assert restored.shape == reference.shape, name
        error = ((restored - reference).norm() / reference.norm()).item()
        assert error < MAX_REL_ERROR_4BIT, (name, error)
        if name.endswith("gate_up_proj"):  # negative control: gate and up swapped must not pass
            gate, up = gate_up_halves(restored, spec.layout)
            swapped = restored.clone()
            s_gate, s_up = gate_up_halves(swapped, spec.layout)
            s_gate.copy_(up)
            s_up.copy_(gate)
            swapped_error = ((swapped - reference).norm() / reference.norm()).item()
            assert swapped_error > 5 * error and swapped_error > 0.5, (name, swapped_error)
    # Every other tensor is stored exactly, under its in-memory name, in its own dtype.
    base = base_tensors(out)
    expected = {n: t for n, t in {**params, **buffers}.items() if n not in experts and n in base}
    missing = set(params) - set(experts) - set(base)
    assert not missing, missing
    for name, tensor in expected.items():
        assert torch.equal(base[name], tensor.detach()), name
    # Source files carried over byte for byte; counts add up to the model's parameters.
    assert (out / "config.json").read_bytes() == (source / "config.json").read_bytes()
    assert (out / "tokenizer.json").is_file()
    s = manifest.summary
    assert s.tensors_quantized == 2 * len(spec.moe_layers)
    assert s.params_quantized + s.params_kept >= sum(p.numel() for p in params.values())
    assert s.compression_ratio > 2.5  # fp32 tiny model, 4-bit codes + fp16 scales every 8 weights
    assert 0 < s.mean_rel_error <= s.max_rel_error < MAX_REL_ERROR_4BIT


def test_hqq_default_beats_rtn_and_reports_estimate(tiny_model, tmp_path):
    source = tiny_model("qwen3_moe")
    errors = {}
    for method in ("hqq", "rtn"):
        out = tmp_path / method
        result = quantize(source, "--out", out, "--method", method, "--group-size", "32")
        assert result.exit_code == 0, result.output
        assert "estimated under a minute on CPU" in result.stderr  # CPU runs say what they cost before starting
        assert "much faster" not in result.stderr  # offered for a second's work, as "0h00m00s" (review)
        errors[method] = load_verified(out, QuantizedModelManifest).summary.mean_rel_error
    assert errors["hqq"] < errors["rtn"], errors


def test_a_long_quantize_is_estimated_in_hours_and_offered_the_faster_method():
    """The control of the note above: over a minute, the time is spelled out and rtn offered (for hqq alone)."""
    from usaf.settings.quantize import QuantizeConfig
    from usaf.stages.quantize import _estimate_note

    weights = {"gate_up": torch.randn(8, 48, 32), "down": torch.randn(8, 32, 24)}
    for method, offered in (("hqq", True), ("rtn", False)):
        config = QuantizeConfig(model="m", method=method, group_size=8)
        said = _estimate_note(weights, config, torch.device("cpu"), layers=10**7)
        assert re.search(r"estimated \d+h\d\dm\d\ds on CPU for the 10000000 MoE layers left", said), said
        assert ("--method rtn is much faster on CPU" in said) == offered, said


def test_group_size_adjusted_to_divide_the_input_width(tiny_model, tmp_path):
    source = tiny_model("qwen3_moe")  # hidden 32, expert width 24: 128 divides neither
    out = tmp_path / "q"
    result = quantize(source, "--out", out, "--method", "rtn")
    assert result.exit_code == 0, result.output
    s = load_verified(out, QuantizedModelManifest).summary
    groups = {r.name.rsplit(".", 1)[-1]: r.group_size for r in s.tensors}
    assert groups == {"gate_up_proj": 32, "down_proj": 24}
    assert len(s.group_sizes_adjusted) == s.tensors_quantized
    assert "group size adjusted" in result.stdout
    assert "more" not in result.stdout  # 4 tensors: every one named


def test_more_adjusted_group_sizes_than_the_line_names_are_counted(tiny_model, tmp_path):
    source = tiny_model("qwen3_moe", num_layers=3)  # 6 expert tensors, each adjusted
    result = quantize(source, "--out", tmp_path / "q", "--method", "rtn")
    assert result.exit_code == 0, result.output
    line = next(x for x in result.stdout.splitlines() if "group size adjusted" in x)
    assert line.count("proj:") == 4 and "and 2 more" in line, line


def _interrupt_after_two_layers(stage, monkeypatch) -> tuple[list[str], object]:
    """quantize's layer writes, stopped as by Ctrl-C before the third; (the layer files saved, the real writer)."""
    saved: list[str] = []
    real = stage._save_layer

    def interrupt(path, *args):
        if len(saved) == 2:
            raise KeyboardInterrupt
        saved.append(path.name)
        return real(path, *args)

    monkeypatch.setattr(stage, "_save_layer", interrupt)
    return saved, real


def test_stopped_with_force_the_note_says_to_resume_without_it(tiny_model, tmp_path, monkeypatch):
    """The note said "run the same command to resume", and the same command, with --force, discarded the kept layers
    (found in review). The control: without --force, the same command resumes (the test below)."""
    import usaf.stages.quantize as stage

    _interrupt_after_two_layers(stage, monkeypatch)
    result = quantize(tiny_model("qwen3_moe", num_layers=4), "--out", tmp_path / "q", "--method", "rtn", "--force")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 130 and "2 of 4 MoE layers quantized and kept" in said, said
    assert "run the same command without --force to resume (with it, it starts over)" in said
    assert "nothing half-written" not in said  # after "kept in ...", it read as contradicting it (found in review)


def test_interrupted_run_resumes_to_byte_identical_output(tiny_model, tmp_path, monkeypatch):
    import usaf.stages.quantize as stage

    source = tiny_model("qwen3_moe", num_layers=4)
    straight = tmp_path / "straight"
    assert quantize(source, "--out", straight, "--method", "rtn", "--group-size", "8").exit_code == 0

    saved, real = _interrupt_after_two_layers(stage, monkeypatch)
    resumed = tmp_path / "resumed"
    result = quantize(source, "--out", resumed, "--method", "rtn", "--group-size", "8")
    assert result.exit_code == 130 and not resumed.exists()
    partial = tmp_path / ".resumed.usaf-partial"
    assert sorted(p.name for p in (partial / "layers").iterdir()) == ["layer-00000.pt", "layer-00000.pt.sha256",
                                                                      "layer-00001.pt", "layer-00001.pt.sha256"]
    said = " ".join(result.stderr.split())  # what is kept and how to go on (found in review: nothing said it)
    assert "the 4 MoE layers left" in said and f"2 of 4 MoE layers quantized and kept in {partial}" in said, said
    other = quantize(source, "--out", resumed, "--method", "rtn", "--group-size", "16")  # the kept settings, named
    assert other.exit_code == 2 and "--group-size 8, not 16" in " ".join(other.stderr.split()), other.stderr

    saved.clear()
    monkeypatch.setattr(stage, "_save_layer", lambda path, *a: saved.append(path.name) or real(path, *a))
    result = quantize(source, "--out", resumed, "--method", "rtn", "--group-size", "8")
    assert result.exit_code == 0, result.output
    assert "resuming" in result.stderr and "the 2 MoE layers left" in " ".join(result.stderr.split())  # not 4
    assert saved == ["layer-00002.pt", "layer-00003.pt"]  # layers 0 and 1 were not quantized again
    assert not partial.exists()
    digests = load_verified(resumed, QuantizedModelManifest).summary.expert_digests  # export --base checks them
    assert digests == load_verified(straight, QuantizedModelManifest).summary.expert_digests and len(digests) == 4
    for name in ["experts_q4.pt", *(p.name for p in straight.glob("base-*.safetensors"))]:
        assert (resumed / name).read_bytes() == (straight / name).read_bytes(), name


def _edit_a_kept_layer(path) -> None:
    """Change one 4-bit code byte of a kept layer file: it still loads, as numbers the output would take."""
    import torch

    saved = torch.load(path, weights_only=True)
    entry = next(iter(saved["entries"].values()))
    codes = next(v for v in entry.values() if isinstance(v, torch.Tensor) and v.dtype == torch.uint8)
    codes.view(-1)[0] ^= 0xFF
    torch.save(saved, path)


@pytest.mark.parametrize("resealed", [False, True])
def test_a_kept_layer_changed_on_disk_is_quantized_again(tiny_model, tmp_path, monkeypatch, resealed):
    """A kept layer file edited in place (still loading) was merged into the output a resume committed, with fresh
    hashes (found in review). Its checksum no longer matches: the layer is quantized again, with a note, and the
    output equals a straight run's. Control (``resealed``: the sidecar rewritten over the edit): the edit is
    merged and the output differs, so the checksum is what caught it."""
    import usaf.stages.quantize as stage
    from usaf.artifacts.checksums import seal

    source = tiny_model("qwen3_moe", num_layers=4)
    straight = tmp_path / "straight"
    assert quantize(source, "--out", straight, "--method", "rtn", "--group-size", "8").exit_code == 0
    _, real = _interrupt_after_two_layers(stage, monkeypatch)
    resumed = tmp_path / "resumed"
    assert quantize(source, "--out", resumed, "--method", "rtn", "--group-size", "8").exit_code == 130
    kept = tmp_path / ".resumed.usaf-partial" / "layers" / "layer-00000.pt"
    _edit_a_kept_layer(kept)
    if resealed:
        seal(kept)
    saved: list[str] = []
    monkeypatch.setattr(stage, "_save_layer", lambda path, *a: saved.append(path.name) or real(path, *a))
    result = quantize(source, "--out", resumed, "--method", "rtn", "--group-size", "8")
    assert result.exit_code == 0, result.output
    same = (resumed / "experts_q4.pt").read_bytes() == (straight / "experts_q4.pt").read_bytes()
    if resealed:
        assert saved == ["layer-00002.pt", "layer-00003.pt"] and not same
    else:
        assert saved == ["layer-00000.pt", "layer-00002.pt", "layer-00003.pt"] and same
        said = " ".join(result.stderr.split())
        assert "layer-00000.pt: not as usaf wrote it (its sha256 is not the one recorded): quantizing the layer again" \
            in said, said


@pytest.mark.parametrize("stop_in", ["copy_model_files", "write_manifest", "drop"])
def test_interrupted_after_the_experts_are_assembled_no_layer_is_quantized_again(
    tiny_model, tmp_path, monkeypatch, stop_in
):
    """Stopped while the model's files are copied or the output hashed (minutes at 30B), the quantized layers were
    gone (layers/ was deleted when experts_q4.pt was assembled) and the rerun quantized every one again (found in
    review). Now layers/ goes at the commit: the rerun quantizes nothing, and the output is the straight run's."""
    import usaf.artifacts.writer as writer
    import usaf.stages.quantize as stage

    source = tiny_model("qwen3_moe", num_layers=4)
    args = ["--method", "rtn", "--group-size", "8"]
    straight = tmp_path / "straight"
    assert quantize(source, "--out", straight, *args).exit_code == 0
    module = {"copy_model_files": stage, "write_manifest": writer, "drop": writer.ArtifactWriter}[stop_in]
    real = getattr(module, stop_in)

    def stopped(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, stop_in, stopped)
    resumed = tmp_path / "resumed"
    stopped_run = quantize(source, "--out", resumed, *args)
    assert stopped_run.exit_code == 130
    partial = tmp_path / ".resumed.usaf-partial"
    if stop_in == "copy_model_files":  # the kept layers are said there too, not only in the layer loop (review)
        said = " ".join(stopped_run.stderr.split())
        assert f"interrupted: 4 of 4 MoE layers quantized and kept in {partial}" in said, said
    assert (partial / "experts_q4.pt").is_file() and len(list((partial / "layers").glob("*.pt"))) == 4

    monkeypatch.setattr(module, stop_in, real)
    saved: list[str] = []
    monkeypatch.setattr(stage, "_save_layer", lambda path, *a: saved.append(path.name))
    result = quantize(source, "--out", resumed, *args)
    assert result.exit_code == 0, result.output
    assert saved == [] and not partial.exists()
    manifest = load_verified(resumed, QuantizedModelManifest)
    assert not (resumed / "layers").exists() and "partial-settings.json" not in {f.path for f in manifest.files}
    assert {f.path: f.sha256 for f in manifest.files} == {
        f.path: f.sha256 for f in load_verified(straight, QuantizedModelManifest).files
    }


def test_without_out_the_same_command_resumes_the_interrupted_output(tiny_model, tmp_path, monkeypatch):
    """A default output is named by its start time: the same command without --out finds the workspace's interrupted
    quantization of the same model and settings and resumes it (the layers done are not quantized again); other
    settings start a new output (control)."""
    import usaf.stages.quantize as stage

    source = tiny_model("qwen3_moe", num_layers=4)
    command = [source, "--workspace", tmp_path, "--method", "rtn", "--group-size", "8"]
    saved, real = _interrupt_after_two_layers(stage, monkeypatch)
    assert quantize(*command).exit_code == 130
    (partial,) = (tmp_path / "quantized_model").glob(".*.usaf-partial")

    saved.clear()
    monkeypatch.setattr(stage, "_save_layer", lambda path, *a: saved.append(path.name) or real(path, *a))
    other = quantize(source, "--workspace", tmp_path, "--method", "rtn", "--group-size", "16")
    assert other.exit_code == 0 and "resuming" not in other.stderr and partial.is_dir()
    saved.clear()
    result = quantize(*command)
    assert result.exit_code == 0, result.output
    target = partial.parent / partial.name.removeprefix(".").removesuffix(".usaf-partial")
    assert f"resuming the interrupted quantization that was writing {target}" in result.stderr
    assert saved == ["layer-00002.pt", "layer-00003.pt"] and not partial.exists()
    assert load_verified(target, QuantizedModelManifest).summary.quant.group_size_requested == 8


def test_an_interrupted_run_is_not_resumed_from_other_weights_of_the_same_shape(tmp_path, monkeypatch):
    """The source fingerprint reads the weight files' headers, not the weights: two fine-tunes of one architecture
    (here two seeds, both saved as .../checkpoint) share it. The partial directory also records the files (path,
    sizes, modification times), so the other model does not resume the first one's layers: without --out it starts
    its own output, with the first one's --out it is refused; a re-saved source is refused too. The control, the
    same files resuming, is the test above."""
    import usaf.stages.quantize as stage
    from usaf.families import load_model_config, resolve_family
    from usaf.families.checkpoint import read_checkpoint
    from usaf.stages.quantize_parts import source_record
    from usaf.testing import build_tiny_model

    def source_fingerprint(model_dir: Path) -> str:
        spec = resolve_family(load_model_config(model_dir))
        return source_record(str(model_dir), model_dir, spec, read_checkpoint(model_dir)).fingerprint

    first, second = (build_tiny_model("qwen3_moe", tmp_path / name / "checkpoint", num_layers=4, seed=seed,
                                      tokenizer=False) for name, seed in (("a", 0), ("b", 1)))  # fmt: skip
    assert source_fingerprint(first) == source_fingerprint(second)  # what made the mix possible
    options = ["--workspace", tmp_path / "ws", "--method", "rtn", "--group-size", "8"]
    saved, real = _interrupt_after_two_layers(stage, monkeypatch)
    assert quantize(first, *options).exit_code == 130
    (partial,) = (tmp_path / "ws" / "quantized_model").glob(".*.usaf-partial")
    monkeypatch.setattr(stage, "_save_layer", lambda path, *a: saved.append(path.name) or real(path, *a))

    saved.clear()
    other = quantize(second, *options)
    assert other.exit_code == 0 and "resuming" not in other.stderr and partial.is_dir(), other.output
    assert saved == [f"layer-0000{i}.pt" for i in range(4)]  # every layer its own
    target = partial.parent / partial.name.removeprefix(".").removesuffix(".usaf-partial")
    refused = quantize(second, "--out", target, "--method", "rtn", "--group-size", "8")
    assert refused.exit_code == 2 and "the model's files changed since" in refused.stderr, refused.output

    shard = next(first.glob("*.safetensors"))  # the first model re-saved in place: same names and sizes
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    refused = quantize(first, "--out", target, "--method", "rtn", "--group-size", "8")
    assert refused.exit_code == 2 and "the model's files changed since" in refused.stderr, refused.output


def test_two_fine_tunes_of_one_architecture_are_two_origins(tmp_path):
    """Their source fingerprints agree (headers only), so the workspace's "newest quantized model" took whichever was
    quantized last without a word, and --resume called the other's complete output this one's. Both now tell them
    apart by directory; the controls: two quantizations of one directory are one origin, and its own output resumes."""
    from usaf.testing import build_tiny_model

    first, second = (build_tiny_model("qwen3_moe", tmp_path / name / "checkpoint", num_layers=2, seed=seed,
                                      tokenizer=False) for name, seed in (("a", 0), ("b", 1)))  # fmt: skip
    rtn = ["--method", "rtn", "--group-size", "8"]
    made = {}
    for name, model, ws in (("first", first, "one"), ("again", first, "one"), ("second", second, "two")):
        result = quantize(model, *rtn, "--workspace", tmp_path / ws, "--json")
        assert result.exit_code == 0, result.output
        made[name] = Path(json.loads(result.stdout)["path"])
    shutil.copytree(made["first"], tmp_path / "two" / "quantized_model" / "first")
    assert load_verified(made["first"], QuantizedModelManifest).summary.source.fingerprint == load_verified(
        made["second"], QuantizedModelManifest
    ).summary.source.fingerprint  # what made the mix possible

    mixed = invoke("score", "--workspace", tmp_path / "two")
    assert mixed.exit_code == 2 and "2 different origins" in mixed.stderr, mixed.output
    one = invoke("score", "--workspace", tmp_path / "one")  # the control: the newest taken (then no tokenizer)
    assert f"using the quantized model {made['again']} (newest" in one.stderr, one.output

    refused = quantize(second, *rtn, "--out", made["first"], "--resume")
    said = " ".join(refused.stderr.split())
    assert refused.exit_code == 2 and f"holds a quantization with the model in {first}, not {second}" in said, said
    resumed = quantize(first, *rtn, "--out", made["first"], "--resume")
    assert resumed.exit_code == 0 and "already complete" in resumed.stderr, resumed.output


def test_existing_output_resume_and_force(tiny_model, tmp_path):
    source = tiny_model("olmoe")
    out = tmp_path / "q"
    assert quantize(source, "--out", out, "--method", "rtn").exit_code == 0
    result = quantize(source, "--out", out, "--method", "rtn")
    assert result.exit_code == 2 and "already exists" in result.stderr and "--resume" in result.stderr
    result = quantize(source, "--out", out, "--method", "rtn", "--resume")
    assert result.exit_code == 0 and "already complete" in result.stderr
    result = quantize(source, "--out", out, "--method", "rtn", "--nbits", "8", "--resume")
    assert result.exit_code == 2 and "holds a quantization with --nbits 4, not 8" in result.stderr  # the flag named
    result = quantize(source, "--out", out, "--method", "rtn", "--nbits", "8", "--force")
    assert result.exit_code == 0
    assert load_verified(out, QuantizedModelManifest).summary.quant.nbits == 8


def test_resume_refuses_a_complete_output_of_the_model_before_it_was_re_saved_in_place(tmp_path):
    """The source fingerprint reads headers only: a model re-saved in place with other weights of the same shapes
    (another seed) had --resume call the old output complete (found in review). The manifest records each shard's
    modification time now. Control: the files untouched, it is complete."""
    from usaf.testing import build_tiny_model

    source = tmp_path / "model"
    build_tiny_model("qwen3_moe", source, num_layers=2, seed=1, tokenizer=False)
    out = tmp_path / "q"
    assert quantize(source, "--out", out, "--method", "rtn").exit_code == 0
    kept = quantize(source, "--out", out, "--method", "rtn", "--resume")
    assert kept.exit_code == 0 and "already complete" in kept.stderr, kept.output

    shutil.rmtree(source)
    build_tiny_model("qwen3_moe", source, num_layers=2, seed=2, tokenizer=False)
    refused = quantize(source, "--out", out, "--method", "rtn", "--resume")
    assert refused.exit_code == 2, refused.output
    assert "the model's files as they were before they changed" in refused.stderr and "--force" in refused.stderr


def test_resume_with_force_and_a_quantized_model_as_model_are_one_clear_error(tiny_model, tmp_path):
    """--resume --force replaced the output --resume asked to accept, in silence; --resume with nothing to accept
    quantized anew; a usaf quantized model given as MODEL was diagnosed as an incomplete download (all found in
    review). Control: the source quantizes (and --resume accepts it: test_existing_output_resume_and_force)."""
    source = tiny_model("olmoe")
    out = tmp_path / "q"
    both = quantize(source, "--out", out, "--method", "rtn", "--resume", "--force")
    assert both.exit_code == 2 and "pass either --resume" in both.stderr and not out.exists(), both.output
    assert quantize(source, "--out", out, "--method", "rtn").exit_code == 0
    nothing = quantize(source, "--out", tmp_path / "none", "--method", "rtn", "--resume")  # it quantized anew
    assert nothing.exit_code == 2 and "holds nothing to accept or resume" in nothing.stderr, nothing.output
    assert not (tmp_path / "none").exists()
    fresh = quantize(source, "--workspace", tmp_path / "ws", "--method", "rtn", "--resume")
    assert fresh.exit_code == 2 and "no interrupted quantization of this model in" in fresh.stderr, fresh.output
    again = quantize(out, "--out", tmp_path / "q2", "--method", "rtn")
    assert again.exit_code == 2 and "already a usaf quantized model" in again.stderr, again.output
    assert not (tmp_path / "q2").exists()


def test_hub_downloads_take_a_repositorys_top_level_only():
    """"*.safetensors" matched subfolders: gpt-oss-20b's original/ (a second copy of its weights) was downloaded too
    (found in review). Control: without the ignore pattern the filter does take it."""
    from huggingface_hub.utils import filter_repo_objects

    from usaf.data.hub import HUB_IGNORED, HUB_PATTERNS

    repo = ["model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json", "tokenizer.json",
            "original/model.safetensors", "original/config.json", "metal/model.bin", "modeling_x.py"]  # fmt: skip
    taken = list(filter_repo_objects(repo, allow_patterns=HUB_PATTERNS, ignore_patterns=HUB_IGNORED))
    assert taken == repo[:4]
    assert "original/model.safetensors" in filter_repo_objects(repo, allow_patterns=HUB_PATTERNS)


def test_partial_run_with_other_settings_is_not_mixed_in(tiny_model, tmp_path):
    source = tiny_model("mixtral")
    out = tmp_path / "q"
    partial = tmp_path / ".q.usaf-partial"
    partial.mkdir()
    (partial / "partial-settings.json").write_text(json.dumps({"source": "other"}))
    result = quantize(source, "--out", out, "--method", "rtn")
    assert result.exit_code == 2 and "--force" in result.stderr and partial.exists()
    assert quantize(source, "--out", out, "--method", "rtn", "--force").exit_code == 0
    assert not partial.exists()


def test_default_output_goes_to_the_workspace(tiny_model, tmp_path):
    result = quantize(tiny_model("qwen3_moe"), "--method", "rtn", "--workspace", tmp_path, "--json")
    assert result.exit_code == 0, result.output
    path = Path(json.loads(result.stdout)["path"])
    assert path.parent == tmp_path / "quantized_model"


def test_hub_id_from_a_prepopulated_offline_cache(tiny_model, tmp_path):
    """A hub id resolves through HF_HOME's cache with HF_HUB_OFFLINE=1 (no network). The cache's layout: a snapshot's
    files are links into the repository's blobs/, and the model is sharded (such a model was refused as an index
    naming shards outside its directory; found in review)."""
    snapshot = tmp_path / "hf" / "hub" / "models--usaf-test--tiny-moe" / "snapshots" / "0123abcd"
    blobs = snapshot.parents[1] / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    source = tiny_model("qwen3_moe", tokenizer=True, max_shard_size="20KB")
    assert (source / "model.safetensors.index.json").is_file()
    for file in sorted(source.iterdir()):
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blobs / blob)
        (snapshot / file.name).symlink_to(f"../../blobs/{blob}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "q"
    cmd = [sys.executable, "-m", "usaf", "quantize", "usaf-test/tiny-moe", "--out", str(out), "--method", "rtn"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert load_verified(out, QuantizedModelManifest).summary.source.model == "usaf-test/tiny-moe"
    # a default output is named after the repository, not the snapshot's revision hash (found in review)
    proc = subprocess.run([*cmd[:5], "--workspace", str(tmp_path / "ws"), "--method", "rtn"], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (named,) = (p.name for p in (tmp_path / "ws" / "quantized_model").iterdir() if not p.name.startswith("."))
    assert named.endswith("-tiny-moe") and "0123abcd" not in named, named
    proc = subprocess.run(
        [*cmd[:4], "usaf-test/absent", "--out", str(tmp_path / "x")], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "not in the local Hugging Face cache" in proc.stderr


# ---- bad input: one clear line, exit 2, no final or partial directory --------------------------------


def test_non_finite_expert_weights_are_one_clear_error(tiny_model, tmp_path):
    """A NaN in an expert's weights raised a ValueError traceback naming neither the model nor the tensor (found in
    review). Control: the same model without it quantizes (the fixtures' models do, throughout this file)."""
    from safetensors.torch import load_file, save_file

    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_model("qwen3_moe"), damaged)
    weights = load_file(damaged / "model.safetensors")
    name = next(n for n in sorted(weights) if ".mlp.experts.0.down_proj" in n)
    weights[name][0, 0] = float("nan")
    save_file(weights, damaged / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "q"
    result = quantize(damaged, "--out", out, "--method", "rtn")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output and not out.exists()
    assert "non-finite weights" in errors[0] and "down_proj" in errors[0] and str(damaged) in result.stderr
    assert "the checkpoint is damaged" in result.stderr
    # no partial kept for a resume no rerun gets past: it refused the next try as "an interrupted run with other
    # settings" (found in review); the next try meets the same damage
    assert [p.name for p in tmp_path.iterdir()] == ["damaged"]
    again = quantize(damaged, "--out", out, "--method", "hqq")
    assert again.exit_code == 2 and "non-finite weights" in again.stderr and "interrupted" not in again.stderr


def test_not_a_moe_model(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    out = tmp_path / "q"
    assert_clean_failure(quantize(tmp_path / "llama", "--out", out), out, "unsupported model", "model_type=llama")


def test_missing_and_truncated_shards(tiny_model, tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_model("qwen3_moe", max_shard_size="20KB"), sharded)
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 2
    out = tmp_path / "q"
    shards[1].unlink()
    assert_clean_failure(quantize(sharded, "--out", out), out, "missing", shards[1].name)
    single = tmp_path / "single"
    shutil.copytree(tiny_model("qwen3_moe"), single)
    weights = single / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert_clean_failure(quantize(single, "--out", out), out, "model.safetensors", "truncated")


def test_shape_disagreeing_with_config(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3_moe"), model)
    config = json.loads((model / "config.json").read_text())
    config["moe_intermediate_size"] = 16  # the checkpoint's experts are 24 wide
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "q"
    assert_clean_failure(quantize(model, "--out", out), out, "does not match", "gate_proj.weight", "expected")


def test_no_space_left(tiny_model, tmp_path, monkeypatch):
    import usaf.stages.quantize as stage

    monkeypatch.setattr(stage.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**6, 10**6 - 10, 10))
    out = tmp_path / "q"
    assert_clean_failure(quantize(tiny_model("qwen3_moe"), "--out", out), out, "--out", "GiB free", "needed")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--nbits", "5"], ["--nbits = 5"]),
        (["--method", "gptq"], ["--method = 'gptq'"]),
        (["--group-size", "0"], ["--group-size = 0"]),
        (["--device", "tpu"], ["--device"]),
    ],
)
def test_bad_values(tiny_model, tmp_path, args, needles):
    out = tmp_path / "q"
    assert_clean_failure(quantize(tiny_model("qwen3_moe"), "--out", out, *args), out, *needles)


def test_missing_model_argument(tmp_path):
    out = tmp_path / "q"
    assert_clean_failure(quantize("--out", out), out, "MODEL is required")
    assert_clean_failure(quantize(tmp_path / "nope", "--out", out), out, "no such directory")


def test_every_tokenizer_file_is_carried_over(tiny_model, tmp_path):
    """added_tokens.json and a *.tiktoken vocabulary were left behind (found in review): a model that needs them had
    no working tokenizer after quantize (and export, which copies the same files)."""
    source = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3_moe"), source)
    (source / "added_tokens.json").write_text('{"<extra>": 600}')
    (source / "qwen.tiktoken").write_text("aGVsbG8= 0\n")
    out = tmp_path / "q"
    assert quantize(source, "--method", "rtn", "--group-size", 8, "--out", out).exit_code == 0
    for name in ("added_tokens.json", "qwen.tiktoken", "config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name


def test_an_out_or_workspace_inside_the_model_is_refused_before_anything_is_made_there(tiny_model, tmp_path):
    """The refusal came after the output's lock had made its parent directories inside the input model, and a
    --workspace inside it was named --out (found in review)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model("qwen3_moe"), model)
    before = sorted(p.name for p in model.iterdir())
    result = quantize(model, "--out", model / "a" / "b" / "c")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and f"--out {model / 'a' / 'b' / 'c'} lies inside the input {model}:" in said, said
    result = quantize(model, "--workspace", model)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "error: the default output " in said and f"lies inside the input {model}" in said
    assert "pass --out DIR outside every input, or --workspace DIR outside every input" in said
    assert sorted(p.name for p in model.iterdir()) == before


def test_a_model_without_tokenizer_files_is_said_at_quantize_time(tiny_model, tmp_path):
    """Quantized in silence, it was refused later by every stage that reads a tokenizer (found in review). Control:
    the same model with its tokenizer gets no such note."""
    source = tiny_model("qwen3_moe", tokenizer=True)
    bare = tmp_path / "bare"
    shutil.copytree(source, bare)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (bare / name).unlink(missing_ok=True)
    for model, said in ((bare, True), (source, False)):
        result = quantize(model, "--out", tmp_path / f"q-{said}", "--method", "rtn", "--group-size", "8")
        assert result.exit_code == 0, result.output
        assert ("has no tokenizer files" in " ".join(result.stderr.split())) is said, result.stderr
        assert "does not load" not in result.stderr


def test_a_model_whose_tokenizer_does_not_load_is_said_at_quantize_time(tiny_model, tmp_path):
    """tokenizer_config.json without tokenizer.json passed the files check: quantized in silence, then refused by
    score with a hint to pass a directory holding tokenizer.json, which --model (a quantized model) cannot be (found
    in review). Said at quantize time; score's hint names the source model."""
    half = tmp_path / "half"
    shutil.copytree(tiny_model("qwen3_moe", tokenizer=True), half)
    (half / "tokenizer.json").unlink()
    result = quantize(half, "--out", tmp_path / "q", "--method", "rtn", "--group-size", "8")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0 and f"MODEL {half}: its tokenizer does not load (no usable tokenizer" in said, said
    from usaf.data.tokenizer import load_tokenizer
    from usaf.errors import UsafError

    with pytest.raises(UsafError) as caught:
        load_tokenizer(str(tmp_path / "q"))
    assert caught.value.hint == ("its tokenizer files are its source model's as they were: mend them there and rerun "
                                 "(usaf quantize)")  # fmt: skip


def test_the_original_tools_multi_gpu_variable_is_said_not_read(tiny_model, tmp_path):
    """USE_MULTI_GPU=1 was warned about by usaf doctor only; a run used one device in silence (found in review). The
    control: without it, no such line."""
    source = tiny_model("qwen3_moe", num_layers=2)
    said = quantize(source, "--out", tmp_path / "a", "--method", "rtn", env={"USE_MULTI_GPU": "1"})
    assert said.exit_code == 0 and "USE_MULTI_GPU='1' is not read" in " ".join(said.stderr.split()), said.output
    quiet = quantize(source, "--out", tmp_path / "b", "--method", "rtn")
    assert quiet.exit_code == 0 and "USE_MULTI_GPU" not in quiet.stderr


def test_a_usaf_artifact_given_as_the_model_is_named_as_what_it_is(tmp_path):
    """A tokens, plan or run directory as MODEL was "no config.json" with a hint about Hugging Face's layout (found in
    review). The control: a directory usaf did not make still gets that answer."""
    tokens = tmp_path / "tok"
    from usaf.demo import demo_model_dir

    made = invoke("tokenize", stdlib_dir() / "shlex.py", "--model", demo_model_dir(), "--out", tokens)
    assert made.exit_code == 0, made.output
    refused = quantize(tokens, "--out", tmp_path / "q")
    said = " ".join(refused.stderr.split())
    assert refused.exit_code == 2 and f"MODEL {tokens}: a usaf tokens artifact, not a model" in said, said
    (tmp_path / "mine").mkdir()
    plain = quantize(tmp_path / "mine", "--out", tmp_path / "q")
    assert plain.exit_code == 2 and "no config.json" in plain.stderr and not (tmp_path / "q").exists()
    tiny = tmp_path / "tiny"  # made by usaf, and a model: quantized (the pipeline example's; refused once here)
    assert invoke("tiny-model", tiny).exit_code == 0
    assert quantize(tiny, "--out", tmp_path / "q", "--method", "rtn").exit_code == 0


def test_overwrite_is_another_name_for_force(tiny_model, tmp_path):
    """Every other command replaces its output with --overwrite; quantize answered it "No such option" (found in
    review). The control: without either, an existing output is refused."""
    source = tiny_model("qwen3_moe", num_layers=2)
    out = tmp_path / "q"
    assert quantize(source, "--out", out, "--method", "rtn").exit_code == 0
    assert quantize(source, "--out", out, "--method", "rtn").exit_code == 2
    replaced = quantize(source, "--out", out, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert load_verified(out, QuantizedModelManifest).summary.quant.method == "hqq"


def test_a_model_given_as_dot_names_its_default_output_after_its_directory(tiny_model, tmp_path, monkeypatch):
    """``cd model && usaf quantize .`` named its output "<stamp>-run", the name of nothing (found in review)."""
    model = tmp_path / "mymodel"
    shutil.copytree(tiny_model("qwen3_moe"), model)
    monkeypatch.chdir(model)
    result = quantize(".", "--workspace", tmp_path / "ws", "--method", "rtn", "--group-size", "8")
    assert result.exit_code == 0, result.output
    (made,) = (tmp_path / "ws" / "quantized_model").iterdir()
    assert made.name.endswith("-mymodel"), made.name
