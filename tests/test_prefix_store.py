"""`usaf score` keeps the frozen-prefix states its scoring pass computed (the calibration sample's; `--cache`: every
training sequence's) in the plan's store; `usaf train` reads them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import invoke, leftovers
from usaf.artifacts import PlanManifest, RunManifest, load_verified
from usaf.testing import stdlib_dir


@pytest.fixture(scope="module")
def setup(quantized, tmp_path_factory):
    qdir = quantized("qwen3_moe", num_layers=3, tokenizer=True)
    tokens = tmp_path_factory.mktemp("store") / "tokens"
    result = invoke("tokenize", stdlib_dir() / "textwrap.py", "--model", qdir, "--seq-len", 48, "--out", tokens)
    assert result.exit_code == 0, result.output
    return qdir, tokens


def score(qdir, tokens, out, *extra):
    return invoke("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--calib-samples", 8,
                  "--train-from", 2, "--no-stability", "--out", out, *extra)  # fmt: skip


def train(qdir, tokens, plan, out, *extra):
    length = extra or ("--steps", 6)
    return invoke("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", out, *length,
                  "--reselect-every", 0, "--save-every", 0, "--lr", 0.05)  # fmt: skip


def test_train_reads_every_prefix_state_from_the_plan_and_learns_the_same(setup, tmp_path):
    qdir, tokens = setup
    result = score(qdir, tokens, tmp_path / "cached", "--cache")
    assert result.exit_code == 0, result.output
    assert "prefix cache:" in result.output
    plan = load_verified(tmp_path / "cached", PlanManifest)  # hashes every file, the store included
    lines = (tokens / "train.jsonl").read_text().splitlines()
    distinct = len({json.dumps(json.loads(line)["input_ids"]) for line in lines})
    record = plan.summary.prefix_cache
    assert record.samples == distinct and record.start == 2 and record.dtype == "float32"
    assert record.tokens == sum(len(json.loads(line)["input_ids"]) for line in set(lines))
    assert result.exit_code == 0 and score(qdir, tokens, tmp_path / "plain", "--no-cache").exit_code == 0

    result = train(qdir, tokens, tmp_path / "cached", tmp_path / "run-cached")
    assert result.exit_code == 0, result.output
    assert "read from the plan" in result.output
    cached = load_verified(tmp_path / "run-cached", RunManifest).summary
    assert cached.prefix_cache_misses == 0 and cached.prefix_cache_hits == 6 * 2  # 6 steps × microbatch 2
    result = train(qdir, tokens, tmp_path / "plain", tmp_path / "run-plain")
    assert result.exit_code == 0, result.output
    plain = load_verified(tmp_path / "run-plain", RunManifest).summary
    assert plain.prefix_cache_misses > 0  # negative control: without the store, states are computed
    assert cached.final_loss == pytest.approx(plain.final_loss, abs=1e-5)


def test_a_store_keyed_for_other_cuts_is_said_to_miss_and_the_frozen_layers_are_prepared(setup, tmp_path):
    """``--seq-len`` (or ``--dtype``) keys every state otherwise than score's --cache did: the run said the store held
    every training sequence, missed every one, and left the frozen layers 4-bit for the misses (found in review).
    The control: the same plan without --seq-len is served whole and prepares nothing."""
    qdir, tokens = setup
    assert score(qdir, tokens, tmp_path / "cached", "--cache").exit_code == 0
    whole = train(qdir, tokens, tmp_path / "cached", tmp_path / "whole", "--steps", 2)
    said = " ".join(whole.output.split())
    assert whole.exit_code == 0 and "(every training sequence: usaf score --cache)" in said, said
    assert "frozen MoE layers' experts dequantized" not in said
    cut = train(qdir, tokens, tmp_path / "cached", tmp_path / "cut", "--steps", 2, "--seq-len", 24)
    said = " ".join(cut.output.split())
    assert cut.exit_code == 0 and "usaf score --cache, but 0 of " in said, said
    assert "2 frozen MoE layers' experts dequantized" in said
    summary = load_verified(tmp_path / "cut", RunManifest).summary
    assert summary.prefix_cache_hits == 0 and summary.prefix_cache_misses == 2 * 2


def test_a_prefix_cache_size_is_said_unused_where_the_plans_store_serves_every_sequence(setup, tmp_path, monkeypatch):
    """With a plan scored with --cache, ``--prefix-cache-gib 0`` (or any size) gave the same hits and misses: no cache
    is filled, and the setting was accepted and unused (found in review). Said (not refused: by then an --overwrite
    has replaced the run directory), from the flag or USAF_*. The control: without it, nothing is said."""
    qdir, tokens = setup
    assert score(qdir, tokens, tmp_path / "cached", "--cache").exit_code == 0
    flagged = train(qdir, tokens, tmp_path / "cached", tmp_path / "flag", "--steps", 2, "--prefix-cache-gib", 0.5)
    said = " ".join(flagged.stderr.split())
    assert flagged.exit_code == 0 and "--prefix-cache-gib 0.5: not used, the plan's store serves every" in said, said
    quiet = train(qdir, tokens, tmp_path / "cached", tmp_path / "quiet", "--steps", 2)
    assert quiet.exit_code == 0 and "not used, the plan's store" not in quiet.stderr
    monkeypatch.setenv("USAF_PREFIX_CACHE_GIB", "0.5")
    noted = train(qdir, tokens, tmp_path / "cached", tmp_path / "env", "--steps", 2)
    said = " ".join(noted.stderr.split())
    assert noted.exit_code == 0 and "USAF_PREFIX_CACHE_GIB 0.5: not used, the plan's store" in said, said


def test_by_default_the_plan_keeps_the_calibration_samples_states_and_train_reads_them(setup, tmp_path):
    """No flag: the store holds exactly the sample's states, each the sequence's own (computed alone) to rounding;
    a one-epoch run reads those and computes the rest, and learns what a run without the store learns."""
    from usaf.artifacts.prefix_store import PrefixStore
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model

    qdir, tokens = setup
    result = score(qdir, tokens, tmp_path / "plan")
    assert result.exit_code == 0, result.output
    assert "the calibration sample's; --cache: all" in result.output
    plan = load_verified(tmp_path / "plan", PlanManifest).summary
    record, fingerprint = plan.prefix_cache, plan.model_fingerprint
    assert (record.scope, record.samples, record.start) == ("calibration", 8, 2)

    engine = SparseEngine(load_quantized_model(qdir), trainable_layers=[2])
    store = PrefixStore(tmp_path / "plan" / "prefix_states.bin", tmp_path / "plan" / "prefix_index.json")
    lines = (tokens / "train.jsonl").read_text().splitlines()
    rows = {json.dumps(json.loads(line)["input_ids"]) for line in lines}
    found = 0
    for row in rows:
        ids = torch.tensor(json.loads(row))
        stored = store.get(engine.prefix_key(ids, fingerprint))
        if stored is not None:
            found += 1
            torch.testing.assert_close(stored, engine.prefix_states(ids[None])[0], rtol=0, atol=1e-5)
    assert found == 8 < len(rows)  # the sample, not the data

    result = train(qdir, tokens, tmp_path / "plan", tmp_path / "run", "--epochs", 1)
    assert result.exit_code == 0, result.output
    assert "read from the plan (the calibration sample)" in result.output
    kept = load_verified(tmp_path / "run", RunManifest).summary
    assert kept.prefix_cache_misses == len(rows) - 8  # every sequence at least once; the sample's from the store
    assert kept.prefix_cache_hits + kept.prefix_cache_misses == 2 * kept.steps  # microbatch 2
    assert score(qdir, tokens, tmp_path / "none", "--no-cache").exit_code == 0
    assert load_verified(tmp_path / "none", PlanManifest).summary.prefix_cache is None
    assert not (tmp_path / "none" / "prefix_states.bin").exists()
    result = train(qdir, tokens, tmp_path / "none", tmp_path / "run-none", "--epochs", 1)
    assert result.exit_code == 0, result.output
    none = load_verified(tmp_path / "run-none", RunManifest).summary
    assert none.prefix_cache_misses == len(rows)  # control: nothing kept
    assert kept.final_loss == pytest.approx(none.final_loss, abs=1e-5)


def test_cache_stores_the_samples_states_as_scored_and_computes_the_others(setup, tmp_path, monkeypatch):
    """--cache takes the calibration pass's states for the sample instead of running the frozen layers again."""
    from usaf.engine.engine import SparseEngine

    qdir, tokens = setup
    captured = []
    capture = SparseEngine.prefix_states

    def counted(self, ids, *args, **kwargs):
        captured.append(len(ids))  # sequences whose frozen layers run
        return capture(self, ids, *args, **kwargs)

    monkeypatch.setattr(SparseEngine, "prefix_states", counted)
    assert score(qdir, tokens, tmp_path / "all", "--cache").exit_code == 0
    record = load_verified(tmp_path / "all", PlanManifest).summary.prefix_cache
    assert record.scope == "data" and sum(captured) == record.samples - 8
    captured.clear()
    assert score(qdir, tokens, tmp_path / "all-again", "--cache", "--calib-samples", 2).exit_code == 0
    assert sum(captured) == record.samples - 2  # control: the count follows the sample


