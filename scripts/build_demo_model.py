"""Build usaf's demo model: a small Qwen3-MoE pretrained on the Python standard library's sources.

Reproducible: fixed seeds, a deterministic data order (a seeded permutation per epoch) and one CPU
thread, so the same Python minor version (whose stdlib is the corpus) and library versions give the
same model. Steps:

1. train a byte-level BPE tokenizer (ChatML specials, chat template) on ``PRETRAIN_DOMAIN``'s training
   sources;
2. tokenize ``PRETRAIN_DOMAIN`` (and, for the record, the reserved fine-tuning ``DEMO_DOMAIN``) with
   ``usaf tokenize``'s own stage, holding out each domain's held-out sources;
3. pretrain a ``Qwen3MoeForCausalLM`` with AdamW, warmup + cosine, and the model's own load-balancing
   loss applied per layer, printing the loss every ``--log-every`` steps;
4. save it in bf16 with the tokenizer and PROVENANCE.json, reload the saved files and report the
   validation perplexity on the held-out pretraining sources and the expert load per layer.

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/build_demo_model.py          # ~20 min on one core
    PYTHONPATH=src python scripts/build_demo_model.py --steps 20 --out /tmp/m   # a quick smoke run

``--size large`` builds the evidence benchmark's second model instead (issue 20: ≥ 8 layers, ≥ 32 experts, top-4,
≥ 4x the demo's parameters): 8 layers, hidden 192, 32 experts of width 96, top-4, 16.7 M parameters, the same
tokenizer (trained the same way on the same files) and corpus, written to ``benchmarks/models/evidence-large``:

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/build_demo_model.py --size large   # ~1 h on one core

``--size shared`` builds its third model (the shared and dense targets need a model that has them): a Qwen2-MoE of
the demo's width, 5 layers, a dense layer 0 and a shared expert in each of the 4 MoE layers, 4.3 M parameters,
written to ``benchmarks/models/evidence-shared``:

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/build_demo_model.py --size shared  # ~27 min on one core
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from usaf.demo import DEMO_DOMAIN, PRETRAIN_DOMAIN, StdlibDomain, demo_model_dir
from usaf.testing import CHATML_TEMPLATE
from usaf.testing.tokenizer import SPECIAL_TOKENS

# The model: ~3.9 M parameters (7.8 MB in bf16), ~6 k tokens/s of training on one CPU thread.
DEMO_CONFIG: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "intermediate_size": 512,  # dense MLP width; unused (every layer is MoE), kept plausible
    "norm_topk_prob": True,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "router_aux_loss_coef": 0.01,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
# The evidence benchmark's second model: 16.7 M parameters, ~3x the demo's compute per token.
LARGE_CONFIG: dict[str, Any] = {
    **DEMO_CONFIG,
    "hidden_size": 192,
    "num_hidden_layers": 8,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 96,
    "intermediate_size": 768,
}
# The evidence's third model (issue 20: the shared and dense targets need a model that has them): a Qwen2-MoE of the
# demo's width with a shared expert (DeepSeek's width: one routed expert's; Qwen2-MoE's sigmoid gate) in every MoE
# layer and a dense first layer (DeepSeek-V3's `first_k_dense_replace`, here `mlp_only_layers`), whose MLP is as wide
# as the MoE layers' active MLP (top-2 + shared: 3 x 128).
SHARED_CONFIG: dict[str, Any] = {
    **DEMO_CONFIG,
    "num_hidden_layers": 5,
    "shared_expert_intermediate_size": 128,
    "intermediate_size": 384,
    "mlp_only_layers": [0],
    "decoder_sparse_step": 1,
    "qkv_bias": True,
}
MODELS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "models"
LARGE_DIR = MODELS_DIR / "evidence-large"
SHARED_DIR = MODELS_DIR / "evidence-shared"
# size -> (transformers model type, config, directory written)
SIZES = {
    "demo": ("qwen3_moe", DEMO_CONFIG, demo_model_dir()),
    "large": ("qwen3_moe", LARGE_CONFIG, LARGE_DIR),
    "shared": ("qwen2_moe", SHARED_CONFIG, SHARED_DIR),
}
IGNORE = -100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="demo", help="the demo model, or the evidence's larger one")
    p.add_argument("--out", type=Path, default=None, help="model directory to write (default: the size's own)")
    p.add_argument("--work-dir", type=Path, default=None, help="token files (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1400)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--aux-coef", type=float, default=0.01, help="weight of the per-layer load-balancing loss")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


# ---------------------------------------------------------------- tokenizer


def domain_files(domain: StdlibDomain) -> tuple[list[Any], list[Any]]:
    """(training files, held-out files) of a domain, in ``usaf tokenize``'s sorted order."""
    from usaf.data.corpus import discover
    from usaf.stages.tokenize import select_heldout

    options = domain.tokenize_options()
    corpus = discover(
        options["inputs"], include=options["include"], exclude=options["exclude"], source_depth=options["source_depth"]
    )
    held = select_heldout(sorted({f.source for f in corpus.files}), list(domain.held_out), 0.0, 0)
    return [f for f in corpus.files if f.source not in held], [f for f in corpus.files if f.source in held]


