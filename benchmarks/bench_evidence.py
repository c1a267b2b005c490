"""Benchmark: fine-tuning quality of usaf against its ablations, LoRA and full fine-tuning (issue 8's evidence).

Workload: the packaged demo model (``usaf.demo.demo_model_dir()``: a Qwen3-MoE pretrained on the Python standard
library, 4 layers, hidden 128, 16 experts top-2, vocab 4096, 3.9 M parameters, bf16 on disk), fine-tuned on
``usaf.demo.DEMO_DOMAIN`` (network, mail and markup modules it never saw) and measured on that domain's held-out
sources, on a sample of its training split, and on ``PRETRAIN_DOMAIN``'s held-out sources (forgetting).

Every arm sees the same data in the same order (``TokenDataset.samples_for_step(step, microbatch, seed)``, what
``usaf train`` uses), the same number of steps x microbatch x seq_len, the same warmup + cosine schedule (5 %
warmup, floor 0.1 x peak), gradient clipping at 1.0, no weight decay, and seeds 0, 1, 2. The arms:

- **usaf** arms go through the stage functions as a user runs them: ``usaf.stages.tokenize.run`` once,
  ``usaf.stages.quantize.run`` once (HQQ 4-bit, group 128: the defaults), ``usaf.stages.score.run`` per seed
  (and per frac) with ``--cache`` as ``usaf demo`` does, ``usaf.stages.train.run`` per seed; everything else
  at ``usaf train``'s defaults (top quarter of the layers = layer 3, per-tensor budget, router lr: usaf's default,
  1e-4 until 3a6d538, 1e-3 since), except ``--save-every 0`` (no checkpoint I/O inside the timed loop). Arms:
  default (frac 0.005, RigL every ``RESELECT_EVERY`` steps, routers on), static mask (``--reselect-every 0``),
  routers frozen (``--no-router``), a larger budget (frac ``FRAC_LARGE``) and two trainable layers
  (``--train-from TRAIN_FROM_HALF``).
- **router only**: the same train stage and Trainer (data, prefix cache, schedule, SparseAdamW, clipping), with
  the plan's deltas removed just before the loop (``usaf train`` has no flag for "no deltas"), so only the
  layer-3 router trains; its learning rate is ``--router-lr``.
- **usaf_router_lr** / **usaf_router_lr_1e-3**: usaf at its defaults (experts + attention, the plan's lr for the
  deltas) with the *routers'* lr as the swept (or fixed) value: the router lr's evidence (issue 20, item 3).
- **LoRA** (peft ``target_modules`` on layer 3's q/k/v/o projections, ``target_parameters`` on its fused
  ``mlp.experts.gate_up_proj``/``down_proj``, at the ranks whose trainable count is closest to usaf's) and
  **full fine-tuning** (every parameter, ``AdamW(fused=True)``) train the *original* bf16 weights upcast to fp32
  with transformers, not the 4-bit base: this is LoRA, not QLoRA.

Each training run is a fresh child process started by a small wrapper (``bench_train.wrapped``), so its peak RSS
(``ru_maxrss``, read right after training, before evaluation) is its own. The child then evaluates the trained
model: usaf arms through ``load_trained_change`` + ``usaf.stages.change.model_with_change`` (what ``usaf
generate``/``export`` apply), the others as the trained transformers model. Perplexity is token-weighted over
fixed, seeded samples of sequences, the same for every arm; the bases (4-bit for usaf, original for the others)
are measured on the same sequences.

Learning rates: a sweep on seed 0 over ``GRIDS`` (one more value beyond the grid's edge when the best is at an
edge, at most ``MAX_EXTEND`` times), picked by the lowest PPL on an in-domain *validation* sample of held-out
sequences disjoint from the reported *test* sample; seeds 1 and 2 run at the chosen lr.

Every run is deterministic at a fixed thread count, so ``--resume`` continues an interrupted benchmark from the
runs already in ``--out`` (the same settings are checked) with the same results.

    python benchmarks/bench_evidence.py [--quick] [--threads 1] [--steps 250] [--seeds 0 1 2] [--no-sweep]
                                        [--domain stdlib-net|torch-cpp] [--arms ARM ...] [--lora-match ARM]
                                        [--resume] [--out benchmarks/results/evidence.json]

Version 2 (issue 20): ``--domain torch-cpp`` fine-tunes on ``usaf.demo.CPP_DOMAIN`` instead (C++ headers: a much
larger shift); ``--arms`` picks arms beyond the default set: ``qlora`` (the same LoRA over usaf's dequantized 4-bit
base), ``usaf_defaults`` (no --frac, no --lr: the default share rule and the plan's lr test, not swept) and the
budget arms; ``--lora-match`` sizes LoRA to another usaf arm (``usaf_defaults``: ~80 k on the demo model);
``usaf_rule_attention`` is the defaults' selection with a swept lr (the lr test's yardstick);
``--model benchmarks/models/evidence-large`` fine-tunes the larger pretrained model (``scripts/build_demo_model.py
--size large``: 8 layers, 32 experts top-4) instead of the demo model; ``--model benchmarks/models/evidence-shared``
(``--size shared``: a Qwen2-MoE with a shared expert in every MoE layer and a dense layer 0) is the one the
``usaf_shared``, ``usaf_all_attention`` and ``usaf_all_dense`` arms are sized for (the shared and dense targets).
    python benchmarks/bench_evidence.py --reaggregate benchmarks/results/evidence.json   # tables only

Needs peft (``pip install 'usaf[bench]'``) for the LoRA arm.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import RESULTS, adamw_state_bytes, current_rss, load_reference, machine, tensor_bytes  # noqa: E402
from bench_train import git_commit, lora_counts_per_rank, lora_model, lora_ranks, wrapped  # noqa: E402

from usaf.settings.train import DEFAULT_LR as TRAIN_DEFAULT_LR  # noqa: E402
from usaf.settings.train import DEFAULT_ROUTER_LR  # noqa: E402

SEQ, SEQ_QUICK = 256, 64
MICROBATCH = 2  # usaf train's default
STEPS, STEPS_QUICK = 250, 6
RESELECT_EVERY, RESELECT_EVERY_QUICK = 40, 3  # 250 steps: 4 reselections (40..160; at 200 the fraction is 0)
WARMUP_FRACTION = 0.05  # usaf train's --warmup default, used for every arm
CLIP = 1.0
FRAC = 0.005
FRAC_LARGE = 0.02  # the demo model is tiny: 0.005 of one layer's experts is 3,931 weights
# experts + attention of layer 3 (786,432 + 49,152 weights) at the count of 0.1 of its experts (78,643)
FRAC_ATTENTION = 0.0941
# The third model's equal-count fracs (usaf_shared, usaf_all_attention, usaf_all_dense: see ARMS)
SHARED_FRAC, ALL_FRAC, ALL_DENSE_FRAC = 0.0944, 0.03, 0.02833
TRAIN_FROM_HALF = 2  # layers 2 and 3 (the default trains the top quarter: layer 3 alone)
EVAL_SEQUENCES, EVAL_SEQUENCES_QUICK = 64, 4
EVAL_SEED = 1234  # the evaluated samples are fixed: the same sequences for every arm and seed
EVAL_MICROBATCH = 8
LAST_N = 0.1  # "final train loss" = mean of the last 10 % of steps
CURVE_WINDOW = 10
MAX_EXTEND = 2
# Arms, in run order. "lr" is the swept learning rate: the deltas' for usaf, the router's for router_only.
ARMS = {
    "usaf": {"kind": "usaf", "frac": FRAC, "reselect": True, "router": True},
    "usaf_static": {"kind": "usaf", "frac": FRAC, "reselect": False, "router": True},
    "usaf_no_router": {"kind": "usaf", "frac": FRAC, "reselect": True, "router": False},
    "router_only": {"kind": "router_only", "frac": FRAC, "reselect": False, "router": True},
    "usaf_frac_large": {"kind": "usaf", "frac": FRAC_LARGE, "reselect": True, "router": True},
    "usaf_top_half": {"kind": "usaf", "frac": FRAC, "reselect": True, "router": True, "train_from": TRAIN_FROM_HALF},
    "lora": {"kind": "lora"},
    "full_finetune": {"kind": "full"},
    # QLoRA: the same LoRA over usaf's own 4-bit base (HQQ, dequantized by `usaf export --no-checkpoint` to fp32), the
    # fair comparison on a card that cannot hold the original weights. Not in the default run; pick it with --arms.
    "qlora": {"kind": "lora", "base": "hqq4"},
    # LoRA on the experts only (no attention), at the same count: the adapter counterpart of usaf's experts-only arms.
    "lora_experts": {"kind": "lora", "experts_only": True},
    # usaf as a user runs it: no --frac (the default rule for the layers' size), no --lr (the plan's lr test), no
    # sweep: lr PLAN_LR stands for "the plan's".
    "usaf_defaults": {"kind": "usaf", "frac": None, "reselect": True, "router": True},
    # Budgets that scale (issue 20): not in the default run; pick them with --arms.
    "usaf_frac_0.001": {"kind": "usaf", "frac": 0.001, "reselect": True, "router": True},
    "usaf_frac_0.05": {"kind": "usaf", "frac": 0.05, "reselect": True, "router": True},
    "usaf_frac_0.1": {"kind": "usaf", "frac": 0.1, "reselect": True, "router": True},
    "usaf_all_layers": {"kind": "usaf", "frac": FRAC, "reselect": True, "router": True, "train_from": 0},
    # Targets beyond the routed experts (issue 20): the experts and the attention of the same layer. At FRAC_ATTENTION
    # the count equals usaf_defaults' (0.1 of the experts); the defaults arm takes the share rule and the lr test.
    "usaf_attention": {
        "kind": "usaf",
        "frac": FRAC_ATTENTION,
        "reselect": True,
        "router": True,
        "targets": "experts,attention",
    },
    "usaf_defaults_attention": {
        "kind": "usaf",
        "frac": None,
        "reselect": True,
        "router": True,
        "targets": "experts,attention",
    },
    # The defaults' selection (the share rule, experts + attention) with a swept lr: the lr test's yardstick on a
    # model where no fixed frac gives the rule's count (the larger model).
    "usaf_rule_attention": {
        "kind": "usaf",
        "frac": None,
        "reselect": True,
        "router": True,
        "targets": "experts,attention",
    },
    # Budgets at the defaults (issue 20, item 2): usaf_defaults_attention (experts + attention, the plan's lr test)
    # at a fixed frac instead of the share rule's, on the second model (whose rule gives 0.027).
    **{
        f"usaf_defaults_frac_{frac}": {
            "kind": "usaf",
            "frac": frac,
            "reselect": True,
            "router": True,
            "targets": "experts,attention",
            "lr_test": True,
        }
        for frac in (0.01, 0.05, 0.1)
    },
    # The experts alone at the share rule's count, lr swept: the target set before the attention joined the defaults,
    # on the second model (where the rule's count is the same with or without the attention: its floor).
    "usaf_rule_experts": {"kind": "usaf", "frac": None, "reselect": True, "router": True, "targets": "experts"},
    # The shared and dense targets (issue 20, item 1), on the third model (benchmarks/models/evidence-shared: a shared
    # expert in every MoE layer, layer 0 dense), each at the count of the arm it adds to, lr swept. usaf_shared: the
    # defaults' layer with the shared expert too, at usaf_rule_attention's count (the rule's 0.1 of the experts' and
    # attention's 835,584 weights = 83,556 entries; 0.0944 of 884,864 with the shared expert's = 83,526).
    "usaf_shared": {
        "kind": "usaf",
        "frac": SHARED_FRAC,
        "reselect": True,
        "router": True,
        "targets": "experts,attention,shared",
    },
    # usaf at its defaults on that model since the shared experts joined them (no --targets resolves to these there)
    "usaf_defaults_shared": {
        "kind": "usaf",
        "frac": None,
        "reselect": True,
        "router": True,
        "targets": "experts,attention,shared",
    },
    # Every layer (--train-from 0), the experts and attention (0.03 of 3,342,336 weights = 100,256 entries), and
    # with the dense layer's MLP and attention too (0.02833 of 3,539,968 = 100,252).
    "usaf_all_attention": {
        "kind": "usaf",
        "frac": ALL_FRAC,
        "reselect": True,
        "router": True,
        "train_from": 0,
        "targets": "experts,attention",
    },
    "usaf_all_dense": {
        "kind": "usaf",
        "frac": ALL_DENSE_FRAC,
        "reselect": True,
        "router": True,
        "train_from": 0,
        "targets": "experts,attention,dense",
    },
    # The router lr's sweep (issue 20, item 3): usaf_defaults_attention (the plan's lr for the deltas) with the
    # routers' lr as the swept "lr"; its point at the default --router-lr is usaf_defaults_attention itself.
    "usaf_router_lr": {
        "kind": "usaf",
        "frac": None,
        "reselect": True,
        "router": True,
        "targets": "experts,attention",
        "swept": "router_lr",
    },
    # The same at one router lr (run with --no-sweep): the candidate default's seeds, and the second model.
    "usaf_router_lr_1e-3": {
        "kind": "usaf",
        "frac": None,
        "reselect": True,
        "router": True,
        "targets": "experts,attention",
        "swept": "router_lr",
    },
}
DEFAULT_ARMS = ("usaf", "usaf_static", "usaf_no_router", "router_only", "usaf_frac_large", "usaf_top_half", "lora",
                "full_finetune")  # fmt: skip
PLAN_LR = 0.0  # the "lr" of an arm that is not swept: usaf train takes the plan's (usaf score's lr test)
# Learning-rate grids (log-spaced by ~3), each holding usaf's default where it has one; the middle value is the
# one used with --no-sweep / --quick.
GRIDS = {
    "usaf": [3e-3, 1e-2, 3e-2],
    "usaf_static": [3e-3, 1e-2, 3e-2],
    "usaf_no_router": [3e-3, 1e-2, 3e-2],
    "router_only": [1e-4, 1e-3, 1e-2],
    "usaf_frac_large": [3e-3, 1e-2, 3e-2],
    "usaf_top_half": [3e-3, 1e-2, 3e-2],
    "lora": [1e-3, 3e-3, 1e-2],
    "qlora": [1e-3, 3e-3, 1e-2],
    "lora_experts": [1e-3, 3e-3, 1e-2],
    "usaf_defaults": [PLAN_LR],
    "full_finetune": [1e-4, 3e-4, 1e-3],
    "usaf_frac_0.001": [3e-3, 1e-2, 3e-2],
    "usaf_frac_0.05": [3e-3, 1e-2, 3e-2],
    "usaf_frac_0.1": [3e-3, 1e-2, 3e-2],
    "usaf_all_layers": [3e-3, 1e-2, 3e-2],
    "usaf_attention": [3e-3, 1e-2, 3e-2],
    "usaf_defaults_attention": [PLAN_LR],
    "usaf_rule_attention": [3e-3, 1e-2, 3e-2],
    "usaf_router_lr": [3e-5, 1e-4, 3e-4, 1e-3],
    "usaf_router_lr_1e-3": [1e-3],
    "usaf_rule_experts": [3e-3, 1e-2, 3e-2],
    "usaf_shared": [3e-3, 1e-2, 3e-2],
    "usaf_defaults_shared": [PLAN_LR],
    "usaf_all_attention": [3e-3, 1e-2, 3e-2],
    "usaf_all_dense": [3e-3, 1e-2, 3e-2],
    **{f"usaf_defaults_frac_{frac}": [PLAN_LR] for frac in (0.01, 0.05, 0.1)},
}
# usaf train's --lr (without a plan's lr test) and --router-lr defaults, read from usaf: the arms run its defaults
# (the router lr was 1e-4 until 3a6d538; the files before it ran that)
DEFAULT_LR = {"usaf": TRAIN_DEFAULT_LR, "router_only": DEFAULT_ROUTER_LR}
LORA_ALPHA = 16


# -- setup: data, quantized model, evaluation samples, plans -------------------------------------------------


def domains() -> dict:
    """The fine-tuning domains by name: the demo's network/mail/markup modules, and C++ (a much larger shift)."""
    from usaf.demo import CPP_DOMAIN, DEMO_DOMAIN

    return {d.name: d for d in (DEMO_DOMAIN, CPP_DOMAIN)}


