"""Benchmark: `usaf train` on CPU: tokens/s against full fine-tuning and LoRA, peak RSS, reselection cost.

Workload: ``bench_engine.py``'s CPU-sized MoE (a random-init Qwen3-MoE: 8 layers, hidden 512, 32 experts,
top-4, expert width 256), built with its tiny tokenizer (vocab 512) and quantized by
``usaf.stages.quantize.run(method="rtn")`` (4-bit, group 128). Data: real text, the sources of a few
Python standard-library packages, tokenized by ``usaf.stages.tokenize.run`` at seq_len 256. The plan is
``usaf.stages.score.run`` at frac 0.005 on the top 2 layers (routers on) with ``cache=True``, so it holds
every training sequence's frozen-prefix state, as ``usaf score --cache`` writes it. Microbatch 2 x 256.
Every figure is measured side by side in this one run.

1. **throughput**: one optimizer step on the same batch in every arm, arms interleaved (each timed step after an
   untimed one of the same arm, so no arm is timed right after another's; ``--no-settle``: without it), medians:
   ``Trainer.step()`` built by the train stage itself (``usaf.stages.train.run`` up to its loop), with the
   prefix cache served by the plan's store (every lookup a hit), as a first epoch without that store runs (a fresh,
   empty cache, then the steps of one first-epoch company, the first computing the company's prefix states, their
   mean per step; once with the frozen layers dequantized per forward, once with them dequantized once, as
   ``usaf train`` does when some prefix must be computed and they fit), and without the cache (all 8 layers); full
   fine-tuning
   (transformers ``from_pretrained`` of the unquantized source, fp32, ``AdamW(fused=True)`` over every
   parameter); LoRA (peft) on the same transformers model: attention projections (``target_modules``)
   and the fused experts (``target_parameters``), on the top 2 layers at the ranks whose trainable count
   is closest to usaf's (expert entries + router weights), and on all 8 layers at the same ranks; QLoRA: the
   top-2 LoRA over the same model with every decoder weight held as 4-bit codes and dequantized on every
   forward (``qlora_base.py``: usaf's format, rtn group 128; checked against a dequantized copy).
   Gradient clipping at 1.0 everywhere. Trainable + optimizer-state bytes are read from the live objects.
2. **rss**: peak RSS of the real CLI, ``python -m usaf train ... --steps N --reselect-every K``, in a fresh
   child started by a small wrapper process (see ``bench_engine.py`` for why), versus (a) the memory plan
   the stage prints before its first step plus the RSS of a fresh process after the CLI's imports, and
   (b) the engine's accounting after the same run (activations measured), read in a replica: the stage
   function ``usaf.stages.train.run`` in another fresh child, instrumented.
3. **reselection**: at frac 0.005 on the top 2 layers, with the prefix cache: plain steps against steps
   with the score sinks installed (the ``SCORE_BATCHES`` steps before a reselection), interleaved pairs on
   the same batch, and one ``reselect(...)`` after those steps, each as a ratio to a plain step.

    python benchmarks/bench_train.py [--repeats 9] [--threads 1] [--profile] [--quick] [--experts 32|64|128]
                                     [--microbatch 2] [--top 2] [--no-rss] [--out benchmarks/results/train.json]

``--experts 64`` / ``128``: the same depth and hidden size at Qwen3-30B-A3B's expert ratios (experts of width 192,
top-8); results default to ``train-e64.json`` / ``train-e128.json``. ``--microbatch`` (sequences of 256 tokens per
step) and ``--top`` (trainable layers) change the workload for every arm (how the ratios grow with the tokens per
step and the trained depth; LoRA's ranks are matched to usaf's count again); results default to ``train-mb4.json``,
``train-e128-top4.json`` and so on.

Needs peft (``pip install 'usaf[bench]'``) for the LoRA arms.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import (  # noqa: E402
    FRAC,
    MODEL,
    MODEL_QUICK,
    RESULTS,
    TOP,
    adamw_state_bytes,
    current_rss,
    load_reference,
    machine,
    malloc_trim,
    profile_step,
    tensor_bytes,
    token_loss,
)
from qlora_base import check_adapters, check_base, quantize_base  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SEQ, SEQ_QUICK = 256, 64
MICROBATCH = 2
PACKAGES = ("json", "tomllib")  # real text: 72 kB of stdlib sources (about 140 sequences of 256 tokens)
PACKAGES_QUICK = ("tomllib",)
CALIB, CALIB_QUICK = 64, 16
STEPS_PLANNED = 1000  # the captured trainers' schedule length (warmup only; it does not change the arithmetic)
WARMUP = 2  # untimed steps per arm
RSS_STEPS, RSS_RESELECT = 30, 10  # the CLI run: reselections at steps 10 and 20, 4 scoring steps before each
RSS_STEPS_QUICK, RSS_RESELECT_QUICK = 12, 6
RESELECT_AT, RESELECT_OF = 50, 1000  # figure 3's fraction: update_fraction(50, 1000, 0.2), the default cycle
LORA_ALPHA = 16  # does not change timing or bytes
QLORA_GROUP = 128  # the QLoRA arm's base: usaf's artifact format (rtn 4-bit, group 128), so the arms differ in method
# The CLI's imports in a fresh process: the RSS baseline of the accounting.
BASELINE_CHILD = (
    "import usaf.cli.app, usaf.cli.train, usaf.stages.train, usaf.stages.train.trainer, usaf.stages.score\n"
    "import usaf.engine.engine, usaf.engine.loading, usaf.engine.reselect, usaf.engine.prefix\n"
    "import usaf.data.tokenizer, usaf.data.dataset, usaf.backends, safetensors.torch\n"
    "import transformers.models.qwen3_moe.modeling_qwen3_moe\n"
    "import psutil\n"
    "print(psutil.Process().memory_info().rss / 2**20)\n"
)
# Runs argv with its output captured, then reports the child's ru_maxrss: a small process, so the
# child's figure does not inherit a large parent's high-water mark (see bench_engine.py).
WRAPPER = (
    "import json, resource, subprocess, sys\n"
    "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
    "print(json.dumps({'rc': p.returncode, 'stdout': p.stdout[-20000:], 'stderr': p.stderr[-20000:],\n"
    "                  'maxrss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))\n"
)


def require_peft():
    try:
        import peft
    except ImportError:
        sys.exit(
            "bench_train.py needs peft for its LoRA arms, and it is not installed.\n"
            "Install it with: pip install 'usaf[bench]'   (or: pip install 'peft>=0.17')"
        )
    return peft


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    env["COLUMNS"] = "2000"  # rich wraps notes at the terminal width; the plan line is parsed whole
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # children compute with the parent's thread count
    return env


def git_commit() -> str | None:
    p = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return p.stdout.strip() or None


# -- setup ---------------------------------------------------------------------------------------------------


def build(
    work: Path, widths: dict, seq: int, calib: int, packages: tuple[str, ...]
) -> tuple[Path, Path, Path, Path, dict]:
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize
    from usaf.stages.score import ScoreConfig
    from usaf.stages.score import run as score
    from usaf.stages.tokenize import TokenizeConfig
    from usaf.stages.tokenize import run as tokenize
    from usaf.testing import build_tiny_model

    t0 = time.perf_counter()
    kwargs = {k: v for k, v in widths.items() if k != "num_layers"}
    src = build_tiny_model("qwen3_moe", work / "src", num_layers=widths["num_layers"], tokenizer=True, **kwargs)
    qmanifest, qdir = quantize(QuantizeConfig(model=str(src), out=work / "q4", method="rtn"))
    t1 = time.perf_counter()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    inputs = [stdlib / p for p in packages]
    tmanifest, tdir = tokenize(TokenizeConfig(inputs=inputs, model=str(qdir), seq_len=seq, out=work / "tokens"))
    t2 = time.perf_counter()
    settings = ScoreConfig(
        model=qdir,
        data=tdir,
        out=work / "plan",
        frac=FRAC,
        calib_samples=calib,
        microbatch=MICROBATCH,
        train_from=widths["num_layers"] - TOP,  # the top TOP layers (the stage's default is the top quarter)
        stability=False,
        cache=True,
        device="cpu",
    )
    pmanifest, plan = score(settings)
    t3 = time.perf_counter()
    summary = tmanifest.summary.model_dump(mode="json")
    info = {
        "build_and_quantize_seconds": t1 - t0,
        "tokenize_seconds": t2 - t1,
        "score_with_cache_seconds": t3 - t2,
        "quantize_mean_rel_error": qmanifest.summary.mean_rel_error,
        "inputs": [str(p) for p in inputs],
        "tokens_summary": {k: v for k, v in summary.items() if k not in ("sources", "tokenizer")},
        "plan": {
            "trainable_layers": pmanifest.summary.trainable_layers,
            "expert_entries": pmanifest.summary.expert_entries,
            "router_params": pmanifest.summary.router_params,
            "calib_samples": pmanifest.summary.calib_samples,
            "prefix_store_bytes": sum(f.stat().st_size for f in plan.glob("prefix_states*")),
        },
    }
    print(f"[setup] model {t1 - t0:.1f}s, tokens {t2 - t1:.1f}s, score --cache {t3 - t2:.1f}s", flush=True)
    return src, qdir, tdir, plan, info


class _Captured(Exception):
    pass


def stage_trainer(qdir: Path, tdir: Path, plan: Path, run_dir: Path, dense_router_grad: bool = False):
    """The Trainer exactly as ``usaf.stages.train.run`` builds it (the stage is stopped at its loop)."""
    from usaf.stages import train as train_stage
    from usaf.stages.progress import NullProgress
    from usaf.stages.train import loop as train_loop

    progress = NullProgress()
    holder = {}

    def capture(trainer, steps, progress):
        holder["trainer"] = trainer
        raise _Captured

    config = train_stage.TrainConfig(
        model=qdir,
        data=tdir,
        plan=plan,
        out=run_dir,
        steps=STEPS_PLANNED,
        reselect_every=0,  # figure 3 drives the reselection itself
        microbatch=MICROBATCH,
        save_every=0,
        device="cpu",
        dtype="float32",
        dense_router_grad=dense_router_grad,
    )
    with mock.patch.object(train_loop, "run_loop", capture), contextlib.suppress(_Captured):
        train_stage.run(config, progress=progress)
    return holder["trainer"], progress.notes


# -- 1. throughput ------------------------------------------------------------------------------------------------


def lora_ranks(target: int, expert_per_rank: int, attention_per_rank: int) -> tuple[int, int]:
    """(expert rank, attention rank) whose trainable count is closest to ``target`` (ties: equal ranks)."""
    best = None
    for re_ in range(1, 17):
        for ra in range(1, 129):
            count = re_ * expert_per_rank + ra * attention_per_rank
            key = (abs(count - target), abs(re_ - ra))
            if best is None or key < best[0]:
                best = (key, (re_, ra))
    return best[1]


def lora_model(src: Path, layers: list[int], expert_rank: int, attention_rank: int, *, four_bit: bool = False):
    """LoRA on the layers' fused experts (``target_parameters``) and, unless ``attention_rank`` is 0, q/k/v/o.

    ``four_bit``: QLoRA: the same LoRA over a base whose decoder weights are 4-bit codes dequantized on every
    forward (``qlora_base``; usaf's artifact format, rtn group 128), checked against the source and against a
    copy holding the dequantized weights.
    """
    from peft import LoraConfig, get_peft_model

    model = load_reference(src)
    probe = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    base_check = None
    start = time.perf_counter()
    if four_bit:
        quantize_base(model, group_size=QLORA_GROUP)
        base_check = {"quantize_seconds": time.perf_counter() - start}
        base_check.update(check_base(model, load_reference(src), probe))
    setup = time.perf_counter() - start
    experts = [f"model.layers.{i}.mlp.experts.{p}" for i in layers for p in ("gate_up_proj", "down_proj")]
    attention = [f"model.layers.{i}.self_attn.{p}" for i in layers for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    attention = attention if attention_rank > 0 else []
    config = LoraConfig(
        r=expert_rank,
        lora_alpha=LORA_ALPHA,
        target_modules=attention,
        target_parameters=experts,
        rank_pattern={p: attention_rank for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    )
    peft_model = get_peft_model(model, config)
    peft_model.train()
    start = time.perf_counter()
    check_adapters(peft_model, probe)
    setup += time.perf_counter() - start
    params = [p for p in peft_model.parameters() if p.requires_grad]
    expert_params = sum(p.numel() for n, p in peft_model.named_parameters() if p.requires_grad and ".experts." in n)
    info = {
        "layers": layers,
        "expert_rank": expert_rank,
        "attention_rank": attention_rank,
        "target_modules": attention,
        "target_parameters": experts,
        "trainable_params": sum(p.numel() for p in params),
        "trainable_expert_params": expert_params,
        "trainable_attention_params": sum(p.numel() for p in params) - expert_params,
        # quantizing the base and the checks: not a cost of training (usaf's are not timed either); callers
        # that time the whole arm subtract it
        "setup_seconds": setup,
    }
    if base_check is not None:
        info["base"] = {"kind": "4-bit codes dequantized per forward (qlora_base.py)", "method": "rtn",
                        "group_size": QLORA_GROUP, **base_check}  # fmt: skip
    return peft_model, params, info


def lora_counts_per_rank(src: Path, layers: list[int]) -> tuple[int, int]:
    """Trainable LoRA parameters per unit of rank, for the experts and for attention, from the model's shapes."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(src)
    h, i, e = c.hidden_size, c.moe_intermediate_size, c.num_experts
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    experts = e * (h + 2 * i) + e * (i + h)  # lora_A (r E, in) + lora_B (out, r E), gate_up then down
    attention = (h + q) + 2 * (h + kv) + (q + h)  # q, k, v, o
    return experts * len(layers), attention * len(layers)


def dense_step(model, params, optimizer, batch) -> float:
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    token_loss(logits, batch.labels).backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)  # as SparseAdamW(max_grad_norm=1.0)
    optimizer.step()
    return time.perf_counter() - start