def train_tokenizer(files: list[Any], out_dir: Path, vocab_size: int, max_length: int) -> Any:
    """Byte-level BPE on the files' text (read in sorted order), saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (f.path.read_text(encoding="utf-8", errors="replace") for f in files)
    tok.train_from_iterator(texts, trainer=trainer, length=len(files))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", model_max_length=max_length
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


# ---------------------------------------------------------------- data


def tokenize_domain(domain: StdlibDomain, tokenizer_dir: Path, out: Path, seq_len: int) -> tuple[Path, Any]:
    """Run ``usaf tokenize`` on a domain; returns the artifact directory and its summary."""
    from usaf.stages.tokenize import TokenizeConfig, run

    config = TokenizeConfig(model=str(tokenizer_dir), seq_len=seq_len, out=out, **domain.tokenize_options())
    manifest, path = run(config)
    return path, manifest.summary


def read_sequences(path: Path) -> list[tuple[list[int], list[int]]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
            rows.append((obj["input_ids"], obj["labels"]))
    return rows


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest row; padding gets label -100 (causal attention never looks right)."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, (a, b) in enumerate(rows):
        ids[i, : len(a)] = torch.tensor(a)
        labels[i, : len(b)] = torch.tensor(b)
    return ids, labels


def batches_for_step(rows: list, batch: int, seed: int, step: int) -> list:
    """The step's sequences: epoch ``e`` reads a permutation seeded by (seed, e), in order."""
    per_epoch = len(rows) // batch
    epoch, index = divmod(step, per_epoch)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(rows), generator=gen)[index * batch : (index + 1) * batch]
    return [rows[i] for i in order.tolist()]


# ---------------------------------------------------------------- model


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL and the number of scored tokens (labels unshifted, HF convention)."""
    logits = logits[:, :-1].float()  # (B, T-1, V)
    target = labels[:, 1:]  # (B, T-1)
    nll = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return nll, int((target != IGNORE).sum())


def balance_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    """The model's own load-balancing loss, applied to each layer separately and averaged.

    transformers' ``load_balancing_loss_func`` pools the counts of all layers before the product, which
    balances the sum over layers and tolerates a layer whose experts are unused; per layer it cannot.
    """
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # qwen2_moe's is the same

    losses = [load_balancing_loss_func((layer,), num_experts, top_k) for layer in router_logits]
    return torch.stack(losses).mean()


@torch.no_grad()
def evaluate(model: Any, rows: list, pad_id: int, batch: int = 8) -> float:
    """Token-weighted mean NLL (nats) over ``rows``."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(rows), batch):
        ids, labels = collate(rows[start : start + batch], pad_id)
        nll, n = lm_loss_sum(model(input_ids=ids).logits, labels)
        total += float(nll)
        count += n
    model.train()
    return total / max(count, 1)


