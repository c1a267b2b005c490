"""Batched first visits (usaf.stages.train.companies): each training sequence's prefix state is computed with its
first-epoch company (whole microbatches of epoch 0's order), once, and a resumed run that recomputes it gets the
straight run's bits."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from helpers import invoke
from helpers_engine import make_engine
from helpers_trained import interrupt_at
from usaf.data.batches import collate
from usaf.data.dataset import TokenDataset
from usaf.engine.engine import SparseEngine
from usaf.engine.prefix import PrefixCache
from usaf.settings import train as train_settings
from usaf.settings.train import company_size
from usaf.stages.train.companies import FirstEpochCompanies, company_prefix_states
from usaf.testing.hostile import resign_checkpoint

VOCAB = 64


def token_file(path, rows: list[list[int]]) -> TokenDataset:
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    return TokenDataset(path, vocab_size=VOCAB)


def rows_of(n: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (length - (i % 3),), generator=g).tolist() for i in range(n)]  # uneven lengths


def test_companies_are_runs_of_whole_first_epoch_microbatches(tmp_path):
    data = token_file(tmp_path / "t.jsonl", rows_of(7))
    companies = FirstEpochCompanies(data, seed=3, size=4)  # two microbatches of 2
    order = data.indices_for_step(0, 7, 3)  # epoch 0, one "step" of every sequence
    expected = [tuple(order[:4]), tuple(order[4:])]  # (a, b, c, d), (e, f, g)
    assert sorted({companies.of(r).rows for r in range(7)}) == sorted(expected)
    for r in range(7):
        assert r in companies.of(r).rows
    assert len({companies.of(r).tag for r in range(7)}) == 2
    # each training microbatch of the first epoch lies in one company, the first ones of each company first
    first_epoch = [tuple(data.indices_for_step(s, 2, 3)) for s in range(3)]
    assert [companies.of(mb[0]).rows for mb in first_epoch] == [expected[0], expected[0], expected[1]]
    assert all(set(mb) <= set(companies.of(mb[0]).rows) for mb in first_epoch)
    control = FirstEpochCompanies(data, seed=3, size=2)  # other companies: other tags, so other cache keys
    assert {control.of(r).tag for r in range(7)}.isdisjoint({companies.of(r).tag for r in range(7)})


def test_a_company_is_whole_microbatches_within_its_token_budget():
    tokens = train_settings.COMPANY_TOKENS
    assert company_size(2, 256, 1) == 2 * (tokens // 512)  # 4: two microbatches of two 256-token sequences
    assert company_size(1, 256, 1) == tokens // 256
    assert company_size(3, 256, 1) == 3 * max(1, tokens // 768)  # whole microbatches only
    assert company_size(1, 4 * tokens, 1) == 1 and company_size(8, 256, 1) == 8, "at least the microbatch"
    assert company_size(2, 256, 2) == 2, "data parallel: one microbatch (other ranks' sequences otherwise)"
    assert company_size(2, 1, 1) % 2 == 0 and company_size(2, 1, 1) <= tokens


def test_a_company_is_computed_once_together_and_served_after(quantized, tmp_path, monkeypatch):
    engine = make_engine(quantized, "qwen3_moe")
    data = token_file(tmp_path / "t.jsonl", rows_of(5))
    companies = FirstEpochCompanies(data, seed=0, size=2)
    calls = []
    real = engine.prefix_states
    monkeypatch.setattr(engine, "prefix_states", lambda x, m=None: calls.append(tuple(x.shape)) or real(x, m))
    cache = PrefixCache(2**30)

    def states(rows):
        batch = collate([data[r] for r in rows], 0, rows=tuple(rows))
        return company_prefix_states(engine, batch, rows, cache, model_fingerprint="m", companies=companies,
                                     load=lambda rs: [data[r] for r in rs], pad_id=0, chunk=2)  # fmt: skip

    a, b = companies.of(0).rows if len(companies.of(0).rows) == 2 else companies.of(1).rows
    first = states([a])  # a revisit-like miss: a alone asks, its whole company is computed
    assert len(calls) == 1 and calls[0][0] == 2 and (cache.misses, cache.hits) == (1, 0)
    both = states([b, a])  # b was computed with a: nothing computed; b's first visit still counts as a miss
    assert len(calls) == 1 and (cache.misses, cache.hits) == (2, 1)
    states([b])
    assert len(calls) == 1 and (cache.misses, cache.hits) == (2, 2), "a revisit is a hit"
    assert torch.equal(both[1, : len(data[a].input_ids)], first[0, : len(data[a].input_ids)])
    # the states are the sequences' own (within a batch's rounding), not a neighbour's
    for i, r in enumerate((b, a)):
        n = len(data[r].input_ids)
        torch.testing.assert_close(both[i, :n], real(torch.tensor([data[r].input_ids]))[0], rtol=1e-5, atol=1e-5)
    # the same tokens asked for alone (held-out data) are another entry, computed alone
    alone = engine.cached_prefix_states(torch.tensor([data[a].input_ids]), cache, model_fingerprint="m")
    assert len(calls) == 2 and calls[1][0] == 1
    torch.testing.assert_close(alone[0], first[0, : len(data[a].input_ids)], rtol=1e-5, atol=1e-5)


def test_a_run_that_visits_each_sequence_once_drops_each_state_once_taken(quantized, tmp_path):
    """A one-epoch run cached every sequence's prefix state for a revisit that never comes: RAM grew to its limit and
    spilled gigabytes to disk (469 → 1,684 MiB in a reviewer's run). Forgotten, a state stays only until its step
    takes it: a company computed ahead waits for its other microbatch, then goes. The same states either way. The
    control: not forgotten, every state stays."""
    engine = make_engine(quantized, "qwen3_moe")
    data = token_file(tmp_path / "t.jsonl", rows_of(8))
    kept = {}
    for once in (False, True):
        companies, cache = FirstEpochCompanies(data, seed=0, size=4), PrefixCache(2**30)
        got, held = [], []
        for step in range(4):  # one epoch: four microbatches of 2, two companies of 4
            rows = data.indices_for_step(step, 2, 0)
            batch = collate([data[r] for r in rows], 0, rows=tuple(rows))
            got.append(company_prefix_states(engine, batch, rows, cache, model_fingerprint="m", companies=companies,
                                             load=lambda rs: [data[r] for r in rs], pad_id=0, chunk=4,
                                             forget=(lambda row: True) if once else None))
            held.append(cache.nbytes["ram"])
        kept[once] = (got, held, len(cache))
    (plain, plain_held, plain_len), (dropped, dropped_held, dropped_len) = kept[False], kept[True]
    assert all(torch.equal(a, b) for a, b in zip(plain, dropped))
    assert plain_len == 8 and dropped_len == 0 and dropped_held[-1] == 0
    assert 0 < dropped_held[0] < plain_held[0] and dropped_held[1] == 0  # the company's second microbatch waited
    assert plain_held[-1] == max(plain_held) > max(dropped_held)


def test_the_rows_a_run_draws_again_are_the_next_epochs_first_ones(tmp_path):
    """Which states a run may drop: an epoch rounded up to whole steps draws a few rows twice, and a yes/no for the
    whole run switched the dropping off for most data sizes (7 sequences at microbatch 2: 4 steps draw 8; found in
    review). Those rows keep their states, the others do not; from two epochs on, every row is drawn again."""
    from usaf.stages.train.trainer import _drawn_again

    data = token_file(tmp_path / "t.jsonl", rows_of(7))
    assert _drawn_again(data, 6, seed=3) == frozenset()  # under an epoch: none
    assert _drawn_again(data, 8, seed=3) == {int(data.order(1, 3)[0])}  # the rounded-up step's one extra
    drawn = [r for step in range(4) for r in data.indices_for_step(step, 2, 3)]
    assert [r for r in set(drawn) if drawn.count(r) > 1] == [int(data.order(1, 3)[0])]  # what the run draws
    assert _drawn_again(data, 14, seed=3) is None
    assert _drawn_again(data, 13, seed=3) == set(data.order(1, 3)[:6].tolist())


def test_a_company_leaves_out_the_states_the_plans_store_holds(quantized, tmp_path, monkeypatch):
    engine = make_engine(quantized, "qwen3_moe")
    data = token_file(tmp_path / "t.jsonl", rows_of(4))
    companies = FirstEpochCompanies(data, seed=0, size=4)  # one company of all four
    stored_row = companies.of(0).rows[1]
    stored_key = engine.prefix_key(torch.tensor(data[stored_row].input_ids), "m")

    class Store(dict):  # the read-only store's lookups
        pass

    store = Store({stored_key: torch.zeros(len(data[stored_row].input_ids), engine.spec.hidden_size)})
    cache = PrefixCache(2**30, store=store)
    calls = []
    real = engine.prefix_states
    monkeypatch.setattr(engine, "prefix_states", lambda x, m=None: calls.append(tuple(x.shape)) or real(x, m))
    rows = list(companies.of(0).rows)
    batch = collate([data[r] for r in rows], 0, rows=tuple(rows))
    got = company_prefix_states(engine, batch, rows, cache, model_fingerprint="m", companies=companies,
                                load=lambda rs: [data[r] for r in rs], pad_id=0, chunk=4)  # fmt: skip
    assert calls == [(3, max(len(data[r].input_ids) for r in rows if r != stored_row))]  # the other three
    assert torch.equal(got[1, : len(data[stored_row].input_ids)], store[stored_key])  # read from the store
    assert (cache.hits, cache.misses) == (1, 3) and len(cache) == 4


def _train(qdir, data, plan, out, *extra):
    return invoke("train", "--model", qdir, "--data", data, "--plan", plan, "--out", out, "--lr", 0.05,
                  "--save-every", 0, "--microbatch", 2, "--steps", 9, "--reselect-every", 3, *extra)  # fmt: skip


def _losses(run) -> list[float]:
    return [m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in m]


def test_a_resumed_run_recomputes_a_revisits_state_with_its_company(prepared, tmp_path, monkeypatch):
    """Six sequences, microbatch 2, nine steps: epochs of three steps; companies of 4 (two microbatches: the token
    budget lowered for these 32-token lines). Interrupted at step 4 (the second epoch), the resumed run has no cache
    and recomputes the states the straight run kept from the first epoch: the same losses and deltas, bit for bit,
    with the checkpoint's company size even where the rule now gives another. The controls: every state the resumed
    run computes moved by one ulp, as a batch of other company does at larger widths (docs/BENCHMARKS.md: up to
    2.4e-7; this tiny model's GEMMs happen not to), changes the deltas, so the check sees the recomputed states (the
    losses, rounded to fp32 sums, do not); a checkpoint without a company size (written before companies had one)
    resumes with the microbatch's; a size of 0 is refused."""
    qdir, tokens, _ = prepared("qwen3_moe")
    data = tmp_path / "six.jsonl"
    data.write_text("".join((tokens / "train.jsonl").read_text().splitlines(keepends=True)[:6]))
    plan = tmp_path / "plan"
    result = invoke("score", "--model", qdir, "--data", data, "--frac", 0.05, "--calib-samples", 4, "--train-from", 2,
                    "--no-stability", "--no-cache", "--no-lr-test", "--device", "cpu", "--out", plan)  # fmt: skip
    assert result.exit_code == 0, result.output
    monkeypatch.setattr(train_settings, "COMPANY_TOKENS", 128)  # 2 × 32-token sequences × 2 microbatches
    straight = tmp_path / "straight"
    real = SparseEngine.prefix_states
    captured = []

    def counting(self, input_ids, attention_mask=None):
        captured.append(input_ids.shape[0])
        return real(self, input_ids, attention_mask)

    monkeypatch.setattr(SparseEngine, "prefix_states", counting)
    assert _train(qdir, data, plan, straight).exit_code == 0
    assert captured == [4, 2]  # step 1 captures its company (steps 1-2), step 3 its own; later steps hit
    monkeypatch.setattr(SparseEngine, "prefix_states", real)

    def resumed(name: str, patch=None, edit=None):
        run = tmp_path / name
        interrupt_at(4, lambda: _train(qdir, data, plan, run), monkeypatch)
        monkeypatch.setattr(train_settings, "COMPANY_TOKENS", 1024)  # the rule would now make one company of six
        if edit is not None:
            (state_file,) = run.glob("checkpoints/*/state.json")
            state_file.write_text(json.dumps(edit(json.loads(state_file.read_text()))))
            resign_checkpoint(state_file.parent)  # what the state's own reading sees, not the checksums' refusal
        captured.clear()
        monkeypatch.setattr(SparseEngine, "prefix_states", patch or counting)
        result = _train(qdir, data, plan, run)
        monkeypatch.setattr(train_settings, "COMPANY_TOKENS", 128)
        monkeypatch.setattr(SparseEngine, "prefix_states", real)
        return run, result

    same, result = resumed("resumed")
    assert result.exit_code == 0 and "resuming from" in result.stderr, result.output
    assert sorted(captured) == [2, 4], "the checkpoint's companies, recomputed once each"
    assert _losses(same) == _losses(straight)
    a, b = (load_file(str(run / "final" / "deltas.safetensors")) for run in (straight, same))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def one_ulp_off(self, input_ids, attention_mask=None):
        states = real(self, input_ids, attention_mask)
        return torch.nextafter(states, torch.full_like(states, float("inf")))

    control, result = resumed("control", one_ulp_off)
    assert result.exit_code == 0, result.output
    c = load_file(str(control / "final" / "deltas.safetensors"))
    assert not all(torch.equal(a[k], c[k]) for k in a)

    _, result = resumed("older", edit=lambda state: {k: v for k, v in state.items() if k != "company_size"})
    assert result.exit_code == 0 and captured == [2, 2, 2], "an older checkpoint: microbatch companies"
    _, result = resumed("zero", edit=lambda state: {**state, "company_size": 0})
    assert result.exit_code == 2 and "company_size 0" in result.stderr, result.output