def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """``aten._grouped_mm``, which torch's counter lacks: 2 x rows x inner x columns over all groups."""
    if len(a_shape) == 3 and len(b_shape) == 3:  # (G, M, K) x (G, K, N): a batched matmul
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 3:  # (M, K) x (G, K, N), rows split by offsets
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (K, M) x (M, N) -> (G, K, N), M split: a weight gradient
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * b_shape[0] * b_shape[1] * a_shape[1]  # (G, M, K) x (K_total, N)


def step_flops(arms: dict, step: int) -> dict[str, float]:
    """GEMM and attention GFLOP of one more step of each arm (torch's FLOP counter; not timed): what each arm
    computes, so a speed ratio can be read against the arithmetic. Gathers, scatters and elementwise work are not
    counted (usaf's sparse delta terms and its SDDMM among them)."""
    from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

    with contextlib.suppress(RuntimeError):  # already registered (a second call in one process)
        register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)
    result = {}
    for name, fn in arms.items():
        with FlopCounterMode(display=False) as counter:
            fn(step)
        result[name] = counter.get_total_flops() / 1e9 / getattr(fn, "steps_per_call", 1)
    return result


def trainer_step(trainer, step: int) -> float:
    """One ``Trainer.step()`` on the batch of global step ``step`` (the same batch every arm uses)."""
    trainer.state.step = step
    start = time.perf_counter()
    record = trainer.step()
    trainer.log(record)
    seconds = time.perf_counter() - start
    if record["skipped"]:
        raise RuntimeError(f"Trainer skipped step {step}")
    return seconds