def setup(work: Path, seq: int, eval_n: int, domain: str = "stdlib-net", model: Path | None = None) -> dict:
    """Tokens, the quantized model and its dequantized base, the evaluation samples; ``model``: the pretrained model
    fine-tuned (default: the demo model; the larger one is ``scripts/build_demo_model.py --size large``'s)."""
    from usaf.demo import PRETRAIN_DOMAIN, demo_model_dir
    from usaf.stages.export import ExportConfig
    from usaf.stages.export import run as export
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize
    from usaf.stages.tokenize import TokenizeConfig
    from usaf.stages.tokenize import run as tokenize

    src = model or demo_model_dir()
    t0 = time.perf_counter()
    demo, demo_dir = tokenize(
        TokenizeConfig(**domains()[domain].tokenize_options(), model=str(src), seq_len=seq, out=work / "tokens-demo")
    )
    pre, pre_dir = tokenize(
        TokenizeConfig(**PRETRAIN_DOMAIN.tokenize_options(), model=str(src), seq_len=seq, out=work / "tokens-pretrain")
    )
    t1 = time.perf_counter()
    qmanifest, qdir = quantize(QuantizeConfig(model=str(src), out=work / "q4", device="cpu"))
    _, q4_base = export(ExportConfig(model=qdir, no_checkpoint=True, dtype="float32", out=work / "q4-dequantized"))
    t2 = time.perf_counter()
    # Evaluation samples: the in-domain held-out sequences split into a validation sample (lr choice) and a
    # disjoint test sample (reported), a sample of the training split, the pretraining domain's held-out.
    heldout = _read_lines(demo_dir / "heldout.jsonl")
    random.Random(EVAL_SEED).shuffle(heldout)
    sets = {
        "indomain_heldout": heldout[:eval_n],
        "indomain_validation": heldout[eval_n : 2 * eval_n],
        "indomain_train_sample": _sample(_read_lines(demo_dir / "train.jsonl"), eval_n),
        "pretrain_heldout": _sample(_read_lines(pre_dir / "heldout.jsonl"), eval_n),
    }
    eval_dir = work / "eval"
    eval_dir.mkdir()
    paths = {}
    for name, lines in sets.items():
        paths[name] = eval_dir / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(line) + "\n" for line in lines))

    def summary(m):
        return {k: v for k, v in m.summary.model_dump(mode="json").items() if k not in ("sources", "tokenizer")}

    info = {
        "tokenize_seconds": t1 - t0,
        "quantize_seconds": t2 - t1,
        "quantize": {"method": "hqq", "bits": 4, "group_size": 128, "mean_rel_error": qmanifest.summary.mean_rel_error},
        "tokens_demo": summary(demo),
        "tokens_pretrain": summary(pre),
        "eval_sets": {n: {"sequences": len(v), "tokens": sum(len(x["input_ids"]) for x in v)} for n, v in sets.items()},
    }
    print(f"[setup] tokenize {t1 - t0:.1f}s, quantize {t2 - t1:.1f}s; train sequences "
          f"{info['tokens_demo']['train_sequences']}", flush=True)  # fmt: skip
    return {"src": src, "qdir": qdir, "q4_base": q4_base, "tokens": demo_dir, "eval": paths, "info": info}


