"""One training step of ``usaf train`` and what it needs: batches, loss, update, evaluation, checkpoint calls.

One step = ``grad_accum`` microbatches of ``microbatch`` sequences, the loss of each weighted by its
share of the step's scored tokens (so the step's loss is token-weighted, whatever the padding), then
one optimizer step over the deltas and routers at the schedule's learning rate. A non-finite loss or
gradient skips the step (the optimizer leaves everything bit-identical) and is counted.

When each step runs, and what happens between steps, is :mod:`usaf.stages.train.loop`'s; what a checkpoint
holds is :mod:`usaf.stages.train.resume`'s.

Data parallel (torchrun, :mod:`usaf.distributed`): a step's global batch is ``microbatch × grad_accum ×
world size`` sequences in the same order one process would draw them, rank ``r`` taking the ``r``-th
contiguous share; the loss of each microbatch is weighted by its share of the *global* scored tokens and
the gradients are summed over ranks (one flat buffer), so the update equals one process's. Grow scores
stay per rank until a reselection merges them. Rank 0 writes metrics and checkpoints; a checkpoint holds
every rank's partial grow scores.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import torch

from usaf.artifacts.run import (
    CHECKPOINTS_DIR,
    METRICS_FILE,
    ReselectionRecord,
    read_checkpoint,
    write_checkpoint,
)
from usaf.backends.base import Backend
from usaf.data.batches import Batch, collate
from usaf.data.dataset import TokenDataset
from usaf.distributed import World, sum_expert_loads
from usaf.engine.engine import SparseEngine
from usaf.engine.optim import SparseAdamW
from usaf.engine.schedule import WarmupCosine
from usaf.errors import UsafError
from usaf.families.modules import has_load_balancing_loss
from usaf.settings.train import company_size
from usaf.stages.train.budget import data_seq_len
from usaf.stages.train.companies import FirstEpochCompanies, company_prefix_states
from usaf.stages.train.config import TrainConfig

ROUTING_WINDOW = 10  # steps whose expert loads are pooled before checking a trainable layer for collapse


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    skipped: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    eval_losses: list[list[float]] = field(default_factory=list)
    reselections: list[dict] = field(default_factory=list)
    routing_baseline: dict[str, list[float]] = field(default_factory=dict)  # layer -> [max share, dead experts]
    routing_warnings: list[str] = field(default_factory=list)
    microbatch: int | None = None  # set when an out-of-memory retry changed it (kept on resume)
    grad_accum: int | None = None
    world_size: int = 1  # processes of the run that wrote this state (data parallel)
    # sequences per first-epoch company (usaf.stages.train.companies), chosen when the run starts and kept on resume;
    # None in a state from before companies had their own size: they were the run's --microbatch
    company_size: int | None = None
    # torch's intra-op threads the run started with on the CPU (its sums' bits depend on the count; a resume runs at
    # it again: usaf.backends.cpu.same_threads_as); None on other devices and in a state from before it was kept
    threads: int | None = None


class Trainer:
    def __init__(
        self,
        engine: SparseEngine,
        config: TrainConfig,
        data: TokenDataset,
        eval_data: TokenDataset | None,
        run_dir: Path,
        *,
        steps: int,
        reselect_every: int,
        pad_id: int,
        prefix: tuple[Any, str] | None = None,
        loss_scaler: Any = None,
        world: World | None = None,
        backend: Backend | None = None,
    ) -> None:
        self.engine = engine
        self.config = config  # the run's settings (frozen); what the run derived from them follows
        self.steps = steps
        self.reselect_every = reselect_every  # 0: a static mask
        self.microbatch, self.grad_accum = config.microbatch, config.grad_accum  # an out-of-memory retry changes them
        self.data = data
        self.eval_data = eval_data
        self.run_dir = run_dir
        self.pad_id = pad_id
        self.prefix = prefix  # (PrefixCache, model fingerprint) or None
        self.optimizer = self._new_optimizer()
        self.schedule = WarmupCosine(int(config.warmup * steps), steps)
        self.collector: Any = None  # grow scores being collected for the next reselection (checkpointed)
        self.scaler = loss_scaler  # DynamicLossScaler under fp16 compute, else None
        self.world = world or World()
        self.backend = backend
        size = company_size(config.microbatch, data_seq_len(config, data), self.world.size)
        threads = backend.compute_threads() if backend is not None else None
        self.state = TrainState(world_size=self.world.size, company_size=size, threads=threads)  # a resume replaces it
        self.resumed_world_size = self.world.size  # a resume: the processes the run trained on until its checkpoint
        self._companies: FirstEpochCompanies | None = None
        self.revisited = _drawn_again(data, steps * config.microbatch * config.grad_accum * self.world.size,
                                      config.seed)  # fmt: skip

    @property
    def companies(self) -> FirstEpochCompanies:
        """Whom each training sequence's prefix state is computed with (usaf.stages.train.companies): the state's
        company size, which a resumed run takes from its checkpoint."""
        size = self.state.company_size or self.config.microbatch
        if self._companies is None or self._companies.size != size:
            self._companies = FirstEpochCompanies(self.data, seed=self.config.seed, size=size)
        return self._companies

    def _new_optimizer(self) -> SparseAdamW:
        c = self.config
        groups = self.engine.parameter_groups(lr=c.lr, router_lr=c.router_lr, weight_decay=c.weight_decay)
        return SparseAdamW(groups, max_grad_norm=c.clip)

    # -- one step -------------------------------------------------------------------------------------

    def _microbatches(self, step: int) -> list[Batch]:
        """This rank's microbatches of the step: its contiguous share of the step's global sequences."""
        share, size = self.microbatch * self.grad_accum, self.microbatch
        rows = self.data.indices_for_step(step, share * self.world.size, self.config.seed)
        rows = rows[self.world.rank * share : (self.world.rank + 1) * share]
        lines = self._lines(rows)
        return [collate(lines[i : i + size], self.pad_id, rows=tuple(rows[i : i + size]))
                for i in range(0, len(lines), size)]  # fmt: skip

    def _lines(self, rows) -> list:
        """The training sequences at dataset indices ``rows``, cut to ``--seq-len``."""
        return self._cut([self.data[i] for i in rows])

    def _cut(self, lines: list) -> list:
        n = self.config.seq_len
        if n is None:
            return lines
        return [replace(line, input_ids=line.input_ids[:n], labels=line.labels[:n]) for line in lines]

    def _loss(self, batch: Batch) -> Any:
        device = next(self.engine.model.parameters()).device
        rows = batch.rows
        batch = Batch(batch.input_ids.to(device), batch.labels.to(device), batch.attention_mask.to(device))
        states = None
        if self.prefix is not None and rows is not None:  # a training microbatch: missing states by company
            cache, fingerprint = self.prefix
            states = company_prefix_states(
                self.engine, batch, rows, cache, model_fingerprint=fingerprint, companies=self.companies,
                load=self._lines, pad_id=self.pad_id, chunk=self._capture_chunk(),
                forget=None if self.revisited is None else lambda row: row not in self.revisited,
            )  # fmt: skip
        elif self.prefix is not None:  # held-out data: each missing state alone
            cache, fingerprint = self.prefix
            states = self.engine.cached_prefix_states(
                batch.input_ids, cache, model_fingerprint=fingerprint, attention_mask=batch.attention_mask
            )
        return self.engine.loss(batch.input_ids, batch.labels, batch.attention_mask, prefix_states=states)

    def _capture_chunk(self) -> int:
        """The most sequences one prefix capture runs: a whole company, or the training microbatch once an
        out-of-memory retry has made it smaller than the run's (the companies stay; their capture is cut)."""
        companies = self.companies
        return companies.size if self.microbatch >= self.config.microbatch else min(self.microbatch, companies.size)

    def step(self) -> dict[str, Any]:
        """Run the next optimizer step; returns its metrics record.

        Out of device memory, the step is retried with a smaller microbatch and more accumulation (the
        same sequences, the same token-weighted loss), and that setting is kept for the rest of the run.
        """
        start = time.perf_counter()
        step = self.state.step
        notes = []
        loads_before = {layer: self.engine.loaded.experts[layer].tokens_per_expert.clone()
                        for layer in self.engine.trainable_layers}  # fmt: skip
        batches = self._microbatches(step)
        scored = self._scored_tokens(batches)  # over every rank: each microbatch's loss weight is its share
        while True:
            scores = self._collector_snapshot()
            try:
                loss_sum = self._forward_backward(batches, scored)
                break
            except torch.OutOfMemoryError:
                self._zero_grad()
                self._restore_collector(scores)  # the failed attempt's partial grow scores are discarded
                notes.append(self._shrink_microbatch())
                batches = self._microbatches(step)  # the same sequences, in smaller microbatches
        sent = self.world.sum_gradients(self._trainables())
        tokens = sum(b.tokens for b in batches)
        loss_sum, tokens = self.world.sum_floats([loss_sum, tokens], "loss all-reduce")
        tokens = int(tokens)
        if self.scaler is not None:
            self.scaler.unscale_(self._trainables())
        lr_factor = self.schedule.apply(self.optimizer, step)
        report = self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update(not report.skipped_nonfinite)
        finite = report.applied and torch.isfinite(torch.tensor(loss_sum))
        self.state.step += 1
        self.state.tokens += tokens
        if not finite:
            self.state.skipped += 1
        else:
            self.state.first_loss = loss_sum if self.state.first_loss is None else self.state.first_loss
            self.state.last_loss = loss_sum
        seconds = time.perf_counter() - start
        routing = self._step_routing(loads_before)  # before the window check resets the counters
        warnings = self._check_routing() if self.state.step % ROUTING_WINDOW == 0 else []
        return {
            **({"routing_warnings": warnings} if warnings else {}),
            **({"notes": notes} if notes else {}),
            **({"loss_scale": self.scaler.scale} if self.scaler is not None else {}),
            "step": self.state.step,
            "loss": loss_sum,
            "lr": self.config.lr * lr_factor,
            "grad_norm": report.grad_norm,
            "skipped": not finite,
            "tokens": self.state.tokens,
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "seconds": seconds,
            **({"world": {"size": self.world.size, "allreduce_bytes": sent}} if self.world.active else {}),
            "routing": routing,
            "memory": self._memory_now(),
        }

    def _step_routing(self, before: dict[int, torch.Tensor]) -> dict[str, dict[str, float]]:
        """This step's expert load per trainable layer: entropy (nats) and the largest expert's share."""
        out = {}
        for layer, counts in before.items():
            step_counts = (self.engine.loaded.experts[layer].tokens_per_expert - counts).double()
            step_counts = self.world.sum_(step_counts.to(self.world.wire), "expert-load all-reduce")
            total = float(step_counts.sum())
            if total <= 0:
                continue
            shares = step_counts / total
            nonzero = shares[shares > 0]
            out[str(layer)] = {
                "entropy": round(float(-(nonzero * nonzero.log()).sum()), 4),
                "max_share": round(float(shares.max()), 4),
            }
        return out

    def _scored_tokens(self, batches: list) -> int:
        """Tokens with a label in the step's global batch (this rank's ``batches`` and every other rank's)."""
        mine = sum(int((b.labels[:, 1:] != -100).sum()) for b in batches)
        return int(self.world.sum_floats([mine], "token-count all-reduce")[0])

    def _forward_backward(self, batches: list, scored: int) -> float:
        """This rank's gradients of the step's token-weighted loss (times the loss scale, under fp16)."""
        self._zero_grad()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        loss_sum = 0.0
        for batch in batches:
            parts = self._loss(batch)
            weight = parts.tokens / max(scored, 1)
            (parts.loss * (weight * scale)).backward()
            loss_sum += float(parts.loss.detach()) * weight
        return loss_sum

    def _trainables(self) -> list[torch.Tensor]:
        return [d.values for d in self.engine.deltas().values()] + list(self.engine.routers.values())

    def _shrink_microbatch(self) -> str:
        """Halve the microbatch (to a divisor of the step's sequences) and raise the accumulation to match."""
        gc.collect()
        if self.backend is not None:
            self.backend.empty_cache()
        total = self.microbatch * self.grad_accum
        smaller = [d for d in range(1, self.microbatch // 2 + 1) if total % d == 0]
        if not smaller:
            raise UsafError(
                f"out of device memory at microbatch {self.microbatch} (step {self.state.step + 1})",
                "use a shorter --seq-len, fewer trainable layers (a higher --train-from), or another --device",
            )
        before = (self.microbatch, self.grad_accum)
        self.microbatch, self.grad_accum = smaller[-1], total // smaller[-1]
        self.state.microbatch, self.state.grad_accum = self.microbatch, self.grad_accum
        note = (
            f"out of memory at microbatch {before[0]} × {before[1]}: retrying step {self.state.step + 1} "
            f"with microbatch {self.microbatch} × grad-accum {self.grad_accum} (kept from now on)"
        )
        self.log({"step": self.state.step + 1, "oom_retry": {"microbatch": self.microbatch,
                                                              "grad_accum": self.grad_accum}})  # fmt: skip
        return note

    def _collector_state(self) -> dict | None:
        """The grow scores as state dicts (CPU copies): what a checkpoint and the ranks' gather carry."""
        if self.collector is None:
            return None
        return {name: acc.state_dict() for name, acc in self.collector.accumulators.items()}

    def _collector_snapshot(self) -> dict | None:
        """The grow scores before a step's attempt, to drop its partial scores if it fails: O(experts), not O(pool)."""
        if self.collector is None:
            return None
        return {name: acc.snapshot() for name, acc in self.collector.accumulators.items()}

    def _restore_collector(self, snapshot: dict | None) -> None:
        if snapshot is not None:
            for name, acc in self.collector.accumulators.items():
                acc.restore(snapshot[name])

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self.engine.model.zero_grad(set_to_none=True)

    def _check_routing(self) -> list[str]:
        """Compare the trainable layers' expert load over the last window with the first window's.

        Collapse: one expert taking over half the tokens (and twice its initial share), or a quarter of
        the experts (at least one) newly receiving none. Each layer warns once.
        """
        sum_expert_loads(self.engine, self.world)
        stats = self.engine.load_stats(reset=True)
        new = []
        # the family's own load-balancing loss where it has one (DeepSeek-V3 has none: --aux-loss-coef is refused)
        ways = "--aux-loss-coef 0.01 or --no-router" if has_load_balancing_loss(self.engine.spec.model_type) else (
            "--no-router")  # fmt: skip
        for layer in self.engine.trainable_layers:
            load, key = stats[layer], str(layer)
            if sum(load.tokens_per_expert) == 0:
                continue
            if key not in self.state.routing_baseline:
                self.state.routing_baseline[key] = [load.max_share, load.dead_experts]
                continue
            if any(w.startswith(f"layer {layer}:") for w in self.state.routing_warnings):
                continue
            share, dead = self.state.routing_baseline[key]
            experts = len(load.tokens_per_expert)
            if load.max_share > max(0.5, 2 * share):
                new.append(
                    f"layer {layer}: routing collapsing, one expert takes {load.max_share:.0%} of tokens "
                    f"(was {share:.0%}); try a lower --router-lr, {ways}"
                )
            elif load.dead_experts >= dead + max(1, experts // 4):
                new.append(
                    f"layer {layer}: {load.dead_experts} of {experts} experts get no tokens (was {int(dead)}); "
                    f"try {ways}"
                )
        self.state.routing_warnings.extend(new)
        return new

    @torch.no_grad()
    def evaluate(self, on_batch: Callable[[int], None] | None = None) -> float | None:
        """Token-weighted held-out loss (no gradients; not counted in step time); ``on_batch``: called with the
        sequences of each microbatch this rank has evaluated."""
        if self.eval_data is None or len(self.eval_data) == 0:
            return None
        loads = [state.tokens_per_expert.clone() for state in self.engine.loaded.experts.values()]
        try:
            return self._evaluate(on_batch)
        finally:  # held-out forwards do not count in the training routing window
            for state, saved in zip(self.engine.loaded.experts.values(), loads):
                state.tokens_per_expert.copy_(saved)

    def eval_share(self) -> int:
        """The held-out sequences this rank evaluates."""
        return sum(len(rows) for rows in self._eval_rows())

    def _eval_rows(self) -> list[range]:
        """This rank's share of the held-out microbatches, as dataset rows."""
        size, n = self.microbatch, len(self.eval_data)
        return [range(start, min(start + size, n)) for start in range(0, n, size)][self.world.rank :: self.world.size]

    def _evaluate(self, on_batch: Callable[[int], None] | None) -> float:
        total = tokens = 0.0
        for rows in self._eval_rows():  # every rank its share of the microbatches
            lines = self._cut([self.eval_data[i] for i in rows])
            parts = self._loss(collate(lines, self.pad_id))
            total += float(parts.ce) * parts.tokens
            tokens += parts.tokens
            if on_batch is not None:
                on_batch(len(rows))
        total, tokens = self.world.sum_floats([total, tokens], "held-out loss all-reduce")
        return total / max(tokens, 1)

    # -- checkpoints ----------------------------------------------------------------------------------

    def save_checkpoint(self, directory: Path) -> Path:
        """Write a complete checkpoint atomically (temp dir + rename) and return its path.

        Under data parallelism every rank calls it (the ranks' grow scores are gathered); rank 0 writes,
        and the others return once it has.
        """
        self._check_finite()  # on every rank (their weights are equal): none waits for a rank 0 that refused
        scores_by_rank = self.world.gather_objects(self._collector_state(), "grow-score gather")
        if self.world.is_main:
            self._write_checkpoint(directory, scores_by_rank)
        self.world.barrier("checkpoint barrier")
        return directory

    def _check_finite(self) -> None:
        """Refuse to save weights an update made infinite or NaN: the steps after it are skipped (non-finite
        gradients), so such a run went on to exit 0 with a change eval, export and generate then refused (``--lr
        1e300``; found in review)."""
        weights = self.engine.weights.items()
        tensors = {name: w.frozen_values for name, w in weights}
        tensors |= {f"{name} (active)": w.delta.values for name, w in weights if w.delta is not None}
        tensors |= dict(self.engine.routers)
        broken = [name for name, tensor in tensors.items() if not bool(torch.isfinite(tensor).all())]
        if broken:
            more = f" and {len(broken) - 1} more" if len(broken) > 1 else ""
            router = f", --router-lr {self.config.router_lr:g}" if self.config.router else ""
            raise UsafError(
                f"step {self.state.step}: the trained weights are no longer finite ({broken[0]}{more}): an update "
                "overflowed; nothing more is saved",
                f"lower --lr (this run's: {self.config.lr:g}{router}) and start again with --overwrite",
            )

    def _write_checkpoint(self, directory: Path, scores_by_rank: list[dict | None]) -> None:
        # lazy: an import cycle (resume imports TrainState from this module)
        from usaf.stages.train.resume import checkpoint_of

        write_checkpoint(directory, checkpoint_of(self, scores_by_rank))

    def load_checkpoint(self, directory: Path) -> None:
        """Continue from ``directory`` (read whole, or refused: never half-loaded) in a fresh engine."""
        # lazy: an import cycle (resume imports TrainState from this module)
        from usaf.stages.train.resume import restore

        # not "--resume": a rerun resumes without it, and the hint says what a user can do (found in review)
        hint = "move it out of the run directory (the rerun resumes from the newest one left), or --overwrite"
        restore(self, read_checkpoint(directory, flag="resuming from", hint=hint, max_step=self.steps), directory)

    def _memory_now(self) -> dict[str, int]:
        """Process RSS, and the accelerator's peak allocation when the backend reports one (bytes)."""
        memory = {"rss": psutil.Process().memory_info().rss}
        peak = self.backend.peak_allocated() if self.backend is not None else None
        if peak is not None:
            memory["device_peak"] = peak
        return memory

    def checkpoint_dir(self) -> Path:
        return self.run_dir / CHECKPOINTS_DIR / f"step-{self.state.step:07d}"

    def log(self, record: dict[str, Any]) -> None:
        if not self.world.is_main:
            return
        with (self.run_dir / METRICS_FILE).open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def record_reselection(self, step: int, report: Any) -> dict:
        total = report.total
        record = ReselectionRecord(
            step=step,
            fraction=report.fraction,
            kept=total.kept,
            dropped=total.dropped,
            grown=total.grown,
            turnover=total.turnover,
        ).model_dump()
        self.state.reselections.append(record)
        return record


def _drawn_again(data: TokenDataset, drawn: int, seed: int) -> frozenset[int] | None:
    """The dataset rows a run of ``drawn`` sequences draws a second time (the next epoch's first ones), or None where
    it draws every row again (two epochs or more). A row drawn once has its prefix state dropped once its step took
    it: cached for a revisit that never comes, a one-epoch run's RAM grew to the cache's limit and spilled to disk.
    Not a yes/no for the whole run: an epoch rounded up to whole steps draws a few rows twice, and that switched the
    dropping off for most data sizes (found in review)."""
    again = drawn - len(data)
    if again >= len(data):
        return None
    return frozenset(int(i) for i in data.order(1, seed)[: max(again, 0)].tolist())