def interleave(arms: dict, steps: list[int], label: str, settle: bool = True) -> dict[str, list[float]]:
    """``WARMUP`` untimed steps per arm (steps[:WARMUP]), then rounds over the rest, arms in turn.

    ``settle``: each timed step follows an untimed step of the same arm on the same batch, so an arm is timed as a
    run of it goes, one step after another, not right after another arm's. Without it the LoRA arms at 128 experts
    took 1.5-2.8× longer in the rounds where they followed full fine-tuning than where they followed QLoRA, and a
    median of 5 took a slow round (BENCHMARKS.md, "How the step ratios grow").
    """
    for fn in arms.values():
        for s in steps[:WARMUP]:
            fn(s)
    times: dict[str, list[float]] = {k: [] for k in arms}
    for i, s in enumerate(steps[WARMUP:]):
        order = list(arms) if i % 2 == 0 else list(reversed(arms))  # A B C, then C B A
        for key in order:
            if settle:
                arms[key](s)
            times[key].append(arms[key](s))
        print(f"[{label}] round {i}: " + "  ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), flush=True)
    return times


def throughput(
    src: Path,
    qdir: Path,
    tdir: Path,
    plan: Path,
    work: Path,
    repeats: int,
    dense_router_grad: bool = False,
    settle: bool = True,
) -> tuple[dict, dict]:
    """Figure 1; ``dense_router_grad``: also a prefix-hit step with ``--dense-router-grad`` (its cost); ``settle``:
    :func:`interleave`'s."""
    from usaf.backends import resolve_backend
    from usaf.engine.prefix import PrefixCache
    from usaf.stages.engine_setup import make_resident

    hit, plan_notes = stage_trainer(qdir, tdir, plan, work / "run-hit")
    miss, _ = stage_trainer(qdir, tdir, plan, work / "run-miss")
    miss_resident, _ = stage_trainer(qdir, tdir, plan, work / "run-miss-resident")
    # What usaf train does when the plan has no prefix store and the frozen layers fit: dequantized once.
    engine = miss_resident.engine
    frozen = [layer for layer in engine.loaded.experts if layer not in engine.trainable_layers]
    make_resident(engine.loaded, resolve_backend("cpu"), True, frozen)
    plain, _ = stage_trainer(qdir, tdir, plan, work / "run-plain")
    plain.prefix = None  # all 8 layers every step (what training from layer 0 does)
    fingerprint = miss.prefix[1]
    miss_caches = []

    def first_epoch(trainer):
        """A first-epoch step as ``usaf train`` runs it without the plan's store, per step: a fresh cache, then
        every step of the company of ``step``'s microbatch (usaf.stages.train.companies, 4 sequences of 256 at
        microbatch 2), the first computing the whole company's prefix states and the others reading them; their
        mean. (Until 2026-12-05 a company was one microbatch and this arm timed that one step, every sample a miss;
        a step that computes its company's states alone would now count the next step's prefix work in its time.)"""
        per_company = max(1, trainer.companies.size // MICROBATCH)  # steps whose microbatches form one company

        def step_fn(step: int) -> float:
            trainer.prefix = (PrefixCache(2**31, None), fingerprint)
            miss_caches.append(trainer.prefix[0])
            first = step - step % per_company
            return statistics.fmean(trainer_step(trainer, s) for s in range(first, first + per_company))

        step_fn.steps_per_call = per_company  # step_flops: FLOPs per step, not per call
        return step_fn

    layers = list(hit.engine.trainable_layers)
    counts = hit.engine.trainable_count()
    usaf_trainable = counts["delta_entries"] + counts["router_params"]
    per_rank = lora_counts_per_rank(src, layers)
    expert_rank, attention_rank = lora_ranks(usaf_trainable, *per_rank)
    lora_top, lora_top_params, lora_top_info = lora_model(src, layers, expert_rank, attention_rank)
    qlora_top, qlora_top_params, qlora_top_info = lora_model(src, layers, expert_rank, attention_rank, four_bit=True)
    all_layers = list(hit.engine.spec.moe_layers)
    lora_all, lora_all_params, lora_all_info = lora_model(src, all_layers, expert_rank, attention_rank)
    if lora_top_info["trainable_params"] != per_rank[0] * expert_rank + per_rank[1] * attention_rank:
        raise RuntimeError(f"LoRA count {lora_top_info['trainable_params']} differs from the shape arithmetic")
    full = load_reference(src)
    full.train()
    full_params = list(full.parameters())
    # fused=True is torch's fastest CPU AdamW (bench_engine.py: 1.65 times faster here): the stronger baseline.
    full_opt = torch.optim.AdamW(full_params, lr=1e-4, fused=True)
    lora_top_opt = torch.optim.AdamW(lora_top_params, lr=1e-4, fused=True)
    qlora_top_opt = torch.optim.AdamW(qlora_top_params, lr=1e-4, fused=True)
    lora_all_opt = torch.optim.AdamW(lora_all_params, lr=1e-4, fused=True)
    batches = {}

    def batch(step: int):
        if step not in batches:
            (batches[step],) = hit._microbatches(step)  # grad_accum 1: one microbatch per step
        return batches[step]

    steps = list(range(WARMUP + repeats))
    arms = {
        "usaf_prefix_hit": lambda s: trainer_step(hit, s),
        "usaf_first_epoch": first_epoch(miss),
        "usaf_first_epoch_frozen_resident": first_epoch(miss_resident),
        "usaf_no_prefix": lambda s: trainer_step(plain, s),
        "full_finetune": lambda s: dense_step(full, full_params, full_opt, batch(s)),
        "lora_top": lambda s: dense_step(lora_top, lora_top_params, lora_top_opt, batch(s)),
        "qlora_top": lambda s: dense_step(qlora_top, qlora_top_params, qlora_top_opt, batch(s)),
        "lora_all_layers": lambda s: dense_step(lora_all, lora_all_params, lora_all_opt, batch(s)),
    }
    if dense_router_grad:
        hit_dense, _ = stage_trainer(qdir, tdir, plan, work / "run-hit-dense", dense_router_grad=True)
        arms["usaf_prefix_hit_dense_router_grad"] = lambda s: trainer_step(hit_dense, s)
    times = interleave(arms, steps, "step", settle)
    gflop = step_flops(arms, steps[-1])
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = [batch(s).tokens for s in steps[WARMUP:]]
    tokens_med = statistics.median(tokens)
    # tokens/s per arm: each round's tokens over its seconds, median over rounds (every arm saw the same batches).
    tps = {k: statistics.median(n / t for n, t in zip(tokens, v)) for k, v in times.items()}
    per_round = {
        f"{a}_over_{b}": [x / y for x, y in zip(times[b], times[a])]
        for a in ("usaf_prefix_hit", "usaf_no_prefix", "usaf_first_epoch", "usaf_first_epoch_frozen_resident")
        for b in ("full_finetune", "lora_top", "qlora_top", "lora_all_layers")
    }
    hits = {"hits": hit.prefix[0].hits, "misses": hit.prefix[0].misses}
    if hits["misses"]:
        raise RuntimeError(f"the plan's prefix store missed {hits['misses']} lookups")
    result = {
        "repeats": repeats,
        "warmup_steps_per_arm": WARMUP,
        "batch_steps": steps,
        "tokens_per_step": tokens,
        "median_tokens_per_step": tokens_med,
        "seconds": times,
        "median_seconds": med,
        "tokens_per_s": tps,
        # speed ratios (>1: usaf faster) = time ratios inverted, from the medians and per round
        "speed_ratio": {k: statistics.median(v) for k, v in per_round.items()},
        "speed_ratio_per_round": per_round,
        "gflop_per_step": gflop,  # GEMMs and attention only (step_flops)
        "gflop_per_second": {k: gflop[k] / med[k] for k in gflop},
        "prefix_store_lookups": hits,
        "first_epoch_lookups": {"hits": sum(c.hits for c in miss_caches), "misses": sum(c.misses for c in miss_caches)},
        "full_finetune": {
            "optimizer": "torch.optim.AdamW(fused=True), clip_grad_norm_ 1.0",
            "experts_implementation": full.config._experts_implementation,
        },
        "lora_top": lora_top_info,
        "qlora_top": qlora_top_info,
        "lora_all_layers": lora_all_info,
        "usaf": {
            "trainable_layers": layers,
            **counts,
            "trainable_total": usaf_trainable,
            "plan_note": next((n for n in plan_notes if n.startswith("training ")), None),
            "prefix_store_note": next((n for n in plan_notes if n.startswith("prefix states")), None),
        },
        "lora_top_over_usaf_trainable": lora_top_info["trainable_params"] / usaf_trainable,
    }
    result["bytes"] = state_bytes(
        hit, full_params, full_opt, lora_top_params, lora_top_opt, lora_all_params, lora_all_opt
    )
    return result, {"trainer": hit}


def state_bytes(trainer, full_params, full_opt, top_params, top_opt, all_params, all_opt) -> dict:
    """Trainable + optimizer-state bytes per arm, read from the live objects after the timed steps."""
    engine, optimizer = trainer.engine, trainer.optimizer
    deltas = engine.deltas().values()
    usaf = {
        "delta_values_fp32": tensor_bytes(d.values for d in deltas),
        "delta_indices_int64": tensor_bytes(d.indices for d in deltas),
        "routers_fp32": tensor_bytes(engine.routers.values()),
        "sparse_adamw_state": optimizer.state_bytes(),
    }
    usaf["total"] = sum(usaf.values())
    usaf["not_in_total"] = {
        "derived_index_buffers": tensor_bytes(t for d in deltas for t in (d.experts, d.rows, d.cols, d.offsets)),
        "grads": tensor_bytes(p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None),
        "router_anchors": optimizer.state_bytes(include_anchors=True) - optimizer.state_bytes(),
    }

    def dense(params, opt) -> dict:
        out = {"params_fp32": tensor_bytes(params), "adamw_state": adamw_state_bytes(opt)}
        out["total"] = out["params_fp32"] + out["adamw_state"]
        out["param_count"] = sum(p.numel() for p in params)
        out["not_in_total"] = {"grads": tensor_bytes(p.grad for p in params if p.grad is not None)}
        return out

    arms = {
        "usaf": usaf,
        "full_finetune": dense(full_params, full_opt),
        "lora_top": dense(top_params, top_opt),
        "lora_all_layers": dense(all_params, all_opt),
    }
    for key in ("full_finetune", "lora_top", "lora_all_layers"):
        arms[f"usaf_over_{key}"] = usaf["total"] / arms[key]["total"]
    return arms


# -- 3. reselection cost --------------------------------------------------------------------------------------------


def reselection(trainer, repeats: int, first_step: int, profile: bool = False) -> dict:
    from usaf.engine.reselect import collect_scores, reselect, update_fraction
    from usaf.stages.train.loop import SCORE_BATCHES

    engine = trainer.engine
    fraction = update_fraction(RESELECT_AT, RESELECT_OF, trainer.config.reselect_fraction)
    times: dict[str, list[float]] = {"plain_step": [], "collecting_step": [], "reselect": [], "collect_setup": []}
    reports = []
    step = first_step
    for r in range(repeats + 1):  # round 0 is a warm-up
        start = time.perf_counter()
        scores = collect_scores(engine)  # as run_loop does at the first step of the scoring window
        setup = time.perf_counter() - start
        sinks = {name: engine.weights[name].score_sink for name in scores}
        plain, collecting = [], []
        for j in range(SCORE_BATCHES):
            order = ("plain", "collect") if (r + j) % 2 == 0 else ("collect", "plain")
            for kind in order:  # the same batch (global step) for both kinds of step
                if kind == "plain":
                    for name in sinks:
                        engine.weights[name].score_sink = None
                    trainer.collector = None
                    plain.append(trainer_step(trainer, step))
                else:
                    for name, sink in sinks.items():
                        engine.weights[name].score_sink = sink
                    trainer.collector = scores
                    collecting.append(trainer_step(trainer, step))
            step += 1
        trainer.collector = None
        start = time.perf_counter()
        scores.close()  # as run_loop does: sinks off, accumulators readable
        report = reselect(engine, trainer.optimizer, scores, fraction)
        trainer.record_reselection(step, report)
        seconds = time.perf_counter() - start
        if r == 0:
            continue
        times["plain_step"] += plain
        times["collecting_step"] += collecting
        times["reselect"].append(seconds)
        times["collect_setup"].append(setup)
        reports.append(report.to_dict()["total"])
        print(
            f"[reselect] round {r}: plain {statistics.median(plain):.3f}s  collecting "
            f"{statistics.median(collecting):.3f}s  reselect {seconds:.3f}s",
            flush=True,
        )
    med = {k: statistics.median(v) for k, v in times.items()}
    pairs = [c / p for p, c in zip(times["plain_step"], times["collecting_step"])]
    every = 50  # the default --reselect-every
    extra = SCORE_BATCHES * (med["collecting_step"] - med["plain_step"]) + med["reselect"] + med["collect_setup"]
    result = {
        "repeats": repeats,
        "score_batches": SCORE_BATCHES,
        "fraction": fraction,
        "prefix_cache": "plan store (hits)",
        "seconds": times,
        "median_seconds": med,
        "ratio_collecting_over_plain_step": statistics.median(pairs),
        "ratio_collecting_over_plain_step_per_pair": pairs,
        "ratio_reselect_over_plain_step": med["reselect"] / med["plain_step"],
        "reselect_counts": reports,
        "accumulator_bytes": sum(a.nbytes for a in scores.values()),
        "cycle_overhead_at_reselect_every_50": extra / (every * med["plain_step"]),
    }
    if profile:  # where a collecting step's extra time goes: one plain and one collecting step, profiled
        result["profile"] = {"plain_step": profile_step(lambda: trainer_step(trainer, step))}
        with collect_scores(engine) as scores:
            trainer.collector = scores
            result["profile"]["collecting_step"] = profile_step(lambda: trainer_step(trainer, step))
            trainer.collector = None
    return result


# -- 2. peak RSS of `usaf train` versus its plan and the engine's accounting -----------------------------------------

_HUMAN = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def parse_plan_memory(line: str) -> dict[str, int]:
    """The ``memory:`` part of the stage's plan line, back to bytes (to the printed precision)."""
    part = line.split("memory:", 1)[1]
    out = {}
    for item in part.split(","):
        m = re.fullmatch(r"\s*(.+?) ([\d.]+) (B|KiB|MiB|GiB|TiB)\s*", item)
        if m:
            out[m.group(1).replace(" ", "_")] = int(float(m.group(2)) * _HUMAN[m.group(3)])
    return out


def wrapped(cmd: list[str]) -> dict:
    start = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True, env=child_env())
    if p.returncode != 0:
        raise RuntimeError(f"wrapper failed ({p.returncode}):\n{p.stderr[-4000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["wall_seconds"] = time.perf_counter() - start
    if out["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed ({out['rc']}):\n{out['stderr'][-4000:]}")
    return out


def cli_command(qdir: Path, tdir: Path, plan: Path, out: Path, steps: int, every: int) -> list[str]:
    cmd = [sys.executable, "-m", "usaf", "train", "--model", str(qdir), "--data", str(tdir), "--plan", str(plan)]
    cmd += ["--out", str(out), "--steps", str(steps), "--reselect-every", str(every)]
    cmd += ["--microbatch", str(MICROBATCH), "--save-every", "0", "--device", "cpu", "--dtype", "float32"]
    return cmd


def replica_child(qdir: Path, tdir: Path, plan: Path, out: Path, steps: int, every: int) -> dict:
    """Runs in a fresh child: the stage function as the CLI calls it, instrumented for the accounting."""
    import usaf.engine.reselect as reselect_module
    from usaf.artifacts.prefix_store import PrefixStore
    from usaf.stages import train as train_stage
    from usaf.stages.progress import NullProgress
    from usaf.stages.train import loop as train_loop

    baseline = current_rss()
    seen: dict[str, int] = {}
    accumulators: list[int] = []
    after: dict = {}
    original_get, original_reselect, original_loop = PrefixStore.get, reselect_module.reselect, train_loop.run_loop

    def get(self, key):
        state = original_get(self, key)
        if state is not None:
            seen[key] = state.numel() * state.element_size()
        return state

    def reselect(engine, optimizer, scores, fraction):
        accumulators.append(sum(a.nbytes for a in scores.values()))
        return original_reselect(engine, optimizer, scores, fraction)

    def loop(trainer, steps, progress):
        original_loop(trainer, steps, progress)
        cache = trainer.prefix[0] if trainer.prefix else None
        after["memory"] = trainer.engine.memory(optimizer=trainer.optimizer, cache=cache)
        after["hits"] = None if cache is None else [cache.hits, cache.misses]

    config = train_stage.TrainConfig(
        model=qdir,
        data=tdir,
        plan=plan,
        out=out,
        steps=steps,
        reselect_every=every,
        microbatch=MICROBATCH,
        save_every=0,
        device="cpu",
        dtype="float32",
    )
    progress = NullProgress()
    with (
        mock.patch.object(PrefixStore, "get", get),
        mock.patch.object(reselect_module, "reselect", reselect),
        mock.patch.object(train_loop, "run_loop", loop),
    ):
        manifest, _ = train_stage.run(config, progress=progress)
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    end = current_rss()
    malloc_trim()
    return {
        "import_baseline_rss_mib": baseline,
        "peak_rss_mib": peak,
        "rss_at_end_mib": end,
        "rss_after_malloc_trim_mib": current_rss(),
        "memory_after_run": after["memory"],
        "prefix_cache_hits_misses": after["hits"],
        "prefix_store_bytes_read": sum(seen.values()),
        "score_accumulator_bytes": max(accumulators, default=0),
        "reselections": len(manifest.summary.reselections),
        "plan_note": next((n for n in progress.notes if n.startswith("training ")), None),
    }


def rss(qdir: Path, tdir: Path, plan: Path, work: Path, steps: int, every: int, runs: int) -> dict:
    baselines, cli_runs = [], []
    for i in range(runs):  # interleaved: import baseline, CLI run
        base = subprocess.run(
            [sys.executable, "-c", BASELINE_CHILD], capture_output=True, text=True, check=True, env=child_env()
        )
        baselines.append(float(base.stdout.strip().splitlines()[-1]))
        out = work / f"rss-run-{i}"
        r = wrapped(cli_command(qdir, tdir, plan, out, steps, every))
        lines = [line.strip() for line in r["stderr"].splitlines()]
        # the stage's plan line: "training N weights of the <targets> + ... ; memory: ..."
        plan_line = next((line for line in lines if line.startswith("training ") and "memory:" in line), None)
        manifest = json.loads((out / "manifest.json").read_text())["summary"]
        cli_runs.append(
            {
                "peak_rss_mib": r["maxrss_kib"] / 1024,
                "wall_seconds": r["wall_seconds"],
                "plan_line": plan_line,
                "reselections": len(manifest["reselections"]),
                "prefix_cache_hits": manifest.get("prefix_cache_hits"),
                "prefix_cache_misses": manifest.get("prefix_cache_misses"),
                "seconds": manifest["seconds"],
                "tokens": manifest["tokens"],
            }
        )
        peak_i = cli_runs[-1]["peak_rss_mib"]
        print(f"[rss] CLI run {i}: peak {peak_i:.0f} MiB, import baseline {baselines[-1]:.0f} MiB", flush=True)
    if any(c["plan_line"] is None for c in cli_runs):
        raise RuntimeError("could not find the plan line in the CLI's output:\n" + r["stderr"][-3000:])
    replica_out = work / "rss-replica"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--replica-child", str(qdir), str(tdir), str(plan)]
    cmd += [str(replica_out), str(steps), str(every), "--microbatch", str(MICROBATCH)]  # as the CLI trained
    rep = wrapped(cmd)
    replica = json.loads(rep["stdout"].strip().splitlines()[-1])
    replica["wrapper_rusage_children_maxrss_mib"] = rep["maxrss_kib"] / 1024
    print(f"[rss] replica: peak {replica['peak_rss_mib']:.0f} MiB", flush=True)

    peak = statistics.median(c["peak_rss_mib"] for c in cli_runs)
    baseline = statistics.median(baselines)
    plan_memory = parse_plan_memory(cli_runs[0]["plan_line"])
    plan_accounted = {"import_baseline": int(baseline * 2**20), **plan_memory}
    after_accounted = {"import_baseline": int(baseline * 2**20), **replica["memory_after_run"]}
    extras = {
        "score_accumulators": replica["score_accumulator_bytes"],
        "prefix_store_pages_read": replica["prefix_store_bytes_read"],
    }
    with_extras = {**after_accounted, **extras}
    mib = 2**20

    def total(d):
        return sum(d.values()) / mib

    return {
        "command": " ".join(["python", "-m", "usaf", *cli_command(qdir, tdir, plan, Path("RUN"), steps, every)[3:]]),
        "steps": steps,
        "reselect_every": every,
        "runs": runs,
        "cli_runs": cli_runs,
        "import_baselines_mib": baselines,
        "import_baseline_mib": baseline,
        "peak_rss_mib": peak,
        "plan_accounted_bytes": plan_accounted,
        "plan_accounted_mib": total(plan_accounted),
        "after_run_accounted_bytes": after_accounted,
        "after_run_accounted_mib": total(after_accounted),
        "extras_bytes": extras,
        "after_run_with_extras_mib": total(with_extras),
        "ratio_measured_over_plan": peak / total(plan_accounted),
        "ratio_measured_over_after_run": peak / total(after_accounted),
        "ratio_measured_over_after_run_with_extras": peak / total(with_extras),
        "replica": replica,
        "target_agreement": 0.2,
    }


# -- main -------------------------------------------------------------------------------------------------------------


def main() -> None:
    # Every figure's helpers read these two module constants (bench_epoch.py imports their defaults): set once below.
    global MICROBATCH, TOP
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds per figure [9; 3 with --quick]")
    parser.add_argument("--rss-runs", type=int, default=None, help="CLI runs for the peak RSS [3; 1 with --quick]")
    parser.add_argument("--quick", action="store_true", help="a 4-layer, hidden-256 model at seq 64: a smoke run")
    parser.add_argument("--out", type=Path, default=None, help="[benchmarks/results/train.json]")
    parser.add_argument("--profile", action="store_true", help="also profile a plain and a collecting step")
    parser.add_argument(
        "--experts",
        type=int,
        choices=(32, 64, 128),
        default=32,
        help="32: the model above; 64 or 128: Qwen3-30B-A3B's expert ratios (experts of width 192 = 0.375 x "
        "hidden, top-8) at the same hidden size and depth [32]",
    )
    parser.add_argument("--microbatch", type=int, default=MICROBATCH, help=f"sequences per step [{MICROBATCH}]")
    parser.add_argument("--top", type=int, default=TOP, help=f"trainable layers, the model's top ones [{TOP}]")
    parser.add_argument("--no-rss", action="store_true", help="skip figure 2 (the CLI's peak RSS)")
    parser.add_argument(
        "--no-settle",
        action="store_true",
        help="time each arm's step right after the other arms' steps, as this benchmark did until the settle step was "
        "added (no untimed step of the same arm first)",
    )
    parser.add_argument(
        "--dense-router-grad-arm", action="store_true", help="figure 1 also times a prefix-hit step with it"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads here and in the children [torch's default]; 1 on a shared machine, where 2-thread "
        "torch loses tens of ms per small parallel op to other processes holding the cores",
    )
    parser.add_argument("--replica-child", nargs=6, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    MICROBATCH, TOP = args.microbatch, args.top
    if args.replica_child is not None:
        q, t, p, o, n, k = args.replica_child
        print(json.dumps(replica_child(Path(q), Path(t), Path(p), Path(o), int(n), int(k))))
        return
    peft = require_peft()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 9)
    runs = args.rss_runs or (1 if args.quick else 3)
    widths = MODEL_QUICK if args.quick else MODEL
    if args.experts != 32:
        widths = {**widths, "num_experts": args.experts, "moe_intermediate_size": 3 * widths["hidden_size"] // 8,
                  "num_experts_per_tok": 8}  # fmt: skip
    seq = SEQ_QUICK if args.quick else SEQ
    calib = CALIB_QUICK if args.quick else CALIB
    rss_steps, rss_every = (RSS_STEPS_QUICK, RSS_RESELECT_QUICK) if args.quick else (RSS_STEPS, RSS_RESELECT)
    suffix = ("-quick" if args.quick else "") + (f"-e{args.experts}" if args.experts != 32 else "")
    suffix += (f"-mb{MICROBATCH}" if MICROBATCH != 2 else "") + (f"-top{TOP}" if TOP != 2 else "")
    out = args.out or RESULTS / f"train{suffix}.json"
    torch.manual_seed(0)
    result: dict = {
        "machine": {**machine(), "peft": peft.__version__},
        "usaf_commit": git_commit(),
        "quick": args.quick,
        "command": " ".join(["python", *sys.argv]),
        "model": {"family": "qwen3_moe", "dtype": "float32", "vocab": 512, "quantization": "rtn 4-bit g128", **widths},
        "batch": {"microbatch": MICROBATCH, "seq": seq},
        "frac": FRAC,
        "top_layers": TOP,
        "settle": not args.no_settle,  # an untimed step of the same arm before each timed one (interleave)
    }
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="usaf-bench-train-") as tmp:
        work = Path(tmp)
        packages = PACKAGES_QUICK if args.quick else PACKAGES
        src, qdir, tdir, plan, result["setup"] = build(work, widths, seq, calib, packages)
        result["throughput"], live = throughput(
            src, qdir, tdir, plan, work, repeats, args.dense_router_grad_arm, settle=not args.no_settle
        )
        out.write_text(json.dumps(result, indent=2) + "\n")  # partial results survive an interrupted run
        first = WARMUP + repeats
        result["reselection"] = reselection(live["trainer"], repeats, first, args.profile)
        result["reselection"]["no_prefix_step_median_seconds"] = result["throughput"]["median_seconds"][
            "usaf_no_prefix"
        ]
        del live
        gc.collect()
        out.write_text(json.dumps(result, indent=2) + "\n")
        if not args.no_rss:
            result["rss"] = rss(qdir, tdir, plan, work, rss_steps, rss_every, runs)
    result["total_seconds"] = time.perf_counter() - started
    result["load_average_1min"] = {"start": load_start, "end": os.getloadavg()[0]}  # other sessions share the CPUs
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_summary(result)
    print(f"wrote {out}")


def print_summary(r: dict) -> None:
    mib = 2**20
    print(f"\nmachine: {r['machine']['summary']}, peft {r['machine']['peft']}")
    t = r["throughput"]
    print(f"1. one optimizer step (2 x {r['batch']['seq']}), median of {t['repeats']} interleaved rounds:")
    for k, v in t["median_seconds"].items():
        print(f"  {k:32s} {v:7.3f} s  {t['tokens_per_s'][k]:7.0f} tokens/s")
    for k, v in t.get("gflop_per_step", {}).items():
        print(f"  {k:32s} {v:7.2f} GFLOP a step (GEMMs, attention)  {t['gflop_per_second'][k]:6.1f} GFLOP/s")
    for k, v in t["speed_ratio"].items():
        print(f"  speed {k:56s} {v:6.2f}")
    lt = t["lora_top"]
    print(
        f"  trainable: usaf {t['usaf']['trainable_total']:,}; LoRA top (experts r={lt['expert_rank']}, attention "
        f"r={lt['attention_rank']}) {lt['trainable_params']:,}; "
        f"LoRA all layers {t['lora_all_layers']['trainable_params']:,}"
    )
    b = t["bytes"]
    for k in ("usaf", "full_finetune", "lora_top", "lora_all_layers"):
        print(f"  trainable + optimizer state, {k:16s} {b[k]['total'] / mib:9.2f} MiB")
    s = r["reselection"]
    med = s["median_seconds"]
    print(
        f"3. plain step {med['plain_step']:.3f} s, collecting step {med['collecting_step']:.3f} s "
        f"(x{s['ratio_collecting_over_plain_step']:.2f}), reselect {med['reselect']:.3f} s "
        f"(x{s['ratio_reselect_over_plain_step']:.2f} of a plain step); overhead per 50-step cycle "
        f"{s['cycle_overhead_at_reselect_every_50']:.1%}"
    )
    if "rss" not in r:
        return
    m = r["rss"]
    print(
        f"2. peak RSS of `usaf train` {m['peak_rss_mib']:.0f} MiB; plan {m['plan_accounted_mib']:.0f} MiB "
        f"(x{m['ratio_measured_over_plan']:.3f}); after-run accounting {m['after_run_accounted_mib']:.0f} MiB "
        f"(x{m['ratio_measured_over_after_run']:.3f}); with accumulators + store pages "
        f"{m['after_run_with_extras_mib']:.0f} MiB (x{m['ratio_measured_over_after_run_with_extras']:.3f})"
    )
    load = r["load_average_1min"]
    print(
        f"total {r['total_seconds']:.0f} s; 1-min load average {load['start']:.1f} at start, {load['end']:.1f} at end"
    )


if __name__ == "__main__":
    main()