def _read_lines(path: Path) -> list[dict]:
    out = []
    with path.open() as f:
        for raw in f:
            if raw.strip():
                obj = json.loads(raw)
                out.append({"input_ids": obj["input_ids"], "labels": obj.get("labels", obj["input_ids"])})
    return out


def _sample(lines: list[dict], n: int) -> list[dict]:
    return random.Random(EVAL_SEED).sample(lines, min(n, len(lines)))


def plan_label(
    seed: int, frac: float | None, train_from: int | None, targets: str = "experts", lr_test: bool = False
) -> str:
    """The plan's key in a results file (and its directory's name); the experts alone keep their old label, and a
    plan with the lr test at a fixed frac says so (without a frac the lr test always runs)."""
    label = f"seed{seed}-frac{frac}-from{train_from}"
    label = label if targets == "experts" else f"{label}-{targets.replace(',', '+')}"
    return f"{label}-lrtest" if lr_test and frac is not None else label


def make_plan(
    env: dict,
    work: Path,
    seed: int,
    frac: float,
    train_from: int | None,
    cache: bool,
    calib: int,
    targets: str = "experts",
    lr_test: bool = False,
) -> tuple[Path, dict]:
    """``usaf score`` for one seed, budget and layer choice, as ``usaf demo`` runs it (``--cache``); ``lr_test``:
    with the lr test (where train takes the plan's lr)."""
    from usaf.stages.score import ScoreConfig
    from usaf.stages.score import run as score

    start = time.perf_counter()
    out = work / f"plan-{plan_label(seed, frac, train_from, targets, lr_test)}"
    manifest, plan = score(
        ScoreConfig(model=env["qdir"], data=env["tokens"], out=out, frac=frac, seed=seed, cache=cache,
                    calib_samples=calib, train_from=train_from, device="cpu", targets=targets,
                    lr_test=lr_test)  # the lr test only where train takes the plan's lr
    )  # fmt: skip
    s = manifest.summary
    info = {
        "seconds": time.perf_counter() - start,
        "trainable_layers": s.trainable_layers,
        "expert_entries": s.expert_entries,
        "router_params": s.router_params,
        "calib_samples": s.calib_samples,
        "stability_mean": s.stability_mean,
        "prefix_cache": cache,
        "frac": s.frac,
        "lr_test": s.lr_test.model_dump() if s.lr_test is not None else None,
    }
    print(f"[score] seed {seed} frac {frac} layers {s.trainable_layers}: {info['seconds']:.1f}s, "
          f"{s.expert_entries} entries, "
          f"stability {s.stability_mean}", flush=True)  # fmt: skip
    return plan, info