@torch.no_grad()
def expert_load(model: Any, rows: list, pad_id: int, batch: int = 8) -> list[dict[str, Any]]:
    """Per MoE layer: tokens routed to each expert (top-k), normalised entropy, max share, dead experts."""
    cfg = model.config
    moe_layers = moe_layer_indices(model)
    counts = torch.zeros(len(moe_layers), cfg.num_experts)
    model.eval()
    for start in range(0, len(rows), batch):
        ids, labels = collate(rows[start : start + batch], pad_id)
        keep = (ids != pad_id) | (labels != IGNORE)
        out = model(input_ids=ids, output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):  # (B*T, E), one per MoE layer in order
            chosen = logits.topk(cfg.num_experts_per_tok, dim=-1).indices[keep.reshape(-1)]
            counts[layer] += torch.bincount(chosen.reshape(-1), minlength=cfg.num_experts).float()
    model.train()
    report = []
    for row, layer in enumerate(moe_layers):
        share = counts[row] / counts[row].sum()
        entropy = float(-(share[share > 0] * share[share > 0].log()).sum() / math.log(cfg.num_experts))
        report.append(
            {
                "layer": layer,
                "entropy_normalised": round(entropy, 4),
                "max_share": round(float(share.max()), 4),
                "min_share": round(float(share.min()), 4),
                "dead_experts": int((counts[row] == 0).sum()),
            }
        )
    return report