def test_a_store_is_consulted_and_its_states_are_what_the_forward_uses(setup, tmp_path):
    """Wrong states planted in a store change the loss; the right ones reproduce the full forward."""
    from usaf.artifacts.prefix_store import PrefixStore
    from usaf.engine.engine import SparseEngine
    from usaf.engine.loading import load_quantized_model
    from usaf.engine.prefix import PrefixCache

    qdir, _ = setup
    engine = SparseEngine(load_quantized_model(qdir), trainable_layers=[2])
    ids = torch.randint(1, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    states = engine.prefix_states(ids)  # (2, 16, H)
    keys = [engine.prefix_key(row, "fp") for row in ids]
    for name, planted in (("right", states), ("wrong", torch.zeros_like(states))):
        PrefixStore.write(tmp_path / f"{name}.bin", tmp_path / f"{name}.json", zip(keys, planted), meta={})
    with torch.no_grad():
        full = float(engine.loss(ids, ids).ce)
        for name in ("right", "wrong"):
            cache = PrefixCache(0, store=PrefixStore(tmp_path / f"{name}.bin", tmp_path / f"{name}.json"))
            got = engine.cached_prefix_states(ids, cache, model_fingerprint="fp")
            assert (cache.hits, cache.misses) == (2, 0)
            loss = float(engine.loss(ids, ids, prefix_states=got).ce)
            assert (loss == pytest.approx(full, abs=1e-6)) == (name == "right")
        cache = PrefixCache(0, store=PrefixStore(tmp_path / "right.bin", tmp_path / "right.json"))
        engine.cached_prefix_states(ids, cache, model_fingerprint="another model")
        assert (cache.hits, cache.misses) == (0, 2)  # other keys never reuse a stale state


def test_cache_without_a_frozen_prefix_is_refused(setup, tmp_path):
    qdir, tokens = setup
    result = invoke("score", "--model", qdir, "--data", tokens, "--train-from", 0, "--cache", "--calib-samples", 4,
                    "--no-stability", "--out", tmp_path / "plan")  # fmt: skip
    assert result.exit_code == 2
    assert "--cache: no frozen prefix" in result.output
    assert not (tmp_path / "plan").exists() and leftovers(tmp_path) == []


def test_a_plan_replaced_after_train_read_it_is_not_mixed_in(setup, tmp_path):
    """train reads a plan's manifest and index at its start and its masks and states after the model has loaded
    (minutes at 30B). A plan replaced at the same path meanwhile (usaf score --overwrite, another seed) served its
    states under the first index and its masks under the first record (found in review). The store is mapped with
    its index now, and the masks are checked against the manifest's sha256. Controls: a store opened after the
    replacement reads the new states; the unchanged masks are read."""
    import shutil

    from usaf.artifacts.plan import read_masks
    from usaf.artifacts.prefix_store import open_store
    from usaf.errors import UsafError

    qdir, tokens = setup
    first, second = tmp_path / "plan", tmp_path / "other"
    assert score(qdir, tokens, first).exit_code == 0
    assert score(qdir, tokens, second, "--seed", 7).exit_code == 0
    shutil.copytree(first, tmp_path / "copy")
    manifest = load_verified(first, PlanManifest)
    store = open_store(first, manifest.summary.prefix_cache)  # as train opens it: nothing read yet
    reference = open_store(tmp_path / "copy", manifest.summary.prefix_cache)
    keys = sorted(reference._entries)
    before = {key: reference.get(key) for key in keys}
    assert read_masks(first, manifest)  # control: the file the manifest records

    shutil.copyfile(second / "prefix_states.bin", tmp_path / "states")  # replaced as a whole new plan would be
    (tmp_path / "states").replace(first / "prefix_states.bin")
    masks = load_file(first / "masks.safetensors")  # another selection of the same counts per expert: it passes
    name = sorted(masks)[0]  # every check of the masks against the manifest but its hash
    chosen, shape = masks[name], next(t.shape for t in manifest.summary.tensors if t.name == name)
    per_expert = shape[1] * shape[2]  # flat indices into the stored (E, O, I)
    expert = int(chosen[0]) // per_expert
    taken = set(chosen.tolist())
    free = next(i for i in range(expert * per_expert, (expert + 1) * per_expert) if i not in taken)
    masks[name] = torch.cat([torch.tensor([free]), chosen[1:]]).sort().values  # the first entry moved, in its expert
    save_file(masks, tmp_path / "masks")
    (tmp_path / "masks").replace(first / "masks.safetensors")
    assert all(torch.equal(store.get(key), before[key]) for key in keys)
    reopened = open_store(first, manifest.summary.prefix_cache)
    assert any(not torch.equal(reopened.get(key), before[key]) for key in keys if key in reopened)  # it did change
    with pytest.raises(UsafError, match="changed since the plan's manifest was read"):
        read_masks(first, manifest)