# -- evaluation (shared by every arm and the bases) ------------------------------------------------------------


@torch.no_grad()
def evaluate(model, sets: dict[str, Path]) -> dict:
    """Token-weighted next-token NLL and perplexity per set (labels unshifted, as in ``SparseEngine.loss``)."""
    from usaf.data.batches import batches
    from usaf.data.tokens import iter_token_file

    model.eval()
    out = {}
    for name, path in sets.items():
        lines = list(iter_token_file(path, vocab_size=model.config.vocab_size))
        total, tokens = 0.0, 0
        for batch in batches(lines, EVAL_MICROBATCH, 0):
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
            logits = logits[:, :-1].float()
            targets = batch.labels[:, 1:]
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                           ignore_index=-100, reduction="sum"))  # fmt: skip
            tokens += int((targets != -100).sum())
        out[name] = {"nll": total / tokens, "ppl": math.exp(total / tokens), "tokens": tokens}
    return out


def evaluate_bases(env: dict) -> dict:
    from usaf.stages.change import model_with_change

    original = load_reference(env["src"])  # bf16 on disk, upcast to fp32: what LoRA and full fine-tuning start from
    q4 = model_with_change(env["qdir"], None, device=torch.device("cpu"))  # the 4-bit base usaf starts from
    exported = load_reference(env["q4_base"])  # QLoRA's base: the same 4-bit weights as a plain transformers model
    return {"original_fp32": evaluate(original, env["eval"]), "hqq4": evaluate(q4, env["eval"]),
            "hqq4_exported_fp32": evaluate(exported, env["eval"])}  # fmt: skip


# -- one training run, in a fresh child ---------------------------------------------------------------------------


