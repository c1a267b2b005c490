"""Next-token cross-entropy from the final hidden states, a chunk of positions at a time.

The whole logits tensor of a batch, ``(B, T, V)``, is the largest thing a training step would otherwise
hold: at Qwen3-30B-A3B's 151,936-token vocabulary, microbatch 2 × 512 tokens, its fp32 log-softmax (kept
for backward) is 0.58 GiB and the fp32 copy and gradient around it another 1.16 GiB, and on DirectML one
such tensor exceeds the ~800 MB per-allocation limit from ~1,300 tokens on. Here the output projection runs
on ``rows`` positions at a time; each chunk's loss and its gradient with respect to the hidden states are
computed together in the forward (the projection is frozen, so that gradient is all backward needs), and only
that gradient, ``(N, H)``, is kept. The logits of one chunk exist at a time, and only during the forward.

:class:`HeadInput` gets the hidden states out of the model's own forward: within :meth:`HeadInput.capture`
the model's output projection (this instance only, as :class:`usaf.engine.prefix.PrefixRunner` does with
layers) records its input and returns a zero-stride stand-in instead of computing the logits, so the rest of
the model's forward (router losses, output object) stays transformers' code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn import functional as F

from usaf.backends.transfer import device_capabilities
from usaf.data.packing import IGNORE_INDEX

# Positions per chunk are sized so one chunk's fp32 logits take at most this many bytes. The loss's working
# memory is about that (the softmax is made in place), plus the compute-dtype logits in half precision.
CHUNK_LOGIT_BYTES = 64 * 2**20


class HeadInput:
    """Intercepts ``head`` (the model's output projection, ``nn.Linear(H, V)``) for :meth:`capture`.

    Use :meth:`of`: one interceptor per head module, however many users (the engine, eval) ask for it.
    """

    @classmethod
    def of(cls, head: nn.Linear) -> HeadInput:
        """The interceptor of ``head``, made on first use."""
        existing = getattr(head, "_usaf_head_input", None)
        if existing is None:
            existing = cls(head)
            head._usaf_head_input = existing
        return existing

    def __init__(self, head: nn.Linear) -> None:
        self.head = head
        self._capturing = False
        self._input: torch.Tensor | None = None
        original = head.forward

        def forward(hidden: torch.Tensor, _original=original) -> torch.Tensor:
            if not self._capturing:
                return _original(hidden)
            self._input = hidden  # (B, T, H)
            # (B, T, V) of zeros with stride 0: no memory. Nothing reads it; the loss is computed from the input.
            return hidden.new_zeros((), dtype=torch.float32).expand(*hidden.shape[:-1], head.out_features)

        head.forward = forward  # this instance only; the class is untouched

    @contextlib.contextmanager
    def capture(self) -> Iterator[Callable[[], torch.Tensor]]:
        """Within the block the model's logits are not computed; the returned callable gives the head's input."""
        self._capturing = True
        self._input = None

        def captured() -> torch.Tensor:
            if self._input is None:
                raise RuntimeError("the model's forward never reached its output projection")
            return self._input

        try:
            yield captured
        finally:
            self._capturing = False
            self._input = None


def next_token_loss(
    hidden: torch.Tensor, labels: torch.Tensor, head: nn.Linear, *, chunk_bytes: int | None = None
) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy (fp32 scalar) and the number of scored tokens.

    Args:
        hidden: ``(B, T, H)`` final hidden states (the output projection's input).
        labels: ``(B, T)`` unshifted labels; position t predicts label t+1; ``-100`` is not scored.
        head: the frozen output projection ``(V, H)`` (+ bias).
        chunk_bytes: fp32 logits per chunk, in bytes (sets the positions per chunk); default
            ``CHUNK_LOGIT_BYTES``, or the device's per-allocation limit where that is smaller.
    """
    if chunk_bytes is None:
        limit = device_capabilities(hidden.device).max_allocation_bytes
        chunk_bytes = CHUNK_LOGIT_BYTES if limit is None else min(CHUNK_LOGIT_BYTES, limit)
    width = hidden.shape[-1]
    inputs = hidden[:, :-1].reshape(-1, width)  # (N, H), N = B * (T - 1)
    targets = labels[:, 1:].reshape(-1).to(hidden.device)  # (N,)
    rows = max(1, chunk_bytes // (4 * head.out_features))
    tokens = int((targets != IGNORE_INDEX).sum())
    if torch.is_grad_enabled() and inputs.requires_grad:
        if head.weight.requires_grad:  # its gradient would be silently missing
            raise ValueError("next_token_loss trains no output projection: freeze it (requires_grad_(False))")
        return _HeadCrossEntropy.apply(inputs, targets, head.weight, head.bias, rows), tokens
    total, _ = _chunked(inputs, targets, head.weight, head.bias, rows, want_grad=False)
    return total, tokens


class _HeadCrossEntropy(torch.autograd.Function):
    """``sum CE(hidden @ W^T + b, targets)``; the gradient w.r.t. ``hidden`` is computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, targets, weight, bias, rows):
        total, grad = _chunked(hidden, targets, weight, bias, rows, want_grad=True)
        ctx.save_for_backward(grad)  # (N, H): all that is kept for backward
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return grad * grad_total, None, None, None, None  # grad_total: the 0-dim fp32 upstream gradient


@torch.no_grad()
def _chunked(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: int,
    *,
    want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(summed loss, d loss / d hidden (N, H) or None)``, ``rows`` positions at a time.

    Per position: ``log-sum-exp(logits) - logits[target]`` on fp32 logits (F.cross_entropy's value), and the
    gradient ``softmax @ W - W[target]`` (``(softmax - one_hot) @ W`` with the one-hot term as a row gather:
    no scatter, index_put or one_hot, which DirectML rejects). The fp32 logits are turned into the softmax in
    place, so one chunk costs its fp32 logits and, in half precision, their compute-dtype copies.
    """
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad = torch.empty_like(hidden) if want_grad else None  # (N, H)
    for start in range(0, hidden.shape[0], rows):
        stop = min(start + rows, hidden.shape[0])
        target = targets[start:stop]  # (n,)
        scored = target != IGNORE_INDEX  # (n,)
        safe = torch.where(scored, target, torch.zeros_like(target))  # unscored rows pick id 0, weighted 0 below
        logits = F.linear(hidden[start:stop], weight, bias).float()  # (n, V)
        picked = logits.gather(1, safe[:, None]).squeeze(1)  # (n,)
        top = logits.amax(dim=-1, keepdim=True)  # (n, 1)
        probs = logits.sub_(top).exp_()  # (n, V) unnormalised softmax, in place of the logits
        norm = probs.sum(dim=-1, keepdim=True)  # (n, 1)
        lse = (top + norm.log()).squeeze(1)  # (n,)
        total += ((lse - picked) * scored).sum()
        if grad is not None:
            probs.div_(norm)  # (n, V) softmax
            rows_grad = probs.to(weight.dtype) @ weight - weight.index_select(0, safe)  # (n, H)
            grad[start:stop] = rows_grad * scored[:, None]  # unscored rows contribute nothing
        del logits, probs  # before the next chunk's logits exist: one chunk alive at a time
    return total, grad
