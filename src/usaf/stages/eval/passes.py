"""One evaluation pass: every sequence through the model, per-sequence summed NLL and per-token routing.

Base and fine-tuned passes run the same code over the same sequences in the same microbatches, so their
per-sequence results pair up (for the paired bootstrap) and their routing lines up token by token. A pass stops
between two microbatches on a stop request (Ctrl-C, SIGTERM, SIGHUP) and hands what it has done to its caller,
which keeps it; a rerun continues from there (:class:`PartialPass`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from usaf.data.batches import Batch, collate
from usaf.data.tokens import TokenLine
from usaf.engine.experts import LayerExperts
from usaf.engine.head_loss import CHUNK_LOGIT_BYTES, HeadInput, next_token_loss
from usaf.engine.routing import RoutingCapture
from usaf.errors import StopSignal
from usaf.stages.eval.inputs import EvalSequence
from usaf.stages.progress import Progress


@dataclass
class PassResult:
    nll: torch.Tensor  # (N,) float64: summed NLL of each sequence's scored tokens
    tokens: torch.Tensor  # (N,) int64: scored tokens per sequence
    routing: dict[int, torch.Tensor]  # MoE layer -> (n_real, k) uint8/int16 sorted top-k sets, sequences in order
    input_tokens: int  # real (unpadded) tokens run through the model
    seconds: float
    cached: bool = False
    first_layer: int = 0  # the first decoder layer run; those below gave their states from the base pass


@dataclass
class PartialPass:
    """A pass stopped after its first ``batches`` microbatches: their results, in order."""

    batches: int
    result: PassResult
    threads: int | None = None  # the torch threads it ran at (None: kept by an older usaf)


PREFIX_RAM_SHARE = 0.25  # of available RAM the base pass's prefix states may take, to be reused by the tuned pass


def batches_of(sequences: Sequence[EvalSequence], microbatch: int, pad_id: int) -> list[Batch]:
    """Right-padded microbatches in input order (the pairing of the two passes depends on it)."""
    lines = [TokenLine(i, s.input_ids, s.labels, s.source) for i, s in enumerate(sequences)]
    return [collate(lines[i : i + microbatch], pad_id) for i in range(0, len(lines), microbatch)]


@torch.no_grad()
def batch_hidden(model: nn.Module, batch: Batch, device: torch.device) -> torch.Tensor:
    """``(B, S, H)``: the final hidden states of one batch (the output projection's input; no logits computed)."""
    with HeadInput.of(model.get_output_embeddings()).capture() as head_input:
        model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device), use_cache=False)
        return head_input()


@torch.no_grad()
def sequence_nll(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL and scored-token count per sequence: ``(B,)`` float64 and ``(B,)`` int64.

    ``SparseEngine.loss``'s arithmetic (:func:`usaf.engine.head_loss.next_token_loss`: position t predicts
    label t+1, -100 ignored, fp32 cross-entropy, a chunk of positions at a time), one sequence at a time and
    kept per sequence instead of averaged over the batch.
    """
    head = model.get_output_embeddings()
    nll = torch.empty(hidden.shape[0], dtype=torch.float64)
    counts = torch.empty(hidden.shape[0], dtype=torch.int64)
    for i in range(hidden.shape[0]):
        summed, counts[i] = next_token_loss(hidden[i : i + 1], labels[i : i + 1], head)
        nll[i] = float(summed)
    return nll, counts


@torch.no_grad()
@torch.no_grad()
def max_logit_change(model: nn.Module, before: torch.Tensor, after: torch.Tensor, mask: torch.Tensor) -> float:
    """``max |logits(after) - logits(before)|`` over the real positions of ``mask (B, S)``.

    ``before``/``after``: ``(B, S, H)`` final hidden states. The logits are made a chunk of positions at a
    time (as the loss makes them), never for the whole batch at once.
    """
    head = model.get_output_embeddings()
    width = before.shape[-1]
    keep = mask.reshape(-1).to(before.device) != 0  # (B*S,)
    before, after = before.reshape(-1, width), after.reshape(-1, width)  # (B*S, H)
    rows = max(1, CHUNK_LOGIT_BYTES // (4 * head.out_features))
    largest = 0.0
    for start in range(0, before.shape[0], rows):
        stop = start + rows
        # in place: two chunks of logits live at most, as the loss's working memory plans (the expression's
        # temporaries held four, eval's peak above its plan; found in review)
        change = head(after[start:stop]).float()  # (n, V)
        change -= head(before[start:stop]).float()
        # masked_fill, not boolean indexing: indexing by a mask runs a nonzero, which DirectML rejects
        largest = max(largest, float(change.abs_().masked_fill_(~keep[start:stop, None], 0).max()))
    return largest


def run_pass(
    model: nn.Module,
    experts: Mapping[int, LayerExperts],
    batches: Sequence[Batch],
    *,
    device: torch.device,
    progress: Progress,
    description: str,
    around: Callable[[int], contextlib.AbstractContextManager] | None = None,
    earlier: PartialPass | None = None,
    stop: Callable[[], None] | None = None,
    on_stop: Callable[[PartialPass], None] | None = None,
) -> PassResult:
    """Evaluate every batch; progress counts sequences (and tokens per second).

    ``around(i)``: a context each batch's forward runs in (the fine-tuned pass injects the base pass's prefix
    states); ``experts``: the MoE layers whose routing is captured (those the forward runs). ``earlier``: the
    batches an interrupted pass did, taken as they are (the pass goes on after them). ``stop()``: called before
    each batch, raises :class:`usaf.errors.StopSignal` on a stop request; ``on_stop`` then gets the pass so far.
    """
    done = earlier.batches if earlier is not None else 0
    nll, tokens, seen, before = [], [], 0, 0.0
    routing: dict[int, list[torch.Tensor]] = {layer: [] for layer in experts}
    if earlier is not None:
        nll, tokens = [earlier.result.nll], [earlier.result.tokens]
        seen, before = earlier.result.input_tokens, earlier.result.seconds
        for layer in experts:
            routing[layer].append(earlier.result.routing[layer])
    progress.start(description, sum(len(b.input_ids) for b in batches), "sequences")
    progress.advance(sum(len(b.input_ids) for b in batches[:done]))
    start = time.perf_counter()

    def so_far() -> PassResult:
        parts = {layer: torch.cat(sets) if sets else torch.zeros(0, 0, dtype=torch.uint8)
                 for layer, sets in routing.items()}  # fmt: skip
        empty = (torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.int64))
        nll_, tokens_ = (torch.cat(nll), torch.cat(tokens)) if nll else empty
        return PassResult(nll_, tokens_, parts, seen, before + time.perf_counter() - start)

    try:
        with RoutingCapture(experts) as capture:
            for i in range(done, len(batches)):
                batch = batches[i]
                if stop is not None:
                    try:
                        stop()
                    except StopSignal:
                        if on_stop is not None:
                            on_stop(PartialPass(i, so_far()))
                        raise
                with around(i) if around is not None else contextlib.nullcontext():
                    hidden = batch_hidden(model, batch, device)
                sums, counts = sequence_nll(model, hidden, batch.labels)
                nll.append(sums)
                tokens.append(counts)
                for layer, sets in capture.take(batch.attention_mask).items():
                    routing[layer].append(sets)
                seen += batch.tokens
                progress.advance(len(batch.input_ids), tokens=seen)
    finally:
        progress.finish()
    return so_far()