def child(spec: dict) -> dict:
    """Train one arm at one lr and seed, read the peak RSS, then evaluate (runs in the child process)."""
    torch.set_num_threads(spec["threads"])
    baseline = current_rss()
    result = _usaf_child(spec) if spec["kind"] in ("usaf", "router_only") else _dense_child(spec)
    result["peak_rss_mib_after_training"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["rss_after_imports_mib"] = baseline
    start = time.perf_counter()
    result["eval"] = evaluate(result.pop("model"), {k: Path(v) for k, v in spec["eval"].items()})
    result["eval_seconds"] = time.perf_counter() - start
    return result


def _usaf_child(spec: dict) -> dict:
    from usaf.artifacts.run import load_trained_change
    from usaf.engine.optim import SparseAdamW
    from usaf.stages import train as train_stage
    from usaf.stages.change import model_with_change
    from usaf.stages.train import loop as train_loop

    router_only = spec["kind"] == "router_only"
    held: dict = {}
    original_loop = train_loop.run_loop

    def loop(trainer, steps, progress):
        if router_only:  # no expert deltas: only the routers train, in the same loop
            trainer.engine.set_deltas({})
            c = trainer.config
            groups = trainer.engine.parameter_groups(lr=c.lr, router_lr=c.router_lr, weight_decay=0.0)
            trainer.optimizer = SparseAdamW(groups, max_grad_norm=trainer.config.clip)
        start = time.perf_counter()
        original_loop(trainer, steps, progress)
        held["loop_seconds"] = time.perf_counter() - start
        held["state_bytes"] = usaf_state_bytes(trainer)
        held["trainable"] = trainer.engine.trainable_count()

    lr = DEFAULT_LR["usaf"] if router_only else (None if spec["lr"] == PLAN_LR else spec["lr"])
    router_lr = spec["lr"] if router_only else spec.get("router_lr", DEFAULT_LR["router_only"])
    if spec.get("swept") == "router_lr":  # the routers' lr is the swept one; the deltas' is the plan's
        lr, router_lr = None, spec["lr"]
    config = train_stage.TrainConfig(
        model=Path(spec["qdir"]),
        data=Path(spec["tokens"]),
        plan=Path(spec["plan"]),
        out=Path(spec["run_dir"]),
        steps=spec["steps"],
        microbatch=MICROBATCH,
        lr=lr,
        router_lr=router_lr,
        reselect_every=spec["reselect_every"],
        router=spec["router"],
        dense_router_grad=spec.get("dense_router_grad", False),  # bench_router_grad.py's arms
        save_every=0,
        seed=spec["seed"],
        device="cpu",
    )
    start = time.perf_counter()
    with mock.patch.object(train_loop, "run_loop", loop):
        manifest, run_dir = train_stage.run(config)
    train_seconds = time.perf_counter() - start
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r and "step" in r and "seconds" in r]
    change = load_trained_change(run_dir)
    model = model_with_change(Path(spec["qdir"]), change, device=torch.device("cpu"))
    s = manifest.summary
    return {
        "model": model,
        "losses": [r["loss"] for r in steps],
        "step_seconds": [r["seconds"] for r in steps],
        "skipped_steps": s.skipped_steps,
        "tokens": s.tokens,
        "loop_seconds": held["loop_seconds"],
        "train_stage_seconds": train_seconds,
        "trainable": held["trainable"],
        "trainable_params": held["trainable"]["delta_entries"] + held["trainable"]["router_params"],
        "state_bytes": held["state_bytes"],
        "reselections": [r.model_dump() for r in s.reselections],
        "frozen_entries": s.frozen_entries,
        "prefix_cache": [s.prefix_cache_hits, s.prefix_cache_misses],
        "routing_warnings": s.routing_warnings,
        "change_expert_entries": change.expert_entries,
        "learning_rates": {
            "deltas": None if router_only else s.lr,
            "deltas_source": s.lr_source,
            "router": router_lr if spec["router"] else None,
        },  # fmt: skip
    }


def usaf_state_bytes(trainer) -> dict:
    """Trainable + optimizer-state bytes of a usaf run, read from the live objects after training."""
    engine = trainer.engine
    deltas = engine.deltas().values()
    out = {
        "delta_values_fp32": tensor_bytes(d.values for d in deltas),
        "delta_indices_int64": tensor_bytes(d.indices for d in deltas),
        "frozen_record": tensor_bytes(t for w in engine.weights.values() for t in (w.frozen_indices, w.frozen_values)),
        "routers_fp32": tensor_bytes(engine.routers.values()),
        "optimizer_state": trainer.optimizer.state_bytes(),
    }
    out["total"] = sum(out.values())
    return out


def _dense_child(spec: dict) -> dict:
    """LoRA or full fine-tuning of the original weights (fp32), same data order, schedule and clipping as usaf."""
    from usaf.data.batches import collate
    from usaf.data.dataset import TokenDataset
    from usaf.engine.schedule import WarmupCosine

    torch.manual_seed(spec["seed"])  # LoRA's A init
    src = Path(spec["src"])
    if spec["kind"] == "lora":
        model, params, info = lora_model(src, spec["layers"], *spec["lora_ranks"])
    else:
        model = load_reference(src)
        params, info = list(model.parameters()), {"trainable_params": sum(p.numel() for p in model.parameters())}
    model.train()
    optimizer = torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.0, fused=True)
    steps = spec["steps"]
    schedule = WarmupCosine(int(WARMUP_FRACTION * steps), steps)  # usaf train's schedule
    data = TokenDataset(Path(spec["tokens"]) / "train.jsonl", vocab_size=model.config.vocab_size)
    losses, seconds, tokens = [], [], 0
    loop_start = time.perf_counter()
    for step in range(steps):
        start = time.perf_counter()
        batch = collate(data.samples_for_step(step, MICROBATCH, spec["seed"]), 0)  # usaf train's data order
        schedule.apply(optimizer, step)
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        logits = logits[:, :-1].float()
        targets = batch.labels[:, 1:]
        n = int((targets != -100).sum())
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                               reduction="sum") / n  # fmt: skip
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        tokens += batch.tokens
    loop_seconds = time.perf_counter() - loop_start
    state = {"params_fp32": tensor_bytes(params), "adamw_state": adamw_state_bytes(optimizer)}
    state["total"] = sum(state.values())
    info.pop("target_modules", None)
    info.pop("target_parameters", None)
    return {
        "model": model,
        "losses": losses,
        "step_seconds": seconds,
        "skipped_steps": 0,
        "tokens": tokens,
        "loop_seconds": loop_seconds,
        "trainable_params": info["trainable_params"],
        "trainable": info,
        "state_bytes": state,
        "learning_rates": {"all": spec["lr"]},
    }