def moe_layer_indices(model: Any) -> list[int]:
    """The decoder layers with routed experts (a dense layer records no router logits)."""
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to 10 % of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def pretrain(model: Any, train: list, heldout: list, args: argparse.Namespace, pad_id: int) -> dict[str, Any]:
    cfg = model.config
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    probe = heldout[:: max(1, len(heldout) // 32)][:32]  # a fixed subset for the periodic check
    history, window, tokens_seen = [], [], 0
    start = time.time()
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        ids, labels = collate(batches_for_step(train, args.batch, args.seed, step), pad_id)
        out = model(input_ids=ids, output_router_logits=True)
        nll, n = lm_loss_sum(out.logits, labels)
        lm = nll / n
        aux = balance_loss(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
        (lm + args.aux_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens_seen += n
        window.append(float(lm.detach()))
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.time() - start
            line = {
                "step": step + 1,
                "loss": round(sum(window) / len(window), 4),
                "aux": round(float(aux.detach()), 4),
                "lr": round(lr_at(step, args), 6),
                "tokens": tokens_seen,
                "tok_per_s": round(tokens_seen / elapsed),
                "elapsed_s": round(elapsed),
            }
            if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
                line["probe_heldout_loss"] = round(evaluate(model, probe, pad_id), 4)
            print(json.dumps(line), flush=True)
            history.append(line)
            window = []
    return {"history": history, "tokens_seen": tokens_seen, "seconds": round(time.time() - start, 1)}


def split_record(summary: Any) -> dict[str, Any]:
    return {
        "train_tokens": summary.train_tokens,
        "heldout_tokens": summary.heldout_tokens,
        "train_sequences": summary.train_sequences,
        "heldout_sequences": summary.heldout_sequences,
        "heldout_sources": summary.heldout_sources,
        "documents": summary.documents,
        "input_bytes": summary.input_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="usaf-demo-build-"))
    work.mkdir(parents=True, exist_ok=True)
    model_type, model_config, default_out = SIZES[args.size]
    out: Path = args.out or default_out
    staging = out.with_name(out.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    t0 = time.time()

    pre_train_files, pre_held_files = domain_files(PRETRAIN_DOMAIN)
    tokenizer = train_tokenizer(
        pre_train_files, staging, model_config["vocab_size"], model_config["max_position_embeddings"]
    )
    assert len(tokenizer) == model_config["vocab_size"], len(tokenizer)
    assert tokenizer.eos_token_id == model_config["eos_token_id"]
    print(f"tokenizer: {len(tokenizer)} tokens, trained on {len(pre_train_files)} files ({time.time() - t0:.0f} s)")

    pre_dir, pre_summary = tokenize_domain(PRETRAIN_DOMAIN, staging, work / "pretrain-tokens", args.seq_len)
    demo_dir, demo_summary = tokenize_domain(DEMO_DOMAIN, staging, work / "demo-tokens", args.seq_len)
    for name, s in (("pretrain", pre_summary), ("demo", demo_summary)):
        print(f"{name} domain: train {s.train_tokens} tokens / held-out {s.heldout_tokens} ({s.input_bytes} bytes)")
    train_rows = read_sequences(pre_dir / "train.jsonl")
    held_rows = read_sequences(pre_dir / "heldout.jsonl")
    demo_held_rows = read_sequences(demo_dir / "heldout.jsonl")

    config = AutoConfig.for_model(model_type, **model_config)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="grouped_mm")
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M parameters; {args.steps} steps of {args.batch} x {args.seq_len} tokens")
    run = pretrain(model, train_rows, held_rows, args, tokenizer.pad_token_id)

    model.to(torch.bfloat16).save_pretrained(staging)
    saved = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32)  # what ships, in fp32 compute
    held_loss = evaluate(saved, held_rows, tokenizer.pad_token_id)
    demo_held_loss = evaluate(saved, demo_held_rows, tokenizer.pad_token_id)
    load = expert_load(saved, held_rows[:64], tokenizer.pad_token_id)
    final_train = run["history"][-1]["loss"]
    print(f"held-out (pretraining domain): loss {held_loss:.4f}, perplexity {math.exp(held_loss):.2f}")
    print(
        f"held-out (demo domain, before fine-tuning): loss {demo_held_loss:.4f}, "
        f"perplexity {math.exp(demo_held_loss):.2f}"
    )
    for row in load:
        print(f"expert load layer {row['layer']}: {json.dumps(row)}")
    dead = sum(r["dead_experts"] for r in load)

    provenance = {
        "script": "scripts/build_demo_model.py",
        "command": " ".join(["python", "scripts/build_demo_model.py", *(argv if argv is not None else sys.argv[1:])]),
        "seed": args.seed,
        "steps": args.steps,
        "batch_sequences": args.batch,
        "seq_len": args.seq_len,
        "lr_peak": args.lr,
        "warmup_steps": args.warmup,
        "weight_decay": args.weight_decay,
        "aux_loss": f"per-layer load_balancing_loss_func (qwen3_moe), coefficient {args.aux_coef}",
        "model_type": model_type,
        "threads": args.threads,
        "tokens_seen": run["tokens_seen"],
        "pretrain_seconds": run["seconds"],
        "total_seconds": round(time.time() - t0, 1),
        "parameters": params,
        "stored_dtype": "bfloat16",
        "model_config": model_config,
        "size": args.size,
        "final_train_loss": final_train,
        "heldout_loss": round(held_loss, 4),
        "heldout_perplexity": round(math.exp(held_loss), 3),
        "demo_domain_heldout_loss_before_finetuning": round(demo_held_loss, 4),
        "expert_load": load,
        "dead_experts": dead,
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "torch_version": torch.__version__,
        "transformers_version": __import__("transformers").__version__,
        "tokenizers_version": __import__("tokenizers").__version__,
        "stdlib": {
            "pretrain_files": len(pre_train_files) + len(pre_held_files),
            "pretrain_bytes": sum(f.bytes for f in pre_train_files + pre_held_files),
            "tokenizer_training_files": len(pre_train_files),
        },
        "pretrain_domain": {
            "name": PRETRAIN_DOMAIN.name,
            "paths": list(PRETRAIN_DOMAIN.paths),
            "include": list(PRETRAIN_DOMAIN.include),
            "exclude": list(PRETRAIN_DOMAIN.exclude),
            "held_out": list(PRETRAIN_DOMAIN.held_out),
            "source_depth": PRETRAIN_DOMAIN.source_depth,
            **split_record(pre_summary),
        },
        "demo_domain": {
            "name": DEMO_DOMAIN.name,
            "paths": list(DEMO_DOMAIN.paths),
            "include": list(DEMO_DOMAIN.include),
            "exclude": list(DEMO_DOMAIN.exclude),
            "held_out": list(DEMO_DOMAIN.held_out),
            "source_depth": DEMO_DOMAIN.source_depth,
            **split_record(demo_summary),
        },
        "history": run["history"],
    }
    (staging / "PROVENANCE.json").write_text(json.dumps(provenance, indent=1) + "\n", encoding="utf-8")
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB) in {time.time() - t0:.0f} s")
    if dead:
        print(f"warning: {dead} dead experts", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