def plan_key(arm: str, seed: int) -> tuple:
    """``(seed, frac, train_from, targets, lr_test)``: arms with equal keys share a plan. The lr test runs where the
    deltas take the plan's lr: no frac (the defaults' rule), or an arm that asks (``"lr_test"``)."""
    a = ARMS[arm]
    lr_test = a["frac"] is None or a.get("lr_test", False)
    return seed, a["frac"], a.get("train_from"), a.get("targets", "experts"), lr_test


def run_arm(env: dict, arm: str, lr: float, seed: int, plan, work: Path, cfg: dict) -> dict:
    a = ARMS[arm]
    spec = {
        "kind": a["kind"],
        "lr": lr,
        "seed": seed,
        "steps": cfg["steps"],
        "threads": torch.get_num_threads(),
        "src": str(env["q4_base"] if a.get("base") == "hqq4" else env["src"]),
        "qdir": str(env["qdir"]),
        "tokens": str(env["tokens"]),
        "eval": {k: str(v) for k, v in env["eval"].items() if cfg["validation"] or k != "indomain_validation"},
    }
    if a["kind"] in ("usaf", "router_only"):
        spec["plan"] = str(plan(plan_key(arm, seed)))
        spec["run_dir"] = str(work / "runs" / f"{arm}-lr{lr:g}-seed{seed}")
        spec["reselect_every"] = cfg["reselect_every"] if a["reselect"] else 0
        spec["router"] = a["router"]
        spec["swept"] = a.get("swept", "lr")
    else:
        spec["layers"] = cfg["layers"]
        spec["lora_ranks"] = cfg["lora_experts_ranks"] if a.get("experts_only") else cfg["lora_ranks"]
    spec_file = work / "specs" / f"{arm}-lr{lr:g}-seed{seed}.json"
    spec_file.parent.mkdir(exist_ok=True)
    spec_file.write_text(json.dumps(spec))
    start = time.perf_counter()
    out = wrapped([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_file)])
    result = json.loads(out["stdout"].strip().splitlines()[-1])
    result["wrapper_maxrss_mib"] = out["maxrss_kib"] / 1024
    result["wall_seconds"] = time.perf_counter() - start
    result.update(arm=arm, lr=lr, seed=seed)
    n = max(1, round(LAST_N * len(result["losses"])))
    result["final_train_loss"] = statistics.fmean(result["losses"][-n:])
    result["first_train_loss"] = result["losses"][0]
    result["median_step_seconds"] = statistics.median(result["step_seconds"])
    # Kept compact: the loss curve as means over windows of CURVE_WINDOW steps, step times as statistics.
    losses, secs = result.pop("losses"), result.pop("step_seconds")
    result["loss_curve"] = [round(statistics.fmean(losses[i : i + CURVE_WINDOW]), 4)
                            for i in range(0, len(losses), CURVE_WINDOW)]  # fmt: skip
    result["step_seconds"] = {"mean": statistics.fmean(secs), "p90": sorted(secs)[int(0.9 * (len(secs) - 1))]}
    ev = result["eval"]
    print(f"[{arm} lr {lr:g} seed {seed}] {result['wall_seconds']:.0f}s: train {result['final_train_loss']:.3f}, "
          f"ppl held-out {ev['indomain_heldout']['ppl']:.2f}"
          + (f", val {ev['indomain_validation']['ppl']:.2f}" if "indomain_validation" in ev else "")
          + f", pretrain {ev['pretrain_heldout']['ppl']:.2f}; step {result['median_step_seconds'] * 1e3:.0f} ms",
          flush=True)  # fmt: skip
    return result


# -- the run ------------------------------------------------------------------------------------------------------


def sweep(run, arms: tuple[str, ...] = DEFAULT_ARMS) -> dict:
    """Seed 0 over each arm's grid (extended past an edge that wins); returns the chosen lr per arm.

    ``run(arm, lr, seed)`` returns one run's result.
    """
    chosen = {}
    for arm in arms:
        if GRIDS[arm] == [PLAN_LR]:  # not swept: the plan decides
            run(arm, PLAN_LR, 0)
            chosen[arm] = PLAN_LR
            continue
        tried = {lr: run(arm, lr, 0) for lr in sorted(GRIDS[arm])}
        for _ in range(MAX_EXTEND):
            best = min(tried, key=lambda x: tried[x]["eval"]["indomain_validation"]["ppl"])
            ordered = sorted(tried)
            if best == ordered[0]:
                lr = ordered[0] / (ordered[1] / ordered[0])
            elif best == ordered[-1]:
                lr = ordered[-1] * (ordered[-1] / ordered[-2])
            else:
                break
            lr = float(f"{lr:.3g}")
            tried[lr] = run(arm, lr, 0)
        chosen[arm] = min(tried, key=lambda x: tried[x]["eval"]["indomain_validation"]["ppl"])
        print(f"[sweep] {arm}: lr {chosen[arm]:g}", flush=True)
    return chosen


def aggregate(runs: list, chosen: dict, seeds: list[int]) -> dict:
    """Per arm at its chosen lr: mean, std, min, max over seeds; step time ratio to usaf per seed."""
    table = {}
    by = {(r["arm"], r["seed"]): r for r in runs if r["lr"] == chosen.get(r["arm"])}
    for arm in ARMS:
        rs = [by[(arm, s)] for s in seeds if (arm, s) in by]
        if not rs:
            continue
        row: dict = {"lr": chosen[arm], "seeds": [r["seed"] for r in rs], "trainable_params": rs[0]["trainable_params"]}
        sets = [k for k in rs[0]["eval"] if all(k in r["eval"] for r in rs)]  # validation: seed 0 only
        figures = {
            "final_train_loss": [r["final_train_loss"] for r in rs],
            "first_train_loss": [r["first_train_loss"] for r in rs],
            **{f"ppl_{k}": [r["eval"][k]["ppl"] for r in rs] for k in sets},
            "median_step_seconds": [r["median_step_seconds"] for r in rs],
            "loop_seconds": [r["loop_seconds"] for r in rs],
            "peak_rss_mib_after_training": [r["peak_rss_mib_after_training"] for r in rs],
            "rss_after_imports_mib": [r["rss_after_imports_mib"] for r in rs],
        }
        for key, values in figures.items():
            row[key] = _spread(values)
        ratios = [
            by[(arm, s)]["median_step_seconds"] / by[("usaf", s)]["median_step_seconds"]
            for s in seeds
            if (arm, s) in by and ("usaf", s) in by
        ]
        loop_ratios = [
            by[(arm, s)]["loop_seconds"] / by[("usaf", s)]["loop_seconds"]
            for s in seeds
            if (arm, s) in by and ("usaf", s) in by
        ]
        row["step_time_over_usaf"] = _spread(ratios) if ratios else None
        row["loop_time_over_usaf"] = _spread(loop_ratios) if loop_ratios else None
        row["state_bytes"] = rs[0]["state_bytes"]
        table[arm] = row
    return table


def sweep_table(runs: list) -> dict:
    """Seed 0's runs per arm and lr: validation / test / pretraining PPL and final train loss."""
    out: dict = {}
    for r in runs:
        if r["seed"] == 0 and "indomain_validation" in r["eval"]:
            out.setdefault(r["arm"], {})[f"{r['lr']:g}"] = {
                "ppl_validation": r["eval"]["indomain_validation"]["ppl"],
                "ppl_indomain_heldout": r["eval"]["indomain_heldout"]["ppl"],
                "ppl_indomain_train_sample": r["eval"]["indomain_train_sample"]["ppl"],
                "ppl_pretrain_heldout": r["eval"]["pretrain_heldout"]["ppl"],
                "final_train_loss": r["final_train_loss"],
            }
    return out


def _spread(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: seq 64, 6 steps, seed 0, no sweep")
    parser.add_argument("--steps", type=int, default=None, help=f"training steps per run [{STEPS}]")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="[0 1 2; 0 with --quick]")
    parser.add_argument("--no-sweep", action="store_true", help="each arm at its grid's middle lr, no sweep")
    parser.add_argument("--threads", type=int, default=1, help="torch threads here and in the children [1]")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="[benchmarks/results/evidence.json; evidence-DOMAIN.json for another --domain]",
    )
    parser.add_argument(
        "--domain",
        default="stdlib-net",
        choices=("stdlib-net", "torch-cpp"),
        help="the fine-tuning domain: usaf.demo.DEMO_DOMAIN or CPP_DOMAIN [stdlib-net]",
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        default=list(DEFAULT_ARMS),
        choices=list(ARMS),
        help="the arms to run, in order (usaf is always scored first: LoRA's size follows it) "
        f"[{' '.join(DEFAULT_ARMS)}]",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="the pretrained model to fine-tune [the demo model; benchmarks/models/evidence-large: the larger one]",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="score without --cache: each step runs the frozen prefix (cheaper than caching every training sequence "
        "for a short run on a larger model; cached and uncached losses agree to rounding, tested)",
    )
    parser.add_argument("--resume", action="store_true", help="reuse the runs already in --out (same settings)")
    parser.add_argument(
        "--reaggregate", type=Path, default=None, help="recompute the summary tables of a results file from its runs"
    )
    parser.add_argument(
        "--lora-match",
        default="usaf",
        choices=[a for a in ARMS if ARMS[a]["kind"] == "usaf"],
        help="the usaf arm whose trainable count LoRA's ranks match [usaf]",
    )
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        result = child(json.loads(args.child.read_text()))
        print(json.dumps(result))
        return
    if args.reaggregate is not None:
        r = json.loads(args.reaggregate.read_text())
        seeds = r["settings"]["seeds"]
        if "chosen_lr" not in r:  # a run stopped during the sweep
            sys.exit(f"{args.reaggregate}: no chosen learning rates (the sweep did not finish)")
        r["table"] = aggregate(r["runs"], r["chosen_lr"], seeds)
        r["sweep"] = sweep_table(r["runs"]) if r["settings"]["sweep"] else None
        args.reaggregate.write_text(json.dumps(r, indent=1) + "\n")
        if "total_seconds" in r:
            print_summary(r)
        return
    torch.set_num_threads(args.threads)
    import peft

    quick = args.quick
    seeds = args.seeds or ([0] if quick else [0, 1, 2])
    do_sweep = not (quick or args.no_sweep)
    cfg = {
        "steps": args.steps or (STEPS_QUICK if quick else STEPS),
        "reselect_every": RESELECT_EVERY_QUICK if quick else RESELECT_EVERY,
        "validation": do_sweep,
    }
    seq = SEQ_QUICK if quick else SEQ
    eval_n = EVAL_SEQUENCES_QUICK if quick else EVAL_SEQUENCES
    arms = tuple(args.arms)
    stem = "evidence" if args.domain == "stdlib-net" else f"evidence-{args.domain}"
    out = args.out or RESULTS / (f"{stem}-quick.json" if quick else f"{stem}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    result: dict = {
        "machine": {**machine(), "peft": peft.__version__},
        "usaf_commit": git_commit(),
        "command": " ".join(["python", *sys.argv]),
        "quick": quick,
        "settings": {
            **cfg,
            "seq_len": seq,
            "microbatch": MICROBATCH,
            "tokens_per_step": MICROBATCH * seq,
            "seeds": seeds,
            "domain": args.domain,
            "sweep": do_sweep,
            "grids": GRIDS,
            "max_extend": MAX_EXTEND,
            "warmup_fraction": WARMUP_FRACTION,
            "clip": CLIP,
            "weight_decay": 0.0,
            "eval_sequences": eval_n,
            "last_n_fraction": LAST_N,
            "arms": {arm: ARMS[arm] for arm in arms},
            "lora_match": args.lora_match,
            "lora_alpha": LORA_ALPHA,
            **({"model": str(args.model)} if args.model is not None else {}),  # the demo model's files omit it
            **({"prefix_cache": False} if args.no_cache else {}),
        },
    }
    # --resume: runs already in --out with the same settings are reused (every run is deterministic at a fixed
    # thread count: the same seed gives the same numbers), the rest are run.
    done: dict = {}
    invocations = []
    if args.resume and out.is_file():
        previous = json.loads(out.read_text())
        if previous.get("settings") != json.loads(json.dumps(result["settings"])):
            sys.exit(f"--resume: {out} was made with other settings; pass another --out or drop --resume")
        done = {(r["arm"], r["lr"], r["seed"]): r for r in previous["runs"]}
        invocations = previous.get("invocations") or [
            {"command": previous["command"], "date": previous["machine"]["date"], "load_average_1min": None}
        ]
        for r in previous["runs"]:
            r.setdefault("invocation", 0)
        print(f"[resume] {len(done)} runs reused from {out}", flush=True)
    invocations.append(
        {"command": result["command"], "date": result["machine"]["date"], "load_average_1min": load_start}
    )
    result["invocations"] = invocations
    runs: list = list(done.values())
    result["runs"] = runs

    def save():
        result["seconds_so_far"] = time.perf_counter() - started
        out.write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="usaf-bench-evidence-") as tmp:
        work = Path(tmp)
        env = setup(work, seq, eval_n, args.domain, args.model)
        result["setup"] = env["info"]
        result["bases"] = evaluate_bases(env)
        print("[bases] " + json.dumps({k: {s: round(v["ppl"], 2) for s, v in b.items()}
                                       for k, b in result["bases"].items()}), flush=True)  # fmt: skip
        plans: dict = {}
        result["plans"] = previous["plans"] if done else {}

        def plan(key: tuple) -> Path:  # scored when first needed
            if key not in plans:
                seed, frac, train_from, targets, lr_test = key
                plans[key], result["plans"][plan_label(*key)] = make_plan(
                    env,
                    work,
                    seed,
                    frac,
                    train_from,
                    cache=not (quick or args.no_cache) and train_from != 0,
                    calib=8 if quick else 64,
                    targets=targets,
                    lr_test=lr_test,
                )
            return plans[key]

        def run(arm: str, lr: float, seed: int) -> dict:
            if (arm, lr, seed) in done:
                return done[(arm, lr, seed)]
            r = run_arm(env, arm, lr, seed, plan, work, cfg)
            r["invocation"] = len(invocations) - 1
            runs.append(r)
            save()
            return r

        # LoRA's ranks: the pair whose trainable count is closest to the default usaf arm's (expert entries +
        # router weights), on the same layers.
        if done:
            cfg["layers"], cfg["lora_ranks"] = previous["lora"]["layers"], previous["lora"]["ranks_experts_attention"]
            result["lora"] = previous["lora"]
        else:
            plan(plan_key(args.lora_match, seeds[0]))
            first = result["plans"][plan_label(*plan_key(args.lora_match, seeds[0]))]
            cfg["layers"] = first["trainable_layers"]
            target = first["expert_entries"] + first["router_params"]
            per_rank = lora_counts_per_rank(env["src"], cfg["layers"])
            cfg["lora_ranks"] = list(lora_ranks(target, *per_rank))
            result["lora"] = {"layers": cfg["layers"], "ranks_experts_attention": cfg["lora_ranks"],
                              "usaf_target": target, "per_rank_experts_attention": list(per_rank)}  # fmt: skip
        # LoRA on the experts only: the expert rank whose count is closest to the same target
        lora = result["lora"]
        expert_rank = max(1, round(lora["usaf_target"] / lora["per_rank_experts_attention"][0]))
        cfg["lora_experts_ranks"] = [expert_rank, 0]
        lora["ranks_experts_only"] = cfg["lora_experts_ranks"]
        save()
        if do_sweep:
            chosen = sweep(run, arms)
            cfg["validation"] = False  # the validation sample is only for choosing the lr
        else:
            chosen = {arm: sorted(GRIDS[arm])[len(GRIDS[arm]) // 2] for arm in arms}
        result["chosen_lr"] = chosen
        for i, seed in enumerate(seeds):
            if do_sweep and seed == 0:
                continue  # seed 0 ran in the sweep
            order = list(arms) if i % 2 == 0 else list(reversed(arms))  # interleave arm order across seeds
            for arm in order:
                run(arm, chosen[arm], seed)
    result["table"] = aggregate(runs, chosen, seeds)
    result["sweep"] = sweep_table(runs) if do_sweep else None
    result["total_seconds"] = time.perf_counter() - started
    result["load_average_1min"] = {"start": load_start, "end": os.getloadavg()[0]}
    save()
    print_summary(result)
    print(f"wrote {out}")


def print_summary(r: dict) -> None:
    b = r["bases"]
    print(f"\nmachine: {r['machine']['summary']}")
    for name, base in b.items():
        print(f"  base {name:14s} " + "  ".join(f"{k} {v['ppl']:.2f}" for k, v in base.items()))
    print(f"{'arm':16s} {'lr':>7s} {'params':>9s} {'train loss':>12s} {'held-out':>14s} {'train-sample':>14s} "
          f"{'pretrain':>14s} {'step/usaf':>9s} {'state KiB':>10s} {'RSS MiB':>8s}")  # fmt: skip
    for arm, row in r["table"].items():

        def f(key, row=row):
            v = row[key]
            return f"{v['mean']:.3f}±{v['std']:.3f}" if key == "final_train_loss" else f"{v['mean']:.2f}±{v['std']:.2f}"

        ratio = row["step_time_over_usaf"]
        print(f"{arm:16s} {row['lr']:7.0e} {row['trainable_params']:9,d} {f('final_train_loss'):>12s} "
              f"{f('ppl_indomain_heldout'):>14s} {f('ppl_indomain_train_sample'):>14s} "
              f"{f('ppl_pretrain_heldout'):>14s} "
              f"{ratio['mean'] if ratio else float('nan'):9.2f} {row['state_bytes']['total'] / 1024:10.1f} "
              f"{row['peak_rss_mib_after_training']['mean']:8.0f}")  # fmt: skip
    load = r["load_average_1min"]
    print(f"total {r['total_seconds']:.0f} s; 1-min load average {load['start']:.1f} → {load['end']:.1f}")


if __name__ == "__main__":
    main()
